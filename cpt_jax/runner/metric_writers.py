"""Metric writers: where a run's records go, behind one interface (after clu's).

The runner produces three kinds of record, each a flat ``{name: value}`` dict at a
step:

=========  ==========================================  ==============================
kind       when                                        ``metrics.jsonl`` line
=========  ==========================================  ==============================
``train``  every ``config.log_every`` steps (and last)  the record itself
``eval``   every ``config.eval_every`` steps            ``{"eval": record}``
``final``  once, after the final evaluation             ``{"final": record}``
=========  ==========================================  ==============================

Every writer implements ``write(kind, step, record)``, ``flush()`` and ``close()``:

* `JsonlWriter`: one JSON line per record (see the table), line-buffered;
* `MemoryWriter`: the same lines kept in a list (checkpointed with the state, so a
  resumed run rewrites ``metrics.jsonl`` without duplicates);
* `TensorBoardWriter`: numeric fields as scalars (``final`` ones prefixed ``final/``);
* `LoggingWriter`: one absl INFO line per record;
* `ProgressBarWriter`: a tqdm bar advanced by ``train`` records (bits, loss, it/s);
* `MultiWriter`: fans a record out to several writers.

Example:
  >>> memory = MemoryWriter()
  >>> writer = MultiWriter([memory, LoggingWriter()])
  >>> writer.write("train", 4, {"step": 4, "loss": 0.5})
  >>> writer.write("eval", 4, {"step": 4, "test_accuracy": 0.9})
  >>> memory.records
  [{'step': 4, 'loss': 0.5}, {'eval': {'step': 4, 'test_accuracy': 0.9}}]
"""
from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

from absl import logging

RECORD_KINDS = ("train", "eval", "final")
"""The kinds of record a writer receives (see the module docstring)."""


def jsonl_entry(kind: str, record: Mapping[str, Any]) -> dict[str, Any]:
    """The ``metrics.jsonl`` object of a record: itself for ``train``, else ``{kind: record}``.

    Args:
      kind: one of `RECORD_KINDS`.
      record: the record's fields.

    Returns:
      The JSON-able dict written as one line.

    Example:
      >>> jsonl_entry("eval", {"step": 8, "test_loss": 0.3})
      {'eval': {'step': 8, 'test_loss': 0.3}}
    """
    if kind not in RECORD_KINDS:
        raise ValueError(f"record kind {kind!r} is unknown; choose one of {list(RECORD_KINDS)}")
    return dict(record) if kind == "train" else {kind: dict(record)}


def numeric_scalars(record: Mapping[str, Any]) -> dict[str, float]:
    """The fields of `record` worth a scalar plot: ints and floats, not bools, not ``step``.

    Example:
      >>> numeric_scalars({"step": 3, "loss": 0.25, "interrupted": False, "model": "cnn"})
      {'loss': 0.25}
    """
    return {k: v for k, v in record.items()
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}


class MetricWriter:
    """The interface: ``write(kind, step, record)``, ``flush()``, ``close()`` (no-ops here)."""

    def write(self, kind: str, step: int, record: Mapping[str, Any]) -> None:
        """Record `record` (of kind `kind`, see `RECORD_KINDS`) at `step`."""

    def flush(self) -> None:
        """Make what was written durable (before a checkpoint is saved)."""

    def close(self) -> None:
        """Flush and release the writer's resources."""


class JsonlWriter(MetricWriter):
    """Appends one `jsonl_entry` line per record to `path` (line-buffered)."""

    def __init__(self, path: str):
        self._file = open(path, "a", buffering=1)

    def write(self, kind: str, step: int, record: Mapping[str, Any]) -> None:
        self._file.write(json.dumps(jsonl_entry(kind, record)) + "\n")

    def flush(self) -> None:
        self._file.flush()

    def close(self) -> None:
        self._file.close()


class MemoryWriter(MetricWriter):
    """Keeps the `jsonl_entry` of every record in ``self.records`` (after `initial`)."""

    def __init__(self, initial: Sequence[dict[str, Any]] = ()):
        self.records: list[dict[str, Any]] = list(initial)

    def write(self, kind: str, step: int, record: Mapping[str, Any]) -> None:
        self.records.append(jsonl_entry(kind, record))


def write_jsonl(path: str, entries: Sequence[Mapping[str, Any]]) -> None:
    """Replace `path` atomically by one JSON line per entry (write a temp file, rename).

    Example:
      >>> import tempfile, os
      >>> path = os.path.join(tempfile.mkdtemp(), "m.jsonl")
      >>> write_jsonl(path, [{"step": 1}, {"step": 2}]); open(path).read()
      '{"step": 1}\\n{"step": 2}\\n'
    """
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        for entry in entries:
            f.write(json.dumps(entry) + "\n")
    os.replace(tmp, path)


def import_summary_writer():
    """``tensorboardX.SummaryWriter`` without importing PyTorch.

    tensorboardX imports torch when it is installed (seconds and ~1 GB, unused for
    scalars); it is hidden for the duration of the import unless the process already
    loaded it. Raises ImportError when tensorboardX is missing.
    """
    hide = "torch" not in sys.modules
    if hide:
        sys.modules["torch"] = None  # `import torch` raises ImportError
    try:
        from tensorboardX import SummaryWriter
    finally:
        if hide and sys.modules.get("torch", 0) is None:
            del sys.modules["torch"]
    return SummaryWriter


class TensorBoardWriter(MetricWriter):
    """`numeric_scalars` of every record as TensorBoard scalars in `logdir`.

    ``final`` records are written at their step under ``final/<name>``. `purge_step`
    hides the events at steps >= it written by an earlier (interrupted) run, so
    resumed curves do not double.
    """

    def __init__(self, logdir: str, purge_step: int = 0):
        self._writer = import_summary_writer()(logdir, purge_step=int(purge_step))

    def write(self, kind: str, step: int, record: Mapping[str, Any]) -> None:
        prefix = "final/" if kind == "final" else ""
        for name, value in numeric_scalars(record).items():
            self._writer.add_scalar(prefix + name, value, step)

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


def tensorboard_writer(logdir: str, purge_step: int = 0) -> MetricWriter:
    """A `TensorBoardWriter`, or a no-op `MetricWriter` when tensorboardX is missing."""
    try:
        return TensorBoardWriter(logdir, purge_step)
    except ImportError:  # pragma: no cover
        logging.info("tensorboardX not installed: no TensorBoard events")
        return MetricWriter()


class LoggingWriter(MetricWriter):
    """One absl INFO line per record: ``[train] step 4: loss=0.5, bits=3``."""

    def write(self, kind: str, step: int, record: Mapping[str, Any]) -> None:
        fields = ", ".join(f"{k}={v:.6g}" for k, v in numeric_scalars(record).items())
        logging.info("[%s] step %d: %s", kind, step, fields)


class ProgressBarWriter(MetricWriter):
    """A tqdm bar over `total` steps, advanced (with bits, loss, it/s) by ``train`` records."""

    def __init__(self, total: int, initial: int = 0):
        from tqdm.auto import tqdm

        self._bar = tqdm(total=total, initial=initial, desc="train", unit="step",
                         dynamic_ncols=True, mininterval=1.0)
        self._last_time, self._last_step = time.time(), initial

    def write(self, kind: str, step: int, record: Mapping[str, Any]) -> None:
        if kind != "train":
            return
        now = time.time()
        rate = (step - self._last_step) / max(now - self._last_time, 1e-9)
        self._last_time, self._last_step = now, step
        self._bar.set_postfix(bits=record.get("bits", 32), loss=f"{record['loss']:.3f}",
                              it_s=f"{rate:.1f}")
        self._bar.update(step - self._bar.n)

    def close(self) -> None:
        self._bar.close()


def progress_writer(total: int, initial: int = 0) -> MetricWriter:
    """A `ProgressBarWriter`, or a `LoggingWriter` when tqdm is missing."""
    try:
        return ProgressBarWriter(total, initial)
    except ImportError:  # pragma: no cover
        return LoggingWriter()


class MultiWriter(MetricWriter):
    """Writes, flushes and closes each of `writers` in order."""

    def __init__(self, writers: Sequence[MetricWriter]):
        self.writers = list(writers)

    def write(self, kind: str, step: int, record: Mapping[str, Any]) -> None:
        for writer in self.writers:
            writer.write(kind, step, record)

    def flush(self) -> None:
        for writer in self.writers:
            writer.flush()

    def close(self) -> None:
        for writer in self.writers:
            writer.close()


def find_writer(writer: MetricWriter, kind: type) -> MetricWriter | None:
    """The first writer of class `kind` in `writer` (itself or inside a `MultiWriter`)."""
    if isinstance(writer, kind):
        return writer
    for inner in getattr(writer, "writers", ()):
        found = find_writer(inner, kind)
        if found is not None:
            return found
    return None
