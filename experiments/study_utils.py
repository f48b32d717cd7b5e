"""Shared helpers of the study scripts (schedule suite, critical period, range test,
allocation): configs and overrides, resumable runs, aggregation over seeds, tables,
correlations and the Pareto front.

Every study trains through `cpt_jax.runner.train_and_evaluate` in its own run
directory ``WORKDIR/runs/<name>_seed<k>/``. A run whose ``summary.json`` exists (and
was not interrupted) is loaded instead of trained again, so a study can be stopped
and restarted with the same command. The run's config is saved beside it as
``study_config.json``; a run directory holding a summary of a *different* config is
an error (use another ``--workdir``), never silently reused.
"""
from __future__ import annotations

import contextlib
import csv
import importlib.util
import json
import math
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

DEFAULT_CONFIG = os.path.join(os.path.dirname(__file__), "configs", "default.py")
LOWER_IS_BETTER = ("perplexity", "loss", "error", "bpc")


# --------------------------------------------------------------------------- parsing

def parse_int_list(text: str, name: str = "list") -> list[int]:
    """``"0,1,2"`` -> ``[0, 1, 2]``; ranges ``"2-8"`` or ``"2..8"`` are inclusive.

    Example:
      >>> parse_int_list("2..4,8")
      [2, 3, 4, 8]
    """
    out: list[int] = []
    if text is None or not str(text).strip():
        raise ValueError(f"--{name} must list at least one integer, got {text!r}")
    for part in str(text).split(","):
        part = part.strip()
        if not part:
            continue
        sep = ".." if ".." in part else ("-" if "-" in part[1:] else None)
        try:
            if sep:
                lo, hi = part.split(sep, 1) if sep == ".." else part.rsplit("-", 1)
                lo_i, hi_i = int(lo), int(hi)
                if hi_i < lo_i:
                    raise ValueError
                out.extend(range(lo_i, hi_i + 1))
            else:
                out.append(int(part))
        except ValueError:
            raise ValueError(f"--{name}: {part!r} is not an integer or a range a..b "
                             f"with a <= b (in {text!r})") from None
    if not out:
        raise ValueError(f"--{name} must list at least one integer, got {text!r}")
    return out


def parse_float_list(text: str, name: str = "list") -> list[float]:
    """``"0,0.5,1"`` -> ``[0.0, 0.5, 1.0]``."""
    try:
        values = [float(p) for p in str(text).split(",") if p.strip()]
    except ValueError:
        raise ValueError(f"--{name} must be comma-separated numbers, got {text!r}") from None
    if not values:
        raise ValueError(f"--{name} must list at least one number, got {text!r}")
    return values


def parse_str_list(text: str) -> list[str]:
    """``"a, b"`` -> ``["a", "b"]`` (empty string -> ``[]``)."""
    return [p.strip() for p in str(text or "").split(",") if p.strip()]


# --------------------------------------------------------------------------- configs

def load_config(path: str = DEFAULT_CONFIG):
    """``get_config()`` of the config file at `path` (as ``--config`` would load it)."""
    if not os.path.isfile(path):
        raise ValueError(f"config file {path!r} does not exist")
    spec = importlib.util.spec_from_file_location("_study_config", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module.get_config()


def with_overrides(config, overrides: Mapping[str, Any]):
    """A copy of `config` with dotted keys set (``{"precision.max_bits": 4}``)."""
    import ml_collections

    config = ml_collections.ConfigDict(config.to_dict())
    for key, value in overrides.items():
        node = config
        parts = key.split(".")
        for part in parts[:-1]:
            if part not in node:
                with node.ignore_type():
                    node[part] = ml_collections.ConfigDict()
            node = node[part]
        if isinstance(value, list):
            value = tuple(value)
        with node.ignore_type():
            node[parts[-1]] = value
    return config


def parse_set_flags(items: Sequence[str]) -> dict[str, Any]:
    """``["model_kwargs.features=(16, 32)", "num_steps=10"]`` -> dotted overrides.

    Values are Python literals (`ast.literal_eval`), else kept as strings. Unlike
    ``--config.x=...`` this can add keys a config does not have yet (e.g. entries
    of an empty ``model_kwargs``).

    Example:
      >>> parse_set_flags(["model_kwargs.hidden=(16,)", "model=mlp"])
      {'model_kwargs.hidden': (16,), 'model': 'mlp'}
    """
    import ast

    out: dict[str, Any] = {}
    for item in items or ():
        if "=" not in item:
            raise ValueError(f"--set expects key=value, got {item!r}")
        key, text = item.split("=", 1)
        try:
            value = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            value = text
        out[key.strip()] = value
    return out


def define_study_flags(default_seeds: str) -> None:
    """The flags every study shares: --config, --workdir (required), --seeds,
    --compile_cache, --progress and --set. Each study adds its own (--quick, ...)."""
    from absl import flags
    from ml_collections import config_flags

    config_flags.DEFINE_config_file("config", DEFAULT_CONFIG, "Config file.", lock_config=False)
    flags.DEFINE_string("workdir", None, "Directory for runs, tables and plots.")
    flags.DEFINE_string("seeds", default_seeds,
                        "Comma-separated seeds (--quick: 0 unless given).")
    flags.DEFINE_string("compile_cache", "auto",
                        "JAX persistent compilation cache dir ('auto': WORKDIR/jax_cache, "
                        "'none': off).")
    flags.DEFINE_bool("progress", False, "Progress bar per run.")
    flags.DEFINE_multi_string("set", [], "Config override key=value (Python literal), e.g. "
                              "--set='model_kwargs.features=(16,32,64)'; may add keys.")
    flags.mark_flags_as_required(["workdir"])


def config_and_seeds(f) -> tuple[Any, list[int]]:
    """The config with the --set overrides applied, and the seeds (--quick keeps the
    first one unless --seeds was given)."""
    config = with_overrides(f.config, parse_set_flags(f.set))
    seeds = parse_int_list(f.seeds, "seeds")
    if f.quick and not f["seeds"].present:
        seeds = seeds[:1]
    return config, seeds


def study_overrides(config) -> dict[str, Any]:
    """Settings every study run uses: no TensorBoard events and no per-run PNGs (the
    study draws its own plots from ``metrics.jsonl`` and ``summary.json``)."""
    del config
    return {"tensorboard": False, "plots": False}


def metric_info(summary: Mapping[str, Any]) -> tuple[str, float, bool]:
    """``(name, final test value, higher_is_better)`` of a run summary.

    Reads ``final_test_<metric>`` (or the first ``final_<split>_<metric>`` if the task
    has no test split).
    """
    name = str(summary.get("metric", "accuracy"))
    key = f"final_test_{name}"
    if key not in summary:
        keys = sorted(k for k in summary if k.startswith("final_") and k.endswith("_" + name))
        if not keys:
            raise ValueError(f"summary has no final_*_{name} entry: {sorted(summary)}")
        key = keys[0]
    return name, float(summary[key]), name not in LOWER_IS_BETTER


# --------------------------------------------------------------------------- runs

def run_dir(workdir: str, name: str, seed: int) -> str:
    """``WORKDIR/runs/<name>_seed<seed>``."""
    return os.path.join(workdir, "runs", f"{name}_seed{int(seed)}")


def _config_json(config) -> dict[str, Any]:
    return json.loads(config.to_json_best_effort(sort_keys=True))


def run_or_load(config, directory: str, *, progress: bool = False,
                patch: contextlib.AbstractContextManager | None = None,
                extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Train `config` in `directory`, or load its ``summary.json`` if already done.

    Resumable: a finished, not interrupted run with the same config is loaded; an
    unfinished one is trained again (resuming from its checkpoint if the runner saved
    one). A directory holding a run of a different config (a field present in both
    differs) raises ValueError. `extra` (settings outside the config, e.g. a
    learning-rate patch) is stored and compared with the config.
    `patch` is a context manager entered around the training. An interrupted training
    (Ctrl-C) re-raises KeyboardInterrupt so the whole study stops.
    """
    summary_path = os.path.join(directory, "summary.json")
    config_path = os.path.join(directory, "study_config.json")
    wanted = _config_json(config)
    if extra:
        wanted["_study"] = dict(extra)
    if os.path.isfile(config_path):
        with open(config_path) as f:
            stored = json.load(f)
        flat_s, flat_w = _flatten(stored), _flatten(wanted)
        # Fields present in both must agree (a field added to the configs since is fine).
        diff = sorted(k for k in set(flat_s) & set(flat_w) if flat_s[k] != flat_w[k])
        if diff:
            raise ValueError(
                f"{directory} holds a run of another config (differs in "
                f"{', '.join(diff[:6])}); use another --workdir or delete that directory")
    if os.path.isfile(summary_path):
        with open(summary_path) as f:
            summary = json.load(f)
        if not summary.get("interrupted", False):
            return summary
    # Not finished: train; the runner resumes from a checkpoint in `directory` if the
    # config saves them (``checkpoint_every``), else starts over.
    os.makedirs(directory, exist_ok=True)
    with open(config_path, "w") as f:
        json.dump(wanted, f, indent=1, sort_keys=True)
    from cpt_jax.runner.job import train_and_evaluate

    with (patch if patch is not None else contextlib.nullcontext()):
        summary = train_and_evaluate(config, directory, progress=progress)
    if summary.get("interrupted"):
        raise KeyboardInterrupt(f"run in {directory} was interrupted")
    return summary


def _flatten(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, Mapping):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def read_metrics(directory: str) -> tuple[list[dict], list[dict]]:
    """``(train_records, eval_records)`` of a run's ``metrics.jsonl``."""
    train, evals = [], []
    path = os.path.join(directory, "metrics.jsonl")
    if not os.path.isfile(path):
        return train, evals
    with open(path) as f:
        for line in f:
            rec = json.loads(line)
            if "eval" in rec:
                evals.append(rec["eval"])
            elif "final" not in rec:
                train.append(rec)
    return train, evals


@contextlib.contextmanager
def lr_held_constant(hold_steps: int) -> Iterator[None]:
    """Inside the block, the runner's lr schedule is: constant base lr for `hold_steps`
    steps, then the config's schedule over the remaining ``total - hold_steps`` steps.

    ``lr(t) = lr_0`` for ``t < H``; ``lr(t) = schedule_{T-H}(t - H)`` after, with
    ``schedule_{T-H}`` the config's ``optimizer.lr_schedule`` built for a run of
    ``T - H`` steps (step decay at 50%/75% of the post-deficit budget). Used by the
    critical-period study so every deficit gets the same post-deficit schedule.
    (Implemented by wrapping ``builders.learning_rate_from_config``, which
    ``optimizer_from_config`` calls, for the duration.)
    """
    import optax

    from cpt_jax.runner import builders

    hold = int(hold_steps)
    original = builders.learning_rate_from_config
    if hold <= 0:
        yield
        return

    def held(o, total_steps: int):
        after = original(o, max(1, int(total_steps) - hold))
        return optax.join_schedules([optax.constant_schedule(float(o.learning_rate)), after],
                                    [hold])

    builders.learning_rate_from_config = held
    try:
        yield
    finally:
        builders.learning_rate_from_config = original


def enable_compile_cache(directory: str | None, workdir: str = "") -> None:
    """Use JAX's persistent compilation cache in `directory` (seeds share compiles).

    ``"auto"``: ``WORKDIR/jax_cache``; ``""`` or ``"none"``: off. Runs that differ
    only in their seed compile to the same program, so every seed after the first
    skips compilation (a large share of a short CPU run).
    """
    if not directory or directory == "none":
        return
    if directory == "auto":
        if not workdir:
            return
        directory = os.path.join(workdir, "jax_cache")
    import jax

    os.makedirs(directory, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", directory)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


def config_ops(config) -> list:
    """The `OpRecord`s of the quantized model `config` trains (shapes only, no compute).

    Same model, rules and sample inputs as `train_and_evaluate`, so per-op MACs,
    accumulation lengths and reuse are the ones the runner's cost accounting uses.
    """
    import jax

    from cpt_jax import cost as cost_lib
    from cpt_jax.doors import quantize_model
    from cpt_jax.runner import job as runner
    from cpt_jax.runner.tasks import build_task

    task = build_task(config)
    p = config.precision
    qmodel = quantize_model(task.model, rules=runner.rules_from_config(p),
                            config=runner.quant_config_from_config(p),
                            provider=runner.provider_from_config(p))
    kwargs = {"train": False, **task.apply_kwargs}
    variables = jax.eval_shape(lambda k: qmodel.init(k, task.sample_inputs, **kwargs),
                               jax.random.key(0))
    return cost_lib.count_ops(qmodel, variables, task.sample_inputs, **kwargs)


# --------------------------------------------------------------------------- statistics

def mean_std(values: Iterable[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (``ddof=1``; 0 for a single value)."""
    v = np.asarray(list(values), np.float64)
    if v.size == 0:
        return float("nan"), float("nan")
    return float(v.mean()), float(v.std(ddof=1)) if v.size > 1 else 0.0


def correlation_undefined(x: Sequence[float], y: Sequence[float],
                          names: tuple[str, str] = ("x", "y")) -> str | None:
    """Why the correlation of `x` and `y` (called `names`) is undefined, or None.

    Example:
      >>> correlation_undefined([1, 2], [3, 4]), correlation_undefined([1, 2, 3], [5, 5, 5])
      ('only 2 points, at least 3 needed', 'y is constant')
      >>> correlation_undefined([1, 2, 3], [3, 1, 2]) is None
      True
    """
    x = np.asarray(x, np.float64)
    y = np.asarray(y, np.float64)
    if x.size < 3:
        return f"only {x.size} point{'s' if x.size != 1 else ''}, at least 3 needed"
    constant = [name for name, v in zip(names, (x, y)) if np.ptp(v) == 0]
    if constant:
        return " and ".join(constant) + (" are" if len(constant) == 2 else " is") + " constant"
    return None


def rho_text(x: Sequence[float], y: Sequence[float],
             names: tuple[str, str] = ("x", "y")) -> str:
    """Spearman's rho of `x` and `y` as ``+0.12``, or ``undefined (why)``: never ``nan``.

    Example:
      >>> rho_text([1, 2, 3], [1, 3, 2]), rho_text([1, 2, 3], [4, 4, 4], ("depth", "reuse"))
      ('+0.50', 'undefined (reuse is constant)')
    """
    why = correlation_undefined(x, y, names)
    return f"undefined ({why})" if why else f"{correlations(x, y)['spearman_rho']:+.2f}"


def correlations(x: Sequence[float], y: Sequence[float]) -> dict[str, Any]:
    """Pearson r and Spearman rho of `x` and `y` with their two-sided p-values.

    ``r = cov(x, y) / (std x std y)``; rho is r of the ranks (ties averaged).
    NaN where fewer than 3 points or a constant input, with the reason in
    ``"undefined"`` (None when defined; `correlation_undefined`).
    """
    why = correlation_undefined(x, y)
    x = np.asarray(x, np.float64)
    y = np.asarray(y, np.float64)
    out = {"n": int(x.size), "pearson_r": float("nan"), "pearson_p": float("nan"),
           "spearman_rho": float("nan"), "spearman_p": float("nan"), "undefined": why}
    if why:
        return out
    from scipy import stats

    r, p = stats.pearsonr(x, y)
    rho, p_s = stats.spearmanr(x, y)
    out.update(pearson_r=float(r), pearson_p=float(p), spearman_rho=float(rho),
               spearman_p=float(p_s))
    return out


def pareto_front(costs: Sequence[float], metrics: Sequence[float],
                 higher_is_better: bool = True) -> list[bool]:
    """Which points are Pareto-optimal: no other point is at most as costly and at
    least as good, and strictly better in one of the two.

    Example:
      >>> pareto_front([1, 2, 3], [0.5, 0.4, 0.9])
      [True, False, True]
    """
    c = np.asarray(costs, np.float64)
    m = np.asarray(metrics, np.float64) * (1.0 if higher_is_better else -1.0)
    front = []
    for i in range(c.size):
        dominated = np.any((c <= c[i]) & (m >= m[i]) & ((c < c[i]) | (m > m[i])))
        front.append(not bool(dominated) and bool(np.isfinite(m[i])))
    return front


# --------------------------------------------------------------------------- tables

def _fmt(value: Any, digits: int = 4) -> str:
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, (float, np.floating)):
        if not math.isfinite(value):
            return "nan"
        return f"{value:.{digits}f}"
    return str(value)


def write_csv(path: str, rows: Sequence[Mapping[str, Any]], columns: Sequence[str]) -> None:
    """Rows as CSV with the given columns (floats at full precision)."""
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(columns)
        for row in rows:
            writer.writerow([repr(float(row[c])) if isinstance(row.get(c), (float, np.floating))
                             else row.get(c, "") for c in columns])


def read_csv(path: str) -> list[dict[str, str]]:
    """Rows of a CSV as dicts of strings."""
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def markdown_table(rows: Sequence[Mapping[str, Any]], columns: Sequence[str],
                   headers: Sequence[str] | None = None, digits: int = 4) -> str:
    """A GitHub markdown table of `rows` (floats with `digits` decimals)."""
    headers = list(headers or columns)
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    for row in rows:
        lines.append("| " + " | ".join(_fmt(row.get(c, ""), digits) for c in columns) + " |")
    return "\n".join(lines)


def pm(mean: float, std: float, digits: int = 4, n: int | None = None) -> str:
    """``"mean +- std"``; over `n` < 2 values the mean alone, ``"mean (n=1)"``: the
    sample std of one value is undefined, and ``+- 0.0000`` would claim no spread.

    Example:
      >>> pm(0.5, 0.01), pm(0.5, 0.0, n=1), pm(*mean_std([0.25]), n=1)
      ('0.5000 +- 0.0100', '0.5000 (n=1)', '0.2500 (n=1)')
    """
    if n is not None and n < 2:
        return f"{_fmt(mean, digits)} (n={n})"
    return f"{_fmt(mean, digits)} +- {_fmt(std, digits)}"


def pm_of(values: Iterable[float], digits: int = 4) -> str:
    """`pm` of the mean and sample std of `values` (the mean alone for one value)."""
    v = list(values)
    return pm(*mean_std(v), digits=digits, n=len(v))


def describe_correlation(c: Mapping[str, float], what: str) -> str:
    """One markdown line stating Pearson/Spearman of a correlation dict (or why they
    are undefined)."""
    if c.get("undefined"):
        return f"- {what}: undefined ({c['undefined']}), n = {c['n']}"
    return (f"- {what}: Pearson r = {_fmt(c['pearson_r'], 3)} (p = {_fmt(c['pearson_p'], 3)}), "
            f"Spearman rho = {_fmt(c['spearman_rho'], 3)} (p = {_fmt(c['spearman_p'], 3)}), "
            f"n = {c['n']}")


def matplotlib_pyplot():
    """``matplotlib.pyplot`` on the Agg backend."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def annotate_points(ax, points, labels, fontsize: int = 7) -> None:
    """Label each (x, y) point, moving a label to another side of its point when it
    would overlap a label already placed (greedy, in display space)."""
    fig = ax.figure
    offsets = [(4, 3), (4, -10), (-4, 3), (-4, -10), (4, 12), (-4, 12), (4, -19), (-4, -19),
               (4, 21), (-4, 21), (4, -28), (-4, -28)]
    placed = []
    renderer = None
    for (x, y), text in zip(points, labels):
        for dx, dy in offsets:
            ann = ax.annotate(text, (x, y), xytext=(dx, dy), textcoords="offset points",
                              fontsize=fontsize, ha="left" if dx > 0 else "right")
            if renderer is None:
                fig.canvas.draw()
                renderer = fig.canvas.get_renderer()
            box = ann.get_window_extent(renderer)
            if not any(box.overlaps(other) for other in placed):
                placed.append(box)
                break
            ann.remove()
        else:  # every side is taken: keep the first
            ann = ax.annotate(text, (x, y), xytext=offsets[0], textcoords="offset points",
                              fontsize=fontsize)
            placed.append(ann.get_window_extent(renderer))


def log_line(text: str) -> None:
    """Print a progress line (flushed; studies run for a while)."""
    print(text, flush=True)
