"""Critical learning periods of low precision (Wolfe & Kyrillidis 2024, after
Achille et al.): a precision deficit early in training, then a full budget.

    python -m experiments.critical_period --workdir=/tmp/cp --quick
    python -m experiments.critical_period --workdir=/tmp/cp --budget=800 \
        --deficits=0,100,200,400,800 --low_bits=2 --seeds=0,1,2

For each deficit ``D`` the forward bits are held at ``low_bits`` for ``D`` steps,
then at ``high_bits`` for ``budget`` steps (schedule ``critical_period``,
``num_steps = D + budget``; backward bits stay at the config's ``grad_bits``).

Defaults follow the paper's scripts per dataset (`paper_defaults`; Wolfe &
Kyrillidis' ``run_crit_learn*.py``): low bits 3 (CIFAR, graphs), 4 (ImageNet), 5
(PTB), 3 elsewhere, high bits 8; the deficit covers ``t <= D`` (``D + 1`` steps) on
CIFAR, as its ``crit_learn.py``, and ``t < D`` elsewhere (``--deficit_rule``). The
learning rate (``--lr_mode``):

* ``hold`` (default): the base learning rate, constant, during the deficit; then
  the config's schedule (e.g. step decay at 50% and 75%) over the ``budget`` steps
  after it, so every run gets the same post-deficit training, as in the paper
  ("train normally for a fixed budget after the deficit");
* ``whole``: the config's schedule over all ``D + budget`` steps (the deficit also
  eats into the high-lr phase).

Writes ``critical_period.csv`` / ``.md`` (``deficit_steps, metric_mean, metric_std,
...``), ``critical_period_runs.csv``, ``critical_period.png`` (final metric versus
D, mean +- std over seeds) and ``curves.png`` (test metric during training).

Claim tested: the longer the early deficit, the lower the final metric, even with
the full budget after it.
"""
from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence
from typing import Any

from experiments import study_utils as su

PAPER_DEFAULTS = (  # (dataset prefixes, low_bits, inclusive): the paper's scripts
    (("cifar",), 3, True),                        # cpt_cifar: '3 8', crit_learn.py t <= D
    (("imagenet", "imagenette"), 4, False),       # cpt_imagenet: '4 8', t < D
    (("cora", "citeseer", "pubmed", "arxiv", "ogbn"), 3, False),   # cpt_gnn: '3 8', t < D
    (("ptb",), 5, False),                         # cpt_ptb: '5 8', t < D
)
DEFICIT_RULES = ("paper", "lt", "le")
QUICK_BUDGET = 300
QUICK_DEFICIT_FRACTIONS = (0.0, 0.5, 1.0)
DEFICIT_FRACTIONS = (0.0, 0.125, 0.25, 0.5, 1.0)
LR_MODES = ("hold", "whole")
COLUMNS = ("deficit_steps", "metric", "metric_mean", "metric_std", "num_seeds", "total_steps",
           "low_bits", "high_bits", "relative_cost_fp32", "mean_bits", "train_metric_at_switch",
           "control_mean", "control_std", "effect_mean", "effect_std")


def paper_defaults(dataset: str) -> tuple:
    """``(low_bits, inclusive)`` of the paper's critical-period scripts for `dataset`
    (`PAPER_DEFAULTS`; ``(3, False)`` for a dataset they do not cover).

    Example:
      >>> paper_defaults("cifar10"), paper_defaults("imagenet2012"), paper_defaults("digits")
      ((3, True), (4, False), (3, False))
    """
    for prefixes, low_bits, inclusive in PAPER_DEFAULTS:
        if str(dataset).lower().startswith(prefixes):
            return low_bits, inclusive
    return 3, False


def deficit_config(config, deficit: int, budget: int, low_bits: int, high_bits: int,
                   seed: int, inclusive: bool = False):
    """The config of one run: ``critical_period`` schedule, ``num_steps = D + budget``;
    `inclusive`: low bits while ``t <= D`` (``precision.deficit_inclusive``)."""
    if deficit < 0:
        raise ValueError(f"deficit_steps must be >= 0, got {deficit}")
    if budget < 1:
        raise ValueError(f"budget must be >= 1 step, got {budget}")
    if not 1 <= low_bits <= high_bits:
        raise ValueError(f"need 1 <= low_bits <= high_bits, got low_bits={low_bits}, "
                         f"high_bits={high_bits}")
    return su.with_overrides(config, {
        **su.study_overrides(config),
        "num_steps": int(deficit + budget), "seed": int(seed),
        "log_every": max(1, min(int(config.get("log_every", 50)), int(budget) // 40)),
        "precision.schedule": "critical_period", "precision.deficit_steps": int(deficit),
        "precision.deficit_inclusive": bool(inclusive and deficit > 0),
        "precision.min_bits": int(low_bits), "precision.max_bits": int(high_bits),
        "precision.eval_bits": 0,
    })


def _train(config, workdir: str, name: str, deficit: int, seed: int, lr_mode: str,
           progress: bool) -> dict[str, Any]:
    directory = su.run_dir(workdir, name, seed)
    su.log_line(f"[critical] {name} seed {seed} ({config.num_steps} steps, lr {lr_mode}) "
                f"-> {directory}")
    patch = su.lr_held_constant(int(deficit)) if lr_mode == "hold" else None
    summary = su.run_or_load(config, directory, progress=progress, patch=patch,
                             extra={"lr_mode": lr_mode})
    metric, value, higher = su.metric_info(summary)
    train, _ = su.read_metrics(directory)
    at_switch = [r.get("accuracy", r["loss"]) for r in train if r["step"] <= int(deficit)]
    return {"deficit_steps": int(deficit), "seed": int(seed), "metric": metric,
            "value": value, "higher_is_better": higher,
            "relative_cost_fp32": float(summary["relative_cost_fp32"]),
            "mean_bits": float(summary["mean_bits"]), "total_steps": int(config.num_steps),
            "train_metric_at_switch": float(at_switch[-1]) if at_switch else float("nan"),
            "directory": directory}


def run_critical_period(config, workdir: str, *, deficits: Sequence[int], budget: int,
                        low_bits: int, high_bits: int, seeds: Sequence[int],
                        lr_mode: str = "hold", control: bool = False,
                        progress: bool = False, inclusive: bool = False) -> dict[str, Any]:
    """Train (or load) every (deficit, seed) run and write the table and plots.

    `inclusive`: the deficit covers ``t <= D`` (``D + 1`` low steps; CPT's CIFAR
    ``crit_learn.py``) instead of ``t < D``; ``D = 0`` stays deficit-free.

    `control`: also train, for each D > 0, the same ``D + budget`` steps and lr plan
    at `high_bits` throughout (no deficit), so the deficit's effect is separated from
    the extra steps: ``effect = metric(deficit) - metric(control)``, paired by seed.
    """
    if lr_mode not in LR_MODES:
        raise ValueError(f"lr_mode={lr_mode!r} is unknown; choose one of {LR_MODES}")
    os.makedirs(workdir, exist_ok=True)
    runs, controls = [], []
    for d in deficits:
        for seed in seeds:
            cfg = deficit_config(config, int(d), budget, low_bits, high_bits, seed, inclusive)
            runs.append(_train(cfg, workdir, f"deficit{int(d)}", int(d), seed, lr_mode,
                               progress))
            if control and int(d) > 0:
                cfg = deficit_config(config, int(d), budget, high_bits, high_bits, seed)
                controls.append(_train(cfg, workdir, f"control{int(d)}", int(d), seed,
                                       lr_mode, progress))
            elif control:
                controls.append(runs[-1])
    rows = []
    for d in deficits:
        mine = [r for r in runs if r["deficit_steps"] == int(d)]
        mean, std = su.mean_std(r["value"] for r in mine)
        row = {"deficit_steps": int(d), "metric": mine[0]["metric"], "metric_mean": mean,
               "metric_std": std, "num_seeds": len(mine),
               "total_steps": mine[0]["total_steps"], "low_bits": int(low_bits),
               "high_bits": int(high_bits),
               "relative_cost_fp32": mine[0]["relative_cost_fp32"],
               "mean_bits": mine[0]["mean_bits"],
               "train_metric_at_switch": su.mean_std(
                   r["train_metric_at_switch"] for r in mine)[0],
               "control_mean": float("nan"), "control_std": float("nan"),
               "effect_mean": float("nan"), "effect_std": float("nan")}
        ctrl = {r["seed"]: r["value"] for r in controls if r["deficit_steps"] == int(d)}
        if ctrl:
            effects = [r["value"] - ctrl[r["seed"]] for r in mine if r["seed"] in ctrl]
            row["control_mean"], row["control_std"] = su.mean_std(ctrl.values())
            row["effect_mean"], row["effect_std"] = su.mean_std(effects)
            row["control_n"], row["effect_n"] = len(ctrl), len(effects)
        rows.append(row)
    corr = {"runs": su.correlations([r["deficit_steps"] for r in runs], [r["value"] for r in runs]),
            "means": su.correlations([r["deficit_steps"] for r in rows],
                                     [r["metric_mean"] for r in rows])}
    if controls:
        effects = [r["value"] - c["value"] for r in runs for c in controls
                   if c["seed"] == r["seed"] and c["deficit_steps"] == r["deficit_steps"]]
        corr["effect_runs"] = su.correlations(
            [r["deficit_steps"] for r in runs for c in controls
             if c["seed"] == r["seed"] and c["deficit_steps"] == r["deficit_steps"]], effects)
    write_outputs(workdir, config, rows, runs, corr, budget=budget, lr_mode=lr_mode,
                  controls=controls, inclusive=inclusive)
    return {"rows": rows, "runs": runs, "controls": controls, "correlation": corr}


def write_outputs(workdir: str, config, rows, runs, corr, *, budget: int, lr_mode: str,
                  controls=(), inclusive: bool = False) -> None:
    """critical_period.csv/.md, critical_period_runs.csv and the plots."""
    su.write_csv(os.path.join(workdir, "critical_period.csv"), rows, COLUMNS)
    su.write_csv(os.path.join(workdir, "critical_period_runs.csv"), runs,
                 ("deficit_steps", "seed", "metric", "value", "relative_cost_fp32",
                  "mean_bits", "total_steps", "train_metric_at_switch"))
    with open(os.path.join(workdir, "critical_period_correlation.json"), "w") as f:
        json.dump(corr, f, indent=1)
    metric = rows[0]["metric"]
    base = rows[0]
    table = [{**r, "metric_pm": su.pm(r["metric_mean"], r["metric_std"], n=r["num_seeds"]),
              "delta": r["metric_mean"] - base["metric_mean"],
              "control_pm": su.pm(r["control_mean"], r["control_std"], n=r.get("control_n")),
              "effect_pm": su.pm(r["effect_mean"], r["effect_std"], n=r.get("effect_n"))}
             for r in rows]
    cols = ["deficit_steps", "total_steps", "metric_pm", "delta"]
    heads = ["deficit D", "total steps", f"test {metric}", "delta vs first D"]
    if controls:
        cols += ["control_pm", "effect_pm"]
        heads += [f"control: {rows[0]['high_bits']} bits throughout", "deficit effect (paired)"]
    cols += ["train_metric_at_switch", "relative_cost_fp32"]
    heads += ["train metric at end of deficit", "cost vs fp32"]
    md = [f"# Critical learning period: {config.dataset} / {config.model}", "",
          f"Forward bits {rows[0]['low_bits']} while "
          f"{'t <= D (D + 1 steps)' if inclusive else 't < D (D steps)'}, then "
          f"{rows[0]['high_bits']} for "
          f"{budget} steps; backward bits {config.precision.grad_bits}; lr mode `{lr_mode}`; "
          f"seeds {sorted({r['seed'] for r in runs})}. Final test {metric}, mean +- sample "
          f"std over seeds; delta against D = {base['deficit_steps']}."
          + (" Control: the same D + budget steps and lr plan at "
             f"{rows[0]['high_bits']} bits throughout; deficit effect = deficit run - "
             "control, per seed." if controls else ""), "",
          su.markdown_table(table, cols, heads),
          "", "Correlation of the final metric with D:",
          su.describe_correlation(corr["runs"], "every run"),
          su.describe_correlation(corr["means"], "per-D means")]
    if "effect_runs" in corr:
        md.append(su.describe_correlation(corr["effect_runs"],
                                          "deficit effect (run - control) with D"))
    md.append("")
    with open(os.path.join(workdir, "critical_period.md"), "w") as f:
        f.write("\n".join(md))
    try:
        plot(rows, runs, os.path.join(workdir, "critical_period.png"), controls=controls,
             title=f"{config.dataset} / {config.model}: {rows[0]['low_bits']}-bit deficit, "
                   f"then {rows[0]['high_bits']}-bit for {budget} steps")
        plot_curves(runs, os.path.join(workdir, "curves.png"), metric)
    except Exception as exc:  # plots never lose the tables
        su.log_line(f"[critical] plotting failed: {exc}")


def plot(rows, runs, path: str, title: str = "", controls=()) -> None:
    """Final metric versus deficit length (mean +- std, and each seed); with
    controls, the no-deficit runs of the same length too."""
    plt = su.matplotlib_pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    ax.scatter([r["deficit_steps"] for r in runs], [r["value"] for r in runs], s=12,
               color="tab:gray", alpha=0.6, label="each seed")
    ax.errorbar([r["deficit_steps"] for r in rows], [r["metric_mean"] for r in rows],
                yerr=[r["metric_std"] for r in rows], fmt="o-", capsize=3,
                label=f"{rows[0]['low_bits']}-bit deficit, mean +- std")
    if controls:
        ax.errorbar([r["deficit_steps"] for r in rows], [r["control_mean"] for r in rows],
                    yerr=[r["control_std"] for r in rows], fmt="s--", capsize=3,
                    color="tab:green", label=f"control ({rows[0]['high_bits']} bits throughout)")
    ax.set_xlabel("deficit D (steps at low precision before the budget)")
    ax.set_ylabel(f"final test {rows[0]['metric']}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    if title:
        ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_curves(runs, path: str, metric: str) -> None:
    """Training accuracy (or loss) against the step after the deficit, one line per D
    (first seed), so the runs line up on the post-deficit budget."""
    plt = su.matplotlib_pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    first_seed = min(r["seed"] for r in runs)
    for r in runs:
        if r["seed"] != first_seed:
            continue
        train, _ = su.read_metrics(r["directory"])
        if not train:
            continue
        key = "accuracy" if "accuracy" in train[0] else "loss"
        ax.plot([t["step"] - r["deficit_steps"] for t in train], [t[key] for t in train],
                lw=1, label=f"D={r['deficit_steps']}")
        ax.set_ylabel(f"training {key} (one batch)")
    ax.axvline(0, color="k", lw=0.8, ls=":")
    ax.set_xlabel("step - D (0: end of the deficit)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# --------------------------------------------------------------------------- CLI

def define_flags() -> None:
    """Flags of the command line (defined only when run as a script)."""
    from absl import flags

    su.define_study_flags(default_seeds="0,1,2")
    flags.DEFINE_bool("quick", False, f"Minutes-long CPU run: budget {QUICK_BUDGET}, D in "
                                      f"{QUICK_DEFICIT_FRACTIONS} x budget, one seed.")
    flags.DEFINE_integer("budget", 0, "Steps at high_bits after the deficit (0: config's "
                                      f"num_steps; --quick: {QUICK_BUDGET}).")
    flags.DEFINE_integer("steps", 0, "Alias of --budget.")
    flags.DEFINE_string("deficits", "", "Deficit lengths D in steps (default: "
                                        f"{DEFICIT_FRACTIONS} x budget).")
    flags.DEFINE_integer("low_bits", 0, "Forward bits during the deficit (0: the paper's "
                                        "for the dataset, see paper_defaults).")
    flags.DEFINE_enum("deficit_rule", "paper", list(DEFICIT_RULES),
                      "Low bits while t < D (lt), t <= D (le: CPT's CIFAR crit_learn.py), or "
                      "the paper's rule for the dataset (paper).")
    flags.DEFINE_integer("high_bits", 0, "Forward bits after it (0: config's max_bits).")
    flags.DEFINE_enum("lr_mode", "hold", list(LR_MODES), "Learning-rate plan (see docstring).")
    flags.DEFINE_bool("control", False, "Also train each D's length at high_bits throughout "
                                        "(separates the deficit from the extra steps).")


def main(argv) -> None:
    from absl import flags

    if len(argv) > 1:
        raise SystemExit(f"unexpected arguments: {argv[1:]}")
    f = flags.FLAGS
    config, seeds = su.config_and_seeds(f)
    budget = f.budget or f.steps or (QUICK_BUDGET if f.quick else int(config.num_steps))
    if f.deficits:
        deficits = su.parse_int_list(f.deficits, "deficits")
    else:
        fractions = QUICK_DEFICIT_FRACTIONS if f.quick else DEFICIT_FRACTIONS
        deficits = [int(round(x * budget)) for x in fractions]
    high = f.high_bits or int(config.precision.max_bits)
    paper_low, paper_inclusive = paper_defaults(config.dataset)
    inclusive = paper_inclusive if f.deficit_rule == "paper" else f.deficit_rule == "le"
    su.enable_compile_cache(f.compile_cache, f.workdir)
    try:
        run_critical_period(config, f.workdir, deficits=deficits, budget=budget,
                            low_bits=f.low_bits or paper_low, high_bits=high, seeds=seeds,
                            lr_mode=f.lr_mode, control=f.control, progress=f.progress,
                            inclusive=inclusive)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    with open(os.path.join(f.workdir, "critical_period.md")) as fh:
        print(fh.read())


if __name__ == "__main__":
    from absl import app

    define_flags()
    app.run(main)
