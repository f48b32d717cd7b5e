"""The main job as a library function: `train_and_evaluate(config, workdir)`.

Reads an `ml_collections.ConfigDict` (see ``experiments/configs/``), builds the
task, the quantized model, the schedules and the optimizer, trains with one compiled
step for the whole run, and writes to `workdir`:

* ``metrics.jsonl``: one JSON object per logged step (step, bits, grad_bits, loss,
  accuracy, cumulative relative cost) and per evaluation;
* ``summary.json``: final test metric (at the eval bits and in full precision),
  ``relative_cost_fp32``, ``relative_cost_static8``, ``num_compiles``, ``steps``,
  ``wall_time_s`` and more;
* PNG plots (bits over steps; loss and accuracy curves) and TensorBoard events.

Ctrl-C ends the run cleanly: what was measured so far is evaluated and written.
"""
from __future__ import annotations

import json
import math
import os
import time
from typing import Any, Dict, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import logging

from cpt_jax import cost as cost_lib
from cpt_jax import parallel
from cpt_jax import schedules as sched_lib
from cpt_jax.config import CPT_CONFIG, INT8_CONFIG, QuantConfig, TensorQuant
from cpt_jax.formats import AffineInt, BlockFloat, SymmetricInt
from cpt_jax.tasks import Task, build_task
from cpt_jax.training import (TrainState, aggregate, create_train_state, make_eval_step,
                              make_train_step)
from cpt_jax.transform import quantize_model

FULL_PRECISION_SCHEDULES = ("none", "fp32", "full")
QUANTIZERS = ("cpt", "symmetric", "int8", "block_float")


# --------------------------------------------------------------------------- builders

def precision_schedule_from_config(p, total_steps: int) -> Optional[sched_lib.PrecisionSchedule]:
    """The forward schedule of ``config.precision`` (None for full precision).

    ``p.schedule``: a `SUITE` name, ``"constant"`` (at ``p.max_bits``),
    ``"critical_period"`` (``p.min_bits`` for ``p.deficit_steps``, then ``p.max_bits``)
    or ``"none"`` (full precision).
    """
    name = p.schedule
    if name in FULL_PRECISION_SCHEDULES:
        return None
    if name == "constant":
        return sched_lib.constant(p.max_bits)
    if name == "critical_period":
        return sched_lib.critical_period(p.min_bits, p.max_bits, p.get("deficit_steps", 0))
    if name in sched_lib.SUITE:
        return sched_lib.cyclic(name, min_bits=p.min_bits, max_bits=p.max_bits,
                                num_cycles=p.num_cycles, total_steps=total_steps)
    raise ValueError(
        f"config.precision.schedule={name!r} is unknown; choose one of "
        f"{list(sched_lib.SUITE) + ['constant', 'critical_period', 'none']}")


def grad_schedule_from_config(p) -> Optional[sched_lib.PrecisionSchedule]:
    """``constant(p.grad_bits)``, or None when ``grad_bits >= 32`` (fp32 errors)."""
    if p.schedule in FULL_PRECISION_SCHEDULES or p.grad_bits >= 32:
        return None
    return sched_lib.constant(p.grad_bits)


def quant_config_from_config(p) -> QuantConfig:
    """The default `QuantConfig` named by ``p.quantizer``."""
    name = p.get("quantizer", "cpt")
    if name == "cpt":
        return CPT_CONFIG
    if name == "symmetric":
        return QuantConfig(weight=TensorQuant(SymmetricInt(-1)), activation=TensorQuant(SymmetricInt()))
    if name == "int8":
        return INT8_CONFIG
    if name == "block_float":
        return QuantConfig(weight=TensorQuant(BlockFloat(), "stochastic"),
                           activation=TensorQuant(BlockFloat(), "stochastic"),
                           error=TensorQuant(BlockFloat(), "stochastic"))
    raise ValueError(f"config.precision.quantizer={name!r} is unknown; choose one of {QUANTIZERS}")


def rules_from_config(p) -> tuple:
    """Rules keeping the layers matched by ``p.keep_full_precision`` (regexes) in fp32,
    followed by any per-layer ``p.rules`` (``[(regex, bits_offset), ...]``)."""
    rules = [(pattern, None) for pattern in p.get("keep_full_precision", ("classifier",))]
    base = quant_config_from_config(p)
    for pattern, bits_offset in p.get("bit_offsets", ()) or ():
        rules.append((pattern, base.replace(bits_offset=float(bits_offset))))
    return tuple(rules)


def learning_rate_from_config(o, total_steps: int):
    """optax schedule: ``o.lr_schedule`` in step (÷10 at 50% and 75%, CPT), cosine, constant."""
    lr = float(o.learning_rate)
    kind = o.get("lr_schedule", "step")
    warmup = int(o.get("warmup_steps", 0))
    if kind == "constant":
        base = optax.constant_schedule(lr)
    elif kind == "cosine":
        base = optax.cosine_decay_schedule(lr, max(1, total_steps - warmup))
    elif kind == "step":
        base = optax.piecewise_constant_schedule(
            lr, {int(total_steps * 0.5): 0.1, int(total_steps * 0.75): 0.1})
    else:
        raise ValueError(
            f"config.optimizer.lr_schedule={kind!r} is unknown; choose step, cosine or constant")
    if warmup > 0:
        return optax.join_schedules([optax.linear_schedule(0.0, lr, warmup), base], [warmup])
    return base


def optimizer_from_config(o, total_steps: int) -> optax.GradientTransformation:
    """SGD (momentum, L2 weight decay as PyTorch), Adam or AdamW from ``config.optimizer``."""
    lr = learning_rate_from_config(o, total_steps)
    name = o.get("name", "sgd")
    wd = float(o.get("weight_decay", 0.0))
    if name == "sgd":
        parts = [optax.add_decayed_weights(wd)] if wd else []
        parts.append(optax.sgd(lr, momentum=float(o.get("momentum", 0.9)) or None,
                               nesterov=bool(o.get("nesterov", False))))
        tx = optax.chain(*parts)
    elif name == "adam":
        parts = [optax.add_decayed_weights(wd)] if wd else []
        parts.append(optax.adam(lr))
        tx = optax.chain(*parts)
    elif name == "adamw":
        tx = optax.adamw(lr, weight_decay=wd)
    else:
        raise ValueError(f"config.optimizer.name={name!r} is unknown; choose sgd, adam or adamw")
    clip = float(o.get("grad_clip", 0.0) or 0.0)
    if clip > 0:
        tx = optax.chain(optax.clip_by_global_norm(clip), tx)
    return tx


def eval_bits_from_config(p) -> float:
    """Bits used for the quantized evaluation: ``p.eval_bits`` or the schedule's max."""
    if p.schedule in FULL_PRECISION_SCHEDULES:
        return 32.0
    return float(p.get("eval_bits", 0) or p.max_bits)


# --------------------------------------------------------------------------- validation

def validate_config(config) -> None:
    """Check the fields the runner reads; ValueError names field, value and what is allowed."""
    def need_int(field, value, minimum):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
            raise ValueError(f"config.{field}={value!r} must be an integer >= {minimum}")

    need_int("num_steps", config.num_steps, 1)
    need_int("batch_size", config.batch_size, 1)
    need_int("seed", config.seed, 0)
    p = config.precision
    if p.schedule not in FULL_PRECISION_SCHEDULES:
        need_int("precision.min_bits", p.min_bits, 1)
        need_int("precision.max_bits", p.max_bits, 1)
        if p.min_bits > p.max_bits:
            raise ValueError(
                f"config.precision.min_bits={p.min_bits} must be <= precision.max_bits={p.max_bits}")
        need_int("precision.grad_bits", p.grad_bits, 1)
        if p.schedule in sched_lib.SUITE:
            need_int("precision.num_cycles", p.num_cycles, 1)
            if p.num_cycles > config.num_steps:
                raise ValueError(
                    f"config.precision.num_cycles={p.num_cycles} must be <= num_steps="
                    f"{config.num_steps} (each cycle needs at least one step)")
    precision_schedule_from_config(p, config.num_steps)
    quant_config_from_config(p)
    data_dir = config.get("data_dir", None)
    if data_dir and not os.path.isdir(os.path.expanduser(str(data_dir))):
        raise ValueError(f"config.data_dir={data_dir!r} is not a directory")


# --------------------------------------------------------------------------- helpers

class _JsonlWriter:
    def __init__(self, path: str):
        self._f = open(path, "a", buffering=1)

    def write(self, record: Dict[str, Any]) -> None:
        self._f.write(json.dumps(record) + "\n")

    def close(self) -> None:
        self._f.close()


def _evaluate(task: Task, eval_step, state: TrainState, bits: float) -> Dict[str, Dict[str, float]]:
    results = {}
    for split in task.eval_splits:
        sums = [eval_step(state, batch, jnp.float32(bits)) for batch in task.eval_batches(split)]
        results[split] = aggregate(jax.device_get(sums))
    return results


def _metric_of(task: Task, result: Dict[str, float]) -> float:
    return float(result.get(task.metric, float("nan")))


def _plot_run(workdir: str, history: list, evals: list, task: Task) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not history:
        return
    steps = [h["step"] for h in history]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.4))
    if "bits" in history[0]:
        axes[0].step(steps, [h["bits"] for h in history], where="post", label="forward bits")
        if "grad_bits" in history[0]:
            axes[0].step(steps, [h["grad_bits"] for h in history], where="post",
                         label="backward bits")
        axes[0].legend(fontsize=8)
    else:
        axes[0].text(0.5, 0.5, "full precision", ha="center", transform=axes[0].transAxes)
    axes[0].set_title("precision")
    axes[0].set_xlabel("step")
    axes[1].plot(steps, [h["loss"] for h in history])
    axes[1].set_yscale("log")
    axes[1].set_title("training loss")
    axes[1].set_xlabel("step")
    metric = task.metric
    if "accuracy" in history[0]:
        axes[2].plot(steps, [h["accuracy"] for h in history], label="train accuracy", alpha=0.6)
    test = [(e["step"], e[f"test_{metric}"]) for e in evals if f"test_{metric}" in e]
    if test:
        axes[2].plot(*zip(*test), "o-", label=f"test {metric}")
    axes[2].set_title(metric)
    axes[2].set_xlabel("step")
    axes[2].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(workdir, "curves.png"), dpi=110)
    plt.close(fig)


def params_sha256(params) -> str:
    """SHA-256 of the parameters' bytes (leaves in tree order): equal hashes, equal runs."""
    import hashlib

    h = hashlib.sha256()
    for leaf in jax.tree_util.tree_leaves(jax.device_get(params)):
        h.update(np.ascontiguousarray(leaf).tobytes())
    return h.hexdigest()


# --------------------------------------------------------------------------- main loop

def train_and_evaluate(config, workdir: str, *, progress: bool = True) -> Dict[str, Any]:
    """Train per `config`, write metrics, plots and ``summary.json`` to `workdir`.

    Returns the summary dict. See the module docstring for the outputs.
    """
    validate_config(config)
    os.makedirs(workdir, exist_ok=True)
    t_start = time.time()
    total_steps = int(config.num_steps)
    p = config.precision

    task = build_task(config)
    fwd_schedule = precision_schedule_from_config(p, total_steps)
    grad_schedule = grad_schedule_from_config(p)
    qmodel = quantize_model(task.model, rules=rules_from_config(p),
                            config=quant_config_from_config(p))
    optimizer = optimizer_from_config(config.optimizer, total_steps)
    rng = jax.random.key(int(config.seed))
    init_rng, data_rng = jax.random.split(rng)
    state = create_train_state(qmodel, optimizer, init_rng, task.sample_inputs,
                               **{"train": False, **task.apply_kwargs})
    ops = cost_lib.count_ops(qmodel, state.variables(), task.sample_inputs,
                             **{"train": False, **task.apply_kwargs})
    mesh = parallel.mesh_from_config(config)
    if mesh is not None:
        state = parallel.replicate(state, mesh)
    train_step = make_train_step(qmodel, optimizer, fwd_schedule, grad_schedule,
                                 loss_fn=task.loss_fn, nonfinite=config.get("nonfinite", "skip"),
                                 apply_kwargs=task.apply_kwargs)
    eval_step = make_eval_step(qmodel, loss_fn=task.loss_fn, apply_kwargs=task.apply_kwargs)
    eval_bits = eval_bits_from_config(p)

    # Per-step relative cost from the schedules (exact, host side, no device sync).
    if fwd_schedule is None:
        per_step_cost = np.ones(total_steps)
        run = {"relative_cost_fp32": 1.0,
               "relative_cost_static8": cost_lib.fp32_bitops_per_step(ops)
               / float(cost_lib.bitops_per_step(ops, 8.0, 8.0)),
               "mean_bits": 32.0, "mean_grad_bits": 32.0}
    else:
        bits_all = sched_lib.schedule_values(fwd_schedule, total_steps)
        grads_all = (None if grad_schedule is None
                     else sched_lib.schedule_values(grad_schedule, total_steps))
        cost_fn = jax.jit(jax.vmap(lambda b, g: cost_lib.relative_cost_per_step(ops, b, g)))
        per_step_cost = np.asarray(cost_fn(
            jnp.asarray(bits_all), jnp.asarray(grads_all if grads_all is not None
                                               else np.full(total_steps, 32.0, np.float32))),
            np.float64)
        run = cost_lib.run_cost(fwd_schedule, grad_schedule, total_steps, ops)
    cumulative_cost = np.cumsum(per_step_cost) / total_steps

    log_every = max(1, int(config.get("log_every", 50)))
    eval_every = int(config.get("eval_every", 0) or 0)
    metrics_writer = _JsonlWriter(os.path.join(workdir, "metrics.jsonl"))
    tb_writer = _make_tb_writer(workdir, config)
    history, evals = [], []
    interrupted = False
    pbar = _progress_bar(total_steps, progress)
    t_train = time.time()
    last_t, last_step = t_train, 0
    step = int(state.step)
    try:
        while step < total_steps:
            batch = task.train_batch(state.step, data_rng)
            if mesh is not None:
                batch = parallel.shard_batch(batch, mesh)
            state, metrics = train_step(state, batch)
            step += 1
            if step % log_every == 0 or step == total_steps:
                m = jax.device_get(metrics)
                now = time.time()
                rate = (step - last_step) / max(now - last_t, 1e-9)
                last_t, last_step = now, step
                record = {"step": step, "loss": float(m["loss"]),
                          "cumulative_relative_cost": float(cumulative_cost[step - 1])}
                if "accuracy" in m:
                    record["accuracy"] = float(m["accuracy"])
                for k in ("bits", "grad_bits"):
                    if k in m:
                        record[k] = float(m[k])
                record["skipped_steps"] = int(state.skipped_steps)
                history.append(record)
                metrics_writer.write(record)
                _tb_log(tb_writer, record, step)
                if not math.isfinite(record["loss"]) and config.get("nonfinite", "skip") == "stop":
                    raise FloatingPointError(
                        f"non-finite loss at step {step} (bits={record.get('bits')}, "
                        f"grad_bits={record.get('grad_bits')})")
                if pbar is not None:
                    pbar.set_postfix(bits=record.get("bits", 32), loss=f"{record['loss']:.3f}",
                                     it_s=f"{rate:.1f}")
                    pbar.update(step - pbar.n)
            if eval_every and step % eval_every == 0 and step < total_steps:
                res = _evaluate(task, eval_step, state, eval_bits)
                rec = {"step": step, "eval_bits": eval_bits}
                for split, r in res.items():
                    rec[f"{split}_{task.metric}"] = _metric_of(task, r)
                    rec[f"{split}_loss"] = r["loss"]
                evals.append(rec)
                metrics_writer.write({"eval": rec})
                _tb_log(tb_writer, rec, step)
    except KeyboardInterrupt:
        interrupted = True
        logging.warning("Interrupted at step %d: evaluating and writing what was measured.", step)
    finally:
        if pbar is not None:
            pbar.close()
    train_time = time.time() - t_train

    final = _evaluate(task, eval_step, state, eval_bits)
    final_fp = _evaluate(task, eval_step, state, 32.0)
    done_steps = int(state.step)
    summary: Dict[str, Any] = {
        "dataset": config.dataset, "model": config.model, "schedule": p.schedule,
        "min_bits": p.get("min_bits"), "max_bits": p.get("max_bits"),
        "grad_bits": p.get("grad_bits"), "num_cycles": p.get("num_cycles"),
        "seed": int(config.seed), "steps": done_steps, "num_steps": total_steps,
        "eval_bits": eval_bits, "metric": task.metric,
        "num_compiles": train_step.num_compiles,
        "wall_time_s": time.time() - t_start, "train_time_s": train_time,
        "steps_per_s": done_steps / max(train_time, 1e-9),
        "interrupted": interrupted,
        "skipped_steps": int(state.skipped_steps),
        "total_macs_per_example_batch": cost_lib.total_macs(ops),
        "num_quantized_ops": sum(op.quantized for op in ops),
        "num_full_precision_ops": sum(not op.quantized for op in ops),
    }
    if done_steps < total_steps and done_steps > 0:
        frac = float(np.sum(per_step_cost[:done_steps]) / done_steps)
        summary["relative_cost_fp32"] = frac
        summary["relative_cost_static8"] = frac * run["relative_cost_static8"] / max(
            run["relative_cost_fp32"], 1e-12)
    else:
        summary["relative_cost_fp32"] = float(run["relative_cost_fp32"])
        summary["relative_cost_static8"] = float(run["relative_cost_static8"])
    summary["mean_bits"] = float(run["mean_bits"])
    summary["mean_grad_bits"] = float(run["mean_grad_bits"])
    for split, r in final.items():
        summary[f"final_{split}_{task.metric}"] = _metric_of(task, r)
        summary[f"final_{split}_loss"] = r["loss"]
    for split, r in final_fp.items():
        summary[f"final_{split}_{task.metric}_fp32"] = _metric_of(task, r)
    summary["params_sha256"] = params_sha256(state.params)
    summary.update(task.info and {"task_info": task.info} or {})
    metrics_writer.write({"final": {k: v for k, v in summary.items() if k != "task_info"}})
    metrics_writer.close()
    with open(os.path.join(workdir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2, sort_keys=True)
    try:
        _plot_run(workdir, history, evals + [{"step": done_steps, **{
            f"test_{task.metric}": summary.get(f"final_test_{task.metric}")}}], task)
        if fwd_schedule is not None:
            sched_lib.plot_schedules({"forward bits": fwd_schedule}, total_steps,
                                     os.path.join(workdir, "bits.png"), title="precision schedule")
    except Exception as exc:  # plots must never lose a run's results
        logging.warning("plotting failed: %s", exc)
    if tb_writer is not None:
        _tb_log(tb_writer, {k: v for k, v in summary.items() if isinstance(v, (int, float))},
                done_steps, prefix="final/")
        tb_writer.close()
    return summary


def _progress_bar(total: int, enabled: bool):
    if not enabled:
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:  # pragma: no cover
        return None
    return tqdm(total=total, desc="train", unit="step", dynamic_ncols=True, mininterval=1.0)


def _make_tb_writer(workdir: str, config):
    if not config.get("tensorboard", True):
        return None
    try:
        from tensorboardX import SummaryWriter
    except ImportError:  # pragma: no cover
        logging.info("tensorboardX not installed: no TensorBoard events")
        return None
    return SummaryWriter(os.path.join(workdir, "tensorboard"))


def _tb_log(writer, record: Dict[str, Any], step: int, prefix: str = "") -> None:
    if writer is None:
        return
    for k, v in record.items():
        if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool):
            writer.add_scalar(prefix + k, v, step)
