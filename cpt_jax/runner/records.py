"""What the loop records and where: the ``train`` and ``eval`` records, the run's
metric writers (`cpt_jax.runner.metric_writers`) and its periodic actions (log,
evaluate, checkpoint; `cpt_jax.runner.periodic_actions`).
"""
from __future__ import annotations

import os
from typing import Any

import jax

from cpt_jax.runner import metric_writers as writers_lib
from cpt_jax.runner import realized
from cpt_jax.runner.evaluation import eval_bits_at, evaluate, metric_of
from cpt_jax.runner.periodic_actions import PeriodicAction
from cpt_jax.runner.resume import Checkpointer
from cpt_jax.runner.run import Run
from cpt_jax.training import TrainState

METRICS_FILE = "metrics.jsonl"


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
