r"""Compare finished runs of the main job side by side: one table, one figure.

    python -m experiments.compare --runs=fp32=/tmp/c_none,static8=/tmp/c_8,CPT=/tmp/c_cpt \
        --out=/tmp/compare

reads each run's ``summary.json`` and ``metrics.jsonl`` and writes
``OUT/compare.md`` (and prints it): final test metric (at the eval bits and in
fp32), BitOps relative to fp32 and to static 8/8, mean forward bits, compilations,
steps and wall time; and ``OUT/compare.png``: training loss (moving average) and
forward bits (the schedule named in the summary) against the step, and cumulative training BitOps relative to fp32.

A run directory without ``summary.json`` (still running, or stopped before its
summary) is an error naming it.
"""
from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np
from absl import app, flags

from cpt_jax import schedules as sched_lib
from cpt_jax.runner import job as runner
from experiments import study_utils as su
from experiments.configs import default

COLUMNS = ("label", "metric_value", "metric_fp32", "relative_cost_fp32",
           "relative_cost_static8", "mean_bits", "num_compiles", "steps", "wall_time_s")


def parse_runs(text: str) -> list[tuple[str, str]]:
    """``"a=DIR1,b=DIR2"`` (or bare directories, labelled by their basename)."""
    runs = []
    for item in (s.strip() for s in text.split(",")):
        if not item:
            continue
        label, sep, directory = item.partition("=")
        if not sep:
            label, directory = os.path.basename(os.path.normpath(item)), item
        runs.append((label.strip(), os.path.expanduser(directory.strip())))
    if not runs:
        raise ValueError("--runs is empty: give label=DIR pairs separated by commas")
    return runs


def load_run(label: str, directory: str) -> dict[str, Any]:
    """One row of the table plus the run's training records."""
    path = os.path.join(directory, "summary.json")
    if not os.path.isfile(path):
        raise ValueError(f"{directory}: no summary.json (is the run finished?)")
    with open(path) as f:
        summary = json.load(f)
    metric, value, higher = su.metric_info(summary)
    train, _ = su.read_metrics(directory)
    return {"label": label, "bits_per_step": bits_per_step(summary), "directory": directory, "metric": metric,
            "higher_is_better": higher, "metric_value": value,
            "metric_fp32": summary.get(f"final_test_{metric}_fp32", float("nan")),
            "relative_cost_fp32": float(summary["relative_cost_fp32"]),
            "relative_cost_static8": float(summary["relative_cost_static8"]),
            "mean_bits": summary.get("mean_bits", float("nan")),
            "num_compiles": summary.get("num_compiles", ""),
            "steps": summary.get("steps", ""),
            "wall_time_s": f"{float(summary.get('wall_time_s', float('nan'))):.0f}",
            "train": train}


def bits_per_step(summary: dict[str, Any]) -> np.ndarray:
    """The forward bits of every step, rebuilt from the schedule named in the summary
    (empty for a full-precision run)."""
    if summary.get("schedule") is None:
        return np.zeros((0,))
    # The default precision fields, overridden by those the summary records (a summary
    # written before a field existed ran with its default).
    p = default.get_precision_config()
    p.convention = "floor"  # summaries written before the convention field: T // n periods
    p.update({k: summary[k] for k in ("schedule", "min_bits", "max_bits", "num_cycles",
                                      "deficit_steps", "deficit_inclusive", "convention")
              if summary.get(k) is not None})
    total = int(summary.get("num_steps") or summary.get("steps") or 0)
    if total <= 0:
        return np.zeros((0,))
    schedule = runner.precision_schedule_from_config(p, total)
    if schedule is None:
        return np.zeros((0,))
    return np.asarray(sched_lib.schedule_values(schedule, total))


def moving_average(values: Sequence[float], window: int) -> np.ndarray:
    """Trailing mean over at most `window` points: ``m_i = mean(v[max(0, i-w+1) : i+1])``."""
    v = np.asarray(values, dtype=np.float64)
    if v.size == 0:
        return v
    csum = np.concatenate([[0.0], np.cumsum(v)])
    i = np.arange(1, v.size + 1)
    lo = np.maximum(0, i - window)
    return (csum[i] - csum[lo]) / (i - lo)


def markdown(rows: Sequence[dict[str, Any]]) -> str:
    metric = rows[0]["metric"]
    return su.markdown_table(
        rows, COLUMNS,
        ("run", f"test {metric}", f"test {metric} (fp32 eval)", "BitOps vs fp32",
         "BitOps vs static 8/8", "mean fwd bits", "compiles", "steps", "wall s"))


def plot(rows: Sequence[dict[str, Any]], path: str, window: int = 5) -> None:
    plt = su.matplotlib_pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for row in rows:
        train = [r for r in row["train"] if "loss" in r]
        steps = [r["step"] for r in train]
        line, = axes[0].plot(steps, moving_average([r["loss"] for r in train], window),
                             label=row["label"])
        color = line.get_color()
        bits = row["bits_per_step"]
        if bits.size:
            axes[1].plot(np.arange(bits.size), bits, color=color, lw=1, label=row["label"])
        cost = [(r["step"], r["cumulative_relative_cost"]) for r in train
                if "cumulative_relative_cost" in r]
        if cost:
            axes[2].plot(*zip(*cost), color=color, label=row["label"])
    axes[0].set(xlabel="step", ylabel=f"training loss (moving average of {window} logs)")
    axes[1].set(xlabel="step", ylabel="forward bits (fp32 runs not drawn)")
    axes[2].set(xlabel="step", ylabel="cumulative training BitOps / fp32 run", yscale="log")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def compare(runs: Sequence[tuple[str, str]], out: str, window: int = 5) -> str:
    """Write ``out/compare.md`` and ``out/compare.png``; return the markdown table."""
    rows = [load_run(label, directory) for label, directory in runs]
    metrics = {r["metric"] for r in rows}
    if len(metrics) > 1:
        raise ValueError(f"the runs report different metrics {sorted(metrics)}: "
                         f"compare runs of the same task")
    os.makedirs(out, exist_ok=True)
    table = markdown(rows)
    with open(os.path.join(out, "compare.md"), "w") as f:
        f.write(table + "\n")
    plot(rows, os.path.join(out, "compare.png"), window)
    return table


FLAGS = flags.FLAGS


def define_flags() -> None:
    flags.DEFINE_string("runs", None, "label=DIR pairs, comma separated.")
    flags.DEFINE_string("out", None, "Folder for compare.md and compare.png.")
    flags.DEFINE_integer("window", 5, "Moving-average window (in logged points) of the loss.")
    flags.mark_flags_as_required(["runs", "out"])


def main(argv) -> None:
    del argv
    try:
        print(compare(parse_runs(FLAGS.runs), FLAGS.out, FLAGS.window))
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    define_flags()
    app.run(main)
