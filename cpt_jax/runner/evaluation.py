"""Evaluation: a state's metrics on every eval split, at the eval protocol's bits.

`evaluate` runs the compiled eval step over each split; `eval_bits_at` is the bits
of an evaluation after a number of steps (``precision.eval_bits_mode``);
`best_metrics` the best of every evaluation of a run.
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from cpt_jax.runner.run import Run
from cpt_jax.runner.tasks import Task
from cpt_jax.training import TrainState, aggregate


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
