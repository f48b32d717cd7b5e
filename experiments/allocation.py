"""Per-layer bit allocation at equal BitOps (Shen, Lai, Zhang 2024, seed 003):
accumulation length, element reuse and depth as guides for which layers get bits.

    python -m experiments.allocation --workdir=/tmp/alloc --quick
    python -m experiments.allocation --workdir=/tmp/alloc --seeds=0,1,2 --steps=800 \
        --config.precision.schedule=constant --config.precision.max_bits=4 --spread=3

For each policy of `cpt_jax.allocation` (``--policies``) the per-layer forward-bit
offsets are solved at the uniform allocation's training BitOps (over the run's
own schedule, so any schedule combines: the offsets are added to its bits) and the
model is trained with them (``config.precision.bit_offsets``). ``random`` draws a
new order per seed. The runner's own cost accounting is checked against the
allocation's predicted cost.

Writes ``allocation.csv`` / ``.md`` (``policy, metric_mean, metric_std,
relative_cost_fp32, cost_error, offsets``), ``allocation_runs.csv``,
``factors.csv`` (each layer's accumulation, reuse, depth), ``allocation.png``
(metric per policy, and the offsets per layer).

Claim tested: more accumulation and less reuse tolerate fewer bits (so
``neg_accumulation`` beats ``pos_accumulation`` and ``pos_reuse`` beats
``neg_reuse``); depth does not matter much (``pos_depth`` close to ``neg_depth``).
Contrasts are paired by seed (mean +- std of the per-seed difference).
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
DEFAULT_POLICIES = ("uniform", "random", "recommended", "pos_accumulation", "neg_accumulation",
                    "pos_reuse", "neg_reuse", "pos_depth", "neg_depth")
QUICK_POLICIES = ("uniform", "neg_accumulation", "pos_accumulation", "pos_reuse", "neg_reuse")
COLUMNS = ("policy", "metric", "metric_mean", "metric_std", "num_seeds", "relative_cost_fp32",
           "cost_error", "offsets")
CONTRASTS = (("accumulation: fewer bits where K is long", "neg_accumulation", "pos_accumulation"),
             ("reuse: fewer bits where reuse is low", "pos_reuse", "neg_reuse"),
             ("depth: more bits deeper", "pos_depth", "neg_depth"),
             ("recommended vs uniform", "recommended", "uniform"))


def run_values(config):
    """``(bits, grad_bits)`` per step of the config's schedules (grad None: fp32)."""
    from cpt_jax import schedules as sched_lib
    from cpt_jax.runner import job as runner

    p = config.precision
    T = int(config.num_steps)
    fwd = runner.precision_schedule_from_config(p, T)
    if fwd is None:
        raise ValueError("allocation needs a quantized schedule, got "
                         f"config.precision.schedule={p.schedule!r}")
    grad = runner.grad_schedule_from_config(p)
    return (sched_lib.schedule_values(fwd, T),
            None if grad is None else sched_lib.schedule_values(grad, T))


def run_allocation(config, workdir: str, *, policies: Sequence[str], seeds: Sequence[int],
                   spread: float = 2.0, min_layer_bits: int = 2,
                   progress: bool = False) -> dict[str, Any]:
    """Solve, train (or load) and tabulate every (policy, seed)."""
    from cpt_jax import allocation as pol

    for name in policies:
        if name not in pol.POLICIES:
            raise ValueError(f"--policies: {name!r} is unknown; choose from {pol.POLICIES}")
    os.makedirs(workdir, exist_ok=True)
    base = su.with_overrides(config, su.study_overrides(config))
    ops = su.config_ops(base)
    factors = pol.layer_factors(ops)
    bits, grads = run_values(base)
    runs = []
    for name in policies:
        for seed in seeds:
            alloc = pol.allocate(ops, name, bits=bits, grad_bits=grads, spread=spread,
                                 min_bits=min_layer_bits, seed=int(seed))
            cfg = su.with_overrides(base, {"seed": int(seed),
                                           "precision.bit_offsets": alloc.bit_offsets()})
            directory = su.run_dir(workdir, name, seed)
            su.log_line(f"[allocation] {name} seed {seed} offsets "
                        f"{[o for _, o in alloc.offsets]} (cost error {alloc.cost_error:+.3%}) "
                        f"-> {directory}")
            summary = su.run_or_load(cfg, directory, progress=progress)
            if not np.isclose(summary["relative_cost_fp32"], alloc.relative_cost_fp32,
                              rtol=1e-5, atol=1e-9):
                raise RuntimeError(
                    f"{name}: runner cost {summary['relative_cost_fp32']} != allocation cost "
                    f"{alloc.relative_cost_fp32}: the rules did not reach the ops")
            metric, value, higher = su.metric_info(summary)
            runs.append({"policy": name, "seed": int(seed), "metric": metric, "value": value,
                         "higher_is_better": higher,
                         "relative_cost_fp32": float(summary["relative_cost_fp32"]),
                         "cost_error": alloc.cost_error,
                         "offsets": " ".join(f"{n}:{o:+d}" for n, o in alloc.offsets)})
    rows = []
    for name in policies:
        mine = [r for r in runs if r["policy"] == name]
        mean, std = su.mean_std(r["value"] for r in mine)
        offsets = sorted({r["offsets"] for r in mine})
        rows.append({"policy": name, "metric": mine[0]["metric"], "metric_mean": mean,
                     "metric_std": std, "num_seeds": len(mine),
                     "relative_cost_fp32": float(np.mean([r["relative_cost_fp32"] for r in mine])),
                     "cost_error": float(np.mean([r["cost_error"] for r in mine])),
                     "offsets": offsets[0] if len(offsets) == 1 else "per seed"})
    contrasts = paired_contrasts(runs)
    write_outputs(workdir, base, rows, runs, factors, contrasts, spread=spread)
    return {"rows": rows, "runs": runs, "factors": factors, "contrasts": contrasts}


def paired_contrasts(runs: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """For each claim's policy pair (a, b) present: mean +- std over seeds of
    ``metric(a) - metric(b)`` (paired by seed; positive = a is better for accuracy)."""
    out = []
    for label, a, b in CONTRASTS:
        va = {r["seed"]: r["value"] for r in runs if r["policy"] == a}
        vb = {r["seed"]: r["value"] for r in runs if r["policy"] == b}
        seeds = sorted(set(va) & set(vb))
        if not seeds:
            continue
        diffs = [va[s] - vb[s] for s in seeds]
        mean, std = su.mean_std(diffs)
        out.append({"contrast": label, "a": a, "b": b, "diff_mean": mean, "diff_std": std,
                    "num_seeds": len(seeds), "a_wins": sum(d > 0 for d in diffs)})
    return out


def write_outputs(workdir: str, config, rows, runs, factors, contrasts, *, spread: float) -> None:
    """allocation.csv/.md, allocation_runs.csv, factors.csv and the plot."""
    from cpt_jax import allocation as pol

    su.write_csv(os.path.join(workdir, "allocation.csv"), rows, COLUMNS)
    su.write_csv(os.path.join(workdir, "allocation_runs.csv"), runs,
                 ("policy", "seed", "metric", "value", "relative_cost_fp32", "cost_error",
                  "offsets"))
    ftable = pol.factor_table(factors)
    fcols = ("name", "index", "depth", "accumulation", "weight_reuse", "activation_reuse",
             "reuse", "macs")
    su.write_csv(os.path.join(workdir, "factors.csv"), ftable, fcols)
    with open(os.path.join(workdir, "contrasts.json"), "w") as f:
        json.dump(contrasts, f, indent=1)
    p = config.precision
    metric = rows[0]["metric"]
    logk = [np.log(f.accumulation) for f in factors]
    logr = [np.log(f.reuse) for f in factors]
    depth = [f.depth for f in factors]
    fc = {"accumulation~depth": su.rho_text(logk, depth, ("accumulation", "depth")),
          "reuse~depth": su.rho_text(logr, depth, ("reuse", "depth")),
          "accumulation~reuse": su.rho_text(logk, logr, ("accumulation", "reuse"))}
    table = [{**r, "metric_pm": su.pm(r["metric_mean"], r["metric_std"], n=r["num_seeds"]),
              "cost_error": f"{r['cost_error']:+.2%}"} for r in rows]
    md = [f"# Per-layer bit allocation at equal BitOps: {config.dataset} / {config.model}", "",
          f"Schedule `{p.schedule}` ({p.min_bits}-{p.max_bits} forward, {p.grad_bits} backward), "
          f"{config.num_steps} steps, offset spread {spread}, seeds "
          f"{sorted({r['seed'] for r in runs})}. Final test {metric}, mean +- sample std. "
          f"`cost_error`: the allocation's BitOps relative to uniform's, minus 1.", "",
          su.markdown_table(table, ("policy", "metric_pm", "relative_cost_fp32", "cost_error",
                                    "offsets"),
                            ("policy", f"test {metric}", "cost vs fp32", "cost error",
                             "offsets (layer:bits)")),
          "", "Paired contrasts (metric(a) - metric(b), per seed):", "",
          (su.markdown_table([{**c, "diff": su.pm(c["diff_mean"], c["diff_std"], n=c["num_seeds"]),
                               "wins": f"{c['a_wins']}/{c['num_seeds']}"} for c in contrasts],
                             ("contrast", "a", "b", "diff", "wins"),
                             ("claim", "a", "b", "a - b", "seeds a > b"))
           if contrasts else "(no policy pair of a claim was run)"),
          "", "Layer factors (forward order):", "",
          su.markdown_table(ftable, fcols, digits=3), "",
          "Spearman correlation of the factors across layers (they are confounded in a "
          "plain network): " + ", ".join(f"{k} {v}" for k, v in fc.items()), ""]
    with open(os.path.join(workdir, "allocation.md"), "w") as f:
        f.write("\n".join(md))
    try:
        plot(rows, factors, os.path.join(workdir, "allocation.png"),
             title=f"{config.dataset} / {config.model}, {p.schedule} {p.max_bits} bits, "
                   f"equal BitOps")
    except Exception as exc:  # plots never lose the tables
        su.log_line(f"[allocation] plotting failed: {exc}")


def plot(rows, factors, path: str, title: str = "") -> None:
    """Left: final metric per policy (mean +- std). Right: offsets per layer."""
    plt = su.matplotlib_pyplot()
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4.2),
                                  gridspec_kw={"width_ratios": [1.2, 1]})
    names = [r["policy"] for r in rows]
    ax.bar(range(len(rows)), [r["metric_mean"] for r in rows],
           yerr=[r["metric_std"] for r in rows], capsize=3,
           color=["tab:gray" if n in ("uniform", "random") else "tab:blue" for n in names])
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels(names, rotation=45, ha="right", fontsize=8)
    lo = min(r["metric_mean"] - r["metric_std"] for r in rows)
    hi = max(r["metric_mean"] + r["metric_std"] for r in rows)
    pad = max(1e-3, 0.15 * (hi - lo))
    ax.set_ylim(lo - pad, hi + pad)
    ax.set_ylabel(f"final test {rows[0]['metric']}")
    ax.grid(axis="y", alpha=0.3)
    layer_names = [f.name for f in factors]
    grid = np.zeros((len(rows), len(layer_names)))
    for i, r in enumerate(rows):
        if r["offsets"] == "per seed":
            grid[i, :] = np.nan
            continue
        d = dict(item.rsplit(":", 1) for item in r["offsets"].split())
        grid[i, :] = [int(d[n]) for n in layer_names]
    vmax = max(1.0, np.nanmax(np.abs(grid)) if np.isfinite(grid).any() else 1.0)
    im = ax2.imshow(grid, cmap="coolwarm", vmin=-vmax, vmax=vmax, aspect="auto")
    ax2.set_yticks(range(len(rows)))
    ax2.set_yticklabels(names, fontsize=8)
    ax2.set_xticks(range(len(layer_names)))
    ax2.set_xticklabels(layer_names, rotation=45, ha="right", fontsize=7)
    ax2.set_title("bit offset per layer (forward order)", fontsize=9)
    fig.colorbar(im, ax=ax2, fraction=0.04)
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
    flags.DEFINE_bool("quick", False, f"Minutes-long CPU run: {QUICK_STEPS} steps, policies "
                                      f"{QUICK_POLICIES}, one seed.")
    flags.DEFINE_integer("steps", 0, f"Training steps (0: the config's; --quick: {QUICK_STEPS}).")
    flags.DEFINE_string("policies", "", f"Policies (default {','.join(DEFAULT_POLICIES)}).")
    flags.DEFINE_float("spread", 2.0, "Target range of the offsets (bits).")
    flags.DEFINE_integer("min_layer_bits", 2, "No layer goes below this many bits.")
    flags.DEFINE_bool("quantize_all", False,
                      "Quantize every layer (clear precision.keep_full_precision).")


def main(argv) -> None:
    from absl import flags

    if len(argv) > 1:
        raise SystemExit(f"unexpected arguments: {argv[1:]}")
    f = flags.FLAGS
    config, seeds = su.config_and_seeds(f)
    steps = f.steps or (QUICK_STEPS if f.quick else 0)
    overrides: dict[str, Any] = {}
    if steps:
        overrides["num_steps"] = int(steps)
    if f.quantize_all:
        overrides["precision.keep_full_precision"] = ()
    config = su.with_overrides(config, overrides)
    policies = (su.parse_str_list(f.policies) if f.policies
                else list(QUICK_POLICIES if f.quick else DEFAULT_POLICIES))
    su.enable_compile_cache(f.compile_cache, f.workdir)
    try:
        run_allocation(config, f.workdir, policies=policies, seeds=seeds, spread=f.spread,
                       min_layer_bits=f.min_layer_bits, progress=f.progress)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    with open(os.path.join(f.workdir, "allocation.md")) as fh:
        print(fh.read())


if __name__ == "__main__":
    from absl import app

    define_flags()
    app.run(main)
