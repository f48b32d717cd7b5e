"""A Grain input pipeline: streams, shards per process, augments, prefetches, resumes exactly.

``config.input_pipeline`` picks how a run reads its training batches:

* ``"device"`` (default, small data): the whole dataset on the device,
  `cpt_jax.data.image.batch_at_step` (a pure function of the step);
* ``"grain"``: this module, over a random-access source (``tfds.data_source``, or any
  sequence of ``{"image", "label"}`` dicts), for data that does not fit on the device
  (ImageNet) and for multi-host runs.

The training stream (:func:`train_dataset`), with B the global batch size, P processes
and p this process (``jax.process_index()``)::

    element e  = source[shuffle_seed(epoch)(e mod N)],   epoch = e // N  (reshuffled per epoch)
    element e -> transforms (a RandomMap draws from a generator seeded by (seed, e))
    global batch t = elements [t*B, (t+1)*B);  process p reads rows [p*B/P, (p+1)*B/P) of it

so the union over processes of their local batches t is exactly the one-process global
batch t, in the same order (``jax.make_array_from_process_local_data`` then assembles it),
and a batch depends only on (source, seed, t): not on P, nor on threads or prefetching.
Batches run across epoch boundaries (no remainder is dropped).

Resume: :class:`DeviceIterator` (Grain's ``DatasetIterator`` with batches prefetched to
the device) reports ``get_state()``, the Grain state after the last batch it handed
out (``{"next_index": t}``, JSON); the runner stores it in the orbax checkpoint and
``set_state`` brings a new iterator to the same place, so a resumed run sees exactly
the batches it would have seen.

Augmentations are Grain transforms on uint8 NumPy images: :class:`PadCropFlip`
(CIFAR: zero-pad 4, random 32x32 crop, horizontal flip with probability 1/2),
:class:`RandomResizedCrop` (ImageNet training: Inception crop, area in [0.08, 1],
aspect ratio in [3/4, 4/3], resized, flipped) and :class:`ResizeCenterCrop`
(ImageNet evaluation: shorter side to ``size / 0.875``, central ``size`` x ``size``).
Normalization ``(x / pixel_max - mean) / std`` runs on the device, after the uint8
batch is transferred (4x less to copy than float32).

Example:
  >>> source = [{"image": np.full((4, 4, 1), i, np.uint8), "label": i % 2}
  ...           for i in range(10)]
  >>> ds = train_dataset(source, global_batch_size=4, seed=0, transforms=[ImageLabel()])
  >>> it = DeviceIterator(ds, mean=[0.0], std=[1.0], pixel_max=1.0)
  >>> batch = next(it)
  >>> batch["inputs"].shape, batch["labels"].shape, it.get_state()
  ((4, 4, 4, 1), (4,), {'next_index': 1})
"""
from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import grain
import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["INPUT_PIPELINES", "ImageLabel", "PadCropFlip", "RandomResizedCrop",
           "ResizeCenterCrop", "train_dataset", "eval_batches_from_source",
           "DeviceIterator", "GrainInput", "ArraySource", "source_channel_stats",
           "IMAGENET_MEAN", "IMAGENET_STD"]

INPUT_PIPELINES = ("device", "grain")
"""Values of ``config.input_pipeline``."""

Example = dict[str, Any]

IMAGENET_MEAN = (0.485, 0.456, 0.406)
"""Per-channel mean of ImageNet train pixels / 255 (the torchvision constants)."""
IMAGENET_STD = (0.229, 0.224, 0.225)
"""Per-channel std of ImageNet train pixels / 255."""


@dataclasses.dataclass(frozen=True)
class ArraySource:
    """A random-access source over in-memory arrays: ``source[i] = {"image", "label"}``.

    Lets the Grain pipeline read datasets loaded from local files
    (`cpt_jax.data.image.load_image_dataset`).

    Example:
      >>> src = ArraySource(np.zeros((3, 2, 2, 1), np.uint8), np.arange(3))
      >>> len(src), int(src[2]["label"])
      (3, 2)
    """

    images: Any
    labels: Any

    def __post_init__(self):
        if len(self.images) != len(self.labels):
            raise ValueError(f"{len(self.images)} images but {len(self.labels)} labels")

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> Example:
        return {"image": self.images[index], "label": self.labels[index]}


# --------------------------------------------------------------------------------------
# Transforms (host side, NumPy, one example at a time)
# --------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ImageLabel(grain.transforms.Map):
    """Keep ``image`` (uint8, (H, W, C); a 2-D image gets C = 1) and ``label`` (int32).

    Example:
      >>> out = ImageLabel().map({"image": np.zeros((2, 2), np.uint8), "label": 3, "id": "x"})
      >>> out["image"].shape, out["label"].dtype, sorted(out)
      ((2, 2, 1), dtype('int32'), ['image', 'label'])
    """

    def map(self, element: Example) -> Example:
        image = np.asarray(element["image"])
        if image.ndim == 2:
            image = image[..., None]
        if image.ndim != 3 or image.dtype != np.uint8:
            raise ValueError(f"expected a uint8 (H, W, C) image, got dtype {image.dtype} "
                             f"shape {image.shape}")
        return {"image": image, "label": np.asarray(element["label"], np.int32)}


@dataclasses.dataclass(frozen=True)
class PadCropFlip(grain.transforms.RandomMap):
    """CIFAR augmentation: zero-pad ``pad``, random (H, W) crop, flip with probability 1/2.

    The offset (dy, dx) is uniform in {0..2*pad}^2, as torchvision's
    ``RandomCrop(H, padding=pad)`` + ``RandomHorizontalFlip()`` (and
    `cpt_jax.data.image.augment_cifar`, its on-device twin).

    Example:
      >>> x = {"image": np.arange(16, dtype=np.uint8).reshape(4, 4, 1), "label": 0}
      >>> PadCropFlip(pad=0).random_map(x, np.random.default_rng(0))["image"].shape
      (4, 4, 1)
    """

    pad: int = 4
    flip: bool = True

    def random_map(self, element: Example, rng: np.random.Generator) -> Example:
        image = element["image"]
        h, w = image.shape[:2]
        dy, dx = rng.integers(0, 2 * self.pad + 1, size=2) - self.pad  # shift in [-pad, pad]
        # out[i, j] = image[i + dy, j + dx] where inside the image, else 0 (the padding)
        out = np.zeros_like(image)
        out[max(0, -dy):min(h, h - dy), max(0, -dx):min(w, w - dx)] = image[
            max(0, dy):min(h, h + dy), max(0, dx):min(w, w + dx)]
        if self.flip and rng.random() < 0.5:
            out = np.ascontiguousarray(out[:, ::-1])
        return {**element, "image": out}


def _resize(image: np.ndarray, height: int, width: int) -> np.ndarray:
    """Bilinear resize of a uint8 (H, W, C) image (PIL, antialiased when shrinking)."""
    from PIL import Image

    if image.shape[:2] == (height, width):
        return image
    channels = image.shape[2]
    pil = Image.fromarray(image[..., 0] if channels == 1 else image)
    out = np.asarray(pil.resize((width, height), Image.BILINEAR))
    return out[..., None] if channels == 1 else out


@dataclasses.dataclass(frozen=True)
class RandomResizedCrop(grain.transforms.RandomMap):
    """ImageNet training crop (Inception / torchvision ``RandomResizedCrop`` + flip).

    Up to 10 draws of an area fraction s ~ U[0.08, 1] and a log-uniform aspect ratio
    r in [3/4, 4/3]: crop (h, w) = (sqrt(s*A/r), sqrt(s*A*r)) rounded, at a uniform
    position, if it fits; else the central crop of the clipped ratio. Resized to
    ``size`` x ``size`` (bilinear), flipped with probability 1/2.

    Example:
      >>> x = {"image": np.zeros((40, 30, 3), np.uint8), "label": 0}
      >>> RandomResizedCrop(size=16).random_map(x, np.random.default_rng(0))["image"].shape
      (16, 16, 3)
    """

    size: int = 224
    area: tuple[float, float] = (0.08, 1.0)
    ratio: tuple[float, float] = (3 / 4, 4 / 3)

    def _window(self, h: int, w: int, rng: np.random.Generator) -> tuple[int, int, int, int]:
        log_ratio = (math.log(self.ratio[0]), math.log(self.ratio[1]))
        for _ in range(10):
            target = h * w * rng.uniform(*self.area)
            r = math.exp(rng.uniform(*log_ratio))
            cw, ch = round(math.sqrt(target * r)), round(math.sqrt(target / r))
            if 0 < cw <= w and 0 < ch <= h:
                return int(rng.integers(0, h - ch + 1)), int(rng.integers(0, w - cw + 1)), ch, cw
        r = min(max(w / h, self.ratio[0]), self.ratio[1])
        cw, ch = (w, round(w / r)) if w / h < r else (round(h * r), h)
        cw, ch = min(max(cw, 1), w), min(max(ch, 1), h)
        return (h - ch) // 2, (w - cw) // 2, ch, cw

    def random_map(self, element: Example, rng: np.random.Generator) -> Example:
        image = element["image"]
        y, x, ch, cw = self._window(image.shape[0], image.shape[1], rng)
        out = _resize(np.ascontiguousarray(image[y:y + ch, x:x + cw]), self.size, self.size)
        if rng.random() < 0.5:
            out = out[:, ::-1]
        return {**element, "image": np.ascontiguousarray(out)}


@dataclasses.dataclass(frozen=True)
class ResizeCenterCrop(grain.transforms.Map):
    """ImageNet evaluation: shorter side to ``round(size / crop_fraction)``, central crop.

    With ``size=224`` and ``crop_fraction=0.875`` the shorter side becomes 256.

    Example:
      >>> x = {"image": np.zeros((50, 80, 3), np.uint8), "label": 0}
      >>> ResizeCenterCrop(size=16).map(x)["image"].shape
      (16, 16, 3)
    """

    size: int = 224
    crop_fraction: float = 0.875

    def map(self, element: Example) -> Example:
        image = element["image"]
        h, w = image.shape[:2]
        short = max(self.size, round(self.size / self.crop_fraction))
        nh, nw = (short, max(short, round(w * short / h))) if h <= w else (
            max(short, round(h * short / w)), short)
        image = _resize(image, nh, nw)
        y, x = (nh - self.size) // 2, (nw - self.size) // 2
        return {**element, "image": np.ascontiguousarray(
            image[y:y + self.size, x:x + self.size])}


# --------------------------------------------------------------------------------------
# Datasets
# --------------------------------------------------------------------------------------


def _apply(ds: grain.MapDataset, transforms: Sequence[Any], seed: int) -> grain.MapDataset:
    """Chain ``transforms``: a RandomMap draws from (seed, element index), a Map is plain."""
    for t in transforms:
        if isinstance(t, grain.transforms.RandomMap):
            ds = ds.random_map(t, seed=seed)
        else:
            ds = ds.map(t)
    return ds


def _process(process_index: int | None, process_count: int | None) -> tuple[int, int]:
    count = jax.process_count() if process_count is None else int(process_count)
    index = jax.process_index() if process_index is None else int(process_index)
    if count < 1 or not 0 <= index < count:
        raise ValueError(f"process_index={index} must be in [0, process_count={count})")
    return index, count


def train_dataset(source: Sequence[Example], *, global_batch_size: int, seed: int,
                  transforms: Sequence[Any], process_index: int | None = None,
                  process_count: int | None = None,
                  num_epochs: int | None = None) -> grain.MapDataset:
    """This process's training batches: shuffled per epoch, transformed, batched, sharded.

    Global batch t holds elements ``[t*B, (t+1)*B)`` of the stream ``shuffle(seed,
    epoch)(source)`` repeated ``num_epochs`` times (None: forever); this process's
    batch t holds rows ``[p*B/P, (p+1)*B/P)`` of it (see the module docstring).

    Args:
      source: a random-access source (``tfds.data_source(...)``, a list of dicts).
      global_batch_size: B, the batch over all processes (a multiple of P).
      seed: seeds the per-epoch shuffle and every RandomMap.
      transforms: Grain ``Map`` / ``RandomMap`` transforms, applied in order.
      process_index: p (None: ``jax.process_index()``).
      process_count: P (None: ``jax.process_count()``).
      num_epochs: passes over the source (None: unbounded).

    Returns:
      A ``grain.MapDataset`` whose item t is this process's batch t (dict of arrays
      with leading size B/P).

    Example:
      >>> src = [{"image": np.full((1, 1, 1), i, np.uint8), "label": i} for i in range(8)]
      >>> ds = train_dataset(src, global_batch_size=4, seed=0, transforms=[ImageLabel()],
      ...                    process_index=1, process_count=2)
      >>> ds[0]["label"].shape
      (2,)
    """
    index, count = _process(process_index, process_count)
    if not isinstance(global_batch_size, int) or global_batch_size < 1 or (
            global_batch_size % count):
        raise ValueError(f"global_batch_size={global_batch_size!r} must be a positive "
                         f"multiple of the {count} processes")
    if len(source) < 1:
        raise ValueError("the training source is empty")
    ds = grain.MapDataset.source(source).seed(int(seed)).shuffle().repeat(num_epochs)
    ds = _apply(ds, transforms, int(seed))
    ds = ds.batch(global_batch_size // count, drop_remainder=True)
    return ds[index::count]


def eval_batches_from_source(source: Sequence[Example], batch_size: int,
                             transforms: Sequence[Any], ) -> Iterator[tuple[Any, Any, Any]]:
    """A whole split in source order: ``(images, labels, mask)``, the last batch padded.

    Like `cpt_jax.data.image.eval_batches`: ``ceil(N / batch_size)`` batches, the last
    padded with zero images and label 0 where ``mask`` is False. ``transforms`` must be
    deterministic (Maps).

    Example:
      >>> src = [{"image": np.zeros((2, 2, 1), np.uint8), "label": 1}] * 5
      >>> [int(m.sum()) for _, _, m in eval_batches_from_source(src, 2, [ImageLabel()])]
      [2, 2, 1]
    """
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
    ds = _apply(grain.MapDataset.source(source), transforms, 0).batch(batch_size)
    for batch in ds:
        images, labels = batch["image"], batch["label"]
        valid = images.shape[0]
        mask = np.arange(batch_size) < valid
        if valid < batch_size:
            images = np.concatenate([images, np.zeros((batch_size - valid,) + images.shape[1:],
                                                      images.dtype)])
            labels = np.concatenate([labels, np.zeros(batch_size - valid, labels.dtype)])
        yield images, labels, mask


def source_channel_stats(source: Sequence[Example], transforms: Sequence[Any], *,
                         pixel_max: float = 255.0,
                         max_examples: int = 2048) -> tuple[np.ndarray, np.ndarray]:
    """Per-channel mean and std of ``image / pixel_max`` over evenly spaced examples.

    Reads ``min(N, max_examples)`` examples at indices ``round(linspace(0, N-1, n))``
    (deterministic, independent of the seed) after ``transforms`` (deterministic Maps).

    Example:
      >>> src = [{"image": np.full((2, 2, 1), v, np.uint8), "label": 0} for v in (0, 255)]
      >>> source_channel_stats(src, [ImageLabel()])
      (array([0.5], dtype=float32), array([0.5], dtype=float32))
    """
    n = len(source)
    if n < 1:
        raise ValueError("the source is empty")
    picks = np.unique(np.round(np.linspace(0, n - 1, min(n, max_examples))).astype(int))
    ds = _apply(grain.MapDataset.source(source), transforms, 0)
    pixels = np.concatenate([ds[int(i)]["image"].reshape(-1, ds[int(i)]["image"].shape[-1])
                             for i in picks]).astype(np.float64) / pixel_max
    std = pixels.std(0)
    return (pixels.mean(0).astype(np.float32),
            np.where(std > 0, std, 1.0).astype(np.float32))


# --------------------------------------------------------------------------------------
# Iterator: prefetch to device, checkpointable state
# --------------------------------------------------------------------------------------


@jax.jit
def _normalize(images: jax.Array, mean: jax.Array, std: jax.Array,
               pixel_max: jax.Array) -> jax.Array:
    return (images.astype(jnp.float32) / pixel_max - mean) / std


class DeviceIterator:
    """Batches of a :func:`train_dataset` on the device, ``prefetch`` ahead; resumable.

    ``next(it)`` returns ``{"inputs": (x / pixel_max - mean) / std (float32),
    "labels": int32}``; ``place`` puts a host batch on the device(s) (default
    ``jax.device_put``; with several processes,
    `cpt_jax.distributed.mesh.global_batch_from_local` over the mesh). Grain reads with
    ``num_threads`` threads. ``get_state()`` is Grain's state after the last batch
    returned (JSON-serializable); ``set_state(s)`` continues from there.

    Example:
      >>> src = [{"image": np.zeros((2, 2, 1), np.uint8), "label": 0}] * 8
      >>> ds = train_dataset(src, global_batch_size=2, seed=0, transforms=[ImageLabel()])
      >>> it = DeviceIterator(ds, mean=[0.0], std=[1.0])
      >>> it.set_state({"next_index": 5}); _ = next(it); it.get_state()
      {'next_index': 6}
    """

    def __init__(self, dataset: grain.MapDataset, *, mean: Any, std: Any,
                 pixel_max: float = 255.0, prefetch: int = 2, num_threads: int = 4,
                 place: Callable[[Any], Any] | None = None):
        if prefetch < 1 or num_threads < 1:
            raise ValueError(f"prefetch={prefetch} and num_threads={num_threads} must be >= 1")
        options = grain.ReadOptions(num_threads=num_threads,
                                    prefetch_buffer_size=max(prefetch, num_threads))
        self._host = iter(dataset.to_iter_dataset(options))
        self._stats = (jnp.asarray(mean, jnp.float32), jnp.asarray(std, jnp.float32),
                       jnp.float32(pixel_max))
        self._place = place or jax.device_put
        self._prefetch = int(prefetch)
        self._queue: collections.deque = collections.deque()
        self._state = dict(self._host.get_state())

    def __iter__(self) -> DeviceIterator:
        return self

    def _pull(self) -> None:
        batch = next(self._host)
        state = dict(self._host.get_state())
        placed = self._place({"image": batch["image"], "label": batch["label"]})
        self._queue.append(({"inputs": _normalize(placed["image"], *self._stats),
                             "labels": placed["label"].astype(jnp.int32)}, state))

    def __next__(self) -> dict[str, jax.Array]:
        while len(self._queue) < self._prefetch:
            self._pull()
        batch, self._state = self._queue.popleft()
        return batch

    def get_state(self) -> dict[str, Any]:
        """Grain's iterator state after the last batch returned by ``next``."""
        return dict(self._state)

    def set_state(self, state: dict[str, Any]) -> None:
        """Continue after the batch that ``state`` (from :meth:`get_state`) was taken at."""
        self._queue.clear()
        self._host.set_state(dict(state))
        self._state = dict(self._host.get_state())


class GrainInput:
    """A task's Grain training input: makes the :class:`DeviceIterator`, keeps its state.

    The runner calls ``batches(mesh)`` once (the mesh, or None, says where batches go:
    with a mesh, each process's rows are assembled into global arrays by
    `cpt_jax.distributed.mesh.global_batch_from_local`), ``get_state()`` when it saves a
    checkpoint and ``set_state(s)`` after restoring one (before or after ``batches``).

    Example:
      >>> src = ArraySource(np.zeros((8, 2, 2, 1), np.uint8), np.zeros(8, np.int32))
      >>> ds = train_dataset(src, global_batch_size=2, seed=0, transforms=[ImageLabel()])
      >>> data = GrainInput(ds, mean=[0.0], std=[1.0])
      >>> data.set_state({"next_index": 3}); _ = next(data.batches()); data.get_state()
      {'next_index': 4}
    """

    def __init__(self, dataset: grain.MapDataset, *, mean: Any, std: Any,
                 pixel_max: float = 255.0, prefetch: int = 2, num_threads: int = 4):
        self.dataset = dataset
        self._options = dict(mean=mean, std=std, pixel_max=pixel_max, prefetch=prefetch,
                             num_threads=num_threads)
        self._iterator: DeviceIterator | None = None
        self._pending: dict[str, Any] | None = None

    def batches(self, mesh: Any = None) -> DeviceIterator:
        """The iterator of training batches (placed over ``mesh`` when given)."""
        place = None
        if mesh is not None:
            from cpt_jax.distributed import mesh as parallel

            place = lambda batch: parallel.global_batch_from_local(batch, mesh)  # noqa: E731
        self._iterator = DeviceIterator(self.dataset, place=place, **self._options)
        if self._pending is not None:
            self._iterator.set_state(self._pending)
        return self._iterator

    def get_state(self) -> dict[str, Any]:
        """Grain's state after the last batch handed out (JSON-serializable)."""
        if self._iterator is not None:
            return self._iterator.get_state()
        return dict(self._pending) if self._pending is not None else {"next_index": 0}

    def set_state(self, state: dict[str, Any]) -> None:
        """Continue from ``state`` (a value of :meth:`get_state`)."""
        self._pending = dict(state)
        if self._iterator is not None:
            self._iterator.set_state(self._pending)
