"""The checkpoint storage: `CheckpointManager`, orbax save/restore verified by the manifest.

A checkpoint of step ``s`` is the state (`cpt_jax.runner.checkpoint_files.to_saveable`)
and a JSON ``meta`` dict, under `directory` (an orbax ``CheckpointManager`` root)::

    <directory>/<step>/state/...           orbax PyTree (OCDBT) of the state
    <directory>/<step>/meta/...            orbax JSON of `meta`
    <directory>/<step>/cpt_manifest.json   sha256 + size of every file above
    <directory>/invalid/<step>-<time>/     checkpoints found torn or corrupt

Integrity: orbax writes a step into a temporary folder and renames it when complete,
so a save killed midway leaves no ``<step>`` folder (its temporary folder is removed at
the next start). The manifest is written last (atomically, fsynced); a checkpoint
without one, or whose files do not match it, is *not* used: `restore_latest` logs a
warning, moves it to ``invalid/`` and falls back to the previous good checkpoint.
A checkpoint of another program or another model is never moved: restoring it raises
`IncompatibleCheckpointError`.

Example:
  >>> import tempfile
  >>> from cpt_jax.models import MLP
  >>> from cpt_jax.training import create_train_state
  >>> state = create_train_state(MLP(hidden=(4,), num_classes=2), optax.sgd(0.1),
  ...                            jax.random.key(0), jnp.ones((1, 3)))
  >>> manager = CheckpointManager(tempfile.mkdtemp(), keep=3)
  >>> folder = manager.save(100, state, {"note": "hello"})    # returns <dir>/100
  >>> restored = manager.restore_latest(state)   # `state`: the template; None if nothing usable
  >>> restored.step, restored.meta["note"]
  (100, 'hello')
"""
from __future__ import annotations

import dataclasses
import os
import shutil
import time
from collections.abc import Callable
from typing import Any

import jax
from absl import logging

from cpt_jax.runner.checkpoint_files import (
    MANIFEST_NAME,
    from_saveable,
    structure_mismatch,
    to_saveable,
    verify_manifest,
    write_manifest,
)
from cpt_jax.runner.orbax_logs import quiet_orbax_logs

INVALID_DIR = "invalid"


class CorruptCheckpointError(ValueError):
    """A checkpoint is torn (no manifest) or its files do not match the manifest."""


class IncompatibleCheckpointError(ValueError):
    """An intact checkpoint that is not this run's: another program's (no ``meta``
    item) or another model's state (a leaf missing, or of another shape or dtype).
    Never skipped nor moved: the run stops before anything is written."""


@dataclasses.dataclass(frozen=True)
class Restored:
    """A restored checkpoint: its `step`, the `state` (same pytree type as the
    template) and the `meta` dict saved with it."""

    step: int
    state: Any
    meta: dict[str, Any]



DEFAULT_KEEP = 3
"""How many of the newest checkpoints are kept unless told (``config.keep_checkpoints``
defaults to it)."""


class CheckpointManager:
    """Save/restore run checkpoints with orbax; keep the last `keep`; verify on restore.

    Saves are synchronous (the step's files and manifest are on disk when `save`
    returns), so a signal handler can save and exit. Only process 0 writes manifests.

    Args:
      directory: the checkpoint root (created if missing).
      keep: how many of the newest checkpoints to keep (older ones are deleted).

    Example:
      >>> import tempfile
      >>> from cpt_jax.models import MLP
      >>> from cpt_jax.training import create_train_state
      >>> state = create_train_state(MLP(hidden=(4,), num_classes=2), optax.sgd(0.1),
      ...                            jax.random.key(0), jnp.ones((1, 3)))
      >>> manager = CheckpointManager(os.path.join(tempfile.mkdtemp(), "checkpoints"), keep=2)
      >>> for step in (100, 200, 300):
      ...     folder = manager.save(step, state, {"seed": 0})
      >>> manager.restore_latest(state).step, manager.steps()
      (300, [200, 300])
    """

    def __init__(self, directory: str, *, keep: int = DEFAULT_KEEP):
        import orbax.checkpoint as ocp

        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ValueError(f"keep={keep!r} must be an integer >= 1")
        quiet_orbax_logs()
        self._ocp = ocp
        self.directory = os.path.abspath(os.path.expanduser(directory))
        os.makedirs(self.directory, exist_ok=True)
        self.keep = keep
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep, create=True, enable_async_checkpointing=False,
            cleanup_tmp_directories=True)
        self._mgr = ocp.CheckpointManager(self.directory, options=options)

    def step_dir(self, step: int) -> str:
        """The folder of the checkpoint at `step`."""
        return os.path.join(self.directory, str(int(step)))

    def steps(self) -> list[int]:
        """Steps of the complete (orbax-committed) checkpoints, ascending (unverified)."""
        return sorted(int(s) for s in self._mgr.all_steps())

    def save(self, step: int, state: Any, meta: dict[str, Any] | None = None) -> str:
        """Write `state` and JSON `meta` as the checkpoint of `step`; returns its folder.

        A step already saved is left as it is.
        """
        ocp = self._ocp
        step = int(step)
        if step in self.steps():
            logging.info("checkpoint of step %d already exists; not saved again", step)
            return self.step_dir(step)
        t0 = time.time()
        meta = dict(meta or {})
        meta["checkpoint_step"] = step
        self._mgr.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(to_saveable(state)),
            meta=ocp.args.JsonSave(meta)), force=True)
        self._mgr.wait_until_finished()
        if jax.process_index() == 0:
            write_manifest(self.step_dir(step), step)
        logging.info("saved checkpoint of step %d to %s (%.2f s)", step, self.step_dir(step),
                     time.time() - t0)
        return self.step_dir(step)

    def read_meta(self, step: int) -> dict[str, Any]:
        """The JSON `meta` of the checkpoint of `step` (not verified)."""
        ocp = self._ocp
        out = self._mgr.restore(int(step), args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
        return dict(out["meta"] or {})

    def restore(self, step: int, template: Any,
                check_meta: Callable[[dict[str, Any]], None] | None = None) -> Restored:
        """Verify, then restore the checkpoint of `step` into `template`'s structure,
        shapes, dtypes and shardings.

        `check_meta(meta)` runs before the state is read; its exceptions propagate
        (e.g. a ValueError for a checkpoint of another config). Raises
        `CorruptCheckpointError` if the checkpoint is torn, corrupt or unreadable.
        """
        ocp = self._ocp
        step = int(step)
        where = self.step_dir(step)
        self.check_ours(where)
        problem = verify_manifest(where, step)
        if problem is not None:
            raise CorruptCheckpointError(f"checkpoint {where}: {problem}")
        try:
            meta = self.read_meta(step)
        except Exception as exc:  # noqa: BLE001
            raise CorruptCheckpointError(
                f"checkpoint {where}: unreadable meta: {type(exc).__name__}: {exc}") from exc
        if check_meta is not None:
            check_meta(meta)
        saveable = to_saveable(template)
        self._check_structure(step, saveable)
        abstract = jax.tree_util.tree_map(ocp.utils.to_shape_dtype_struct, saveable)
        try:
            out = self._mgr.restore(step, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract)))
            state = from_saveable(template, out["state"])
        except Exception as exc:  # noqa: BLE001 - any failure makes it unusable
            raise CorruptCheckpointError(
                f"checkpoint {where} could not be restored into the current state: "
                f"{type(exc).__name__}: {exc}") from exc
        return Restored(step=step, state=state, meta=meta)

    def check_ours(self, where: str) -> None:
        """`IncompatibleCheckpointError` for a step folder another program wrote: orbax
        commits ``state`` and ``meta`` together, so a cpt_jax checkpoint, even one
        killed before its manifest, has both (one with a manifest is ours: a missing
        item is then corruption, found by `verify_manifest`)."""
        if os.path.isfile(os.path.join(where, MANIFEST_NAME)):
            return
        if not all(os.path.isdir(os.path.join(where, item)) for item in ("state", "meta")):
            found = sorted(os.listdir(where)) if os.path.isdir(where) else []
            raise IncompatibleCheckpointError(
                f"{where} is not a cpt_jax checkpoint (it holds {found[:4]}, not state/ and "
                f"meta/): the --workdir belongs to another program; use a new --workdir")

    def _check_structure(self, step: int, saveable: Any) -> None:
        """`IncompatibleCheckpointError` if the state saved at `step` is another model's."""
        from etils import epath

        try:
            saved = self._ocp.StandardCheckpointHandler().metadata(
                epath.Path(os.path.join(self.step_dir(step), "state")))
        except Exception as exc:  # noqa: BLE001 - unreadable metadata is corruption
            raise CorruptCheckpointError(
                f"checkpoint {self.step_dir(step)}: unreadable state metadata: "
                f"{type(exc).__name__}: {exc}") from exc
        problem = structure_mismatch(getattr(saved, "tree", saved), saveable)
        if problem is not None:
            raise IncompatibleCheckpointError(
                f"checkpoint {self.step_dir(step)} holds another model's state: {problem}; "
                f"use a new --workdir (nothing was changed)")

    def check_latest_meta(self, check_meta: Callable[[dict[str, Any]], None]) -> None:
        """Run `check_meta` on the newest checkpoint's meta before any state exists.

        Lets a caller refuse a checkpoint of another run (or another program's folder,
        `check_ours`) before it builds or compiles anything; checkpoints whose meta
        cannot be read are left to `restore_latest`, which skips them.
        """
        for step in reversed(self.steps()):
            self.check_ours(self.step_dir(step))
            try:
                meta = self.read_meta(step)
            except Exception:  # noqa: BLE001 - unreadable: restore_latest decides
                continue
            check_meta(meta)
            return

    def restore_latest(self, template: Any,
                       check_meta: Callable[[dict[str, Any]], None] | None = None,
                       ) -> Restored | None:
        """The newest usable checkpoint, or None if there is none.

        A torn or corrupt checkpoint is skipped with a warning and moved to
        ``<directory>/invalid/``; the previous good one is used. `check_meta` as in
        `restore` (its errors propagate and nothing is moved).
        """
        for step in reversed(self.steps()):
            try:
                return self.restore(step, template, check_meta)
            except CorruptCheckpointError as exc:
                moved = self._quarantine(step)
                logging.warning("Skipping unusable checkpoint (%s); moved it to %s and trying "
                                "the previous one.", exc, moved)
        return None

    def _quarantine(self, step: int) -> str:
        if jax.process_index() != 0:  # process 0 moves it; every process skips it alike
            self._mgr.reload()
            return "(moved by process 0)"
        dest_root = os.path.join(self.directory, INVALID_DIR)
        os.makedirs(dest_root, exist_ok=True)
        dest = os.path.join(dest_root, f"{step}-{time.strftime('%Y%m%d-%H%M%S')}")
        n = 0
        while os.path.exists(dest + (f".{n}" if n else "")):
            n += 1
        dest = dest + (f".{n}" if n else "")
        try:
            os.replace(self.step_dir(step), dest)
        except OSError:  # pragma: no cover - cross-device or permissions
            shutil.rmtree(self.step_dir(step), ignore_errors=True)
            dest = "(deleted)"
        self._mgr.reload()
        return dest

    def close(self) -> None:
        """Release orbax's resources."""
        self._mgr.close()

