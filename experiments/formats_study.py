"""Hardware number formats under cyclic precision: static MX/NVFP4, cyclic MX, format schedules.

    python -m experiments.formats_study --workdir=/tmp/formats --quick
    python -m experiments.formats_study --workdir=/tmp/formats --seeds=0,1,2 \
        --tasks=shakespeare,digits --shakespeare_steps=200 --digits_steps=600
    python -m experiments.formats_study --workdir=/tmp/per_token --tasks=shakespeare \
        --seeds=0,1,2 --shakespeare_steps=120 --formats=fp32,symmetric_b4,\
symmetric_per_token_b4,symmetric_b8,symmetric_per_token_b8
    python -m experiments.formats_study --workdir=/tmp/format_schedules --quick \
        --tasks=shakespeare --seeds=0,1,2 --formats=fp32,mxfp8_gemm,mxfp4_gemm,nvfp4_gemm,\
cpt_formats,cpt_mx_formats,nvfp4_then_mxfp8

Runs, on each task (the tiny-shakespeare Transformer, `configs/shakespeare_transformer.py`;
scikit-learn digits with the small CNN, `configs/default.py`):

* ``fp32``: full precision;
* static ``mxfp8``, ``mxfp6``, ``mxfp4``, ``nvfp4`` (`cpt_jax.quant_config.PRESETS`;
  weights, activations and errors in the format, blocks along the contraction);
* cyclic ``mx_int`` (MX("int") at the traced width, cos_growth 4..8) and
  ``mx_float`` (MX("float"): e2m1 / e2m3 / e4m3 elements as the width cycles
  4 <-> 8), errors at 8 bits; each compiles once for the whole run;
* static real-GEMM presets ``mxfp8_gemm``, ``mxfp4_gemm``, ``nvfp4_gemm`` (all three
  GEMMs on codes, `cpt_jax.providers.lowp_gemm`; on CPU the numbers of a GPU's GEMMs);
* any preset at a static width, ``PRESET_b<bits>`` (e.g. ``symmetric_b4`` against
  ``symmetric_per_token_b4``: activations per tensor or per token, weights per
  channel, errors at 8 bits);
* schedules over formats (``config.precision.formats``, `cpt_jax.format_schedules`;
  each step the widest format whose element width <= the schedule's bits):
  ``cpt_formats`` (cos_growth 4..8 over nvfp4_gemm / mxfp6_gemm / mxfp8_gemm),
  ``cpt_mx_formats`` (the same over mxfp4_gemm / mxfp6_gemm / mxfp8_gemm) and
  ``nvfp4_then_mxfp8`` (NVFP4 for the first 75% of the steps, then MXFP8: the NVFP4
  pretraining recipes' last phase in higher precision). Evaluated, as CPT evaluates,
  at the schedule's max bits (MXFP8); each paired with static ``mxfp8_gemm`` too.

Every run trains through `cpt_jax.runner.train_and_evaluate` (the recipe is patched
in for the run's duration, `quantizer_preset`); the cost is recomputed with the
format's stored bits including block scales (`cpt_jax.cost.run_cost(...,
config=...)`: MXFP8 is 8.25 bits per element) and reported relative to static
8/8-bit integer BitOps. Writes to WORKDIR: ``formats.csv`` (task, format,
schedule, seed, metric, relative_cost_static8), ``formats.md`` (mean +- sample std
over seeds) and ``formats.png`` (metric versus cost per task). Resumable.
"""
from __future__ import annotations

import contextlib
import functools
import os
import re
import sys
from collections.abc import Iterator, Sequence
from typing import Any

from experiments import study_utils as su

CONFIG_DIR = os.path.join(os.path.dirname(__file__), "configs")
TASK_CONFIGS = {"shakespeare": os.path.join(CONFIG_DIR, "shakespeare_transformer.py"),
                "digits": os.path.join(CONFIG_DIR, "default.py")}
STATIC_FORMATS = ("mxfp8", "mxfp6", "mxfp4", "nvfp4")
GEMM_FORMATS = ("mxfp8_gemm", "mxfp6_gemm", "mxfp4_gemm", "nvfp4_gemm")
CYCLIC_FORMATS = ("mx_int", "mx_float")
FORMAT_SCHEDULES = {
    "cpt_formats": ("nvfp4_gemm,mxfp6_gemm,mxfp8_gemm", "cos_growth"),
    "cpt_mx_formats": ("mxfp4_gemm,mxfp6_gemm,mxfp8_gemm", "cos_growth"),
    "nvfp4_then_mxfp8": ("nvfp4_gemm,mxfp8_gemm", "critical_period"),
}
"""Schedules over formats: ``(config.precision.formats, config.precision.schedule)``."""
ALL_FORMATS = ("fp32",) + STATIC_FORMATS + CYCLIC_FORMATS
CYCLIC_BITS = (4, 8)
GRAD_BITS = 8
LAST_PHASE = 0.25  # nvfp4_then_mxfp8: the last quarter of the steps in MXFP8
QUICK_STEPS = {"shakespeare": 120, "digits": 300}
CSV_COLUMNS = ("task", "format", "schedule", "seed", "metric", "relative_cost_static8",
               "format_steps")


@contextlib.contextmanager
def quantizer_preset(name: str) -> Iterator[None]:
    """Inside the block the runner quantizes every layer with ``PRESETS[name]``.

    (Wraps ``quant_config_from_config`` wherever the runner looks it up:
    `cpt_jax.runner.run`, `cpt_jax.runner.outputs` and ``runner.job``, which
    `study_utils.config_ops` reads; as `study_utils.lr_held_constant` wraps the
    learning rate; the config keeps its own ``quantizer`` field.)
    """
    from cpt_jax.quant_config import get_preset
    from cpt_jax.runner import job, outputs, run

    config = get_preset(name)
    modules = (run, outputs, job)
    originals = [module.quant_config_from_config for module in modules]
    for module in modules:
        module.quant_config_from_config = lambda p: config
    try:
        yield
    finally:
        for module, original in zip(modules, originals):
            module.quant_config_from_config = original


def schedule_plan(fmt: str, num_steps: int) -> dict[str, Any]:
    """The plan of a schedule over formats (`FORMAT_SCHEDULES`) for a run of `num_steps`.

    Example:
      >>> schedule_plan("nvfp4_then_mxfp8", 120)["overrides"]["precision.deficit_steps"]
      90
    """
    formats, schedule = FORMAT_SCHEDULES[fmt]
    lo, hi = CYCLIC_BITS
    overrides = {"precision.schedule": schedule, "precision.min_bits": lo,
                 "precision.max_bits": hi, "precision.grad_bits": GRAD_BITS,
                 "precision.eval_bits": 0, "precision.formats": formats}
    label = f"cos_growth {lo}-{hi} over {formats}"
    if schedule == "critical_period":
        deficit = int(round(num_steps * (1 - LAST_PHASE)))
        overrides["precision.deficit_steps"] = deficit
        label = f"{formats.split(',')[0]} for {deficit} steps, then {formats.split(',')[-1]}"
    return {"format": fmt, "schedule": label, "overrides": overrides}


def preset_at_width(fmt: str) -> tuple[str, int] | None:
    """``("symmetric_per_token", 4)`` for ``"symmetric_per_token_b4"``: any preset at a
    static width (weights and activations at ``bits``, errors at `GRAD_BITS`), else None.

    Example:
      >>> preset_at_width("symmetric_b8"), preset_at_width("mxfp8")
      (('symmetric', 8), None)
    """
    from cpt_jax.quant_config import PRESETS

    match = re.fullmatch(r"(?P<preset>.+)_b(?P<bits>\d+)", fmt)
    if match is None or match["preset"] not in PRESETS:
        return None
    return match["preset"], int(match["bits"])


def preset_name(fmt: str) -> str:
    """The `PRESETS` entry a format's runs use (``fp32`` runs keep ``cpt``'s, unused)."""
    at_width = preset_at_width(fmt)
    return at_width[0] if at_width else ("cpt" if fmt == "fp32" else fmt)


def format_plan(fmt: str, num_steps: int = 0) -> dict[str, Any]:
    """``{"format", "schedule", "overrides"}`` of one format's runs (`num_steps`: the
    run's length, for the schedules over formats).

    Example:
      >>> format_plan("mx_int")["schedule"]
      'cos_growth 4-8'
    """
    if fmt == "fp32":
        return {"format": fmt, "schedule": "none", "overrides": {"precision.schedule": "none"}}
    if fmt in FORMAT_SCHEDULES:
        return schedule_plan(fmt, num_steps)
    if (at_width := preset_at_width(fmt)) is not None:
        bits = at_width[1]
        return {"format": fmt, "schedule": f"static {bits}",
                "overrides": {"precision.schedule": "constant", "precision.max_bits": bits,
                              "precision.min_bits": bits, "precision.grad_bits": GRAD_BITS,
                              "precision.eval_bits": 0}}
    if fmt in STATIC_FORMATS + GEMM_FORMATS:
        return {"format": fmt, "schedule": "static 8",
                "overrides": {"precision.schedule": "constant", "precision.max_bits": 8,
                              "precision.min_bits": 8, "precision.grad_bits": GRAD_BITS,
                              "precision.eval_bits": 0}}
    if fmt in CYCLIC_FORMATS:
        lo, hi = CYCLIC_BITS
        return {"format": fmt, "schedule": f"cos_growth {lo}-{hi}",
                "overrides": {"precision.schedule": "cos_growth", "precision.min_bits": lo,
                              "precision.max_bits": hi, "precision.grad_bits": GRAD_BITS,
                              "precision.eval_bits": 0}}
    known = ALL_FORMATS + GEMM_FORMATS + tuple(FORMAT_SCHEDULES)
    raise ValueError(f"--formats: {fmt!r} is not one of {known} nor PRESET_b<bits> "
                     f"(e.g. symmetric_per_token_b4)")


def format_cost(config, fmt: str, ops) -> float:
    """BitOps of the run relative to static 8/8 integer bits, stored bits incl. scales.

    ``sum_t sum_ops MACs (b_w b_a + b_g (b_w + b_a)) / (T sum_ops MACs 3 * 8^2)``
    with each ``b`` the format's `bits_per_element` (fp32 layers count 32).
    """
    from cpt_jax import cost as cost_lib
    from cpt_jax.quant_config import get_preset
    from cpt_jax.runner import job as runner

    steps = int(config.num_steps)
    if fmt == "fp32":
        return cost_lib.fp32_bitops_per_step(ops) / float(cost_lib.bitops_per_step(ops, 8.0, 8.0))
    p = config.precision
    schedule = runner.precision_schedule_from_config(p, steps)
    grad = runner.grad_schedule_from_config(p)
    recipe = (runner.quant_config_from_config(p) if fmt in FORMAT_SCHEDULES
              else get_preset(preset_name(fmt)))
    return float(cost_lib.run_cost(schedule, grad, steps, ops,
                                   config=recipe)["relative_cost_static8"])


def steps_per_format(config, fmt: str) -> str:
    """``"nvfp4_gemm 60 / mxfp6_gemm 30 / mxfp8_gemm 30"`` for a schedule over formats
    (each step's format, `cpt_jax.format_schedules.format_steps`), else ``""``."""
    from cpt_jax.format_schedules import format_steps
    from cpt_jax.runner import job as runner

    if fmt not in FORMAT_SCHEDULES:
        return ""
    steps = int(config.num_steps)
    p = config.precision
    counts = format_steps(runner.quant_config_from_config(p),
                          runner.precision_schedule_from_config(p, steps), steps)
    return " / ".join(f"{name} {n}" for name, n in counts.items())


def run_task(task: str, base, workdir: str, formats: Sequence[str], seeds: Sequence[int],
             progress: bool = False) -> list[dict[str, Any]]:
    """Train (or load) every (format, seed) run of one task; one row per run."""
    rows = []
    for fmt in formats:
        plan = format_plan(fmt, int(base.num_steps))
        cfg0 = su.with_overrides(base, plan["overrides"])
        patch = (contextlib.nullcontext if fmt in FORMAT_SCHEDULES
                 else functools.partial(quantizer_preset, preset_name(fmt)))
        with patch():
            ops = su.config_ops(cfg0)
        cost = format_cost(cfg0, fmt, ops)
        for seed in seeds:
            cfg = su.with_overrides(cfg0, {"seed": int(seed)})
            directory = su.run_dir(workdir, f"{task}_{fmt}", seed)
            su.log_line(f"[formats] {task} {fmt} seed {seed} ({cfg.num_steps} steps)")
            summary = su.run_or_load(cfg, directory, progress=progress, patch=patch(),
                                     extra={"format": fmt})
            metric, value, higher = su.metric_info(summary)
            rows.append({"task": task, "format": fmt, "schedule": plan["schedule"],
                         "seed": int(seed), "metric": value, "metric_name": metric,
                         "higher_is_better": higher, "relative_cost_static8": cost,
                         "format_steps": steps_per_format(cfg, fmt),
                         "num_compiles": summary.get("num_compiles")})
    return rows


def paired_deltas(rows: Sequence[dict[str, Any]], task: str, fmt: str,
                  reference: str = "fp32") -> list[float]:
    """``metric(fmt, seed) - metric(reference, seed)`` for the seeds both ran (same
    init, same batches)."""
    ref = {r["seed"]: r["metric"] for r in rows if (r["task"], r["format"]) == (task, reference)}
    return [r["metric"] - ref[r["seed"]] for r in rows
            if (r["task"], r["format"]) == (task, fmt) and r["seed"] in ref]


def summarize(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (task, format): metric mean +- sample std over seeds, the paired
    difference to fp32 (mean +- std over seeds), cost."""
    out = []
    keys = list(dict.fromkeys((r["task"], r["format"]) for r in rows))
    for task, fmt in keys:
        mine = [r for r in rows if (r["task"], r["format"]) == (task, fmt)]
        mean, std = su.mean_std(r["metric"] for r in mine)
        deltas = paired_deltas(rows, task, fmt)
        d_mean, d_std = su.mean_std(deltas)
        vs_mxfp8 = paired_deltas(rows, task, fmt, "mxfp8_gemm")
        out.append({"task": task, "format": fmt, "schedule": mine[0]["schedule"],
                    "metric_name": mine[0]["metric_name"], "metric_mean": mean,
                    "delta_fp32_pm": su.pm(d_mean, d_std, n=len(deltas)) if deltas else "",
                    "delta_mxfp8_gemm_pm": su.pm_of(vs_mxfp8) if vs_mxfp8 else "",
                    "format_steps": mine[0].get("format_steps", ""),
                    "metric_std": std, "metric_pm": su.pm(mean, std, n=len(mine)),
                    "num_seeds": len(mine),
                    "relative_cost_static8": mine[0]["relative_cost_static8"],
                    "higher_is_better": mine[0]["higher_is_better"]})
    return out


def plot(summary: Sequence[dict[str, Any]], path: str) -> None:
    """Metric (mean +- std) versus cost relative to static 8/8, one panel per task."""
    plt = su.matplotlib_pyplot()
    tasks = list(dict.fromkeys(r["task"] for r in summary))
    fig, axes = plt.subplots(1, len(tasks), figsize=(5.5 * len(tasks), 4.2), squeeze=False)
    for ax, task in zip(axes[0], tasks):
        mine = [r for r in summary if r["task"] == task]
        for r in mine:
            marker = ("s" if r["format"] in CYCLIC_FORMATS + tuple(FORMAT_SCHEDULES)
                      else ("*" if r["format"] == "fp32" else "o"))
            ax.errorbar(r["relative_cost_static8"], r["metric_mean"], yerr=r["metric_std"],
                        fmt=marker, capsize=3)
        su.annotate_points(ax, [(r["relative_cost_static8"], r["metric_mean"]) for r in mine],
                           [r["format"] for r in mine])
        ax.set_xscale("log")
        ax.set_xlabel("BitOps relative to static 8/8 (stored bits incl. scales)")
        better = "higher" if mine[0]["higher_is_better"] else "lower"
        ax.set_ylabel(f"test {mine[0]['metric_name']} ({better} is better)")
        ax.set_title(task)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_outputs(workdir: str, rows, summary, steps: dict[str, int], seeds) -> None:
    """formats.csv (one row per run), formats.md (per format) and formats.png."""
    su.write_csv(os.path.join(workdir, "formats.csv"), rows, CSV_COLUMNS)
    lines = ["# Hardware formats under cyclic precision", "",
             f"Seeds {list(seeds)}; steps {steps}. Metric: final test metric, mean +- "
             "sample std over seeds. Cost: BitOps relative to static 8/8-bit, each tensor "
             "counted at its stored bits including block scales (MXFP8 8.25, NVFP4 4.5).",
             ""]
    for task in dict.fromkeys(r["task"] for r in summary):
        mine = [r for r in summary if r["task"] == task]
        keys = ["format", "schedule", "metric_pm", "delta_fp32_pm", "relative_cost_static8"]
        heads = ["format", "schedule", f"test {mine[0]['metric_name']}",
                 "minus fp32, same seed", "cost vs static 8/8"]
        if any(r["delta_mxfp8_gemm_pm"] for r in mine):
            keys[4:4], heads[4:4] = ["delta_mxfp8_gemm_pm"], ["minus mxfp8_gemm, same seed"]
        if any(r["format_steps"] for r in mine):
            keys.append("format_steps")
            heads.append("steps per format")
        lines += [f"## {task}", "", su.markdown_table(mine, tuple(keys), tuple(heads)), ""]
    with open(os.path.join(workdir, "formats.md"), "w") as f:
        f.write("\n".join(lines))
    plot(summary, os.path.join(workdir, "formats.png"))


def main(argv: Sequence[str]) -> None:
    from absl import flags

    f = flags.FLAGS
    del argv
    os.makedirs(f.workdir, exist_ok=True)
    su.enable_compile_cache(f.compile_cache, f.workdir)
    tasks = su.parse_str_list(f.tasks)
    formats = su.parse_str_list(f.formats)
    for fmt in formats:
        format_plan(fmt, 100)  # ValueError for an unknown format before any training
    seeds = su.parse_int_list(f.seeds, "seeds")
    steps = {"shakespeare": f.shakespeare_steps, "digits": f.digits_steps}
    if f.quick:
        steps = {t: (steps[t] if f[f"{t}_steps"].present else QUICK_STEPS[t]) for t in steps}
    rows = []
    for task in tasks:
        if task not in TASK_CONFIGS:
            raise ValueError(f"--tasks: {task!r} is not one of {sorted(TASK_CONFIGS)}")
        base = su.load_config(TASK_CONFIGS[task])
        overrides = {**su.study_overrides(base), "num_steps": int(steps[task])}
        if f.data_root:
            folder = {"shakespeare": "tinyshakespeare"}.get(task)
            if folder:
                overrides["data_dir"] = os.path.join(f.data_root, folder)
        base = su.with_overrides(base, overrides)
        rows += run_task(task, base, f.workdir, formats, seeds, progress=f.progress)
    summary = summarize(rows)
    write_outputs(f.workdir, rows, summary, {t: steps[t] for t in tasks}, seeds)
    su.log_line(open(os.path.join(f.workdir, "formats.md")).read())


def define_flags() -> None:
    from absl import flags

    flags.DEFINE_string("workdir", None, "Directory for runs, tables and the figure.")
    flags.DEFINE_string("seeds", "0,1,2", "Comma-separated seeds.")
    flags.DEFINE_string("tasks", "shakespeare,digits", "Tasks: shakespeare, digits.")
    flags.DEFINE_string("formats", ",".join(ALL_FORMATS), "Formats to run.")
    flags.DEFINE_integer("shakespeare_steps", 200, "Training steps on tiny-shakespeare.")
    flags.DEFINE_integer("digits_steps", 1500, "Training steps on digits.")
    flags.DEFINE_bool("quick", False, f"Short runs: {QUICK_STEPS} steps unless given.")
    flags.DEFINE_string("data_root", "../shared/datasets",
                        "Folder holding tinyshakespeare/ ('' : TFDS download).")
    flags.DEFINE_string("compile_cache", "auto", "JAX compilation cache ('auto', 'none', dir).")
    flags.DEFINE_bool("progress", False, "Progress bar per run.")
    flags.mark_flags_as_required(["workdir"])


if __name__ == "__main__":
    from absl import app

    define_flags()
    app.run(main, argv=sys.argv)
