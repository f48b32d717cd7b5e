"""Image classification tasks (`cpt_jax.runner.tasks` registers them).

Image datasets (``config.input_pipeline``): ``"device"`` holds the whole dataset on
the device (`cpt_jax.data.image.batch_at_step`); ``"grain"`` streams it through Grain
from local files or a TFDS-prepared directory (`cpt_jax.data.sources`), the only
option for variable-size datasets (``imagenet2012``, ``imagenette``: random-resized
crops of ``config.image_size`` for training, resize + central crop for evaluation).
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import jax.numpy as jnp
import numpy as np

from cpt_jax import data as image_data
from cpt_jax.data import sources as data_sources
from cpt_jax.models import get_model
from cpt_jax.runner.task import Task

if TYPE_CHECKING:
    pass


INPUT_PIPELINES = ("device", "grain")
"""``config.input_pipeline``: the whole dataset on the device, or streamed by Grain."""


def load_grain_pipeline():
    """`cpt_jax.data.pipeline`, imported on first use: only ``input_pipeline="grain"``
    needs the grain package, so the device pipeline runs where grain is absent."""
    try:
        from cpt_jax.data import pipeline
    except ImportError as e:
        raise ImportError(f"config.input_pipeline='grain' needs the grain package ({e}); "
                          f"pip install grain") from e
    return pipeline


def _model_kwargs(config) -> dict:
    kwargs = config.get("model_kwargs", None)
    return dict(kwargs) if kwargs else {}


def _augment(config) -> bool:
    augment = config.get("augment", None)
    return bool(config.dataset.startswith("cifar") if augment is None else augment)


def image_classification_task(config) -> Task:
    """Image classification on a named dataset (digits, MNIST, CIFAR, ImageNet, ...).

    Config fields read: dataset, data_dir, input_pipeline ("device" | "grain"), model,
    model_kwargs, batch_size, eval_batch_size, augment (CIFAR crop+flip; default on for
    CIFAR), image_size (variable-size datasets), seed.
    """
    pipeline = config.get("input_pipeline", "device")
    if pipeline not in INPUT_PIPELINES:
        raise ValueError(f"config.input_pipeline={pipeline!r} must be one of "
                         f"{INPUT_PIPELINES}")
    if pipeline == "grain":
        return grain_image_task(config)
    return device_image_task(config)


def _check_batch_size(config, num_train: int) -> int:
    batch_size = int(config.batch_size)
    if batch_size > num_train:
        raise ValueError(
            f"config.batch_size={batch_size} is larger than the {num_train} training "
            f"examples of {config.dataset!r}")
    return batch_size


def normalization_stats(config, mean: Any, std: Any, channels: int) -> tuple:
    """(mean, std) of the input normalisation: ``config.normalize_mean/std`` when set
    (e.g. CPT's CIFAR constants), else the given training-set statistics.

    ``normalize(x) = (x / pixel_max - mean) / std`` per channel.
    """
    fixed = []
    for name, stats in (("normalize_mean", mean), ("normalize_std", std)):
        value = tuple(config.get(name, ()) or ())
        if value and len(value) != channels:
            raise ValueError(f"config.{name}={value} needs one value per channel ({channels})")
        if name == "normalize_std" and any(v <= 0 for v in value):
            raise ValueError(f"config.{name}={value} must be positive")
        fixed.append(np.asarray(value, np.float32) if value else stats)
    return tuple(fixed)


def device_image_task(config) -> Task:
    """The whole dataset on the device; ``train_batch`` = `image_data.batch_at_step`."""
    data_dir = config.get("data_dir", None) or None
    ds = image_data.load_image_dataset(config.dataset, data_dir)
    mean, std = normalization_stats(config, ds.mean, ds.std, ds.image_shape[-1])
    ds = ds.replace(mean=mean, std=std)
    batch_size = _check_batch_size(config, ds.num_train)
    device_ds = image_data.to_device(ds)
    augment = _augment(config)
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


@dataclasses.dataclass(frozen=True)
class _GrainData:
    """Train/test sources of a named image dataset and what the pipeline needs."""

    train: Any
    test: Any
    mean: Any
    std: Any
    pixel_max: float
    train_transforms: tuple
    eval_transforms: tuple
    image_shape: tuple


def grain_sources(config) -> _GrainData:
    """Sources and transforms of ``config.dataset`` for the Grain pipeline.

    Local files (``config.data_dir``, loaded into memory) when there are some, else a
    TFDS-prepared directory through ``tfds.data_source`` (streamed; no TensorFlow).
    """
    grain_pipeline = load_grain_pipeline()
    name, spec = config.dataset, image_data.IMAGE_SPECS[config.dataset]
    data_dir = config.get("data_dir", None) or None
    decode = grain_pipeline.ImageLabel()
    if not spec.fixed_size:
        size = int(config.get("image_size", 224) or 224)
        crop = grain_pipeline.RandomResizedCrop(size=size)
        center = grain_pipeline.ResizeCenterCrop(size=size)
        return _GrainData(
            *(data_sources.open_tfds_source(spec.tfds_name, spec.tfds_split(s), data_dir)
              for s in ("train", "test")),
            mean=grain_pipeline.IMAGENET_MEAN, std=grain_pipeline.IMAGENET_STD,
            pixel_max=255.0, train_transforms=(decode, crop if _augment(config) else center),
            eval_transforms=(decode, center), image_shape=(size, size, spec.channels))
    augment = (grain_pipeline.PadCropFlip(),) if _augment(config) else ()
    shape = (spec.height, spec.width, spec.channels)
    if image_data.has_local_files(name, data_dir):
        ds = image_data.load_image_dataset(name, data_dir)
        return _GrainData(grain_pipeline.ArraySource(ds.train_images, ds.train_labels),
                          grain_pipeline.ArraySource(ds.test_images, ds.test_labels),
                          ds.mean, ds.std, ds.pixel_max, (decode,) + augment, (decode,), shape)
    hint = image_data.expected_local_files(name)
    train, test = (data_sources.open_tfds_source(spec.tfds_name, spec.tfds_split(s), data_dir,
                                                 local_hint=hint) for s in ("train", "test"))
    mean, std = grain_pipeline.source_channel_stats(train, (decode,))
    return _GrainData(train, test, mean, std, 255.0, (decode,) + augment, (decode,), shape)


def grain_image_task(config) -> Task:
    """Training batches streamed by Grain (`cpt_jax.data.pipeline`), sharded per process."""
    grain_pipeline = load_grain_pipeline()
    data = grain_sources(config)
    mean, std = normalization_stats(config, data.mean, data.std, data.image_shape[-1])
    data = dataclasses.replace(data, mean=mean, std=std)
    spec = image_data.IMAGE_SPECS[config.dataset]
    batch_size = _check_batch_size(config, len(data.train))
    dataset = grain_pipeline.train_dataset(data.train, global_batch_size=batch_size,
                                           seed=int(config.seed),
                                           transforms=data.train_transforms)
    stream = grain_pipeline.GrainInput(dataset, mean=data.mean, std=data.std,
                                       pixel_max=data.pixel_max)
    model = get_model(config.model, num_classes=spec.num_classes, **_model_kwargs(config))
    eval_bs = int(config.get("eval_batch_size", 0) or 500)
    stats = (jnp.asarray(data.mean, jnp.float32), jnp.asarray(data.std, jnp.float32))

    def train_batch(step, key):
        raise RuntimeError("this task streams its training batches: use "
                           "task.input_pipeline.batches() (config.input_pipeline='grain')")

    def eval_batches(split: str):
        if split != "test":
            raise ValueError(f"unknown eval split {split!r}")
        for images, labels, mask in grain_pipeline.eval_batches_from_source(
                data.test, eval_bs, data.eval_transforms):
            yield {"inputs": image_data.normalize(jnp.asarray(images), *stats, data.pixel_max),
                   "labels": jnp.asarray(labels, jnp.int32), "mask": jnp.asarray(mask)}

    sample = jnp.zeros((batch_size,) + tuple(data.image_shape), jnp.float32)
    return Task(name=config.dataset, model=model, sample_inputs=sample, train_batch=train_batch,
                eval_batches=eval_batches, num_train_examples=len(data.train),
                steps_per_epoch=max(1, len(data.train) // batch_size), input_pipeline=stream,
                info={"num_classes": spec.num_classes, "num_test": len(data.test),
                      "image_shape": list(data.image_shape), "augment": _augment(config),
                      "input_pipeline": "grain"})


BUILDERS = {name: image_classification_task for name in image_data.IMAGE_DATASETS}
"""Dataset name -> task builder, for `cpt_jax.runner.tasks`."""
