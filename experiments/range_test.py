"""Precision range test: pick CPT's ``min_bits`` from short runs at static widths
(Fu et al. 2021 describe it in words: start low and raise the precision until
training accuracy improves clearly within the first epochs).

    python -m experiments.range_test --workdir=/tmp/range --quick
    python -m experiments.range_test --workdir=/tmp/range --bits=2..8 --steps=200 --seeds=0,1

Runs ``--steps`` steps at each static forward width of ``--bits`` (backward bits at
the config's ``grad_bits``) and one full-precision reference, all at the base
learning rate held constant (``--lr_constant``, the lr of the first epochs of a
real run). Early progress of a run = its mean training accuracy over the last
quarter of the logged steps (mean training loss if the task has no accuracy).

Rule: with ``P(b)`` the progress at ``b`` bits and ``P_hi`` that at the widest
tested width (the high-precision end, ``max_bits``), the recommended ``min_bits``
is the smallest width ``b`` such that every tested width ``b' >= b`` has
``P(b') >= P_hi - tolerance`` (accuracy, absolute) or ``P(b') <= P_hi (1 +
tolerance)`` (loss). ``max_bits`` is the widest tested width (the config's
``max_bits`` by default). Prints ``recommended min_bits=.. max_bits=..``.

Writes ``range_test.csv`` / ``.md``, ``recommendation.json``, ``range_test.png``
(progress versus width, the tolerance band and the choice) and ``range_curves.png``.
"""
from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

from experiments import study_utils as su

QUICK_STEPS = 150
QUICK_BITS = (2, 3, 4, 6, 8)
COLUMNS = ("bits", "measure", "progress_mean", "progress_std", "metric", "metric_mean",
           "metric_std", "num_seeds", "within_tolerance")


def early_progress(train_records: Sequence[dict[str, Any]], fraction: float = 0.25):
    """``(measure, value)``: mean training accuracy (or loss) over the last `fraction`
    of the logged records."""
    if not train_records:
        raise ValueError("a run has no logged training records")
    key = "accuracy" if "accuracy" in train_records[0] else "loss"
    n = max(1, int(round(len(train_records) * fraction)))
    values = [float(r[key]) for r in train_records[-n:]]
    return key, float(np.mean(values))


def recommend_min_bits(bits: Sequence[int], progress: Sequence[float], *, tolerance: float,
                       higher_is_better: bool = True) -> int:
    """The smallest width from which every wider tested width is within `tolerance`
    of the widest one (absolute for accuracy, relative for loss).

    Example:
      >>> recommend_min_bits([2, 3, 4, 8], [0.2, 0.85, 0.9, 0.91], tolerance=0.1)
      3
    """
    order = np.argsort(bits)
    b = np.asarray(bits)[order]
    p = np.asarray(progress, np.float64)[order]
    ref = p[-1]
    ok = (p >= ref - tolerance) if higher_is_better else (p <= ref * (1.0 + tolerance))
    choice = int(b[-1])
    for i in range(len(b) - 1, -1, -1):
        if not ok[i]:
            break
        choice = int(b[i])
    return choice


def range_config(config, bits: int, steps: int, seed: int, lr_constant: bool):
    """One short static run (``bits = 32``: full precision)."""
    overrides = {**su.study_overrides(config), "num_steps": int(steps), "seed": int(seed),
                 "log_every": max(1, int(steps) // 40), "eval_every": 0}
    if lr_constant:
        overrides["optimizer.lr_schedule"] = "constant"
    if bits >= 32:
        overrides["precision.schedule"] = "none"
    else:
        overrides.update({"precision.schedule": "constant", "precision.max_bits": int(bits),
                          "precision.min_bits": min(int(config.precision.min_bits), int(bits)),
                          "precision.eval_bits": 0})
    return su.with_overrides(config, overrides)


def run_range_test(config, workdir: str, *, bits: Sequence[int], steps: int,
                   seeds: Sequence[int], tolerance: float = 0.02, include_fp32: bool = True,
                   lr_constant: bool = True, progress: bool = False) -> dict[str, Any]:
    """Train (or load) the short runs, apply the rule, write the outputs."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    if tolerance < 0:
        raise ValueError(f"tolerance must be >= 0, got {tolerance}")
    if any(not 1 <= b <= 31 for b in bits):
        raise ValueError(f"--bits must be in [1, 31], got {list(bits)}")
    os.makedirs(workdir, exist_ok=True)
    widths = sorted(set(int(b) for b in bits)) + ([32] if include_fp32 else [])
    runs = []
    for b in widths:
        for seed in seeds:
            cfg = range_config(config, b, steps, seed, lr_constant)
            name = "fp32" if b >= 32 else f"bits{b}"
            directory = su.run_dir(workdir, name, seed)
            su.log_line(f"[range] {name} seed {seed} ({steps} steps) -> {directory}")
            summary = su.run_or_load(cfg, directory, progress=progress)
            train, _ = su.read_metrics(directory)
            measure, value = early_progress(train)
            metric, final, higher = su.metric_info(summary)
            runs.append({"bits": b, "seed": int(seed), "measure": measure, "progress": value,
                         "metric": metric, "value": final, "directory": directory})
    measure = runs[0]["measure"]
    higher = measure == "accuracy"
    rows = []
    for b in widths:
        mine = [r for r in runs if r["bits"] == b]
        pm_, ps_ = su.mean_std(r["progress"] for r in mine)
        mm, ms = su.mean_std(r["value"] for r in mine)
        rows.append({"bits": b, "measure": measure, "progress_mean": pm_, "progress_std": ps_,
                     "metric": mine[0]["metric"], "metric_mean": mm, "metric_std": ms,
                     "num_seeds": len(mine)})
    quant = [r for r in rows if r["bits"] < 32]
    min_bits = recommend_min_bits([r["bits"] for r in quant], [r["progress_mean"] for r in quant],
                                  tolerance=tolerance, higher_is_better=higher)
    max_bits = max(r["bits"] for r in quant)
    ref = quant[-1]["progress_mean"]
    for r in rows:
        r["within_tolerance"] = bool(r["progress_mean"] >= ref - tolerance if higher
                                     else r["progress_mean"] <= ref * (1 + tolerance))
    rec = {"min_bits": min_bits, "max_bits": max_bits, "measure": measure,
           "tolerance": tolerance, "steps": int(steps), "reference_progress": ref,
           "fp32_progress": next((r["progress_mean"] for r in rows if r["bits"] == 32), None)}
    write_outputs(workdir, config, rows, runs, rec)
    return {"rows": rows, "runs": runs, "recommendation": rec}


def write_outputs(workdir: str, config, rows, runs, rec) -> None:
    """range_test.csv/.md, recommendation.json and the two plots."""
    su.write_csv(os.path.join(workdir, "range_test.csv"), rows, COLUMNS)
    with open(os.path.join(workdir, "recommendation.json"), "w") as f:
        json.dump(rec, f, indent=1)
    measure = rec["measure"]
    table = [{**r, "bits": "fp32" if r["bits"] == 32 else r["bits"],
              "progress_pm": su.pm(r["progress_mean"], r["progress_std"], n=r["num_seeds"]),
              "metric_pm": su.pm(r["metric_mean"], r["metric_std"], n=r["num_seeds"]),
              "within_tolerance": "yes" if r["within_tolerance"] else ""} for r in rows]
    md = [f"# Precision range test: {config.dataset} / {config.model}", "",
          f"{rec['steps']} steps per run at a constant learning rate, seeds "
          f"{sorted({r['seed'] for r in runs})}. Early progress = mean training {measure} "
          f"over the last quarter of the logged steps. Rule: lowest width from which every "
          f"wider width is within {rec['tolerance']} "
          f"({'absolute' if measure == 'accuracy' else 'relative'}) of the widest "
          f"({rec['max_bits']} bits).", "",
          su.markdown_table(table, ("bits", "progress_pm", "within_tolerance", "metric_pm"),
                            ("forward bits", f"early train {measure}", "within tolerance",
                             f"test {rows[0]['metric']} after {rec['steps']} steps")),
          "", f"**Recommended: min_bits={rec['min_bits']}, max_bits={rec['max_bits']}**", ""]
    with open(os.path.join(workdir, "range_test.md"), "w") as f:
        f.write("\n".join(md))
    try:
        plot(rows, rec, os.path.join(workdir, "range_test.png"),
             title=f"{config.dataset} / {config.model}, {rec['steps']} steps")
        plot_curves(runs, os.path.join(workdir, "range_curves.png"))
    except Exception as exc:  # plots never lose the tables
        su.log_line(f"[range] plotting failed: {exc}")


def plot(rows, rec, path: str, title: str = "") -> None:
    """Early progress versus forward bits with the tolerance band and the choice."""
    plt = su.matplotlib_pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    quant = [r for r in rows if r["bits"] < 32]
    ax.errorbar([r["bits"] for r in quant], [r["progress_mean"] for r in quant],
                yerr=[r["progress_std"] for r in quant], fmt="o-", capsize=3,
                label="static width")
    ref, tol = rec["reference_progress"], rec["tolerance"]
    lo, hi = ((ref - tol, ref) if rec["measure"] == "accuracy" else (ref, ref * (1 + tol)))
    ax.axhspan(lo, hi, color="tab:green", alpha=0.15, label="tolerance of the widest")
    if rec.get("fp32_progress") is not None:
        ax.axhline(rec["fp32_progress"], color="k", ls=":", lw=1, label="fp32")
    ax.axvline(rec["min_bits"], color="tab:red", ls="--", lw=1,
               label=f"recommended min_bits={rec['min_bits']}")
    ax.set_xlabel("forward bits")
    ax.set_ylabel(f"early training {rec['measure']}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    if title:
        ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_curves(runs, path: str) -> None:
    """Training accuracy (or loss) against the step for each width (first seed)."""
    plt = su.matplotlib_pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    first = min(r["seed"] for r in runs)
    for r in runs:
        if r["seed"] != first:
            continue
        train, _ = su.read_metrics(r["directory"])
        ax.plot([t["step"] for t in train], [t[r["measure"]] for t in train], lw=1,
                label="fp32" if r["bits"] == 32 else f"{r['bits']} bits")
    ax.set_xlabel("step")
    ax.set_ylabel(f"training {runs[0]['measure']} (one batch)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# --------------------------------------------------------------------------- CLI

def define_flags() -> None:
    """Flags of the command line (defined only when run as a script)."""
    from absl import flags

    su.define_study_flags(default_seeds="0,1")
    flags.DEFINE_bool("quick", False, f"Minutes-long CPU run: {QUICK_STEPS} steps, widths "
                                      f"{QUICK_BITS}, one seed.")
    flags.DEFINE_string("bits", "", "Static widths to test (default 2..max_bits).")
    flags.DEFINE_integer("steps", 0, f"Steps per run (0: num_steps // 10; --quick: {QUICK_STEPS}).")
    flags.DEFINE_float("tolerance", 0.02, "Allowed gap to the widest width (accuracy: "
                                          "absolute; loss: relative).")
    flags.DEFINE_bool("fp32", True, "Also run a full-precision reference.")
    flags.DEFINE_bool("lr_constant", True, "Hold the base learning rate constant.")


def main(argv) -> None:
    from absl import flags

    if len(argv) > 1:
        raise SystemExit(f"unexpected arguments: {argv[1:]}")
    f = flags.FLAGS
    config, seeds = su.config_and_seeds(f)
    max_bits = int(config.precision.max_bits)
    if f.bits:
        bits = su.parse_int_list(f.bits, "bits")
    elif f.quick:
        bits = [b for b in QUICK_BITS if b <= max_bits]
    else:
        bits = list(range(2, max_bits + 1))
    steps = f.steps or (QUICK_STEPS if f.quick else max(1, int(config.num_steps) // 10))
    su.enable_compile_cache(f.compile_cache, f.workdir)
    try:
        result = run_range_test(config, f.workdir, bits=bits, steps=steps, seeds=seeds,
                                tolerance=f.tolerance, include_fp32=f.fp32,
                                lr_constant=f.lr_constant, progress=f.progress)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    with open(os.path.join(f.workdir, "range_test.md")) as fh:
        print(fh.read())
    rec = result["recommendation"]
    print(f"recommended min_bits={rec['min_bits']} max_bits={rec['max_bits']}")


if __name__ == "__main__":
    from absl import app

    define_flags()
    app.run(main)
