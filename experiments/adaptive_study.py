"""Precision that answers the training: static, cyclic and controlled precision, paired by seed.

    python -m experiments.adaptive_study --workdir=/tmp/adaptive --seeds=0,1,2

Trains the tiny-shakespeare Transformer (`configs/shakespeare_transformer.py`) with
each arm of `ARMS` (CPT's integer quantizer; forward bits, then error bits):

==========================  ===========================================================
``static_low``              every step at ``--low_bits`` / ``--grad_bits``
``static_8``                every step at 8 / 8 bits
``cpt``                     CPT's cos_growth from ``--low_bits`` to 8, 8 cycles; errors
                            at ``--grad_bits``
``cpt_never_fires``         ``cpt`` through the controller's train step, ``ratio`` 1e9: the
                            same compiled program as ``cpt_on_instability`` (a different
                            one from ``cpt``'s: its float rounding differs), never boosting
``cpt_on_instability``      ``cpt`` + `cpt_jax.on_instability` on the gradient norm:
                            ``--boost`` forward and ``--error_boost`` error bits for
                            ``--hold`` steps after a step whose norm exceeds ``--ratio``
                            times its running mean (or is not finite)
``static_low_final_phase``  ``static_low``, its last ``--fraction`` of the steps at 8 / 8
                            bits (`cpt_jax.final_phase`, the NVFP4 recipe's last phase)
==========================  ===========================================================

Every arm trains through `cpt_jax.runner.train_and_evaluate` (the main job, with
``config.precision.controller`` for the controlled arms); seeds share initialization
and batches across arms, so differences are paired by seed. The cost is the bits
actually used (`cpt_jax.runner.realized` for the controlled arm), BitOps relative to
static 8/8. Writes to WORKDIR: ``adaptive.csv`` (one row per run), ``adaptive.md``
(mean +- sample std over seeds, paired differences to ``static_8`` and ``cpt``),
``adaptive.png`` (perplexity versus cost) and ``adaptive_bits.png`` (the realized
bits of the controlled arm, each seed). Resumable: finished runs are loaded.
"""
from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from typing import Any

from experiments import study_utils as su

CONFIG = os.path.join(os.path.dirname(__file__), "configs", "shakespeare_transformer.py")
ARMS = ("static_low", "static_8", "cpt", "cpt_never_fires", "cpt_on_instability",
        "static_low_final_phase")
NEVER = 1e9
"""``cpt_never_fires``'s ratio: no gradient norm passes 1e9 times its mean."""
CSV_COLUMNS = ("arm", "seed", "metric", "metric_fp32", "relative_cost_static8", "mean_bits",
               "extra_bits", "skipped_steps", "num_compiles")


def arm_overrides(arm: str, low: int, grad_bits: int, *, ratio: float = 2.0, boost: int = 2,
                  error_boost: int = 4, hold: int = 10, fraction: float = 0.25
                  ) -> dict[str, Any]:
    """The config overrides of one arm (`ARMS`).

    Example:
      >>> arm_overrides("cpt_on_instability", 3, 4)["precision.controller"]
      'on_instability'
      >>> arm_overrides("static_low", 3, 4)["precision.max_bits"]
      3
    """
    common = {"precision.grad_bits": int(grad_bits), "precision.eval_bits": 0,
              "precision.controller": "none"}
    static = {**common, "precision.schedule": "constant"}
    cyclic = {**common, "precision.schedule": "cos_growth", "precision.min_bits": int(low),
              "precision.max_bits": 8, "precision.num_cycles": 8}
    plans = {
        "static_low": {**static, "precision.min_bits": int(low), "precision.max_bits": int(low)},
        "static_8": {**static, "precision.min_bits": 8, "precision.max_bits": 8,
                     "precision.grad_bits": 8},
        "cpt": cyclic,
        "cpt_on_instability": {**cyclic, "precision.controller": "on_instability",
                               "precision.controller_statistic": "grad_norm",
                               "precision.controller_ratio": float(ratio),
                               "precision.controller_boost": int(boost),
                               "precision.controller_error_boost": int(error_boost),
                               "precision.controller_hold": int(hold)},
        "cpt_never_fires": {**cyclic, "precision.controller": "on_instability",
                            "precision.controller_statistic": "grad_norm",
                            "precision.controller_ratio": NEVER,
                            "precision.controller_boost": int(boost),
                            "precision.controller_error_boost": int(error_boost),
                            "precision.controller_hold": int(hold)},
        "static_low_final_phase": {**static, "precision.min_bits": int(low),
                                   "precision.max_bits": int(low),
                                   "precision.controller": "final_phase",
                                   "precision.controller_fraction": float(fraction),
                                   "precision.controller_bits": 8},
    }
    if arm not in plans:
        raise ValueError(f"--arms: {arm!r} is not one of {list(ARMS)}")
    return plans[arm]


def extra_bits(summary: dict[str, Any]) -> int:
    """Forward bits the controller added over its base, summed over the steps:
    ``(mean_bits - base_mean_bits) * steps`` (0 without a controller); a boost of 2
    bits for 10 steps adds 20.

    Example:
      >>> extra_bits({"mean_bits": 5.5, "base_mean_bits": 5.0, "steps": 40})
      20
    """
    if "base_mean_bits" not in summary:
        return 0
    return int(round((summary["mean_bits"] - summary["base_mean_bits"]) * summary["steps"]))


def run_arms(base, workdir: str, arms: Sequence[str], seeds: Sequence[int], knobs: dict,
             progress: bool = False) -> list[dict[str, Any]]:
    """Train (or load) every (arm, seed); one row per run."""
    rows = []
    for arm in arms:
        cfg0 = su.with_overrides(base, arm_overrides(arm, **knobs))
        for seed in seeds:
            cfg = su.with_overrides(cfg0, {"seed": int(seed)})
            directory = su.run_dir(workdir, arm, seed)
            su.log_line(f"[adaptive] {arm} seed {seed} ({cfg.num_steps} steps)")
            summary = su.run_or_load(cfg, directory, progress=progress, extra={"arm": arm})
            _, value, _ = su.metric_info(summary)
            rows.append({"arm": arm, "seed": int(seed), "metric": value,
                         "metric_fp32": float(summary["final_test_perplexity_fp32"]),
                         "relative_cost_static8": float(summary["relative_cost_static8"]),
                         "mean_bits": float(summary["mean_bits"]),
                         "extra_bits": extra_bits(summary),
                         "skipped_steps": int(summary["skipped_steps"]),
                         "num_compiles": int(summary["num_compiles"]), "directory": directory})
    return rows


def paired(rows, arm: str, reference: str, key: str = "metric") -> list[float]:
    """``row[key](arm, seed) - row[key](reference, seed)`` over the seeds both ran.

    Example:
      >>> rows = [{"arm": "a", "seed": 0, "metric": 2.0}, {"arm": "b", "seed": 0, "metric": 1.5}]
      >>> paired(rows, "a", "b")
      [0.5]
    """
    ref = {r["seed"]: r[key] for r in rows if r["arm"] == reference}
    return [r[key] - ref[r["seed"]] for r in rows if r["arm"] == arm and r["seed"] in ref]


def minus_line(rows, arm: str, low: str = "cpt", high: str = "static_8") -> list[float]:
    """Per seed, the arm's metric minus the straight line from `low` to `high` at the
    arm's cost: what mixing steps of the two would give if the metric were linear in
    cost, ``m - (m_lo + (c - c_lo) (m_hi - m_lo) / (c_hi - c_lo))``.

    Example:
      >>> rows = [{"arm": a, "seed": 0, "metric": m, "relative_cost_static8": c}
      ...         for a, m, c in [("cpt", 14.0, 0.5), ("static_8", 12.0, 1.0), ("x", 12.9, 0.75)]]
      >>> [round(v, 6) for v in minus_line(rows, "x")]
      [-0.1]
    """
    def by_seed(name):
        return {r["seed"]: r for r in rows if r["arm"] == name}

    lo, hi, out = by_seed(low), by_seed(high), []
    for seed, r in sorted(by_seed(arm).items()):
        if seed not in lo or seed not in hi:
            continue
        a, b = lo[seed], hi[seed]
        span = b["relative_cost_static8"] - a["relative_cost_static8"]
        if span == 0:
            continue
        slope = (b["metric"] - a["metric"]) / span
        out.append(r["metric"] - (a["metric"] + (r["relative_cost_static8"]
                                                 - a["relative_cost_static8"]) * slope))
    return out


def summarize(rows) -> list[dict[str, Any]]:
    """One row per arm: perplexity (at the eval bits and fp32) mean +- std, paired
    differences to ``static_8`` and ``cpt`` and to the cpt-static_8 line at the same
    cost (`minus_line`; also from ``cpt_never_fires``), cost and mean bits."""
    out = []
    for arm in dict.fromkeys(r["arm"] for r in rows):
        mine = [r for r in rows if r["arm"] == arm]
        row = {"arm": arm, "num_seeds": len(mine)}
        for key in ("metric", "metric_fp32", "relative_cost_static8", "mean_bits",
                    "extra_bits"):
            mean, std = su.mean_std(r[key] for r in mine)
            row[f"{key}_mean"], row[f"{key}_std"] = mean, std
            row[f"{key}_pm"] = su.pm(mean, std, n=len(mine))
        for ref in ("static_8", "cpt", "cpt_never_fires"):
            d = paired(rows, arm, ref)
            row[f"minus_{ref}"] = su.pm_of(d) if d else ""
        d = minus_line(rows, arm)
        row["minus_line"] = su.pm_of(d) if d else ""
        d = minus_line(rows, arm, low="cpt_never_fires")
        row["minus_line_never"] = su.pm_of(d) if d else ""
        out.append(row)
    return out


def plot(summary, path: str) -> None:
    """Test perplexity (mean +- std) versus cost relative to static 8/8."""
    plt = su.matplotlib_pyplot()
    fig, ax = plt.subplots(figsize=(6.2, 4.2))
    for r in summary:
        ax.errorbar(r["relative_cost_static8_mean"], r["metric_mean"], yerr=r["metric_std"],
                    fmt="o", capsize=3)
    su.annotate_points(ax, [(r["relative_cost_static8_mean"], r["metric_mean"]) for r in summary],
                       [r["arm"] for r in summary])
    ax.set_xlabel("BitOps relative to static 8/8 (bits actually used)")
    ax.set_ylabel("test perplexity (lower is better)")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_realized(rows, path: str, arm: str = "cpt_on_instability") -> None:
    """The controlled arm's realized forward and error bits beside its base schedule,
    and the gradient norm it watched (logged steps), one panel per seed."""
    import json

    import ml_collections

    from cpt_jax.runner import job as runner
    from cpt_jax.runner import realized

    mine = [r for r in rows if r["arm"] == arm]
    if not mine:
        return
    plt = su.matplotlib_pyplot()
    fig, axes = plt.subplots(len(mine), 1, figsize=(8, 2.3 * len(mine)), sharex=True,
                             squeeze=False)
    for ax, row in zip(axes[:, 0], mine):
        train, _ = su.read_metrics(row["directory"])
        with open(os.path.join(row["directory"], "study_config.json")) as f:
            config = ml_collections.ConfigDict({k: v for k, v in json.load(f).items()
                                                if k != "_study"})
        steps = int(config.num_steps)
        base = runner.precision_schedule_from_config(config.precision, steps)
        ax.step(range(1, steps + 1), [float(base(t)) for t in range(steps)], where="post",
                lw=3, alpha=0.4, color="0.4", label="base (cpt)")
        fwd_steps, fwd = realized.realized_steps(train)
        errors = sum((r.get("grad_bits_per_step", []) for r in train), [])
        ax.step(fwd_steps, fwd, where="post", lw=1, label="forward bits")
        ax.step(fwd_steps, errors, where="post", lw=1, ls="--", label="error bits")
        ax.set_ylabel(f"bits, seed {row['seed']}")
        twin = ax.twinx()
        twin.plot([r["step"] for r in train], [r.get("grad_norm", float("nan")) for r in train],
                  color="tab:red", lw=0.8, alpha=0.7)
        twin.set_ylabel("grad norm", color="tab:red")
    axes[0, 0].legend(fontsize=7, loc="upper right")
    axes[-1, 0].set_xlabel("step")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_outputs(workdir: str, rows, summary, header: str) -> None:
    """adaptive.csv, adaptive.md, adaptive.png, adaptive_bits.png."""
    su.write_csv(os.path.join(workdir, "adaptive.csv"), rows, CSV_COLUMNS)
    keys = ("arm", "metric_pm", "minus_static_8", "minus_cpt", "minus_cpt_never_fires",
            "minus_line", "minus_line_never", "metric_fp32_pm", "relative_cost_static8_mean",
            "mean_bits_mean", "extra_bits_mean")
    heads = ("arm", "test perplexity", "minus static_8, same seed", "minus cpt, same seed",
             "minus cpt_never_fires, same seed", "minus the cpt-static_8 line at its cost",
             "minus the cpt_never_fires-static_8 line",
             "perplexity, fp32 eval", "cost vs static 8/8", "mean bits",
             "bits added (sum over steps)")
    lines = ["# Precision that answers the training", "", header, "",
             su.markdown_table(summary, keys, heads), ""]
    with open(os.path.join(workdir, "adaptive.md"), "w") as f:
        f.write("\n".join(lines))
    plot(summary, os.path.join(workdir, "adaptive.png"))
    plot_realized(rows, os.path.join(workdir, "adaptive_bits.png"))


def main(argv: Sequence[str]) -> None:
    from absl import flags

    f = flags.FLAGS
    del argv
    os.makedirs(f.workdir, exist_ok=True)
    su.enable_compile_cache(f.compile_cache, f.workdir)
    arms = su.parse_str_list(f.arms)
    knobs = {"low": f.low_bits, "grad_bits": f.grad_bits, "ratio": f.ratio, "boost": f.boost,
             "error_boost": f.error_boost, "hold": f.hold, "fraction": f.fraction}
    for arm in arms:
        arm_overrides(arm, **knobs)  # ValueError for an unknown arm before any training
    seeds = su.parse_int_list(f.seeds, "seeds")
    base = su.load_config(CONFIG)
    overrides = {**su.study_overrides(base), "num_steps": int(f.steps),
                 "log_every": int(f.log_every), "eval_every": 0,
                 "optimizer.learning_rate": float(f.learning_rate)}
    if f.data_root:
        overrides["data_dir"] = os.path.join(f.data_root, "tinyshakespeare")
    base = su.with_overrides(base, overrides)
    rows = run_arms(base, f.workdir, arms, seeds, knobs, progress=f.progress)
    header = (f"tiny-shakespeare Transformer, {f.steps} steps, lr {f.learning_rate}, seeds "
              f"{list(seeds)}; low bits {f.low_bits}, errors {f.grad_bits} bits (static_8: "
              f"8/8); on_instability ratio {f.ratio}, boost {f.boost} (errors "
              f"{f.error_boost}), hold {f.hold}; final phase {f.fraction} at 8/8. "
              f"Perplexity at the eval bits (the arm's max bits), mean +- sample std over "
              f"seeds; paired differences by seed.")
    write_outputs(f.workdir, rows, summarize(rows), header)
    su.log_line(open(os.path.join(f.workdir, "adaptive.md")).read())


def define_flags() -> None:
    from absl import flags

    flags.DEFINE_string("workdir", None, "Directory for runs, tables and figures.")
    flags.DEFINE_string("seeds", "0,1,2", "Comma-separated seeds.")
    flags.DEFINE_string("arms", ",".join(ARMS), "Arms to run.")
    flags.DEFINE_integer("steps", 120, "Training steps.")
    flags.DEFINE_integer("log_every", 5, "Steps between train records.")
    flags.DEFINE_float("learning_rate", 2e-3, "AdamW peak learning rate.")
    flags.DEFINE_integer("low_bits", 3, "The low forward bits (static_low, cpt's minimum).")
    flags.DEFINE_integer("grad_bits", 4, "Error bits of every arm but static_8 (8).")
    flags.DEFINE_float("ratio", 2.0, "on_instability: gradient-norm spike ratio.")
    flags.DEFINE_integer("boost", 2, "on_instability: forward bits added.")
    flags.DEFINE_integer("error_boost", 4, "on_instability: error bits added.")
    flags.DEFINE_integer("hold", 10, "on_instability: boosted steps.")
    flags.DEFINE_float("fraction", 0.25, "final_phase: the last fraction at 8 bits.")
    flags.DEFINE_string("data_root", "../shared/datasets",
                        "Folder holding tinyshakespeare/ ('': TFDS download).")
    flags.DEFINE_string("compile_cache", "auto", "JAX compilation cache ('auto', 'none', dir).")
    flags.DEFINE_bool("progress", False, "Progress bar per run.")
    flags.mark_flags_as_required(["workdir"])


if __name__ == "__main__":
    from absl import app

    define_flags()
    app.run(main, argv=sys.argv)
