"""Tasks: what a run trains on, bundled for the runner (data, model, batches, loss, eval).

A `Task` hides the domain (images, graphs, text) from the training loop:

* ``model``: the float Linen model (the runner quantizes it with `quantize_model`);
* ``sample_inputs``: inputs for `init` and cost tracing;
* ``train_batch(step, key) -> batch``: a jittable pure function of the step, so the
  data order is reproducible and resumable;
* ``eval_batches(split) -> iterator of batches`` with ``"mask"`` for exact sums;
* ``loss_fn`` and the ``metric`` reported (``"accuracy"`` or ``"perplexity"``).

`build_task(config)` looks the dataset up in `TASK_BUILDERS`; other domains register
their builder with `register_task`.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, Iterator, Optional, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

from cpt_jax import data as image_data
from cpt_jax.models import get_model
from cpt_jax.training import LossFn, classification_loss

Batch = Dict[str, Any]


@dataclasses.dataclass
class Task:
    """Everything the runner needs about a problem (see module docstring)."""

    name: str
    model: nn.Module
    sample_inputs: Any
    train_batch: Callable[[Any, jax.Array], Batch]
    eval_batches: Callable[[str], Iterator[Batch]]
    num_train_examples: int
    steps_per_epoch: int
    loss_fn: LossFn = classification_loss
    metric: str = "accuracy"
    eval_splits: Sequence[str] = ("test",)
    apply_kwargs: Dict[str, Any] = dataclasses.field(default_factory=dict)
    info: Dict[str, Any] = dataclasses.field(default_factory=dict)


TaskBuilder = Callable[[Any], Task]
TASK_BUILDERS: Dict[str, TaskBuilder] = {}


def register_task(*datasets: str):
    """Decorator: register a ``builder(config) -> Task`` for the given dataset names."""
    def wrap(builder: TaskBuilder) -> TaskBuilder:
        for name in datasets:
            TASK_BUILDERS[name] = builder
        return builder
    return wrap


def available_datasets() -> tuple:
    """Names accepted by `config.dataset`."""
    _import_domain_tasks()
    return tuple(sorted(TASK_BUILDERS))


def _import_domain_tasks() -> None:
    # Domain tasks (graphs, text) live in their own modules and register on import.
    for module in ("cpt_jax.domain_tasks",):
        try:
            __import__(module)
        except ImportError:
            pass


def build_task(config) -> Task:
    """The `Task` for ``config.dataset`` (ValueError listing the valid names)."""
    _import_domain_tasks()
    name = config.dataset
    if name not in TASK_BUILDERS:
        raise ValueError(
            f"config.dataset={name!r} is unknown; choose one of {sorted(TASK_BUILDERS)}")
    return TASK_BUILDERS[name](config)


def _model_kwargs(config) -> dict:
    kwargs = config.get("model_kwargs", None)
    return dict(kwargs) if kwargs else {}


@register_task(*image_data.IMAGE_DATASETS)
def image_classification_task(config) -> Task:
    """Image classification on a named dataset (digits, MNIST, Fashion-MNIST, CIFAR).

    Config fields read: dataset, data_dir, model, model_kwargs, batch_size,
    eval_batch_size, augment (CIFAR crop+flip; default on for CIFAR), seed.
    """
    data_dir = config.get("data_dir", None) or None
    ds = image_data.load_image_dataset(config.dataset, data_dir)
    batch_size = int(config.batch_size)
    if batch_size > ds.num_train:
        raise ValueError(
            f"config.batch_size={batch_size} is larger than the {ds.num_train} training "
            f"examples of {config.dataset!r}")
    device_ds = image_data.to_device(ds)
    augment = config.get("augment", None)
    if augment is None:
        augment = config.dataset.startswith("cifar")
    augment = bool(augment)
    model = get_model(config.model, num_classes=ds.num_classes, **_model_kwargs(config))
    eval_bs = int(config.get("eval_batch_size", 0) or 500)

    def train_batch(step, key):
        images, labels = image_data.batch_at_step(device_ds, step, key, batch_size=batch_size,
                                                  augment=augment)
        return {"inputs": images, "labels": labels}

    def eval_batches(split: str):
        if split != "test":
            raise ValueError(f"unknown eval split {split!r}")
        for images, labels, mask in image_data.eval_batches(ds.test_images, ds.test_labels,
                                                            eval_bs):
            yield {"inputs": image_data.normalize(jnp.asarray(images), ds.mean, ds.std,
                                                  ds.pixel_max),
                   "labels": jnp.asarray(labels, jnp.int32), "mask": jnp.asarray(mask)}

    sample = jnp.zeros((batch_size,) + tuple(ds.image_shape), jnp.float32)
    return Task(name=config.dataset, model=model, sample_inputs=sample, train_batch=train_batch,
                eval_batches=eval_batches, num_train_examples=ds.num_train,
                steps_per_epoch=image_data.steps_per_epoch(ds.num_train, batch_size),
                info={"num_classes": ds.num_classes, "num_test": ds.num_test,
                      "image_shape": list(ds.image_shape), "augment": augment})
