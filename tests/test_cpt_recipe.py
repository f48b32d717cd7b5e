"""CPT's CIFAR recipe pieces: classifier init N(0, sqrt(2/(in*out))) and fixed normalisation."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cpt_jax.models.resnet import CifarResNet, cpt_linear_init
from cpt_jax.runner import image_tasks, tasks
from experiments.configs import cifar10_resnet, default


def test_cpt_linear_init_has_the_formula_std():
    w = np.asarray(cpt_linear_init(jax.random.key(0), (256, 100)))
    expected = np.sqrt(2.0 / (256 * 100))
    assert abs(w.mean()) < 3 * expected / np.sqrt(w.size)
    assert abs(w.std() / expected - 1.0) < 0.02  # 25,600 samples: ~0.5 % sampling error


@pytest.mark.slow
def test_resnet_classifier_init_is_selectable_and_checked():
    x = jnp.zeros((1, 32, 32, 3))
    torch_k = CifarResNet(depth=8).init(jax.random.key(0), x)["params"]["classifier"]["kernel"]
    cpt_k = CifarResNet(depth=8, classifier_init="cpt").init(
        jax.random.key(0), x)["params"]["classifier"]["kernel"]
    in_, out = cpt_k.shape
    assert abs(float(cpt_k.std()) / np.sqrt(2.0 / (in_ * out)) - 1.0) < 0.25  # 640 samples
    # PyTorch's default is U(-1/sqrt(in), 1/sqrt(in)): std 1/sqrt(3 in), a different law.
    assert abs(float(torch_k.std()) * np.sqrt(3.0 * in_) - 1.0) < 0.25
    assert float(jnp.abs(torch_k).max()) <= 1.0 / np.sqrt(in_)
    with pytest.raises(ValueError, match="classifier_init"):
        CifarResNet(depth=8, classifier_init="xavier")


def test_cpt_recipe_sets_init_and_normalisation_and_validates():
    config = cifar10_resnet.get_config("cpt")
    assert config.model_kwargs.classifier_init == "cpt"
    assert tuple(config.normalize_std) == (0.2023, 0.1994, 0.2010)
    assert tuple(config.normalize_mean) == (0.4914, 0.4822, 0.4465)
    plain = cifar10_resnet.get_config()
    assert tuple(plain.normalize_std) == () and "classifier_init" not in plain.model_kwargs


def test_fixed_normalisation_replaces_the_training_statistics():
    config = default.get_config()  # digits: one channel, pixels 0..16
    config.normalize_mean, config.normalize_std = (0.5,), (0.25,)
    task = tasks.build_task(config)
    batch = next(iter(task.eval_batches("test")))
    from cpt_jax import data
    raw = data.load_image_dataset("digits").test_images  # 300 images, padded to the batch
    n = raw.shape[0]
    np.testing.assert_allclose(np.asarray(batch["inputs"])[:n],
                               (raw.astype(np.float32) / 16.0 - 0.5) / 0.25, rtol=1e-6)


@pytest.mark.parametrize("field,value,match", [
    ("normalize_std", (0.2, 0.2), "one value per channel"),
    ("normalize_std", (0.0,), "positive"),
    ("normalize_mean", (0.1, 0.2, 0.3), "one value per channel"),
])
def test_bad_normalisation_is_a_one_line_error(field, value, match):
    config = default.get_config()
    setattr(config, field, value)
    with pytest.raises(ValueError, match=match):
        image_tasks.normalization_stats(config, np.zeros(1), np.ones(1), channels=1)
