"""The main job as a library function: `train_and_evaluate(config, workdir)`.

Reads an `ml_collections.ConfigDict` (``experiments/configs/``, all derived from
``default.get_config()``), and runs in the Flax examples' shape, each step a short
function:

=============  ==========================================================================
build          `build_run`: task, quantized model, schedules, optimizer (each from its
               config subtree by `cpt_jax.runner.builders`, re-exported here), initial state,
               op inventory and per-step cost (`RunCost`), compiled train/eval steps
restore        `restore_run`: the newest good checkpoint in ``workdir/checkpoints``
loop           `train_loop`: one compiled step per batch of `train_batches`; periodic
               work as `PeriodicAction`s (log, evaluate, checkpoint; `make_actions`)
summarize      `summarize`: final `evaluate` (at the eval bits and fp32), costs, timing
write          `write_outputs`: ``summary.json``, the final record, plots
=============  ==========================================================================

Records (train, eval, final) go to `cpt_jax.runner.metric_writers` behind one interface:
``metrics.jsonl``, TensorBoard, the progress bar (or absl logging) and the in-memory
history that checkpoints carry.

Written to `workdir`:

* ``metrics.jsonl``: one JSON object per logged step (step, bits, grad_bits, loss,
  accuracy, cumulative relative cost) and per evaluation;
* ``summary.json``: final test metric (at the eval bits and in full precision),
  ``best_test_<metric>`` (best over every evaluation), ``eval_protocol`` (eval bits
  ``max`` or ``current``, activation ranges ``batch`` or ``running``: see
  `eval_bits_at`, `eval_protocol_name`), ``relative_cost_fp32`` (each step counted in
  its format with ``precision.formats``, plus ``formats`` and ``format_steps``),
  ``relative_cost_static8``, ``num_compiles``, ``steps``, ``wall_time_s`` and more
  (with ``config.precision.controller``: the bits actually used, their histogram and
  the base schedule's cost beside them, `cpt_jax.runner.realized`);
* PNG plots (bits over steps; loss and accuracy curves) and TensorBoard events
  (``workdir/tensorboard``);
* ``checkpoints/<step>/``: every ``config.checkpoint_every`` steps (0: no periodic
  ones), always at the last step (export, evaluation and ``--extend`` read it), and on
  SIGTERM/SIGINT; the newest ``config.keep_checkpoints`` are kept.

Preemption and resumption (see ``docs/reliability.md``): the first SIGTERM or SIGINT
(Ctrl-C) finishes the current step, saves a checkpoint, then evaluates and writes what
was measured (``"interrupted": true``). A `workdir` that holds a checkpoint resumes
from its newest good one (a torn or corrupt one is skipped with a warning): the
parameters at the end are bit-identical to an uninterrupted run's, because the state
(step = schedule position, parameters, optimizer state, PRNG key) is restored exactly
and the data order is a pure function of ``(config.seed, step)``. ``metrics.jsonl`` is
rewritten from the checkpoint's history, so no line is duplicated. ``extend=True``
(``--extend``) continues a finished or interrupted run to a new ``config.num_steps``
with every schedule rebuilt for the new length (`with_segments`).

Non-finite steps follow ``config.nonfinite``: ``skip`` (count them in
``skipped_steps``), ``ignore``, or ``stop`` (raise `NonFiniteError` naming the step,
the bits and the layers, after writing ``summary.json``).
"""
from __future__ import annotations

import dataclasses
import json
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import logging

from cpt_jax import cost as cost_lib
from cpt_jax import schedules as sched_lib
from cpt_jax.controllers import cost_table
from cpt_jax.distributed import mesh as parallel
from cpt_jax.doors import quantize_model
from cpt_jax.format_schedules import format_summary
from cpt_jax.runner import checkpoint as ckpt_lib
from cpt_jax.runner import metric_writers as writers_lib
from cpt_jax.runner import realized, validation
from cpt_jax.runner.builders import (
    controller_from_config,
    eval_bits_from_config,
    eval_protocol_name,
    grad_schedule_from_config,
    optimizer_from_config,
    precision_schedule_from_config,
    provider_from_config,
    quant_config_from_config,
    rules_from_config,
)
from cpt_jax.runner.periodic_actions import PeriodicAction, run_actions
from cpt_jax.runner.tasks import Task, build_task
from cpt_jax.training import (
    TrainState,
    aggregate,
    create_train_state,
    make_eval_step,
    make_train_step,
    nonfinite_layers,
)

CHECKPOINT_SUBDIR = "checkpoints"
METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"


# --------------------------------------------------------------------------- protocol

def eval_bits_at(run: Run, step: int) -> float:
    """Bits of an evaluation after `step` training steps.

    ``precision.eval_bits_mode="max"``: ``run.eval_bits`` (`eval_bits_from_config`);
    ``"current"``: the forward schedule's bits of the last step trained,
    ``schedule(max(step - 1, 0))``, as CPT's and Wolfe et al.'s code evaluate
    (32 for a full-precision run).
    """
    if run.fwd_schedule is None or run.config.precision.eval_bits_mode != "current":
        return run.eval_bits
    return float(run.fwd_schedule(max(int(step) - 1, 0)))


LOWER_IS_BETTER = ("perplexity", "loss")
"""Task metrics whose best value is the minimum."""


def best_metrics(task: Task, records: list[dict[str, Any]],
                 summary: dict[str, Any]) -> dict[str, float]:
    """``best_<split>_<metric>``: the best over every evaluation of the run (the periodic
    ``eval`` records and the final one), the maximum (minimum for `LOWER_IS_BETTER`)."""
    metric, out = task.metric, {}
    pick = min if metric in LOWER_IS_BETTER else max
    evals = [r["eval"] for r in records if "eval" in r]
    for split in task.eval_splits:
        key = f"{split}_{metric}"
        values = [float(e[key]) for e in evals if key in e]
        if f"final_{key}" in summary:
            values.append(float(summary[f"final_{key}"]))
        if values:
            out[f"best_{key}"] = pick(values)
    return out


def validate_config(config) -> None:
    """Check every field the runner reads (see `cpt_jax.runner.validation.validate_config`)."""
    validation.validate_config(config)


# --------------------------------------------------------------------------- build

@dataclasses.dataclass(frozen=True)
class RunCost:
    """The run's compute cost from its schedules (exact, host side, no device sync).

    Attributes:
      per_step: relative BitOps of each step vs fp32, shape ``(total_steps,)``.
      cumulative: ``cumsum(per_step) / total_steps`` (the logged running cost).
      totals: `cost.run_cost`'s dict (``relative_cost_fp32``, ``relative_cost_static8``,
        ``mean_bits``, ``mean_grad_bits``).
    """

    per_step: np.ndarray
    cumulative: np.ndarray
    totals: dict[str, float]


def run_costs(ops, fwd_schedule, grad_schedule, total_steps: int,
              quant_config=None) -> RunCost:
    """`RunCost` of a run: ``per_step[t] = cost(bits(t), grad_bits(t)) / cost(32, 32)``.

    Args:
      ops: the op inventory (`cost.count_ops`).
      fwd_schedule: the forward schedule (None: full precision, cost 1 every step).
      grad_schedule: the backward schedule (None: fp32 errors).
      total_steps: the run's length.
      quant_config: the quantized ops' `QuantConfig`: block scales count in their
        stored bits (e.g. 8 + 8/32 per MXFP8 element); None: the plain widths.

    Returns:
      The per-step, cumulative and total costs.
    """
    if fwd_schedule is None:
        per_step = np.ones(total_steps)
        totals = {"relative_cost_fp32": 1.0,
                  "relative_cost_static8": cost_lib.fp32_bitops_per_step(ops)
                  / float(cost_lib.bitops_per_step(ops, 8.0, 8.0)),
                  "mean_bits": 32.0, "mean_grad_bits": 32.0}
    else:
        bits = sched_lib.schedule_values(fwd_schedule, total_steps)
        grads = (np.full(total_steps, 32.0, np.float32) if grad_schedule is None
                 else sched_lib.schedule_values(grad_schedule, total_steps))
        fp32 = cost_lib.fp32_bitops_per_step(ops)
        cost_fn = jax.jit(jax.vmap(
            lambda b, g: cost_lib.bitops_per_step(ops, b, g, config=quant_config) / fp32))
        per_step = np.asarray(cost_fn(jnp.asarray(bits), jnp.asarray(grads)), np.float64)
        totals = cost_lib.run_cost(fwd_schedule, grad_schedule, total_steps, ops,
                                   config=quant_config)
    return RunCost(per_step=per_step, cumulative=np.cumsum(per_step) / total_steps,
                   totals=totals)


@dataclasses.dataclass(frozen=True)
class Run:
    """What `build_run` makes from the config: fixed for the whole run.

    Attributes: the `config`, the `task`, the quantized model `qmodel`, the forward and
    backward schedules, the optax `optimizer`, the op inventory `ops`, the device
    `mesh` (None: one device), the data key `data_rng`, the compiled `train_step` and
    `eval_step`, the evaluation bits `eval_bits` and the schedules' `cost`; with
    ``config.precision.controller`` its `controller` (whose base is `fwd_schedule`)
    and the `cost_table` of the bits it may use (`cpt_jax.runner.realized`).
    """

    config: Any
    task: Task
    qmodel: Any
    fwd_schedule: sched_lib.PrecisionSchedule | None
    grad_schedule: sched_lib.PrecisionSchedule | None
    optimizer: optax.GradientTransformation
    ops: tuple
    mesh: Any
    data_rng: jax.Array
    train_step: Callable
    eval_step: Callable
    eval_bits: float
    cost: RunCost
    controller: Any = None
    cost_table: Any = None

    @property
    def total_steps(self) -> int:
        return int(self.config.num_steps)


def build_run(config) -> tuple[Run, TrainState]:
    """Build everything a run needs and its initial state (one compiled init).

    Args:
      config: the run's (validated) ConfigDict.

    Returns:
      ``(run, state)``: the `Run` and the initial `TrainState`, sharded over the mesh
      (``config.param_sharding``: "replicate" or "fsdp") when there is more than one
      device.
    """
    total_steps = int(config.num_steps)
    p = config.precision
    task = build_task(config)
    fwd_schedule = precision_schedule_from_config(p, total_steps)
    grad_schedule = grad_schedule_from_config(p, total_steps)
    qmodel = quantize_model(task.model, rules=rules_from_config(p),
                            config=quant_config_from_config(p),
                            provider=provider_from_config(p))
    optimizer = optimizer_from_config(config.optimizer, total_steps)
    controller = controller_from_config(p, fwd_schedule, grad_schedule,
                                        quant_config_from_config(p))
    init_rng, data_rng = jax.random.split(jax.random.key(int(config.seed)))
    init_kwargs = {"train": False, **task.apply_kwargs}
    # One compiled init instead of many eager ops (fast start; same values every run).
    state = jax.jit(lambda key: create_train_state(qmodel, optimizer, key, task.sample_inputs,
                                                   controller=controller,
                                                   **init_kwargs))(init_rng)
    ops = cost_lib.count_ops(qmodel, state.variables(), task.sample_inputs, **init_kwargs)
    mesh = parallel.mesh_from_config(config)
    if mesh is not None:
        state = parallel.shard_state(state, mesh, str(config.param_sharding))
    run = Run(config=config, task=task, qmodel=qmodel, fwd_schedule=fwd_schedule,
              grad_schedule=grad_schedule, optimizer=optimizer, ops=ops, mesh=mesh,
              data_rng=data_rng,
              train_step=_train_step(config, task, qmodel, optimizer, fwd_schedule,
                                     grad_schedule, controller),
              eval_step=make_eval_step(qmodel, loss_fn=task.loss_fn,
                                       apply_kwargs=task.apply_kwargs),
              eval_bits=eval_bits_from_config(p),
              cost=run_costs(ops, fwd_schedule, grad_schedule, total_steps,
                             quant_config=quant_config_from_config(p)),
              controller=controller,
              cost_table=None if controller is None
              else cost_table(ops, quant_config_from_config(p)))
    return run, state


def _train_step(config, task: Task, qmodel, optimizer, fwd_schedule, grad_schedule,
                controller=None):
    if controller is not None:
        return make_train_step(qmodel, optimizer, loss_fn=task.loss_fn,
                               nonfinite=config.nonfinite, apply_kwargs=task.apply_kwargs,
                               controller=controller)
    return make_train_step(qmodel, optimizer, fwd_schedule, grad_schedule,
                           loss_fn=task.loss_fn, nonfinite=config.nonfinite,
                           apply_kwargs=task.apply_kwargs)


Segments = tuple[tuple[int, int], ...]
"""``((start_step, num_steps), ...)``: from `start_step` on, the run trains on the
schedules built for a run of `num_steps` steps (one segment unless ``--extend`` changed
the length)."""


def with_segments(run: Run, segments: Segments) -> Run:
    """`run` trained on segment schedules: an extended run (``--extend``).

    ``bits(t) = schedule_k(t)`` for ``start_k <= t < start_{k+1}``, ``schedule_k``
    built for ``num_steps_k`` (`schedules.switch`, absolute steps); the learning rate
    and every other schedule follow the last segment's length (``config.num_steps``),
    as built by `build_run`. Costs are those of the steps' real bits.

    Args:
      run: the `Run` built for ``config.num_steps`` (the last segment's length).
      segments: the run's `Segments`.

    Returns:
      The `Run` with the segmented forward schedule, its train step and cost.
    """
    if len(segments) <= 1 or run.fwd_schedule is None:
        return run
    p = run.config.precision
    parts = [precision_schedule_from_config(p, int(n)) for _, n in segments]
    starts = [int(start) for start, _ in segments[1:]]
    fwd = sched_lib.switch(parts, starts)
    grad = run.grad_schedule
    if grad is not None and p.controller == "final_phase":  # each segment's last phase
        grads: list[Any] = [grad_schedule_from_config(p, int(n)) for _, n in segments]
        grad = sched_lib.switch(grads, starts)
    controller = controller_from_config(p, fwd, grad, quant_config_from_config(p))
    return dataclasses.replace(
        run, fwd_schedule=fwd, grad_schedule=grad, controller=controller,
        train_step=_train_step(run.config, run.task, run.qmodel, run.optimizer, fwd, grad,
                               controller),
        cost=run_costs(run.ops, fwd, grad, run.total_steps,
                       quant_config=quant_config_from_config(p)))


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


# --------------------------------------------------------------------------- restore

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
        self._manager: ckpt_lib.CheckpointManager | None = None

    @property
    def manager(self) -> ckpt_lib.CheckpointManager:
        if self._manager is None:
            self._manager = ckpt_lib.CheckpointManager(self.directory, keep=self.keep)
        return self._manager

    def exists(self) -> bool:
        return os.path.isdir(self.directory)

    def _check_meta(self, meta: dict[str, Any]) -> None:
        allow = ("num_steps",) if self.extend else ()
        ckpt_lib.check_resume_compatible(meta.get("config", {}), self.config, allow=allow)

    def check_compatible(self) -> None:
        """ValueError for a workdir holding another run's checkpoint (or another
        program's), before anything is built: the newest checkpoint's config."""
        if self.exists():
            self.manager.check_latest_meta(self._check_meta)

    def restore_latest(self, state: TrainState):
        """The newest good checkpoint of this config (`ckpt_lib.Restored`), or None."""
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
            with ckpt_lib.orbax_errors_held():
                self.manager.save(step, state, {
                    "config": ckpt_lib.config_to_json(self.config), "records": records,
                    "schedule_segments": [list(seg) for seg in self.segments], **data})
        except Exception as exc:  # noqa: BLE001 - orbax wraps the OSError in its own
            cause = ckpt_lib.os_error_in(exc)
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


# --------------------------------------------------------------------------- seams

def train_batches(run: Run, start_step: int) -> Iterator[Any]:
    """The training batches from step `start_step` on, placed on the run's mesh.

    The seam for input pipelines: today ``task.train_batch(step, data_rng)``, a pure
    function of ``(config.seed, step)``, so a resumed run sees the same data order.

    Args:
      run: the `Run`.
      start_step: the 0-based step of the first batch (the restored ``state.step``).

    Returns:
      An iterator of batches (dicts of arrays), one per step.
    """
    if run.task.input_pipeline is not None:
        # Streamed (config.input_pipeline="grain"): each process reads its own rows; the
        # iterator's state comes from the checkpoint (`restore_run`), not from the step.
        yield from run.task.input_pipeline.batches(run.mesh)
        return
    step = start_step
    while True:
        batch = run.task.train_batch(jnp.asarray(step, jnp.int32), run.data_rng)
        if run.mesh is not None:
            batch = parallel.shard_batch(batch, run.mesh)
        yield batch
        step += 1


def evaluate(run: Run, state: TrainState, bits: float) -> dict[str, dict[str, float]]:
    """Evaluate `state` on every eval split of the task at `bits` (32: full precision).

    Args:
      run: the `Run` (its task and compiled `eval_step`).
      state: the state to evaluate.
      bits: the evaluation bit-width.

    Returns:
      ``{split: {"loss": ..., <metric>: ...}}``, each the mean over the split's
      examples (`training.aggregate`).
    """
    results = {}
    for split in run.task.eval_splits:
        sums = [run.eval_step(state, batch, jnp.float32(bits))
                for batch in run.task.eval_batches(split)]
        results[split] = aggregate(jax.device_get(sums))
    return results


def metric_of(task: Task, result: dict[str, float]) -> float:
    """``result[task.metric]`` as a float (nan when missing)."""
    return float(result.get(task.metric, float("nan")))


# --------------------------------------------------------------------------- records

def train_record(run: Run, step: int, state: TrainState, metrics) -> dict[str, Any]:
    """The ``train`` record of step `step` (1-based): loss, accuracy, bits, running cost."""
    m = jax.device_get(metrics)
    record = {"step": step, "loss": float(m["loss"]),
              "cumulative_relative_cost": float(run.cost.cumulative[step - 1])}
    if "accuracy" in m:
        record["accuracy"] = float(m["accuracy"])
    for k in ("bits", "grad_bits"):
        if k in m:
            record[k] = float(m[k])
    record["skipped_steps"] = int(state.skipped_steps)
    return record


def eval_record(run: Run, step: int, state: TrainState) -> dict[str, Any]:
    """The ``eval`` record at step `step`: ``<split>_<metric>`` and ``<split>_loss``
    at the run's eval bits (`eval_bits_at`)."""
    bits = eval_bits_at(run, step)
    record: dict[str, Any] = {"step": step, "eval_bits": bits}
    for split, result in evaluate(run, state, bits).items():
        record[f"{split}_{run.task.metric}"] = metric_of(run.task, result)
        record[f"{split}_loss"] = result["loss"]
    return record


def writes_files() -> bool:
    """Whether this process writes the run's files: process 0 of a multi-process run
    (every process joins the checkpoint saves, into the shared ``workdir/checkpoints``)."""
    return jax.process_index() == 0


def make_writers(config, workdir: str, records: list[dict[str, Any]], *, start_step: int,
                 progress: bool) -> tuple[writers_lib.MultiWriter, writers_lib.MemoryWriter]:
    """The run's metric writers: memory (the checkpointed history), ``metrics.jsonl``
    (rewritten from `records`, then appended), TensorBoard (``config.tensorboard``), and
    a progress bar (`progress`) or absl logging; on processes other than 0 (`writes_files`)
    memory and logging only.

    Returns:
      ``(writer, memory)``: the `MultiWriter` and its `MemoryWriter`.
    """
    memory = writers_lib.MemoryWriter(records)
    if not writes_files():  # another process of a multi-process run: memory and logs only
        return writers_lib.MultiWriter([memory, writers_lib.LoggingWriter()]), memory
    path = os.path.join(workdir, METRICS_FILE)
    writers_lib.write_jsonl(path, records)  # no duplicates after a resume
    writers: list[writers_lib.MetricWriter] = [memory, writers_lib.JsonlWriter(path)]
    if config.tensorboard:
        writers.append(writers_lib.tensorboard_writer(os.path.join(workdir, "tensorboard"),
                                                      purge_step=start_step))
    writers.append(writers_lib.progress_writer(int(config.num_steps), start_step) if progress
                   else writers_lib.LoggingWriter())
    return writers_lib.MultiWriter(writers), memory


def make_actions(run: Run, writer: writers_lib.MetricWriter,
                 memory: writers_lib.MemoryWriter,
                 checkpoints: Checkpointer) -> list[PeriodicAction]:
    """The loop's periodic work, in order: log (every ``config.log_every`` steps and the
    last), evaluate (every ``config.eval_every``, not the last: the final evaluation
    follows), checkpoint (every ``config.checkpoint_every`` and the last)."""
    config, total = run.config, run.total_steps
    bits_log = realized.BitsLog() if run.controller is not None else None

    def log(step, state, metrics):
        record = train_record(run, step, state, metrics)
        if bits_log is not None:  # a controller's bits: those used, every step
            record.update(realized.train_fields(
                state, bits_log, run.cost_table, total, run.ops, run.controller.measure_every,
                config.precision.controller_statistic == "quant_error"))
        writer.write("train", step, record)

    def evaluate_now(step, state, metrics):
        writer.write("eval", step, eval_record(run, step, state))

    def save(step, state, metrics):
        writer.flush()
        checkpoints.save(step, state, memory.records)

    actions = [PeriodicAction(max(1, int(config.log_every)), log, total, at_last=True),
               PeriodicAction(int(config.eval_every or 0), evaluate_now, total, skip_last=True),
               PeriodicAction(int(config.checkpoint_every or 0), save, total, at_last=True)]
    if bits_log is not None:
        actions.insert(0, PeriodicAction(1, bits_log.collect, total))
    return actions


# --------------------------------------------------------------------------- loop

class NonFiniteError(FloatingPointError):
    """Training stopped (``config.nonfinite="stop"``) at a non-finite loss or gradient.

    Attributes: `step` (1-based, as in ``metrics.jsonl``), `bits`, `grad_bits`, `loss`,
    `layers` (parameter paths with a non-finite gradient, the layer nearest the output
    first: where the overflow entered backprop), `summary` (what was written to
    ``summary.json``).
    """

    def __init__(self, message: str, *, event: dict[str, Any], summary: dict[str, Any]):
        super().__init__(message)
        self.event = event
        self.summary = summary
        self.step = event["step"]
        self.bits = event.get("bits")
        self.grad_bits = event.get("grad_bits")
        self.loss = event.get("loss")
        self.layers = list(event.get("layers", []))


class StopRequest:
    """SIGINT/SIGTERM handler: the first signal asks the loop to checkpoint and finish;
    a second SIGINT raises KeyboardInterrupt (stop now, no checkpoint).

    ``signum`` is the first signal received (None: none yet). Use as a context manager
    (handlers are installed in the main thread only and restored on exit).
    """

    def __init__(self):
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                try:
                    self._previous[sig] = signal.signal(sig, self._handle)
                except (ValueError, OSError):  # pragma: no cover - exotic platforms
                    pass
        return self

    def _handle(self, signum, frame) -> None:
        if self.signum is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.signum = signum
        logging.warning("Received %s: saving a checkpoint, then finishing with what was "
                        "measured (send SIGINT again to stop at once).",
                        signal.Signals(signum).name)

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def nonfinite_event(step: int, metrics, params, ops) -> dict[str, Any]:
    """What a ``nonfinite="stop"`` step reports: step, loss, bits and the parameter paths
    with a non-finite gradient, ordered nearest the output first (backprop order)."""
    m = jax.device_get(metrics)
    layers = nonfinite_layers(params, m["grads_finite"])
    order = {op.name: i for i, op in enumerate(ops)}

    def rank(path: str) -> int:
        parts = path.split("/")
        for n in range(len(parts) - 1, 0, -1):
            if "/".join(parts[:n]) in order:
                return order["/".join(parts[:n])]
        return -1

    event = {"step": step, "loss": float(m["loss"]),
             "layers": sorted(layers, key=lambda path: -rank(path))}
    for k in ("bits", "grad_bits"):
        if k in m:
            event[k] = float(m[k])
    return event


def nonfinite_message(event: dict[str, Any]) -> str:
    """One line naming the step, the bits, the loss and the first non-finite layer."""
    where = ", ".join(f"{k}={event[k]:g}" for k in ("bits", "grad_bits") if k in event)
    layers = event["layers"]
    if layers:
        more = f" (and {len(layers) - 1} more: {', '.join(layers[1:4])}" \
               f"{', ...' if len(layers) > 4 else ''})" if len(layers) > 1 else ""
        what = f"non-finite gradient in layer {layers[0]}{more}"
    else:
        what = "non-finite loss"
    return (f"training stopped at step {event['step']} ({where or 'full precision'}, "
            f"loss={event['loss']}): {what} [config.nonfinite='stop']")


@dataclasses.dataclass
class LoopResult:
    """How the loop ended: the last `state`, whether it was `interrupted` (signal or
    Ctrl-C), the `stop_event` of a ``nonfinite="stop"`` step (or None) and the
    training wall time `train_time_s`."""

    state: TrainState
    interrupted: bool = False
    stop_event: dict[str, Any] | None = None
    train_time_s: float = 0.0


def train_steps(run: Run, result: LoopResult, actions: list[PeriodicAction],
                stop: StopRequest) -> None:
    """Step until the end, a stop request or a non-finite stop (``result`` is updated
    after every step, so an interrupt keeps the last completed state)."""
    step = int(result.state.step)
    batches = train_batches(run, step)
    while step < run.total_steps and stop.signum is None:
        result.state, metrics = run.train_step(result.state, next(batches))
        step += 1
        if run.config.nonfinite == "stop" and not bool(metrics["finite"]):
            result.stop_event = nonfinite_event(step, metrics, result.state.params, run.ops)
            logging.error(nonfinite_message(result.stop_event))
            return
        run_actions(actions, step, result.state, metrics)


def train_loop(run: Run, state: TrainState, actions: list[PeriodicAction],
               save: Callable[[int, TrainState], None], last_saved: Callable[[], int]
               ) -> LoopResult:
    """Train from `state` to ``config.num_steps``, running `actions` after each step.

    The final state is always saved (unless the step was just saved, or a
    ``nonfinite="stop"`` ended the run). The first SIGTERM/SIGINT finishes the step,
    then `save` s a checkpoint (unless the step was just saved) and ends the loop; a
    second SIGINT ends it at once.

    Returns:
      The `LoopResult`.
    """
    result = LoopResult(state=state)
    t_train = time.time()
    with StopRequest() as stop:
        try:
            train_steps(run, result, actions, stop)
            step = int(result.state.step)
            if (result.stop_event is None and step == run.total_steps
                    and step > last_saved()):
                save(step, result.state)  # the final state, whatever checkpoint_every says
            if stop.signum is not None:
                result.interrupted = True
                step = int(result.state.step)
                if step > last_saved():
                    save(step, result.state)
                logging.warning("Stopped by %s at step %d; rerun with the same --workdir to "
                                "resume.", signal.Signals(stop.signum).name, step)
        except KeyboardInterrupt:
            result.interrupted = True
            logging.warning("Interrupted at step %d: evaluating and writing what was measured "
                            "(no checkpoint).", int(result.state.step))
    result.train_time_s = time.time() - t_train
    return result


# --------------------------------------------------------------------------- summarize

def run_cost_summary(run: Run, done_steps: int) -> dict[str, float]:
    """``relative_cost_fp32`` / ``_static8`` of the steps done (all of them when the run
    finished or did none), and the schedules' mean bits."""
    totals = run.cost.totals
    if 0 < done_steps < run.total_steps:
        frac = float(np.sum(run.cost.per_step[:done_steps]) / done_steps)
        costs = {"relative_cost_fp32": frac,
                 "relative_cost_static8": frac * totals["relative_cost_static8"]
                 / max(totals["relative_cost_fp32"], 1e-12)}
    else:
        costs = {"relative_cost_fp32": float(totals["relative_cost_fp32"]),
                 "relative_cost_static8": float(totals["relative_cost_static8"])}
    costs["mean_bits"] = float(totals["mean_bits"])
    costs["mean_grad_bits"] = float(totals["mean_grad_bits"])
    return costs


def summarize(run: Run, loop: LoopResult, *, resumed_from: int | None,
              start_time: float, segments: Segments = ()) -> dict[str, Any]:
    """The run's summary: config echo, final metrics (at the eval bits and fp32), costs,
    compile count, timing (``wall_time_s`` from `start_time` to after the final
    evaluations), interruption, extension (``extended_from_step``: where the last
    ``--extend`` continued the run, and ``schedule_segments``) and non-finite
    bookkeeping (``summary.json``)."""
    config, p, task, state = run.config, run.config.precision, run.task, loop.state
    extended_from = int(segments[-1][0]) if len(segments) > 1 else None
    done_steps = int(state.step)
    eval_bits = eval_bits_at(run, done_steps)
    final, final_fp = evaluate(run, state, eval_bits), evaluate(run, state, 32.0)
    ops = run.ops
    summary: dict[str, Any] = {
        "dataset": config.dataset, "model": config.model, "schedule": p.schedule,
        "min_bits": p.min_bits, "max_bits": p.max_bits,
        "grad_bits": p.grad_bits, "num_cycles": p.num_cycles,
        "seed": int(config.seed), "steps": done_steps, "num_steps": run.total_steps,
        "eval_bits": eval_bits, "metric": task.metric,
        "eval_protocol": eval_protocol_name(p), "convention": p.convention,
        "num_compiles": run.train_step.num_compiles,
        "wall_time_s": time.time() - start_time, "train_time_s": loop.train_time_s,
        "steps_per_s": (done_steps - (resumed_from or 0)) / max(loop.train_time_s, 1e-9),
        "interrupted": loop.interrupted, "resumed_from_step": resumed_from,
        "extended_from_step": extended_from,
        "skipped_steps": int(state.skipped_steps), "nonfinite_policy": config.nonfinite,
        "total_macs_per_example_batch": cost_lib.total_macs(ops),
        "num_quantized_ops": sum(op.quantized for op in ops),
        "num_full_precision_ops": sum(not op.quantized for op in ops),
    }
    if loop.stop_event is not None:
        summary["nonfinite_stop"] = loop.stop_event
    if extended_from is not None:
        summary["schedule_segments"] = [list(seg) for seg in segments]
    summary.update(run_cost_summary(run, done_steps))
    summary.update(format_summary(quant_config_from_config(p), run.fwd_schedule, done_steps))
    if run.controller is not None:  # the bits used, beside the base schedule's
        summary.update(realized.summary_fields(
            state, run_cost_summary(run, done_steps), run.cost_table, ops,
            quant_config_from_config(p), p.controller, run.controller.measure_every,
            p.controller_statistic == "quant_error"))
    for split, r in final.items():
        summary[f"final_{split}_{task.metric}"] = metric_of(task, r)
        summary[f"final_{split}_loss"] = r["loss"]
    for split, r in final_fp.items():
        summary[f"final_{split}_{task.metric}_fp32"] = metric_of(task, r)
    summary["params_sha256"] = params_sha256(state.params)
    if task.info:
        summary["task_info"] = task.info
    return summary


def params_sha256(params) -> str:
    """SHA-256 of the parameters' bytes (leaves in tree order): equal hashes, equal runs."""
    import hashlib

    h = hashlib.sha256()
    for leaf in jax.tree_util.tree_leaves(jax.device_get(params)):
        h.update(np.ascontiguousarray(leaf).tobytes())
    return h.hexdigest()


# --------------------------------------------------------------------------- write

def precision_series(run: Run, records: list[dict[str, Any]], done_steps: int
                     ) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """The bits of every step ``1..done_steps`` (1-based, as ``metrics.jsonl``):
    ``{label: (steps, bits)}``, what ``curves.png``'s precision panel draws.

    The forward and backward schedules' values at each step; with a controller the
    bits it realized (every step, `realized.realized_steps`) instead of the forward
    schedule. ``{}`` for a full-precision run.
    """
    out: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    n = int(done_steps)
    if run.fwd_schedule is None or n <= 0:
        return out
    steps = np.arange(1, n + 1)
    realized_steps, realized_bits = realized.realized_steps(
        [r for r in records if "step" in r]) if run.controller is not None else ([], [])
    if realized_steps:
        out["forward bits (realized)"] = (np.asarray(realized_steps),
                                          np.asarray(realized_bits, np.float64))
    else:
        out["forward bits"] = (steps, sched_lib.schedule_values(run.fwd_schedule, n))
    if run.grad_schedule is not None:
        out["backward bits"] = (steps, sched_lib.schedule_values(run.grad_schedule, n))
    return out


def plot_run(workdir: str, history: list, evals: list, task: Task,
             precision: dict[str, tuple[np.ndarray, np.ndarray]] | None = None) -> None:
    """``curves.png``: the bits of every step (`precision_series`; without it, the
    logged steps' bits), training loss and the metric over steps."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not history:
        return
    steps = [h["step"] for h in history]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.4))
    if precision:
        for label, (xs, bits) in precision.items():
            axes[0].step(xs, bits, where="post", label=label)
        axes[0].legend(fontsize=8)
    elif "bits" in history[0]:
        axes[0].step(steps, [h["bits"] for h in history], where="post", label="forward bits")
        if "grad_bits" in history[0]:
            axes[0].step(steps, [h["grad_bits"] for h in history], where="post",
                         label="backward bits")
        axes[0].legend(fontsize=8)
    else:
        axes[0].text(0.5, 0.5, "full precision", ha="center", transform=axes[0].transAxes)
    axes[0].set_title("precision")
    axes[1].plot(steps, [h["loss"] for h in history])
    axes[1].set_yscale("log")
    axes[1].set_title("training loss")
    metric = task.metric
    if "accuracy" in history[0]:
        axes[2].plot(steps, [h["accuracy"] for h in history], label="train accuracy", alpha=0.6)
    test = [(e["step"], e[f"test_{metric}"]) for e in evals if f"test_{metric}" in e]
    if test:
        axes[2].plot(*zip(*test), "o-", label=f"test {metric}")
    axes[2].set_title(metric)
    axes[2].legend(fontsize=8)
    for ax in axes:
        ax.set_xlabel("step")
    fig.tight_layout()
    fig.savefig(os.path.join(workdir, "curves.png"), dpi=110)
    plt.close(fig)


def write_plots(workdir: str, run: Run, records: list[dict[str, Any]],
                summary: dict[str, Any]) -> None:
    """``curves.png`` and ``bits.png``; a plotting failure is logged, never raised."""
    metric = run.task.metric
    history = [r for r in records if "step" in r]
    evals = [r["eval"] for r in records if "eval" in r]
    evals.append({"step": summary["steps"], f"test_{metric}": summary.get(f"final_test_{metric}")})
    try:
        plot_run(workdir, history, evals, run.task,
                 precision_series(run, records, int(summary["steps"])))
        if run.controller is not None:
            realized.plot_bits(os.path.join(workdir, "bits.png"), run.fwd_schedule,
                               run.total_steps, records, title=run.config.precision.controller)
        elif run.fwd_schedule is not None:
            sched_lib.plot_schedules({"forward bits": run.fwd_schedule}, run.total_steps,
                                     os.path.join(workdir, "bits.png"),
                                     title="precision schedule")
    except Exception as exc:  # plots must never lose a run's results
        logging.warning("plotting failed: %s", exc)


def write_outputs(workdir: str, run: Run, summary: dict[str, Any],
                  writer: writers_lib.MetricWriter, records: list[dict[str, Any]]) -> None:
    """The ``final`` record (all writers), ``summary.json`` and the plots (process 0 only,
    `writes_files`); closes `writer`."""
    final = {k: v for k, v in summary.items() if k != "task_info"}
    writer.write("final", summary["steps"], final)
    if writes_files():
        with open(os.path.join(workdir, SUMMARY_FILE), "w") as f:
            json.dump(summary, f, indent=2, sort_keys=True)
        if run.config.plots:
            write_plots(workdir, run, records, summary)
    writer.close()


# --------------------------------------------------------------------------- main

def train_and_evaluate(config, workdir: str, *, progress: bool = True,
                       extend: bool = False) -> dict[str, Any]:
    """Train per `config`, write metrics, plots and ``summary.json`` to `workdir`.

    build -> restore -> loop -> summarize -> write (see the module docstring). A
    `workdir` holding a checkpoint (``workdir/checkpoints``) resumes from its newest
    good one; the final state is always checkpointed.

    Args:
      config: the run's ConfigDict (``experiments/configs/default.py`` and derived).
      workdir: output directory (created if needed, once the config, the workdir and
        the data are checked: a bad input leaves nothing behind).
      progress: show a progress bar (else log each record with absl).
      extend: a checkpoint of the same run with another ``num_steps`` is continued
        from its step to ``config.num_steps``, every schedule rebuilt for the new
        length (`with_segments`); without it such a checkpoint is refused.

    Returns:
      The summary dict (as written to ``summary.json``).

    Raises:
      ValueError: a bad config or workdir (before anything is built or created), or
        data that cannot be read (before the workdir is created).
      OSError: a file of the run cannot be written (a checkpoint on a full disk: one
        line naming the folder, `Checkpointer.save`).
      NonFiniteError: with ``config.nonfinite="stop"`` (after writing the summary).
    """
    validate_config(config)
    validation.check_workdir(workdir)
    t_start = time.time()
    refuse_other_runs(workdir, config, extend)
    run, state = build_run(config)   # the data is read here: nothing created before
    os.makedirs(workdir, exist_ok=True)
    checkpoints = Checkpointer(workdir, int(config.keep_checkpoints), config,
                               run.task.input_pipeline, extend=extend)
    state, records, resumed_from = restore_run(checkpoints, state)
    run = with_segments(run, checkpoints.segments)
    writer, memory = make_writers(config, workdir, records, start_step=int(state.step),
                                  progress=progress)
    actions = make_actions(run, writer, memory, checkpoints)

    def save(step: int, state: TrainState) -> None:
        writer.flush()
        checkpoints.save(step, state, memory.records)

    loop = train_loop(run, state, actions, save, lambda: checkpoints.last_saved)
    checkpoints.close()
    progress_bar = writers_lib.find_writer(writer, writers_lib.ProgressBarWriter)
    if progress_bar is not None:
        progress_bar.close()
    summary = summarize(run, loop, resumed_from=resumed_from, start_time=t_start,
                        segments=checkpoints.segments)
    summary.update(best_metrics(run.task, memory.records, summary))
    write_outputs(workdir, run, summary, writer, memory.records)
    if loop.stop_event is not None:
        raise NonFiniteError(nonfinite_message(loop.stop_event), event=loop.stop_event,
                             summary=summary)
    return summary
