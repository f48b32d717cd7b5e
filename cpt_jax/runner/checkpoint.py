"""Checkpoints that make a run resumable bit for bit: orbax storage + a checksum manifest.

A checkpoint of a run at step ``s`` is everything its future depends on:

* the `TrainState`: ``step`` (the position of every schedule: precision, learning
  rate), parameters, ``batch_stats``, optimizer state, ``skipped_steps`` and the PRNG
  key (a typed key is stored as its raw ``key_data`` and re-wrapped on restore);
* the data order needs nothing more: a batch is a pure function of
  ``(config.seed, step)`` (`cpt_jax.data.batch_at_step`), so ``state.step`` suffices;
* a JSON ``meta`` dict (the runner stores the config and the metrics history there,
  so ``metrics.jsonl`` is rewritten from it on resume: no duplicate lines).

Layout under `directory` (an orbax ``CheckpointManager`` root)::

    <directory>/<step>/state/...           orbax PyTree (OCDBT) of the state
    <directory>/<step>/meta/...            orbax JSON of `meta`
    <directory>/<step>/cpt_manifest.json   sha256 + size of every file above
    <directory>/invalid/<step>-<time>/     checkpoints found torn or corrupt

Integrity: orbax writes a step into a temporary folder and renames it when complete,
so a save killed midway leaves no ``<step>`` folder (its temporary folder is removed at
the next start). The manifest is written last (atomically, fsynced); a checkpoint
without one, or whose files do not match it, is *not* used: `restore_latest` logs a
warning, moves it to ``invalid/`` and falls back to the previous good checkpoint.

The run's checkpoints (the main job's one wrapper over `CheckpointManager`):
`Checkpointer` keeps them in ``workdir/checkpoints`` with the config, the record
history and the schedule `Segments` in ``meta``; `refuse_other_runs` stops before
anything is built when the workdir holds another run's (`check_resume_compatible`);
`restore_run` resumes from the newest good one (`resume_segments`: the lengths an
``--extend`` ran).

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

import contextlib
import dataclasses
import hashlib
import json
import logging as py_logging
import os
import shutil
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
from absl import logging
from flax import serialization

if TYPE_CHECKING:
    from cpt_jax.training import TrainState

MANIFEST_NAME = "cpt_manifest.json"
INVALID_DIR = "invalid"
_FORMAT_VERSION = 1


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


# --------------------------------------------------------------------------- pytrees

def _is_typed_key(x) -> bool:
    return isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jax.dtypes.prng_key)


def to_saveable(tree: Any) -> Any:
    """`tree` as a nested dict of plain arrays: typed PRNG keys become ``key_data``.

    ``to_saveable(state)["rng"] == jax.random.key_data(state.rng)``; dataclasses and
    namedtuples become dicts (`flax.serialization.to_state_dict`).

    Example:
      >>> to_saveable({"rng": jax.random.key(0)})["rng"].dtype
      dtype('uint32')
    """
    raw = jax.tree_util.tree_map(lambda x: jax.random.key_data(x) if _is_typed_key(x) else x,
                                 tree)
    return serialization.to_state_dict(raw)


def from_saveable(template: Any, saved: Any) -> Any:
    """Inverse of `to_saveable`: `saved` (nested dict) back into `template`'s pytree type,
    re-wrapping raw key data where the template holds a typed key (same key impl).

    Example:
      >>> t = {"rng": jax.random.key(0), "w": jnp.ones(2)}
      >>> from_saveable(t, to_saveable(t))["rng"].dtype
      key<fry>
    """
    raw_template = jax.tree_util.tree_map(
        lambda x: jax.random.key_data(x) if _is_typed_key(x) else x, template)
    restored = serialization.from_state_dict(raw_template, saved)
    return jax.tree_util.tree_map(
        lambda t, s: jax.random.wrap_key_data(s, impl=jax.random.key_impl(t))
        if _is_typed_key(t) else s, template, restored)


# --------------------------------------------------------------------------- manifest

def _sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _list_files(step_dir: str) -> list[str]:
    out = []
    for root, _, files in os.walk(step_dir):
        for name in files:
            rel = os.path.relpath(os.path.join(root, name), step_dir)
            if rel != MANIFEST_NAME and not rel.startswith(MANIFEST_NAME + "."):
                out.append(rel)
    return sorted(out)


def write_manifest(step_dir: str, step: int) -> str:
    """Write ``cpt_manifest.json`` (sha256 and size of every file) into `step_dir`.

    Written to a temporary file, fsynced, then renamed: the manifest exists only
    complete, and only after every file it lists.
    """
    files = {rel: {"sha256": _sha256_file(os.path.join(step_dir, rel)),
                   "size": os.path.getsize(os.path.join(step_dir, rel))}
             for rel in _list_files(step_dir)}
    manifest = {"format": _FORMAT_VERSION, "step": int(step), "files": files}
    path = os.path.join(step_dir, MANIFEST_NAME)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def verify_manifest(step_dir: str, step: int | None = None) -> str | None:
    """None if `step_dir` matches its manifest, else what is wrong (one line)."""
    path = os.path.join(step_dir, MANIFEST_NAME)
    if not os.path.isfile(path):
        return f"no {MANIFEST_NAME} (a save that did not finish)"
    try:
        with open(path) as f:
            manifest = json.load(f)
        files = manifest["files"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"unreadable {MANIFEST_NAME}: {exc}"
    if step is not None and manifest.get("step") != step:
        return f"{MANIFEST_NAME} is for step {manifest.get('step')}, not {step}"
    if not files:
        return f"{MANIFEST_NAME} lists no files"
    for rel, info in sorted(files.items()):
        full = os.path.join(step_dir, rel)
        if not os.path.isfile(full):
            return f"missing file {rel}"
        size = os.path.getsize(full)
        if size != info.get("size"):
            return f"file {rel} has {size} bytes, the manifest says {info.get('size')}"
        if _sha256_file(full) != info.get("sha256"):
            return f"file {rel} does not match its sha256 in the manifest"
    return None


# --------------------------------------------------------------------------- structure

def _leaf_specs(tree: Any) -> dict[str, tuple]:
    """``{"params/dense/kernel": (shape, dtype name)}`` of every array leaf of `tree`."""
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    out = {}
    for path, leaf in leaves:
        if hasattr(leaf, "shape") and hasattr(leaf, "dtype"):
            key = "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)
            out[key] = (tuple(leaf.shape), str(jax.numpy.dtype(leaf.dtype)))
    return out


def structure_mismatch(saved: Any, template: Any) -> str | None:
    """None if `saved` (a checkpoint's state metadata) has `template`'s leaves, shapes and
    dtypes, else the first difference on one line (a leaf missing on either side, or of
    another shape or dtype).

    Example:
      >>> structure_mismatch({"w": jnp.zeros((2, 3))}, {"w": jnp.zeros((2, 4))})
      'w has shape (2, 3) and dtype float32 there, (2, 4) and float32 here'
    """
    there, here = _leaf_specs(saved), _leaf_specs(template)
    missing, extra = sorted(set(here) - set(there)), sorted(set(there) - set(here))
    if missing:
        return (f"{len(missing)} leaves of this model are not there ({', '.join(missing[:3])}"
                f"{', ...' if len(missing) > 3 else ''})")
    if extra:
        return (f"it holds {len(extra)} leaves this model lacks ({', '.join(extra[:3])}"
                f"{', ...' if len(extra) > 3 else ''})")
    for key in sorted(here, key=lambda k: (not k.startswith("params/"), k)):  # params first
        if there[key] != here[key]:
            (s1, d1), (s2, d2) = there[key], here[key]
            return f"{key} has shape {s1} and dtype {d1} there, {s2} and {d2} here"
    return None


# --------------------------------------------------------------------------- manager

class _QuietOrbax:
    """A `logging.Filter` dropping orbax's INFO chatter (its warnings still show)."""

    def filter(self, record) -> bool:  # noqa: A003 - logging API
        import logging as py_logging

        return record.levelno >= py_logging.WARNING or "orbax" not in record.pathname


_QUIET_ORBAX = _QuietOrbax()


def _quiet_orbax_logs() -> None:
    for target in (logging.get_absl_logger(), logging.get_absl_handler()):
        if _QUIET_ORBAX not in target.filters:
            target.addFilter(_QUIET_ORBAX)


def os_error_in(exc: BaseException | None) -> OSError | None:
    """The first `OSError` with an errno in `exc`'s chain (``__cause__``,
    ``__context__``), or one made from tensorstore's ``[os_error_code='N']`` in a
    message of the chain: what orbax's wrapped failure really was; None if neither.

    Example:
      >>> import errno
      >>> try:
      ...     try:
      ...         raise OSError(errno.ENOSPC, "No space left on device")
      ...     except OSError as e:
      ...         raise ValueError("orbax: save failed") from e
      ... except ValueError as e:
      ...     os_error_in(e).errno == errno.ENOSPC
      True
      >>> os_error_in(ValueError("RESOURCE_EXHAUSTED: ... No space left on device "
      ...                        "[os_error_code='28']")).strerror
      'No space left on device'
    """
    import re

    seen, chain = set(), []
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno is not None:
            return exc
        chain.append(exc)
        exc = exc.__cause__ or exc.__context__
    for link in chain:  # tensorstore (orbax's OCDBT writer): "... [os_error_code='28']"
        code = re.search(r"os_error_code='(\d+)'", str(link))
        if code:
            number = int(code.group(1))
            return OSError(number, os.strerror(number))
    return None


class _HeldOrbaxErrors:
    """A `logging.Filter` that holds back orbax's error records (with their tracebacks):
    a failed save is reported once, as one line, by the caller."""

    def __init__(self):
        self.held: list = []

    def filter(self, record) -> bool:  # noqa: A003 - logging API
        if "orbax" in record.pathname and record.levelno >= py_logging.ERROR:
            self.held.append(record)
            return False
        return True


@contextlib.contextmanager
def orbax_errors_held():
    """While inside, orbax's ERROR records are not shown (logged at debug level if the
    block fails: ``--verbosity=1`` shows them)."""
    holder = _HeldOrbaxErrors()
    targets = [logging.get_absl_logger(), logging.get_absl_handler(),
               *py_logging.getLogger().handlers]
    for target in targets:
        target.addFilter(holder)
    try:
        yield holder
    except BaseException:
        for record in holder.held:
            logging.debug("orbax: %s", record.getMessage())
        raise
    finally:
        for target in targets:
            target.removeFilter(holder)


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
        _quiet_orbax_logs()
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


# --------------------------------------------------------------------------- config

OPERATIONAL_FIELDS = ("log_every", "eval_every", "checkpoint_every", "keep_checkpoints",
                      "tensorboard", "data_dir", "num_devices", "eval_batch_size")
"""Config fields that may change between a checkpoint and its resumption: they do
not change the trained parameters."""


def _flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    if isinstance(d, dict):
        for k, v in d.items():
            out.update(_flatten(v, f"{prefix}{k}."))
    else:
        out[prefix[:-1]] = d
    return out


def config_to_json(config) -> dict[str, Any]:
    """A JSON-able dict of an `ml_collections.ConfigDict` (tuples become lists)."""
    return json.loads(config.to_json_best_effort(sort_keys=True))


FIELDS_ADDED: dict[str, Any] = {"precision.controller": "none"}
"""Fields newer than some checkpoints, with the value that trains as before they
existed: a checkpoint whose config lacks one resumes when the run keeps that value."""

INACTIVE_WITHOUT: dict[str, tuple[str, Any]] = {
    "precision.controller_": ("precision.controller", "none")}
"""Field prefixes that change nothing while another field holds a value: with
``precision.controller=none`` the ``precision.controller_*`` fields are not read."""


def _inactive(key: str, now: dict[str, Any], before: dict[str, Any]) -> bool:
    """True if `key` is read by neither run (its switch is off in both)."""
    for prefix, (switch, off) in INACTIVE_WITHOUT.items():
        if key.startswith(prefix):
            return now.get(switch, off) == off and before.get(switch, off) == off
    return False


def _same(key: str, now: dict[str, Any], before: dict[str, Any]) -> bool:
    """The two configs agree on `key`, a field the older one may lack."""
    if key not in before and key in FIELDS_ADDED:
        return now.get(key) == FIELDS_ADDED[key]
    return now.get(key, "<unset>") == before.get(key, "<unset>") or _inactive(key, now, before)


def check_resume_compatible(saved: dict[str, Any], config, *,
                            allow: Sequence[str] = ()) -> None:
    """ValueError if `config` differs from the checkpoint's `saved` config in any field
    that changes training (all but `OPERATIONAL_FIELDS` and `allow`): the run would not
    continue the same schedule, data order and optimizer.

    A changed ``num_steps`` alone is what ``--extend`` allows (``allow=("num_steps",)``);
    without it the message names the flag. A checkpoint written before a field existed
    resumes while the run keeps the field's old behaviour (`FIELDS_ADDED`,
    `INACTIVE_WITHOUT`).

    Example:
      >>> import ml_collections
      >>> c = ml_collections.ConfigDict({"num_steps": 20, "seed": 0})
      >>> check_resume_compatible({"num_steps": 10, "seed": 0}, c, allow=("num_steps",))
      >>> c = ml_collections.ConfigDict({"precision": {"controller": "none",
      ...                                              "controller_hold": 10}})
      >>> check_resume_compatible({"precision": {}}, c)   # a checkpoint older than controllers
    """
    now = _flatten(config_to_json(config))
    before = _flatten(saved)
    diffs, keys = [], []
    for key in sorted(set(now) | set(before)):
        if key.split(".")[0] in OPERATIONAL_FIELDS or key in allow:
            continue
        if not _same(key, now, before):
            keys.append(key)
            diffs.append(f"config.{key}={now.get(key, '<unset>')!r} "
                         f"(checkpoint: {before.get(key, '<unset>')!r})")
    if not diffs:
        return
    hint = (" To continue this run to the new config.num_steps, rerun with --extend "
            "(every schedule is rebuilt for the new length)." if keys == ["num_steps"] else "")
    raise ValueError(
        "the workdir holds a checkpoint of a different run: " + "; ".join(diffs[:5])
        + ("; ..." if len(diffs) > 5 else "") + "." + hint
        + " Use a new --workdir, or the checkpoint's config values to resume.")


# --------------------------------------------------------------------------- the run's

CHECKPOINT_SUBDIR = "checkpoints"
"""The run's checkpoints: ``workdir/checkpoints`` (a `CheckpointManager` root)."""

Segments = tuple[tuple[int, int], ...]
"""``((start_step, num_steps), ...)``: from `start_step` on, the run trains on the
schedules built for a run of `num_steps` steps (one segment unless ``--extend`` changed
the length)."""


def resume_segments(meta: dict[str, Any], step: int, num_steps: int) -> Segments:
    """The `Segments` of a run resumed at `step` from a checkpoint's `meta`, to `num_steps`.

    The checkpoint's segments (one, ``(0, its config.num_steps)``, if it predates them),
    plus ``(step, num_steps)`` when the length changed (``--extend``).

    Raises:
      ValueError: `num_steps` is below `step`.

    Example:
      >>> resume_segments({"config": {"num_steps": 100}}, 100, 300)
      ((0, 100), (100, 300))
    """
    saved = meta.get("schedule_segments") or [[0, meta["config"]["num_steps"]]]
    segments = tuple((int(start), int(n)) for start, n in saved)
    if segments[-1][1] == int(num_steps):
        return segments
    if int(num_steps) < int(step):
        raise ValueError(f"config.num_steps={num_steps} is below the checkpoint's step {step}: "
                         f"--extend continues a run from its last step to a new length")
    if segments[-1][0] == int(step):
        segments = segments[:-1]
    return segments + ((int(step), int(num_steps)),)


class Checkpointer:
    """The run's `CheckpointManager` in ``workdir/checkpoints`` (created when needed).

    `save` stores the state with the config and the record history (``records``), so
    a resumed run rewrites ``metrics.jsonl`` without duplicates; `last_saved` is the
    step of the latest save (or of the restored checkpoint).
    """

    def __init__(self, workdir: str, keep: int, config, input_pipeline: Any = None, *,
                 extend: bool = False):
        self.directory = os.path.join(workdir, CHECKPOINT_SUBDIR)
        self.keep = keep
        self.config = config
        self.input_pipeline = input_pipeline  # a streamed input's state is saved too
        self.extend = extend  # a changed config.num_steps is allowed (--extend)
        self.segments: Segments = ((0, int(config.num_steps)),)
        self.last_saved = 0
        self._manager: CheckpointManager | None = None

    @property
    def manager(self) -> CheckpointManager:
        if self._manager is None:
            self._manager = CheckpointManager(self.directory, keep=self.keep)
        return self._manager

    def exists(self) -> bool:
        return os.path.isdir(self.directory)

    def _check_meta(self, meta: dict[str, Any]) -> None:
        allow = ("num_steps",) if self.extend else ()
        check_resume_compatible(meta.get("config", {}), self.config, allow=allow)

    def check_compatible(self) -> None:
        """ValueError for a workdir holding another run's checkpoint (or another
        program's), before anything is built: the newest checkpoint's config."""
        if self.exists():
            self.manager.check_latest_meta(self._check_meta)

    def restore_latest(self, state: TrainState):
        """The newest good checkpoint of this config (`Restored`), or None."""
        if not self.exists():
            return None
        return self.manager.restore_latest(state, check_meta=self._check_meta)

    def save(self, step: int, state: TrainState, records: list[dict[str, Any]]) -> None:
        """Save the checkpoint of `step`; a failure to write it (a full disk, a folder
        gone read-only) is one `OSError` naming the step and the folder, its cause
        (orbax's traceback) logged at debug level only."""
        data = ({"data_order": "a pure function of (config.seed, step): nothing else to "
                 "restore"} if self.input_pipeline is None
                else {"input_state": self.input_pipeline.get_state()})
        try:
            with orbax_errors_held():
                self.manager.save(step, state, {
                    "config": config_to_json(self.config), "records": records,
                    "schedule_segments": [list(seg) for seg in self.segments], **data})
        except Exception as exc:  # noqa: BLE001 - orbax wraps the OSError in its own
            cause = os_error_in(exc)
            if cause is None:
                raise
            logging.debug("saving the checkpoint of step %d failed", step, exc_info=exc)
            reason = (cause.strerror or str(cause)).lower()
            raise OSError(cause.errno, f"{reason}: cannot save the checkpoint of step {step} "
                          f"in {self.directory}", cause.filename) from exc
        self.last_saved = step

    def close(self) -> None:
        if self._manager is not None:
            self._manager.close()


def refuse_other_runs(workdir: str, config, extend: bool) -> None:
    """ValueError, before anything is built or compiled, if `workdir` holds another
    run's checkpoint (another config; with `extend` a changed ``num_steps`` is this
    run's) or another program's (`Checkpointer.check_compatible`)."""
    checkpoints = Checkpointer(workdir, int(config.keep_checkpoints), config, extend=extend)
    try:
        checkpoints.check_compatible()
    finally:
        checkpoints.close()


def restore_run(checkpoints: Checkpointer, state: TrainState
                ) -> tuple[TrainState, list[dict[str, Any]], int | None]:
    """Resume from the newest good checkpoint, if any (torn/corrupt ones are skipped).

    Args:
      checkpoints: the run's `Checkpointer`.
      state: the freshly initialized state (the restore target's structure).

    Returns:
      ``(state, records, resumed_from)``: the restored state (or `state`), the
      ``metrics.jsonl`` entries up to the checkpoint, and its step (None: fresh run).
    """
    had = checkpoints.exists() and bool(checkpoints.manager.steps())
    restored = checkpoints.restore_latest(state)
    if restored is None:
        if had:
            logging.warning("no usable checkpoint in %s: starting from step 0",
                            checkpoints.directory)
        return state, [], None
    logging.info("Resuming from the checkpoint of step %d in %s", restored.step,
                 checkpoints.directory)
    checkpoints.last_saved = restored.step
    checkpoints.segments = resume_segments(restored.meta, restored.step,
                                           int(checkpoints.config.num_steps))
    if checkpoints.input_pipeline is not None:
        if "input_state" not in restored.meta:
            raise ValueError(f"the checkpoint of step {restored.step} in "
                             f"{checkpoints.directory} holds no input pipeline state")
        checkpoints.input_pipeline.set_state(restored.meta["input_state"])
    return restored.state, list(restored.meta.get("records", [])), restored.step
