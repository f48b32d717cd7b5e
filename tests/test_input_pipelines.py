"""The runner on TFDS data without TensorFlow (tfds.testing.mock_data), on both input
pipelines ("device" and "grain"), and the grain path's exact resume."""

from __future__ import annotations

import json
import os
import signal

import numpy as np
import pytest

tfds = pytest.importorskip("tensorflow_datasets")

from cpt_jax.data import pipeline as G  # noqa: E402
from cpt_jax.runner import job as runner  # noqa: E402
from cpt_jax.runner.tasks import build_task  # noqa: E402
from experiments.configs import default  # noqa: E402


def _config(pipeline: str, **overrides):
    config = default.get_config()
    config.dataset = "cifar10"
    config.input_pipeline = pipeline
    config.model_kwargs = {"features": (4, 8)}
    config.num_steps = 6
    config.batch_size = 4
    config.eval_batch_size = 8
    config.log_every = 1
    config.eval_every = 0
    config.tensorboard = False
    config.plots = False
    config.precision.num_cycles = 2
    for key, value in overrides.items():
        setattr(config, key, value)
    return config


def _no_tfds_load(monkeypatch):
    def no_load(*args, **kwargs):
        raise AssertionError("tfds.load (TensorFlow) must not be needed")

    monkeypatch.setattr(tfds, "load", no_load)


@pytest.mark.slow
@pytest.mark.parametrize("pipeline", ["device", "grain"])
def test_runner_trains_cifar10_from_tfds_data_source(tmp_path, monkeypatch, pipeline):
    _no_tfds_load(monkeypatch)
    with tfds.testing.mock_data(num_examples=16):
        summary = runner.train_and_evaluate(_config(pipeline), str(tmp_path), progress=False)
    with open(tmp_path / "summary.json") as f:
        assert json.load(f)["params_sha256"] == summary["params_sha256"]
    assert summary["steps"] == 6 and not summary["interrupted"]
    assert 0.0 <= summary["final_test_accuracy"] <= 1.0
    assert summary["task_info"]["num_test"] == 16
    with open(tmp_path / "metrics.jsonl") as f:
        steps = [json.loads(line)["step"] for line in f if line.startswith('{"step"')]
    assert steps == [1, 2, 3, 4, 5, 6]


def test_grain_task_batches_are_the_pipeline_of_the_tfds_source(monkeypatch):
    _no_tfds_load(monkeypatch)
    with tfds.testing.mock_data(num_examples=16):
        task = build_task(_config("grain", augment=False))
        source = tfds.data_source("cifar10", split="train", download=False)
        # Independent of G.train_dataset (which the task uses): the order from Grain's own
        # shuffle of the indices (seed 0, one reshuffle per epoch), pixels from TFDS.
        import grain

        stream = grain.MapDataset.range(16).seed(0).shuffle().repeat(None)
        want_idx = [[int(stream[4 * t + i]) for i in range(4)] for t in range(5)]
        assert sorted(sum(want_idx[:4], [])) == list(range(16))  # an epoch: each once
        assert sum(want_idx[:4], []) != list(range(16))          # shuffled
        images = np.stack([source[i]["image"] for i in range(16)]).astype(np.float64) / 255
        labels = np.array([int(source[i]["label"]) for i in range(16)])
        batches = task.input_pipeline.batches()
        got = [next(batches) for _ in range(5)]
    mean, std = images.mean((0, 1, 2)), images.std((0, 1, 2))
    for batch, idx in zip(got, want_idx):
        np.testing.assert_array_equal(np.asarray(batch["labels"]), labels[idx])
        np.testing.assert_allclose(np.asarray(batch["inputs"]), (images[idx] - mean) / std,
                                   rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_grain_run_stopped_and_resumed_is_bit_identical(tmp_path, monkeypatch):
    _no_tfds_load(monkeypatch)
    from cpt_jax.runner import loop  # where train_steps looks run_actions up
    run_actions = loop.run_actions

    def stop_after_step_3(actions, step, state, metrics):
        run_actions(actions, step, state, metrics)
        if step == 3 and stop_once:
            stop_once.pop()
            os.kill(os.getpid(), signal.SIGTERM)  # as a preemption: checkpoint, then finish

    monkeypatch.setattr(loop, "run_actions", stop_after_step_3)
    config = _config("grain", checkpoint_every=0)
    with tfds.testing.mock_data(num_examples=16):
        stop_once = []
        reference = runner.train_and_evaluate(config, str(tmp_path / "ref"), progress=False)
        stop_once = [True]
        stopped = runner.train_and_evaluate(config, str(tmp_path / "run"), progress=False)
        resumed = runner.train_and_evaluate(config, str(tmp_path / "run"), progress=False)
    assert stopped["interrupted"] and stopped["steps"] == 3
    assert resumed["resumed_from_step"] == 3 and resumed["steps"] == 6
    assert resumed["params_sha256"] == reference["params_sha256"]
    assert stopped["params_sha256"] != reference["params_sha256"]


@pytest.mark.slow
def test_grain_checkpoint_meta_holds_the_iterator_state(tmp_path, monkeypatch):
    _no_tfds_load(monkeypatch)
    from cpt_jax.runner import checkpoint as ckpt_lib

    config = _config("grain", checkpoint_every=3, num_steps=3)
    with tfds.testing.mock_data(num_examples=16):
        runner.train_and_evaluate(config, str(tmp_path / "a"), progress=False)
        manager = ckpt_lib.CheckpointManager(str(tmp_path / "a" / "checkpoints"))
        assert manager.read_meta(3)["input_state"] == {"next_index": 3}
        manager.close()


@pytest.mark.slow
def test_imagenet_resnet18_config_is_cpts_recipe_and_smoke_trains(tmp_path, monkeypatch):
    from experiments.configs import imagenet_resnet18

    config = imagenet_resnet18.get_config()
    p, o = config.precision, config.optimizer
    assert (config.model, config.dataset, config.input_pipeline) == (
        "resnet18", "imagenet2012", "grain")
    assert (p.min_bits, p.max_bits, p.grad_bits, p.schedule) == (4, 8, 8, "cos_growth")
    assert config.num_steps == 90 * (1_281_167 // 256) and config.batch_size == 256
    assert (o.learning_rate, o.momentum, o.weight_decay) == (0.1, 0.9, 1e-4)
    assert set(p.keep_full_precision) == {"stem_conv", "shortcut_conv", "classifier"}

    _no_tfds_load(monkeypatch)
    config.update(num_steps=4, batch_size=2, eval_batch_size=4, image_size=32, log_every=1,
                  eval_every=0, checkpoint_every=0, tensorboard=False, plots=False)
    config.precision.num_cycles = 2
    config.model_kwargs = {"width": 8}
    with tfds.testing.mock_data(num_examples=4):
        summary = runner.train_and_evaluate(config, str(tmp_path), progress=False)
    assert summary["steps"] == 4 and os.path.isfile(tmp_path / "summary.json")
    assert summary["task_info"]["image_shape"] == [32, 32, 3]
    assert summary["task_info"]["num_classes"] == 1000
    assert 0.0 <= summary["final_test_accuracy"] <= 1.0


def test_grain_task_reads_local_files_when_present():
    from cpt_jax.data import image

    task = build_task(_config("grain", dataset="digits", augment=False, batch_size=8))
    ds = image.load_image_dataset("digits")
    order = G.train_dataset(G.ArraySource(ds.train_images, np.arange(ds.num_train)),
                            global_batch_size=8, seed=0, transforms=[G.ImageLabel()],
                            process_index=0, process_count=1)
    batch = next(task.input_pipeline.batches())
    idx = order[0]["label"]
    np.testing.assert_array_equal(np.asarray(batch["labels"]), ds.train_labels[idx])
    want = (ds.train_images[idx].astype(np.float32) / 16 - ds.mean) / ds.std
    np.testing.assert_allclose(np.asarray(batch["inputs"]), want, rtol=1e-5, atol=1e-5)
    assert task.num_train_examples == ds.num_train and task.info["input_pipeline"] == "grain"


def test_grain_without_local_files_or_prepared_tfds_names_the_options(tmp_path, monkeypatch):
    from cpt_jax.data.sources import DatasetUnavailableError

    def data_source(name, **kwargs):
        raise FileNotFoundError(f"no prepared {name} here")

    monkeypatch.setattr(tfds, "data_source", data_source)
    with pytest.raises(DatasetUnavailableError) as err:
        build_task(_config("grain", data_dir=str(tmp_path)))
    msg = str(err.value)
    assert "data_batch_1.npz" in msg and "no prepared cifar10 here" in msg
    assert "tfds build cifar10 --file_format=array_record" in msg


def test_grain_is_for_image_datasets_only():
    with pytest.raises(ValueError, match="input_pipeline='grain' streams image datasets"):
        build_task(_config("grain", dataset="ptb"))
