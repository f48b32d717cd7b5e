"""The run's outputs: the summary (``summary.json``), the parameters' hash, the plots.

`summarize` evaluates the final state (at the eval bits and fp32) and gathers costs
(`run_cost_summary`, from the run's `RunCost`), timing, interruption, extension and
non-finite bookkeeping; `write_outputs` writes the final record, ``summary.json`` and
the plots (``curves.png``, ``bits.png``).
"""
from __future__ import annotations

import json
import os
import time
from typing import Any

import jax
import numpy as np
from absl import logging

from cpt_jax import cost as cost_lib
from cpt_jax import schedules as sched_lib
from cpt_jax.format_schedules import format_summary
from cpt_jax.providers import compute_paths
from cpt_jax.runner import metric_writers as writers_lib
from cpt_jax.runner import realized
from cpt_jax.runner.builders import eval_protocol_name, quant_config_from_config
from cpt_jax.runner.checkpoint_manager import CheckpointManager
from cpt_jax.runner.evaluation import eval_bits_at, evaluate, metric_of
from cpt_jax.runner.loop import LoopResult
from cpt_jax.runner.records import writes_files
from cpt_jax.runner.resume import CHECKPOINT_SUBDIR, Segments
from cpt_jax.runner.run import Run
from cpt_jax.runner.tasks import Task

SUMMARY_FILE = "summary.json"


def finished_summary(workdir: str, num_steps: int) -> dict[str, Any] | None:
    """The record of the run in `workdir` if it already finished its `num_steps`, else None.

    Finished: its ``summary.json`` records `num_steps` steps done of `num_steps`,
    neither interrupted nor stopped at a non-finite step, and its newest checkpoint is
    of that step. Rerunning such a run would train nothing and overwrite its record
    with a run of zero steps (no compilation, no speed); the job returns this record
    instead (``--extend`` continues it to a new length).

    Example:
      >>> import json, tempfile
      >>> workdir = tempfile.mkdtemp()
      >>> with open(os.path.join(workdir, SUMMARY_FILE), "w") as f:
      ...     json.dump({"steps": 12, "num_steps": 12, "interrupted": False}, f)
      >>> finished_summary(workdir, 12) is None   # no checkpoint of step 12: not finished
      True
    """
    path = os.path.join(workdir, SUMMARY_FILE)
    checkpoints = os.path.join(workdir, CHECKPOINT_SUBDIR)
    if not (os.path.isfile(path) and os.path.isdir(checkpoints)):
        return None
    try:
        with open(path) as f:
            summary = json.load(f)
    except (OSError, ValueError):
        return None   # unreadable: the run writes it again
    if (not isinstance(summary, dict) or summary.get("interrupted")
            or "nonfinite_stop" in summary
            or not summary.get("steps") == summary.get("num_steps") == int(num_steps)):
        return None
    manager = CheckpointManager(checkpoints)
    try:
        steps = manager.steps()
    finally:
        manager.close()
    return summary if steps and steps[-1] == int(num_steps) else None


def finished_message(workdir: str, summary: dict[str, Any]) -> str:
    """What a rerun of a finished run says: nothing trained, the record kept, how to go on."""
    steps = int(summary["steps"])
    return (f"the run in {workdir} already finished its {steps} steps: nothing to train, "
            f"its {SUMMARY_FILE} is kept as it was. To train it longer, rerun with "
            f"--config.num_steps=N (N > {steps}) --extend; to train again from step 0, "
            f"use a new --workdir")


def run_cost_summary(run: Run, done_steps: int) -> dict[str, float]:
    """``relative_cost_fp32`` / ``_static8`` of the steps done (all of them when the run
    finished or did none), and the schedules' mean bits (`cost.steps_done_cost` of the
    run's `RunCost`)."""
    return cost_lib.steps_done_cost(run.cost.per_step, run.cost.totals, done_steps)


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
        **compute_summary(quant_config_from_config(p), ops),
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


def compute_summary(quant_config, ops) -> dict[str, Any]:
    """Which arithmetic ran: the config's ``compute`` name, the platform, and how many
    products each path computed (`cpt_jax.providers.compute_paths`: ``int`` for three
    integer GEMMs, ``fake`` for fake quantization, ``fp32``, ...)."""
    return {"compute": getattr(quant_config, "compute", "auto"),
            "compute_platform": jax.default_backend(),
            "products_by_compute": compute_paths(ops)}


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
