"""Image classification datasets: loading (local files or TFDS) and on-device batching.

Loading (host side, NumPy):

* ``load_image_dataset(name, data_dir=None, *, splits=("train", "test"))`` returns an
  :class:`ImageDataset` for one of :data:`IMAGE_DATASETS`:

  - ``digits``: scikit-learn's real 8x8 handwritten digits (bundled with scikit-learn,
    no files, the offline default). A fixed stratified split (seed 0): 1497 train /
    300 test. Pixels are the integers 0..16 (``pixel_max = 16``).
  - ``mnist``, ``fashion_mnist``: the four IDX files (``train-images-idx3-ubyte``,
    ``train-labels-idx1-ubyte``, ``t10k-images-idx3-ubyte``, ``t10k-labels-idx1-ubyte``,
    gzipped (``.gz``) or not) in ``data_dir``. With ``data_dir=None``, Fashion-MNIST is
    read from the Debian package ``dataset-fashion-mnist``
    (``/usr/share/datasets/fashion-mnist``) when it is installed.
  - ``cifar10``: ``data_batch_{1..5}.npz`` + ``test_batch.npz`` (keys ``image`` uint8
    (N, 32, 32, 3), ``label`` (N,)), or the official python pickles
    (``cifar-10-batches-py/data_batch_{1..5}``, ``test_batch``).
  - ``cifar100``: ``train.npz`` / ``test.npz`` (same keys), or the official pickles
    ``cifar-100-python/{train,test}`` (fine labels, 100 classes).

  - ``kmnist``, ``svhn_cropped``: through TFDS only (no local layout).
  - ``imagenet2012``, ``imagenette``: through TFDS only; their images vary in size, so
    they train through the Grain pipeline (:mod:`cpt_jax.data.pipeline`,
    ``config.input_pipeline="grain"``), not :func:`load_image_dataset`.

  When no local file of the dataset is found, TFDS is used without TensorFlow
  (:mod:`cpt_jax.data.sources`): a TFDS-prepared directory through
  ``tfds.data_source(name, split=..., data_dir=data_dir, download=False)``, then
  ``tfds.load`` only when TensorFlow imports. If both fail, a
  :class:`DatasetUnavailableError` names the three options (local files to provide,
  how to prepare a TFDS directory, TensorFlow for ``tfds.load``).

Batching (device side, JAX): the data order is a pure function of ``(key, step)``, so a
run resumed from a checkpoint at step ``s`` sees exactly the batches it would have seen,
and the batch can be drawn inside a jitted train step from the traced ``state.step``:

  epoch = step // steps_per_epoch,   steps_per_epoch = N // batch_size (remainder dropped)
  perm  = jax.random.permutation(fold_in(key, epoch), N)
  batch = perm[(step % steps_per_epoch) * batch_size : ... + batch_size]

Example:
  >>> ds = load_image_dataset("digits")
  >>> data = to_device(ds)
  >>> images, labels = batch_at_step(data, 0, jax.random.PRNGKey(0),
  ...                                batch_size=32, augment=False)
  >>> images.shape, labels.shape
  ((32, 8, 8, 1), (32,))
"""

from __future__ import annotations

import dataclasses
import functools
import gzip
import os
import pickle
import warnings
import zipfile
import zlib
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax import lax

from cpt_jax.data.sources import DatasetUnavailableError, load_tfds_arrays

__all__ = [
    "IMAGE_DATASETS",
    "IMAGE_SPECS",
    "ImageSpec",
    "FASHION_MNIST_DEBIAN_DIR",
    "DatasetUnavailableError",
    "ImageDataset",
    "DeviceDataset",
    "load_image_dataset",
    "has_local_files",
    "expected_local_files",
    "split_dataset",
    "to_device",
    "steps_per_epoch",
    "batch_at_step",
    "augment_cifar",
    "normalize",
    "eval_batches",
]

IMAGE_DATASETS: tuple[str, ...] = ("digits", "mnist", "fashion_mnist", "cifar10", "cifar100",
                                   "kmnist", "svhn_cropped", "imagenet2012", "imagenette")
"""Named image datasets (the last two have variable-size images: Grain pipeline only)."""

FASHION_MNIST_DEBIAN_DIR = "/usr/share/datasets/fashion-mnist"
"""Where the Debian package ``dataset-fashion-mnist`` puts the four IDX gz files."""

_SPLITS = ("train", "test")


@dataclasses.dataclass(frozen=True)
class ImageSpec:
    """What a named image dataset holds: image size (None: varies), classes, TFDS name.

    ``tfds_splits`` maps this module's split names (``train``, ``test``) to the TFDS
    ones (ImageNet's held-out split is ``validation``).
    """

    height: int | None
    width: int | None
    channels: int
    num_classes: int
    tfds_name: str | None
    tfds_splits: tuple[tuple[str, str], ...] = (("train", "train"), ("test", "test"))

    @property
    def fixed_size(self) -> bool:
        """True when every image has the same (height, width)."""
        return self.height is not None and self.width is not None

    def tfds_split(self, split: str) -> str:
        """The TFDS split name of ``split`` (``"train"`` or ``"test"``)."""
        return dict(self.tfds_splits)[split]


_HELD_OUT_IS_VALIDATION = (("train", "train"), ("test", "validation"))

IMAGE_SPECS: dict[str, ImageSpec] = {
    "digits": ImageSpec(8, 8, 1, 10, None),
    "mnist": ImageSpec(28, 28, 1, 10, "mnist"),
    "fashion_mnist": ImageSpec(28, 28, 1, 10, "fashion_mnist"),
    "cifar10": ImageSpec(32, 32, 3, 10, "cifar10"),
    "cifar100": ImageSpec(32, 32, 3, 100, "cifar100"),
    "kmnist": ImageSpec(28, 28, 1, 10, "kmnist"),
    "svhn_cropped": ImageSpec(32, 32, 3, 10, "svhn_cropped"),
    "imagenet2012": ImageSpec(None, None, 3, 1000, "imagenet2012",
                              _HELD_OUT_IS_VALIDATION),
    "imagenette": ImageSpec(None, None, 3, 10, "imagenette", _HELD_OUT_IS_VALIDATION),
}
"""The :class:`ImageSpec` of every name in :data:`IMAGE_DATASETS`."""
_SPECS = IMAGE_SPECS

# --------------------------------------------------------------------------------------
# Containers
# --------------------------------------------------------------------------------------


@struct.dataclass
class ImageDataset:
    """An image classification dataset held on the host (a frozen pytree).

    Images are raw pixels, (N, H, W, C), uint8 where the source is uint8 (digits: the
    integers 0..16, also uint8); labels are int32 in [0, num_classes). ``mean`` and
    ``std`` are per-channel float32 statistics of ``images / pixel_max`` over the train
    split (over the test split when only the test split was loaded), so that
    ``normalize(x, mean, std, pixel_max) = (x / pixel_max - mean) / std``.
    A split that was not loaded is an empty array (0, H, W, C).

    Example:
      >>> ds = load_image_dataset("digits")
      >>> ds.train_images.shape, ds.test_images.shape, ds.num_classes
      ((1497, 8, 8, 1), (300, 8, 8, 1), 10)
    """

    train_images: Any
    train_labels: Any
    test_images: Any
    test_labels: Any
    mean: Any
    std: Any
    num_classes: int = struct.field(pytree_node=False)
    name: str = struct.field(pytree_node=False)
    pixel_max: float = struct.field(pytree_node=False)

    @property
    def image_shape(self) -> tuple[int, int, int]:
        """(H, W, C) of one image."""
        return tuple(self.train_images.shape[1:])  # type: ignore[return-value]

    @property
    def num_train(self) -> int:
        """Number of training examples."""
        return int(self.train_images.shape[0])

    @property
    def num_test(self) -> int:
        """Number of test examples."""
        return int(self.test_images.shape[0])


@struct.dataclass
class DeviceDataset:
    """The arrays of an :class:`ImageDataset` as ``jax.Array`` on a device (a pytree).

    Pass it as an argument of a jitted function (its static fields, ``num_classes``,
    ``name`` and ``pixel_max``, are part of the tree structure).

    Example:
      >>> data = to_device(load_image_dataset("digits"))
      >>> type(data.train_images).__name__, data.train_images.dtype
      ('ArrayImpl', dtype('uint8'))
    """

    train_images: jax.Array
    train_labels: jax.Array
    test_images: jax.Array
    test_labels: jax.Array
    mean: jax.Array
    std: jax.Array
    num_classes: int = struct.field(pytree_node=False)
    name: str = struct.field(pytree_node=False)
    pixel_max: float = struct.field(pytree_node=False)


# --------------------------------------------------------------------------------------
# Statistics and splitting (host side)
# --------------------------------------------------------------------------------------


def _channel_stats(images: np.ndarray, pixel_max: float) -> tuple[np.ndarray, np.ndarray]:
    """Per-channel mean and (population) std of ``images / pixel_max`` as float32.

    Accumulated in float64 over chunks, so a uint8 source is summed exactly without
    materializing a float copy of the whole array. A channel with zero variance gets
    std 1 (normalization then only centres it).
    """
    channels = images.shape[-1]
    if images.shape[0] == 0:
        return np.zeros(channels, np.float32), np.ones(channels, np.float32)
    total = np.zeros(channels, np.float64)
    total_sq = np.zeros(channels, np.float64)
    chunk = 1024
    for i in range(0, images.shape[0], chunk):
        x = images[i:i + chunk].astype(np.float64)
        total += x.sum(axis=(0, 1, 2))
        total_sq += np.square(x).sum(axis=(0, 1, 2))
    count = float(np.prod(images.shape[:-1]))
    mean = total / count
    var = np.maximum(total_sq / count - mean**2, 0.0)
    std = np.sqrt(var)
    std = np.where(std > 0, std, float(pixel_max))
    return (mean / pixel_max).astype(np.float32), (std / pixel_max).astype(np.float32)


def _stratified_holdout(labels: np.ndarray, num_holdout: int, seed: int) -> np.ndarray:
    """Sorted indices of ``num_holdout`` examples drawn per class in proportion.

    Class c (n_c examples of N) gets ``floor(num_holdout * n_c / N)`` examples, the
    remaining ones going to the classes with the largest fractional parts (ties: lower
    class first); within a class the examples are drawn by
    ``np.random.default_rng(seed)``.
    """
    n = labels.shape[0]
    classes, counts = np.unique(labels, return_counts=True)
    quota = num_holdout * counts / n
    take = np.floor(quota).astype(np.int64)
    remainder = num_holdout - int(take.sum())
    order = np.lexsort((classes, -(quota - take)))
    take[order[:remainder]] += 1
    rng = np.random.default_rng(seed)
    chosen = [rng.permutation(np.flatnonzero(labels == c))[:k] for c, k in zip(classes, take)]
    return np.sort(np.concatenate(chosen)) if chosen else np.zeros(0, np.int64)


def _make_dataset(name: str, num_classes: int, pixel_max: float,
                  train: tuple[np.ndarray, np.ndarray],
                  test: tuple[np.ndarray, np.ndarray]) -> ImageDataset:
    stats_images = train[0] if train[0].shape[0] > 0 else test[0]
    mean, std = _channel_stats(stats_images, pixel_max)
    return ImageDataset(
        train_images=train[0], train_labels=train[1].astype(np.int32),
        test_images=test[0], test_labels=test[1].astype(np.int32),
        mean=mean, std=std, num_classes=num_classes, name=name, pixel_max=float(pixel_max))


def split_dataset(ds: ImageDataset, num_val: int, seed: int, *,
                  source: str = "train") -> ImageDataset:
    """Carve a held-out set out of one split: a stratified, seeded split.

    The ``source`` split (``"train"`` or ``"test"``) is divided into ``num_val``
    held-out examples, which become the returned ``test_*`` arrays, and the rest, which
    become ``train_*``; ``mean``/``std`` are recomputed from the new train part. Each
    class keeps its proportion (see ``_stratified_holdout``); the order inside each part
    is the original order. The result depends only on (``ds``, ``num_val``, ``seed``).

    Use it for a validation set (``source="train"``), or to train on a test set when it
    is all that is available offline, e.g. MNIST, whose shared copy holds only the
    t10k files (``source="test"``).

    Example:
      >>> ds = load_image_dataset("mnist", "../shared/datasets/mnist", splits=("test",))  # doctest: +SKIP
      >>> small = split_dataset(ds, num_val=2000, seed=0, source="test")  # doctest: +SKIP
      >>> small.num_train, small.num_test  # doctest: +SKIP
      (8000, 2000)
    """
    if source not in _SPLITS:
        raise ValueError(f"source must be one of {_SPLITS}, got {source!r}")
    images = ds.train_images if source == "train" else ds.test_images
    labels = np.asarray(ds.train_labels if source == "train" else ds.test_labels)
    n = int(images.shape[0])
    if n < 2:
        hint = " (only the test split was loaded? pass source='test')" if source == "train" else ""
        raise ValueError(f"split_dataset: the {source!r} split of {ds.name!r} has {n} "
                         f"examples; at least 2 are needed{hint}")
    if not isinstance(num_val, (int, np.integer)) or not 1 <= num_val <= n - 1:
        raise ValueError(f"num_val must be an integer in [1, {n - 1}] for the {source!r} "
                         f"split of {ds.name!r} ({n} examples), got {num_val!r}")
    held = _stratified_holdout(labels, int(num_val), int(seed))
    mask = np.zeros(n, bool)
    mask[held] = True
    images = np.asarray(images)
    return _make_dataset(ds.name, ds.num_classes, ds.pixel_max,
                         (images[~mask], labels[~mask]), (images[mask], labels[mask]))


# --------------------------------------------------------------------------------------
# File readers
# --------------------------------------------------------------------------------------


def _check_arrays(images: np.ndarray, labels: np.ndarray, *, name: str, split: str,
                  where: str) -> tuple[np.ndarray, np.ndarray]:
    """Validate shapes, dtypes and label range; return (images, labels int32)."""
    spec = _SPECS[name]
    want = (spec.height, spec.width, spec.channels)
    images = np.asarray(images)
    labels = np.asarray(labels)
    if images.ndim == 3 and spec.channels == 1:
        images = images[..., None]
    if images.ndim != 4 or tuple(images.shape[1:]) != want:
        raise ValueError(f"{where}: {name} {split} images have shape {images.shape}, "
                         f"expected (N, {want[0]}, {want[1]}, {want[2]})")
    if labels.ndim != 1 or labels.shape[0] != images.shape[0]:
        raise ValueError(f"{where}: {name} {split} labels have shape {labels.shape}, "
                         f"expected ({images.shape[0]},) to match the images")
    if not np.issubdtype(labels.dtype, np.integer):
        raise ValueError(f"{where}: {name} {split} labels have dtype {labels.dtype}, "
                         f"expected integers")
    if labels.size and (labels.min() < 0 or labels.max() >= spec.num_classes):
        raise ValueError(f"{where}: {name} {split} labels range over "
                         f"[{labels.min()}, {labels.max()}], expected [0, "
                         f"{spec.num_classes - 1}]")
    if images.dtype != np.uint8:
        if not np.issubdtype(images.dtype, np.number):
            raise ValueError(f"{where}: {name} {split} images have dtype {images.dtype}")
        if images.size and (images.min() < 0 or images.max() > 255):
            raise ValueError(f"{where}: {name} {split} images range over "
                             f"[{images.min()}, {images.max()}], expected pixels in [0, 255]")
        images = images.astype(np.uint8)
    return images, labels.astype(np.int32)


def _read_npz(path: str, *, name: str, split: str) -> tuple[np.ndarray, np.ndarray]:
    """Read an ``.npz`` with keys ``image`` (N, H, W, C) uint8 and ``label`` (N,)."""
    spec = _SPECS[name]
    expected = (f"expected an .npz archive with arrays 'image' uint8 (N, {spec.height}, "
                f"{spec.width}, {spec.channels}) and 'label' (N,)")
    with open(path, "rb") as f:
        head = f.read(4)
    if not head:
        raise ValueError(f"{path}: empty file (0 bytes); {expected}")
    if head[:2] != b"PK":  # every zip (so every .npz) starts with "PK"
        raise ValueError(f"{path}: not an .npz (zip) archive, it starts with {head!r}; "
                         f"{expected}")
    try:
        with np.load(path, allow_pickle=False) as archive:
            missing = [k for k in ("image", "label") if k not in archive.files]
            if missing:
                raise ValueError(f"{path}: missing key(s) {missing} (found {archive.files}); "
                                 f"{expected}")
            images, labels = archive["image"], archive["label"]
    except (zipfile.BadZipFile, EOFError, OSError, zlib.error, KeyError) as e:
        raise ValueError(f"{path}: cannot read the file, it is truncated or corrupt "
                         f"({type(e).__name__}: {e}); {expected}") from e
    except ValueError as e:
        if str(e).startswith(path):
            raise
        raise ValueError(f"{path}: cannot read the file ({e}); {expected}") from e
    if images.dtype != np.uint8:
        raise ValueError(f"{path}: 'image' has dtype {images.dtype}; {expected}")
    return _check_arrays(images, labels, name=name, split=split, where=path)


class _ArrayUnpickler(pickle.Unpickler):
    """Unpickler that only reconstructs NumPy arrays, dicts, lists and scalars.

    The official CIFAR python batches are pickles; this refuses any other global, so a
    hostile file cannot run code.
    """

    _ALLOWED = {
        ("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
        ("numpy.core.multiarray", "scalar"), ("numpy._core.multiarray", "scalar"),
        ("numpy.core.numeric", "_frombuffer"), ("numpy._core.numeric", "_frombuffer"),
        ("numpy", "ndarray"), ("numpy", "dtype"), ("_codecs", "encode"),
    }

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in self._ALLOWED or (
                module.startswith("numpy") and name.endswith("DType")):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"global {module}.{name} is not allowed")


def _read_cifar_pickle(path: str, *, name: str, split: str,
                       label_key: str) -> tuple[np.ndarray, np.ndarray]:
    """Read an official CIFAR python batch: dict with ``data`` (N, 3072) and labels."""
    expected = (f"expected an official CIFAR python pickle: a dict with b'data' uint8 "
                f"(N, 3072) and b'{label_key}' (N,)")
    try:
        with open(path, "rb") as f:
            batch = _ArrayUnpickler(f, encoding="bytes").load()
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError,
            ImportError, IndexError) as e:
        raise ValueError(f"{path}: cannot unpickle the file, it is truncated or corrupt "
                         f"({type(e).__name__}: {e}); {expected}") from e
    if not isinstance(batch, dict):
        raise ValueError(f"{path}: unpickled a {type(batch).__name__}; {expected}")
    batch = {k.decode() if isinstance(k, bytes) else k: v for k, v in batch.items()}
    if "data" not in batch or label_key not in batch:
        raise ValueError(f"{path}: keys {sorted(batch)}; {expected}")
    data = np.asarray(batch["data"])
    if data.ndim != 2 or data.shape[1] != 3072 or data.dtype != np.uint8:
        raise ValueError(f"{path}: b'data' has shape {data.shape} dtype {data.dtype}; "
                         f"{expected}")
    images = data.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)
    return _check_arrays(images, np.asarray(batch[label_key]), name=name, split=split,
                         where=path)


_IDX_MAGIC = {"images": 2051, "labels": 2049}  # 0x0803: ubyte, 3 dims; 0x0801: 1 dim


def _read_idx(path: str, kind: str) -> np.ndarray:
    """Read an IDX file (gzipped or not) of unsigned bytes; check magic and length."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
        if raw[:2] == b"\x1f\x8b":
            raw = gzip.decompress(raw)
    except (OSError, EOFError, zlib.error) as e:
        raise ValueError(f"{path}: cannot read the file, it is truncated or corrupt "
                         f"({type(e).__name__}: {e}); expected an IDX {kind} file") from e
    want = _IDX_MAGIC[kind]
    if len(raw) < 4:
        raise ValueError(f"{path}: {len(raw)} bytes, too short for an IDX header "
                         f"(expected magic number {want})")
    magic = int.from_bytes(raw[:4], "big")
    if magic != want:
        raise ValueError(f"{path}: IDX magic number {magic} (0x{magic:08x}), expected "
                         f"{want} (0x{want:08x}) for an IDX {kind} file of unsigned bytes")
    ndim = raw[3]
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise ValueError(f"{path}: {len(raw)} bytes, too short for an IDX header of "
                         f"{ndim} dimensions ({header} bytes)")
    dims = [int.from_bytes(raw[4 + 4 * i:8 + 4 * i], "big") for i in range(ndim)]
    size = header + int(np.prod(dims))
    if len(raw) != size:
        raise ValueError(f"{path}: {len(raw)} bytes (after decompression), expected {size} "
                         f"for an IDX array of shape {tuple(dims)}: truncated or corrupt")
    return np.frombuffer(raw, np.uint8, offset=header).reshape(dims)


# --------------------------------------------------------------------------------------
# Local layouts
# --------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Layout:
    kind: str                            # "npz" | "pickle" | "idx"
    description: str
    subdirs: tuple[str, ...]             # tried below data_dir, "" = data_dir itself
    files: dict[str, tuple[str, ...]]    # split -> file names (for idx: images, labels)


_CIFAR10_TRAIN = tuple(f"data_batch_{i}" for i in range(1, 6))
_IDX_FILES = {"train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
              "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")}

_LAYOUTS: dict[str, tuple[_Layout, ...]] = {
    "cifar10": (
        _Layout("npz", "CIFAR-10 .npz batches", ("", "cifar10"),
                {"train": tuple(f + ".npz" for f in _CIFAR10_TRAIN),
                 "test": ("test_batch.npz",)}),
        _Layout("pickle", "official CIFAR-10 python batches", ("cifar-10-batches-py", ""),
                {"train": _CIFAR10_TRAIN, "test": ("test_batch",)}),
    ),
    "cifar100": (
        _Layout("npz", "CIFAR-100 .npz files", ("", "cifar100"),
                {"train": ("train.npz",), "test": ("test.npz",)}),
        _Layout("pickle", "official CIFAR-100 python files", ("cifar-100-python", ""),
                {"train": ("train",), "test": ("test",)}),
    ),
    "mnist": (
        _Layout("idx", "MNIST IDX files", ("", "mnist", "MNIST/raw"), _IDX_FILES),
    ),
    "fashion_mnist": (
        _Layout("idx", "Fashion-MNIST IDX files",
                ("", "fashion_mnist", "fashion-mnist", "FashionMNIST/raw"), _IDX_FILES),
    ),
}


def _resolve(root: str, filename: str, kind: str) -> str | None:
    """Existing path of ``filename`` in ``root`` (IDX: with or without ``.gz``)."""
    names = (filename + ".gz", filename) if kind == "idx" else (filename,)
    for n in names:
        p = os.path.join(root, n)
        if os.path.isfile(p):
            return p
    return None


def _display(filename: str, kind: str) -> str:
    return filename + "[.gz]" if kind == "idx" else filename


def _find_local(name: str, data_dir: str) -> tuple[str, _Layout] | None:
    """The first (root, layout) below ``data_dir`` holding any file of the layout."""
    for layout in _LAYOUTS.get(name, ()):
        for sub in layout.subdirs:
            root = os.path.join(data_dir, sub) if sub else data_dir
            if not os.path.isdir(root):
                continue
            for files in layout.files.values():
                if any(_resolve(root, f, layout.kind) for f in files):
                    return root, layout
    return None


def has_local_files(name: str, data_dir: str | os.PathLike | None) -> bool:
    """True when ``data_dir`` holds files of a local layout of ``name`` (see the module).

    ``digits`` (bundled with scikit-learn) counts as local; Fashion-MNIST with
    ``data_dir=None`` looks in :data:`FASHION_MNIST_DEBIAN_DIR`.

    Example:
      >>> has_local_files("digits", None), has_local_files("cifar10", "/nonexistent")
      (True, False)
    """
    if name not in _SPECS:
        raise ValueError(f"name must be one of {IMAGE_DATASETS}, got {name!r}")
    if name == "digits":
        return True
    root = os.fspath(data_dir) if data_dir else None
    if root is None and name == "fashion_mnist" and os.path.isdir(FASHION_MNIST_DEBIAN_DIR):
        root = FASHION_MNIST_DEBIAN_DIR
    return root is not None and _find_local(name, root) is not None


def expected_local_files(name: str) -> str:
    """The local files of ``name`` that :func:`load_image_dataset` reads, as text ("" if none).

    Example:
      >>> expected_local_files("cifar100")[:40]
      'CIFAR-100 .npz files (directly or in cif'
    """
    return _expected_files_text(name) if name in _LAYOUTS else ""


def _expected_files_text(name: str) -> str:
    parts = []
    for layout in _LAYOUTS[name]:
        sub = next((s for s in layout.subdirs if s), "")
        names = [_display(f, layout.kind) for fs in layout.files.values() for f in fs]
        where = f" (directly or in {sub}/)" if sub else ""
        parts.append(f"{layout.description}{where}: {', '.join(names)}")
    return "; or ".join(parts)


def _missing_message(name: str, split: str, root: str, layout: _Layout,
                     missing: list[str]) -> str:
    suffix = ".gz" if layout.kind == "idx" else ""
    paths = ", ".join(os.path.join(root, f + suffix) for f in missing)
    msg = (f"{name}: missing file(s) {paths} needed for the {split!r} split (found "
           f"{layout.description} in {root}; the {split!r} split needs "
           f"{', '.join(_display(f, layout.kind) for f in layout.files[split])}"
           f"{'; un-gzipped files without .gz are accepted too' if suffix else ''})")
    if name == "mnist" and split == "train":
        msg += (". The MNIST training set is not available offline (the shared copy holds "
                "only the t10k test files): load splits=('test',) and, for a train/"
                "validation split of it, use split_dataset(ds, num_val, seed, "
                "source='test')")
    return msg


def _load_local_split(name: str, root: str, layout: _Layout, split: str,
                      allow_partial: bool) -> tuple[np.ndarray, np.ndarray]:
    files = layout.files[split]
    paths = [_resolve(root, f, layout.kind) for f in files]
    missing = [f for f, p in zip(files, paths) if p is None]
    if missing:
        partial_ok = (allow_partial and layout.kind != "idx" and len(files) > 1
                      and len(missing) < len(files))
        if not partial_ok:
            msg = _missing_message(name, split, root, layout, missing)
            if layout.kind != "idx" and len(files) > 1 and len(missing) < len(files):
                msg += "; pass allow_partial=True to train on the batches present"
            raise FileNotFoundError(msg)
        warnings.warn(f"{name}: {split!r} split uses {len(files) - len(missing)} of "
                      f"{len(files)} files in {root} (missing: {', '.join(missing)})",
                      stacklevel=3)
    if layout.kind == "idx":
        images = _read_idx(paths[0], "images")
        labels = _read_idx(paths[1], "labels")
        if labels.ndim != 1 or images.shape[0] != labels.shape[0]:
            raise ValueError(f"{paths[1]}: {labels.shape} labels for {images.shape[0]} "
                             f"images in {paths[0]}; expected one label per image")
        return _check_arrays(images, labels, name=name, split=split, where=paths[0])
    parts = []
    for p in paths:
        if p is None:
            continue
        if layout.kind == "npz":
            parts.append(_read_npz(p, name=name, split=split))
        else:
            label_key = "fine_labels" if name == "cifar100" else "labels"
            parts.append(_read_cifar_pickle(p, name=name, split=split, label_key=label_key))
    return (np.concatenate([a for a, _ in parts]), np.concatenate([b for _, b in parts]))


# --------------------------------------------------------------------------------------
# Named loaders
# --------------------------------------------------------------------------------------


def _empty(name: str) -> tuple[np.ndarray, np.ndarray]:
    s = _SPECS[name]
    return np.zeros((0, s.height, s.width, s.channels), np.uint8), np.zeros((0,), np.int32)


def _load_digits() -> tuple[dict[str, tuple[np.ndarray, np.ndarray]], float]:
    from sklearn.datasets import load_digits  # bundled data, no download

    bunch = load_digits()
    images = np.asarray(bunch.images)
    if not np.array_equal(images, np.round(images)) or images.min() < 0 or images.max() > 16:
        raise ValueError("sklearn load_digits: expected integer pixels in [0, 16]")
    images = images.astype(np.uint8)[..., None]
    labels = np.asarray(bunch.target).astype(np.int32)
    test = np.zeros(labels.shape[0], bool)
    test[_stratified_holdout(labels, 300, seed=0)] = True
    out = {"train": (images[~test], labels[~test]), "test": (images[test], labels[test])}
    return {k: _check_arrays(*v, name="digits", split=k, where="sklearn load_digits")
            for k, v in out.items()}, 16.0


def _load_tfds(name: str, splits: Sequence[str], data_dir: str | None,
               ) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """The splits through TFDS (a prepared directory, else tfds.load with TensorFlow)."""
    spec = _SPECS[name]
    hint = _expected_files_text(name) if name in _LAYOUTS else ""
    out = {}
    for split in splits:
        tfds_split = spec.tfds_split(split)
        arrays = load_tfds_arrays(spec.tfds_name, tfds_split, data_dir, ("image", "label"),
                                  local_hint=hint)
        out[split] = _check_arrays(arrays["image"], arrays["label"], name=name, split=split,
                                   where=f"tfds {spec.tfds_name}[{tfds_split}]")
    return out


def load_image_dataset(name: str, data_dir: str | os.PathLike | None = None, *,
                       splits: Sequence[str] = ("train", "test"),
                       allow_partial: bool = False) -> ImageDataset:
    """Load a named image classification dataset into an :class:`ImageDataset`.

    Source, in order: ``digits`` comes from scikit-learn (``data_dir`` is ignored);
    otherwise local files in ``data_dir`` (any file of a known layout found there, or in
    a known sub-folder such as ``cifar-10-batches-py/``, selects that layout; then every
    file the requested splits need must be present); for Fashion-MNIST with
    ``data_dir=None``, the Debian package folder :data:`FASHION_MNIST_DEBIAN_DIR`;
    otherwise TFDS without TensorFlow: a prepared directory through
    ``tfds.data_source(name, split=s, data_dir=data_dir, download=False)``, then
    ``tfds.load`` when TensorFlow imports (:mod:`cpt_jax.data.sources`).

    Args:
      name: one of :data:`IMAGE_DATASETS`.
      data_dir: folder with the local files (see the module docstring), or a TFDS data
        directory, or None.
      splits: the splits to load, a non-empty subset of ("train", "test"); a split not
        requested is an empty (0, H, W, C) array. ``("test",)`` loads MNIST from the
        two t10k files alone.
      allow_partial: for multi-file train splits (CIFAR-10 batches), use the batches
        present (with a warning) instead of raising for the missing ones.

    Returns:
      ImageDataset with uint8 images (N, H, W, C), int32 labels, float32 per-channel
      ``mean``/``std`` of ``images / pixel_max`` (from the train split; from the test
      split when only the test split was loaded).

    Raises:
      ValueError: unknown name or split; a corrupt or truncated file (the message names
        the file and what was expected: keys, shape, IDX magic number); bad shapes or
        labels out of range.
      FileNotFoundError: a file a requested split needs is missing (named in the message).
      DatasetUnavailableError: no local files and TFDS failed; names the three options.

    Example:
      >>> ds = load_image_dataset("cifar10", "../shared/datasets/cifar10")  # doctest: +SKIP
      >>> ds.train_images.shape, ds.train_images.dtype, ds.mean.round(4)  # doctest: +SKIP
      ((50000, 32, 32, 3), dtype('uint8'), array([0.4914, 0.4822, 0.4465], dtype=float32))
    """
    if name not in IMAGE_DATASETS:
        raise ValueError(f"name must be one of {IMAGE_DATASETS}, got {name!r}")
    if isinstance(splits, str):
        splits = (splits,)
    splits = tuple(splits)
    if not splits or any(s not in _SPLITS for s in splits) or len(set(splits)) != len(splits):
        raise ValueError(f"splits must be a non-empty subset of {_SPLITS} without "
                         f"repeats, got {splits!r}")
    spec = _SPECS[name]
    if not spec.fixed_size:
        raise ValueError(f"{name!r} has images of varying size: read it through the Grain "
                         f"pipeline (cpt_jax.data.pipeline, config.input_pipeline='grain')")
    if name == "digits":
        arrays, pixel_max = _load_digits()
    else:
        pixel_max = 255.0
        root_dir = os.fspath(data_dir) if data_dir is not None else None
        if root_dir is None and name == "fashion_mnist" and os.path.isdir(
                FASHION_MNIST_DEBIAN_DIR):
            root_dir = FASHION_MNIST_DEBIAN_DIR
        found = _find_local(name, root_dir) if root_dir is not None else None
        if found is not None:
            root, layout = found
            arrays = {s: _load_local_split(name, root, layout, s, allow_partial)
                      for s in splits}
        else:
            arrays = _load_tfds(name, splits, os.fspath(data_dir) if data_dir else None)
    train = arrays["train"] if "train" in splits else _empty(name)
    test = arrays["test"] if "test" in splits else _empty(name)
    return _make_dataset(name, spec.num_classes, pixel_max, train, test)


# --------------------------------------------------------------------------------------
# Device side: batching, augmentation, normalization
# --------------------------------------------------------------------------------------


def to_device(ds: ImageDataset, device: Any = None) -> DeviceDataset:
    """Put the arrays of ``ds`` on a device (``jax.device_put``; default device if None).

    Images keep their dtype (uint8 stays uint8: 4x less memory than float32).

    Example:
      >>> data = to_device(load_image_dataset("digits"))
      >>> data.train_images.shape, data.train_labels.dtype
      ((1497, 8, 8, 1), dtype('int32'))
    """
    put = lambda x: jax.device_put(np.asarray(x), device)  # noqa: E731
    return DeviceDataset(
        train_images=put(ds.train_images), train_labels=put(ds.train_labels),
        test_images=put(ds.test_images), test_labels=put(ds.test_labels),
        mean=put(np.asarray(ds.mean, np.float32)), std=put(np.asarray(ds.std, np.float32)),
        num_classes=ds.num_classes, name=ds.name, pixel_max=ds.pixel_max)


def steps_per_epoch(n: int, batch_size: int) -> int:
    """Number of full batches in an epoch: ``n // batch_size`` (the remainder dropped).

    Example:
      >>> steps_per_epoch(50_000, 128)
      390
    """
    if not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
    if not isinstance(n, (int, np.integer)) or n < batch_size:
        raise ValueError(f"the number of examples n must be an integer >= batch_size "
                         f"({batch_size}), got {n!r}")
    return int(n) // int(batch_size)


_AUGMENT_STREAM = np.uint32(0xFFFFFFFF)  # fold_in(key, 2^32-1): never an epoch's key


@functools.partial(jax.jit, static_argnames=("pad", "flip"))
def augment_cifar(images: jax.Array, key: jax.Array, *, pad: int = 4,
                  flip: bool = True) -> jax.Array:
    """CIFAR augmentation per example: zero-pad, random crop, random horizontal flip.

    Matches torchvision ``RandomCrop(H, padding=pad)`` (zero padding, of the raw pixels,
    as in CPT's data pipeline) + ``RandomHorizontalFlip()``: each image is padded with
    ``pad`` zero pixels on every side, an (H, W) window is taken at an offset
    (dy, dx) uniform in {0..2*pad}^2, and is mirrored left-right with probability 1/2.
    Apply it to raw pixels, before :func:`normalize`. Example i uses
    ``jax.random.split(key, B)[i]``.

    Example:
      >>> x = jnp.ones((2, 32, 32, 3), jnp.uint8)
      >>> augment_cifar(x, jax.random.PRNGKey(0)).shape
      (2, 32, 32, 3)
    """
    if images.ndim != 4:
        raise ValueError(f"images must be (B, H, W, C), got shape {images.shape}")
    if not isinstance(pad, int) or pad < 0:
        raise ValueError(f"pad must be a non-negative integer, got {pad!r}")
    b, h, w, c = images.shape
    padded = jnp.pad(images, ((0, 0), (pad, pad), (pad, pad), (0, 0)))

    def one(image: jax.Array, k: jax.Array) -> jax.Array:
        k_crop, k_flip = jax.random.split(k)
        dy, dx = jax.random.randint(k_crop, (2,), 0, 2 * pad + 1)
        out = lax.dynamic_slice(image, (dy, dx, 0), (h, w, c))
        if flip:
            out = jnp.where(jax.random.bernoulli(k_flip), out[:, ::-1, :], out)
        return out

    return jax.vmap(one)(padded, jax.random.split(key, b))


def normalize(images: Any, mean: Any, std: Any, pixel_max: float = 255.0) -> jax.Array:
    """Per-channel normalization to float32: ``(images / pixel_max - mean) / std``.

    ``pixel_max`` is 255 for uint8 sources and 16 for ``digits`` (``ds.pixel_max``).

    Example:
      >>> normalize(jnp.full((1, 2, 2, 1), 255, jnp.uint8), jnp.array([0.5]),
      ...           jnp.array([0.25]))[0, 0, 0, 0]
      Array(2., dtype=float32)
    """
    x = jnp.asarray(images).astype(jnp.float32) / jnp.float32(pixel_max)
    return (x - jnp.asarray(mean, jnp.float32)) / jnp.asarray(std, jnp.float32)


@functools.partial(jax.jit, static_argnames=("batch_size", "augment"))
def batch_at_step(data: DeviceDataset, step: Any, key: jax.Array, *, batch_size: int,
                  augment: bool) -> tuple[jax.Array, jax.Array]:
    """The training batch of step ``step``: a pure function of (data, key, step).

      S      = steps_per_epoch(N, batch_size)            (N // batch_size)
      perm   = jax.random.permutation(fold_in(key, step // S), N)
      idx    = dynamic_slice(perm, (step % S) * batch_size, batch_size)
      images = normalize(augment_cifar(train_images[idx], k_aug), mean, std, pixel_max)
      k_aug  = fold_in(fold_in(key, 2**32 - 1), step)    (only if augment)

    Every epoch visits each example at most once (exactly once but for the
    N - S * batch_size left out by that epoch's permutation). ``step`` may be a traced
    integer, so this runs inside a jitted train step; ``batch_size`` and ``augment``
    are static (the function is itself jitted with them as static arguments).

    Returns:
      images float32 (batch_size, H, W, C), normalized; labels int32 (batch_size,).

    Example:
      >>> data = to_device(load_image_dataset("digits"))
      >>> x, y = batch_at_step(data, 10, jax.random.PRNGKey(0), batch_size=64,
      ...                      augment=False)
      >>> x.shape, y.dtype
      ((64, 8, 8, 1), dtype('int32'))
    """
    n = int(data.train_images.shape[0])
    num_steps = steps_per_epoch(n, batch_size)
    step = jnp.asarray(step)
    if not jnp.issubdtype(step.dtype, jnp.integer) or step.ndim != 0:
        raise ValueError(f"step must be a scalar integer, got dtype {step.dtype} shape "
                         f"{step.shape}")
    epoch = step // num_steps
    position = step % num_steps
    perm = jax.random.permutation(jax.random.fold_in(key, epoch), n)
    idx = lax.dynamic_slice(perm, (position * batch_size,), (batch_size,))
    images = jnp.take(data.train_images, idx, axis=0)
    labels = jnp.take(data.train_labels, idx, axis=0).astype(jnp.int32)
    if augment:
        aug_key = jax.random.fold_in(jax.random.fold_in(key, _AUGMENT_STREAM), step)
        images = augment_cifar(images, aug_key)
    return normalize(images, data.mean, data.std, data.pixel_max), labels


def eval_batches(images: Any, labels: Any, batch_size: int, *, pad_last: bool = True,
                 ) -> Iterator[tuple[Any, Any, Any]]:
    """Iterate over a whole split in its fixed order: ``(images, labels, mask)``.

    Batch k holds examples ``[k * batch_size, (k + 1) * batch_size)``; there are
    ``ceil(N / batch_size)`` batches. With ``pad_last=True`` the last batch is padded
    with zero images and label 0 up to ``batch_size`` (so a jitted eval step compiles
    once) and ``mask`` is False on the padding; with ``pad_last=False`` it is shorter
    and ``mask`` is all True. Sum per-example results times ``mask`` and divide by
    ``mask.sum()`` over all batches for exact metrics. Arrays come back raw (apply
    :func:`normalize`) and in the array type given (NumPy stays NumPy, jax stays jax).

    Example:
      >>> ds = load_image_dataset("digits")
      >>> [int(m.sum()) for _, _, m in eval_batches(ds.test_images, ds.test_labels, 128)]
      [128, 128, 44]
    """
    if not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
    n = int(images.shape[0])
    if int(labels.shape[0]) != n:
        raise ValueError(f"labels has {labels.shape[0]} entries for {n} images")
    xp = jnp if isinstance(images, jax.Array) else np
    for start in range(0, n, batch_size):
        x = images[start:start + batch_size]
        y = labels[start:start + batch_size]
        valid = int(x.shape[0])
        mask = xp.ones((valid,), bool)
        if pad_last and valid < batch_size:
            missing = batch_size - valid
            x = xp.concatenate([x, xp.zeros((missing,) + tuple(x.shape[1:]), x.dtype)])
            y = xp.concatenate([y, xp.zeros((missing,), y.dtype)])
            mask = xp.concatenate([mask, xp.zeros((missing,), bool)])
        yield x, y, mask
