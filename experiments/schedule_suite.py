"""The CPT schedule suite (Wolfe & Kyrillidis 2024): every cyclic schedule of
`cpt_jax.schedules.SUITE` against static baselines, at equal steps, over seeds.

    python -m experiments.schedule_suite --workdir=/tmp/suite --quick
    python -m experiments.schedule_suite --workdir=/tmp/suite \
        --config=experiments/configs/default.py --seeds=0,1,2 --steps=800
    python -m experiments.schedule_suite --workdir=/tmp/suite_cifar \
        --config=experiments/configs/cifar10_resnet.py \
        --config.data_dir=../shared/datasets/cifar10          # full recipe (GPU/TPU)

Runs: each SUITE schedule (``min_bits..max_bits`` forward, ``grad_bits`` backward,
``num_cycles`` cycles), static precision at each width ``min_bits..max_bits``
(``--static_bits``; ``--quick``: just min and max) and full precision. Writes to
WORKDIR:

* ``suite.csv`` / ``suite.md``: one row per schedule: ``schedule, kind, metric,
  metric_mean, metric_std, num_seeds, relative_cost_fp32, relative_cost_static,
  relative_cost_static8, mean_bits, pareto``. ``relative_cost_static`` is the run's
  BitOps over those of static ``max_bits`` forward / ``grad_bits`` backward;
  ``relative_cost_static8`` over static 8/8 (the runner's);
* ``suite_runs.csv``: one row per (schedule, seed);
* ``correlation.json``: Pearson and Spearman correlation of metric and cost;
* ``schedules.png`` (the suite's shapes) and ``tradeoff.png`` (metric versus
  relative cost, Pareto front marked).

Claim tested: performance and training cost are correlated, and the schedule
controls the trade-off. Resumable: finished runs (``runs/*/summary.json``) are loaded.
"""
from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

from experiments import study_utils as su

QUICK_STEPS = 300
STUDY_COLUMNS = ("schedule", "kind", "metric", "metric_mean", "metric_std", "num_seeds",
                 "relative_cost_fp32", "relative_cost_static", "relative_cost_static8",
                 "mean_bits", "pareto")


def suite_plan(config, schedules: Sequence[str], static_bits: Sequence[int],
               include_fp32: bool = True) -> list[dict[str, Any]]:
    """The runs of the suite: ``[{"name", "kind", "overrides"}, ...]``.

    Cyclic: ``precision.schedule = name``. Static ``b``: ``schedule = "constant"`` at
    ``max_bits = b`` (evaluated at ``b`` bits). Full precision: ``schedule = "none"``.
    """
    from cpt_jax import schedules as sched_lib

    p = config.precision
    plan = []
    for name in schedules:
        if name not in sched_lib.SUITE:
            raise ValueError(f"--schedules: {name!r} is not in SUITE {sched_lib.SUITE}")
        plan.append({"name": name, "kind": "cyclic",
                     "overrides": {"precision.schedule": name}})
    for b in static_bits:
        if not 1 <= int(b) <= 32:
            raise ValueError(f"--static_bits: {b} is outside [1, 32]")
        plan.append({"name": f"static_{int(b)}", "kind": "static",
                     "overrides": {"precision.schedule": "constant",
                                   "precision.max_bits": int(b),
                                   "precision.min_bits": min(int(p.min_bits), int(b)),
                                   "precision.eval_bits": 0}})
    if include_fp32:
        plan.append({"name": "fp32", "kind": "fp32", "overrides": {"precision.schedule": "none"}})
    return plan


def run_suite(config, workdir: str, *, seeds: Sequence[int], schedules: Sequence[str],
              static_bits: Sequence[int], include_fp32: bool = True,
              progress: bool = False) -> dict[str, Any]:
    """Train (or load) every run of the suite and write the tables and plots.

    Returns ``{"rows": [...], "runs": [...], "correlation": {...}}``.
    """
    os.makedirs(workdir, exist_ok=True)
    p = config.precision
    max_bits = int(p.max_bits)
    plan = suite_plan(config, schedules, static_bits, include_fp32)
    if max_bits not in [int(b) for b in static_bits]:
        # static max_bits is the cost baseline: always run it.
        plan += suite_plan(config, [], [max_bits], include_fp32=False)
    base = su.with_overrides(config, su.study_overrides(config))
    runs = []
    for item in plan:
        for seed in seeds:
            cfg = su.with_overrides(base, {**item["overrides"], "seed": int(seed)})
            directory = su.run_dir(workdir, item["name"], seed)
            su.log_line(f"[suite] {item['name']} seed {seed} ({cfg.num_steps} steps) -> {directory}")
            summary = su.run_or_load(cfg, directory, progress=progress)
            metric, value, higher = su.metric_info(summary)
            runs.append({"schedule": item["name"], "kind": item["kind"], "seed": int(seed),
                         "metric": metric, "value": value, "higher_is_better": higher,
                         "relative_cost_fp32": float(summary["relative_cost_fp32"]),
                         "relative_cost_static8": float(summary["relative_cost_static8"]),
                         "mean_bits": float(summary["mean_bits"]),
                         "wall_time_s": float(summary.get("wall_time_s", float("nan")))})
    rows = aggregate_runs(runs, plan, baseline=f"static_{max_bits}")
    for run in runs:
        run["relative_cost_static"] = run["relative_cost_fp32"] / _baseline_cost(runs, max_bits)
    higher = runs[0]["higher_is_better"]
    quantized = [r for r in rows if r["kind"] != "fp32"]
    cyclic = [r for r in rows if r["kind"] == "cyclic"]
    corr = {
        "metric": runs[0]["metric"],
        "higher_is_better": higher,
        "quantized_configs": su.correlations([r["relative_cost_fp32"] for r in quantized],
                                             [r["metric_mean"] for r in quantized]),
        "cyclic_configs": su.correlations([r["relative_cost_fp32"] for r in cyclic],
                                          [r["metric_mean"] for r in cyclic]),
        "quantized_runs": su.correlations(
            [r["relative_cost_fp32"] for r in runs if r["kind"] != "fp32"],
            [r["value"] for r in runs if r["kind"] != "fp32"]),
    }
    write_outputs(workdir, config, rows, runs, corr, schedules)
    return {"rows": rows, "runs": runs, "correlation": corr}


def _baseline_cost(runs: Sequence[dict[str, Any]], max_bits: int) -> float:
    costs = [r["relative_cost_fp32"] for r in runs if r["schedule"] == f"static_{max_bits}"]
    return float(costs[0])


def aggregate_runs(runs: Sequence[dict[str, Any]], plan: Sequence[dict[str, Any]],
                   baseline: str) -> list[dict[str, Any]]:
    """One row per schedule: metric mean +- sample std over seeds, costs, Pareto flag.

    ``relative_cost_static = relative_cost_fp32 / relative_cost_fp32(baseline)``:
    BitOps are sums over steps and ops, so the ratio of the two runs' fp32-relative
    costs is their BitOps ratio.
    """
    base_cost = [r["relative_cost_fp32"] for r in runs if r["schedule"] == baseline][0]
    rows, seen = [], set()
    for item in plan:
        name = item["name"]
        if name in seen:
            continue
        seen.add(name)
        mine = [r for r in runs if r["schedule"] == name]
        costs = {r["relative_cost_fp32"] for r in mine}
        if len(costs) != 1:
            raise ValueError(f"{name}: seeds disagree on the schedule's cost: {sorted(costs)}")
        mean, std = su.mean_std(r["value"] for r in mine)
        rows.append({"schedule": name, "kind": item["kind"], "metric": mine[0]["metric"],
                     "metric_mean": mean, "metric_std": std, "num_seeds": len(mine),
                     "relative_cost_fp32": mine[0]["relative_cost_fp32"],
                     "relative_cost_static": mine[0]["relative_cost_fp32"] / base_cost,
                     "relative_cost_static8": mine[0]["relative_cost_static8"],
                     "mean_bits": mine[0]["mean_bits"]})
    front = su.pareto_front([r["relative_cost_fp32"] for r in rows],
                            [r["metric_mean"] for r in rows], runs[0]["higher_is_better"])
    for row, on in zip(rows, front):
        row["pareto"] = bool(on)
    return rows


def write_outputs(workdir: str, config, rows, runs, corr, schedules) -> None:
    """suite.csv, suite.md, suite_runs.csv, correlation.json and the two plots."""
    su.write_csv(os.path.join(workdir, "suite.csv"), rows, STUDY_COLUMNS)
    su.write_csv(os.path.join(workdir, "suite_runs.csv"), runs,
                 ("schedule", "kind", "seed", "metric", "value", "relative_cost_fp32",
                  "relative_cost_static", "relative_cost_static8", "mean_bits", "wall_time_s"))
    with open(os.path.join(workdir, "correlation.json"), "w") as f:
        json.dump(corr, f, indent=1)
    p = config.precision
    metric = rows[0]["metric"]
    table_rows = [{**r, "metric_pm": su.pm(r["metric_mean"], r["metric_std"], n=r["num_seeds"]),
                   "pareto": "yes" if r["pareto"] else ""} for r in rows]
    md = [f"# Schedule suite: {config.dataset} / {config.model}",
          "",
          f"{config.num_steps} steps, seeds {sorted({r['seed'] for r in runs})}, cyclic "
          f"schedules {p.min_bits}-{p.max_bits} forward bits with {p.num_cycles} cycles, "
          f"{p.grad_bits} backward bits. Metric: final test {metric} (mean +- sample std "
          f"over seeds). Costs are BitOps relative to fp32 and to static "
          f"{p.max_bits}/{p.grad_bits} bits.",
          "",
          su.markdown_table(table_rows, ("schedule", "kind", "metric_pm", "relative_cost_fp32",
                                         "relative_cost_static", "mean_bits", "pareto"),
                            ("schedule", "kind", f"test {metric}", "cost vs fp32",
                             f"cost vs static {p.max_bits}", "mean fwd bits", "Pareto")),
          "",
          "Correlation of the metric with the relative cost:",
          su.describe_correlation(corr["quantized_configs"],
                                  "quantized configs (cyclic + static), per-config means"),
          su.describe_correlation(corr["cyclic_configs"], "cyclic schedules only"),
          su.describe_correlation(corr["quantized_runs"], "quantized runs, every seed"),
          ""]
    with open(os.path.join(workdir, "suite.md"), "w") as f:
        f.write("\n".join(md))
    try:
        plot_schedule_grid(config, schedules, os.path.join(workdir, "schedules.png"))
        plot_tradeoff(rows, os.path.join(workdir, "tradeoff.png"),
                      title=f"{config.dataset} / {config.model}, {config.num_steps} steps",
                      baseline_bits=int(p.max_bits))
    except Exception as exc:  # plots never lose the tables
        su.log_line(f"[suite] plotting failed: {exc}")


def plot_schedule_grid(config, schedules: Sequence[str], path: str) -> None:
    """The forward-bit curve of each cyclic schedule, one panel each."""
    if not schedules:
        return
    from cpt_jax import schedules as sched_lib
    from cpt_jax.runner import job as runner

    named = {}
    for name in schedules:
        cfg = su.with_overrides(config, {"precision.schedule": name})
        named[name] = runner.precision_schedule_from_config(cfg.precision, int(cfg.num_steps))
    sched_lib.plot_schedules(named, int(config.num_steps), path, grid=True,
                             title=f"forward bits, {config.precision.num_cycles} cycles")


def zoom_limits(values: Sequence[float], fences: float = 5.0):
    """``(lo, hi)`` y-limits of the values inside ``[q1 - k IQR, q3 + k IQR]`` (IQR at
    least 1% of the median's magnitude), or None when every value is inside."""
    v = np.asarray(values, np.float64)
    q1, med, q3 = np.percentile(v, [25, 50, 75])
    iqr = max(q3 - q1, 0.01 * abs(med), 1e-6)
    inside = (v >= q1 - fences * iqr) & (v <= q3 + fences * iqr)
    if inside.all():
        return None
    lo, hi = v[inside].min(), v[inside].max()
    pad = 0.2 * max(hi - lo, 1e-3)
    return lo - pad, hi + pad


def plot_tradeoff(rows: Sequence[dict[str, Any]], path: str, *, title: str = "",
                  baseline_bits: int = 8) -> None:
    """Metric (mean +- std) versus cost relative to static `baseline_bits`, log x,
    Pareto-optimal schedules joined by a line. When a few configs are far below the
    rest (e.g. a collapsed static run), a second panel zooms on the others."""
    plt = su.matplotlib_pyplot()
    zoom = zoom_limits([r["metric_mean"] for r in rows])
    ncols = 1 if zoom is None else 2
    fig, axes = plt.subplots(1, ncols, figsize=(7.5 * ncols, 4.8), squeeze=False)
    styles = {"cyclic": ("o", "tab:blue"), "static": ("s", "tab:orange"),
              "fp32": ("D", "tab:green")}
    front = sorted((r for r in rows if r["pareto"]), key=lambda r: r["relative_cost_static"])
    for i, ax in enumerate(axes[0]):
        for kind, (marker, color) in styles.items():
            pts = [r for r in rows if r["kind"] == kind]
            if not pts:
                continue
            ax.errorbar([r["relative_cost_static"] for r in pts],
                        [r["metric_mean"] for r in pts], yerr=[r["metric_std"] for r in pts],
                        fmt=marker, color=color, label=kind, capsize=3, ms=6)
        if front:
            ax.plot([r["relative_cost_static"] for r in front],
                    [r["metric_mean"] for r in front], "--", color="k", lw=1,
                    label="Pareto front", zorder=0)
            ax.scatter([r["relative_cost_static"] for r in front],
                       [r["metric_mean"] for r in front], s=140, facecolors="none",
                       edgecolors="k", lw=1)
        ax.set_xscale("log")
        shown = rows
        if i == 1:
            ax.set_ylim(*zoom)
            ax.set_title("zoom", fontsize=9)
            shown = [r for r in rows if zoom[0] <= r["metric_mean"] <= zoom[1]]
        elif zoom is not None:
            shown = [r for r in rows if not zoom[0] <= r["metric_mean"] <= zoom[1]]
        su.annotate_points(ax, [(r["relative_cost_static"], r["metric_mean"]) for r in shown],
                           [r["schedule"] for r in shown])
        ax.set_xlabel(f"training BitOps relative to static {baseline_bits}-bit")
        ax.set_ylabel(f"final test {rows[0]['metric']}")
        ax.grid(alpha=0.3)
        if i == 0:
            ax.legend(fontsize=8)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# --------------------------------------------------------------------------- CLI

def define_flags() -> None:
    """Flags of the command line (defined only when run as a script)."""
    from absl import flags

    su.define_study_flags(default_seeds="0,1,2")
    flags.DEFINE_bool("quick", False,
                      f"Minutes-long CPU run: {QUICK_STEPS} steps, one seed, static min/max only.")
    flags.DEFINE_integer("steps", 0, "Training steps of every run (0: the config's / quick).")
    flags.DEFINE_string("schedules", ",".join(_suite()), "SUITE schedules to run.")
    flags.DEFINE_string("static_bits", "",
                        "Static widths (e.g. 3..8); empty: min..max (--quick: min,max).")
    flags.DEFINE_bool("fp32", True, "Include the full-precision baseline.")


def _suite() -> tuple:
    from cpt_jax.schedules import SUITE
    return SUITE


def main(argv) -> None:
    from absl import flags

    if len(argv) > 1:
        raise SystemExit(f"unexpected arguments: {argv[1:]}")
    f = flags.FLAGS
    config, seeds = su.config_and_seeds(f)
    steps = f.steps or (QUICK_STEPS if f.quick else 0)
    if steps:
        config = su.with_overrides(config, {"num_steps": int(steps)})
    p = config.precision
    if f.static_bits:
        static = su.parse_int_list(f.static_bits, "static_bits")
    elif f.quick:
        static = sorted({int(p.min_bits), int(p.max_bits)})
    else:
        static = list(range(int(p.min_bits), int(p.max_bits) + 1))
    schedules = su.parse_str_list(f.schedules)
    su.enable_compile_cache(f.compile_cache, f.workdir)
    try:
        result = run_suite(config, f.workdir, seeds=seeds, schedules=schedules,
                           static_bits=static, include_fp32=f.fp32, progress=f.progress)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    with open(os.path.join(f.workdir, "suite.md")) as fh:
        print(fh.read())
    del result


if __name__ == "__main__":
    from absl import app

    define_flags()
    app.run(main)
