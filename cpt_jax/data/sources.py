"""Where a named dataset comes from when there are no local files: TFDS, without TensorFlow.

Resolution order of every named dataset (image or text) that TFDS has, after the local
files of ``data_dir`` (read by :mod:`cpt_jax.data.image` / :mod:`cpt_jax.data.text`):

1. a TFDS-prepared directory (array_record files) through
   ``tfds.data_source(name, split=..., data_dir=..., download=False)``: random access,
   no TensorFlow, no download (``data_dir=None``: TFDS's default, ``~/tensorflow_datasets``
   or ``$TFDS_DATA_DIR``);
2. ``tfds.load(name, split=..., batch_size=-1, data_dir=...)``, only when TensorFlow
   imports (it may download, the first time);
3. otherwise :class:`DatasetUnavailableError`, whose message names all three options.

Prepare a directory once, on a machine with internet (and TensorFlow)::

    tfds build cifar10 --file_format=array_record --data_dir=/data/tfds

then copy ``/data/tfds`` and pass it as ``data_dir`` (``--config.data_dir``). A
directory prepared as TFRecord converts with ``tfds convert_format``.

Example (offline, under TFDS's mock data):
  >>> import tensorflow_datasets as tfds
  >>> with tfds.testing.mock_data(num_examples=6):
  ...     source = tfds_data_source("cifar10", "train")
  ...     arrays = load_tfds_arrays("cifar10", "test", None, ("image", "label"))
  >>> len(source), arrays["image"].shape
  (6, (6, 32, 32, 3))
"""
from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["DatasetUnavailableError", "tensorflow_available", "tfds_data_source",
           "open_tfds_source", "read_examples", "load_tfds_arrays", "PREPARE_HINT"]

PREPARE_HINT = ("prepare it once on a machine with internet: `tfds build NAME "
                "--file_format=array_record --data_dir=DIR`, copy DIR here and pass "
                "data_dir=DIR (--config.data_dir=DIR)")
"""How to make a TFDS-prepared directory (``NAME``: the TFDS name)."""


class DatasetUnavailableError(FileNotFoundError, RuntimeError):
    """No local files, no TFDS-prepared directory, and ``tfds.load`` could not run."""


def tensorflow_available() -> bool:
    """True when ``import tensorflow`` succeeds (``tfds.load`` needs it).

    Example:
      >>> isinstance(tensorflow_available(), bool)
      True
    """
    try:
        import tensorflow  # noqa: F401  (heavy; only imported to ask)
    except Exception:  # noqa: BLE001 - any import failure means "no TensorFlow"
        return False
    return True


def tfds_data_source(name: str, split: str, data_dir: str | os.PathLike | None = None,
                     ) -> Sequence[dict[str, Any]]:
    """``tfds.data_source(name, split=split, data_dir=data_dir, download=False)``.

    Random access (``len(source)``, ``source[i]`` -> dict of NumPy values) over a
    TFDS-prepared directory of array_record files; needs neither TensorFlow nor the
    internet (nothing is downloaded).

    Args:
      name: the TFDS name, e.g. ``"cifar10"``, ``"imagenet2012"``, ``"tiny_shakespeare"``.
      split: a TFDS split, e.g. ``"train"``, ``"test"``, ``"validation"``.
      data_dir: the TFDS data directory (None: TFDS's default).

    Returns:
      The data source (a sequence of feature dicts).

    Raises:
      Whatever TFDS raises when the directory holds no prepared copy (callers turn it
      into :class:`DatasetUnavailableError`).
    """
    import tensorflow_datasets as tfds  # lazy: heavy, and optional

    with _tfds_warnings_held():  # "no dataset_info.json" etc.: the caller's error says it
        return tfds.data_source(name, split=split, download=False,
                                data_dir=os.fspath(data_dir) if data_dir else None)


class _HeldTfdsWarnings(logging.Filter):
    """Drops TFDS's log records below ERROR (a missing prepared copy is reported once,
    in `DatasetUnavailableError`, not as a warning about its folder first)."""

    def filter(self, record) -> bool:  # noqa: A003 - logging API
        return record.levelno >= logging.ERROR or "tensorflow_datasets" not in record.pathname


@contextlib.contextmanager
def _tfds_warnings_held():
    from absl import logging as absl_logging

    held = _HeldTfdsWarnings()
    targets = [absl_logging.get_absl_logger(), absl_logging.get_absl_handler(),
               logging.getLogger("tensorflow_datasets")]
    for target in targets:
        target.addFilter(held)
    try:
        yield
    finally:
        for target in targets:
            target.removeFilter(held)


def read_examples(source: Sequence[dict[str, Any]], keys: Sequence[str],
                  ) -> dict[str, np.ndarray]:
    """Read a whole data source into stacked arrays: ``{k: stack(source[i][k] for i)}``.

    Every example must hold each key with one shape (the images of a fixed-size
    dataset); the result's first axis is the example index, in the source's order.

    Example:
      >>> read_examples([{"x": np.ones(2), "y": 1}, {"x": np.zeros(2), "y": 0}], ("x", "y"))
      {'x': array([[1., 1.],
             [0., 0.]]), 'y': array([1, 0])}
    """
    examples = [source[i] for i in range(len(source))]
    return {k: np.stack([np.asarray(e[k]) for e in examples]) if examples
            else np.zeros((0,)) for k in keys}


def _describe(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"


def load_tfds_arrays(name: str, split: str, data_dir: str | os.PathLike | None,
                     keys: Sequence[str], *, local_hint: str = "") -> dict[str, np.ndarray]:
    """One split of a TFDS dataset as NumPy arrays: data_source, else tfds.load.

    Tries :func:`tfds_data_source` (a prepared directory, no TensorFlow), then, only if
    :func:`tensorflow_available`, ``tfds.load(name, split=split, batch_size=-1,
    data_dir=data_dir)``.

    Args:
      name: the TFDS name.
      split: the TFDS split.
      data_dir: the TFDS data directory (None: TFDS's default).
      keys: the features to return (e.g. ``("image", "label")``).
      local_hint: the local files the caller looked for (goes into the error).

    Returns:
      ``{key: array}`` with the examples stacked on the first axis.

    Raises:
      DatasetUnavailableError: neither source worked; the message names the three
        options (local files, a TFDS-prepared directory, tfds.load with TensorFlow).
    """
    try:
        return read_examples(tfds_data_source(name, split, data_dir), keys)
    except Exception as e:  # noqa: BLE001 - no TFDS, no prepared copy, bad split...
        source_error = e
    if tensorflow_available():
        try:
            import tensorflow_datasets as tfds

            arrays = tfds.as_numpy(tfds.load(name, split=split, batch_size=-1,
                                             data_dir=os.fspath(data_dir) if data_dir
                                             else None))
            return {k: np.asarray(arrays[k]) for k in keys}
        except Exception as e:  # noqa: BLE001 - network, missing files, ...
            load_text = f"tfds.load failed ({_describe(e)})"
    else:
        load_text = "tfds.load needs TensorFlow, which is not installed"
    raise _unavailable(name, split, data_dir, local_hint, source_error,
                       load_text) from source_error


def _unavailable(name: str, split: str, data_dir: Any, local_hint: str,
                 source_error: BaseException, load_text: str) -> DatasetUnavailableError:
    where = f"in {os.fspath(data_dir)!r}" if data_dir else "(data_dir not set)"
    local = f"no local files {where}" + (f" (expected {local_hint})" if local_hint else "")
    return DatasetUnavailableError(
        f"cannot load {name!r} split {split!r}: (1) {local}; (2) no TFDS-prepared "
        f"directory: tfds.data_source failed ({_describe(source_error)}); (3) "
        f"{load_text}. To use TFDS offline, {PREPARE_HINT.replace('NAME', name)}")


def open_tfds_source(name: str, split: str, data_dir: str | os.PathLike | None, *,
                     local_hint: str = "") -> Sequence[dict[str, Any]]:
    """:func:`tfds_data_source`, or a :class:`DatasetUnavailableError` naming the options.

    For streaming readers (the Grain pipeline), which need random access: a
    TFDS-prepared directory is the only TFDS option (``tfds.load`` is not tried).

    Args:
      name: the TFDS name.
      split: the TFDS split.
      data_dir: the TFDS data directory (None: TFDS's default).
      local_hint: the local files the caller looked for (goes into the error).

    Returns:
      The data source.
    """
    try:
        return tfds_data_source(name, split, data_dir)
    except Exception as e:  # noqa: BLE001 - no TFDS, no prepared copy, bad split...
        raise _unavailable(name, split, data_dir, local_hint, e,
                           "tfds.load is not used for a streaming pipeline") from e
