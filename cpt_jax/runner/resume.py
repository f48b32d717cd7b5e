"""The run's checkpoints: resumable bit for bit, refused when they are another run's.

A checkpoint of a run at step ``s`` is everything its future depends on:

* the `TrainState` (`cpt_jax.runner.checkpoint_manager.CheckpointManager` stores it):
  ``step`` is the position of every schedule (precision, learning rate);
* the data order needs nothing more: a batch is a pure function of
  ``(config.seed, step)`` (`cpt_jax.data.batch_at_step`), so ``state.step`` suffices
  (a streamed input pipeline's state is saved in ``meta``);
* a JSON ``meta`` dict: the config, the record history (so ``metrics.jsonl`` is
  rewritten from it on resume: no duplicate lines) and the schedule `Segments`.

`Checkpointer` (the main job's one wrapper over `CheckpointManager`) keeps them in
``workdir/checkpoints``; `refuse_other_runs` stops before anything is built when the
workdir holds another run's (`check_resume_compatible`); `restore_run` resumes from
the newest good one (`resume_segments`: the lengths an ``--extend`` ran).
"""
from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from absl import logging

from cpt_jax.runner.checkpoint_manager import CheckpointManager
from cpt_jax.runner.orbax_logs import orbax_errors_held, os_error_in

if TYPE_CHECKING:
    from cpt_jax.training import TrainState


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
