"""The main job as a library function: `train_and_evaluate(config, workdir)`.

Reads an `ml_collections.ConfigDict` (see ``experiments/configs/``), builds the
task, the quantized model, the schedules and the optimizer, trains with one compiled
step for the whole run, and writes to `workdir`:

* ``metrics.jsonl``: one JSON object per logged step (step, bits, grad_bits, loss,
  accuracy, cumulative relative cost) and per evaluation;
* ``summary.json``: final test metric (at the eval bits and in full precision),
  ``relative_cost_fp32``, ``relative_cost_static8``, ``num_compiles``, ``steps``,
  ``wall_time_s`` and more;
* PNG plots (bits over steps; loss and accuracy curves) and TensorBoard events
  (``workdir/tensorboard``);
* ``checkpoints/<step>/``: every ``config.checkpoint_every`` steps (0: never), at the
  end, and on SIGTERM/SIGINT; the newest ``config.keep_checkpoints`` are kept.

Preemption and resumption (see ``docs/reliability.md``): the first SIGTERM or SIGINT
(Ctrl-C) finishes the current step, saves a checkpoint, then evaluates and writes what
was measured (``"interrupted": true``). A `workdir` that holds a checkpoint resumes
from its newest good one (a torn or corrupt one is skipped with a warning): the
parameters at the end are bit-identical to an uninterrupted run's, because the state
(step = schedule position, parameters, optimizer state, PRNG key) is restored exactly
and the data order is a pure function of ``(config.seed, step)``. ``metrics.jsonl`` is
rewritten from the checkpoint's history, so no line is duplicated.

Non-finite steps follow ``config.nonfinite``: ``skip`` (count them in
``skipped_steps``), ``ignore``, or ``stop`` (raise `NonFiniteError` naming the step,
the bits and the layers, after writing ``summary.json``).
"""
from __future__ import annotations

import json
import os
import signal
import threading
import time
from typing import Any, Dict, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import logging

from cpt_jax import checkpoint as ckpt_lib
from cpt_jax import cost as cost_lib
from cpt_jax import parallel
from cpt_jax import schedules as sched_lib
from cpt_jax.quant_config import CPT_CONFIG, INT8_CONFIG, QuantConfig, TensorQuant
from cpt_jax.formats import BlockFloat, SymmetricInt
from cpt_jax.tasks import Task, build_task
from cpt_jax import validation
from cpt_jax.training import (TrainState, aggregate, create_train_state, make_eval_step,
                              make_train_step, nonfinite_layers)
from cpt_jax.transform import quantize_model
from cpt_jax.validation import FULL_PRECISION_SCHEDULES, QUANTIZERS

CHECKPOINT_SUBDIR = "checkpoints"


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
        return QuantConfig(weight=TensorQuant(SymmetricInt(-1)),
                           activation=TensorQuant(SymmetricInt()))
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
    """Check every field the runner reads (see `cpt_jax.validation.validate_config`)."""
    validation.validate_config(config)


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

class NonFiniteError(FloatingPointError):
    """Training stopped (``config.nonfinite="stop"``) at a non-finite loss or gradient.

    Attributes: `step` (1-based, as in ``metrics.jsonl``), `bits`, `grad_bits`, `loss`,
    `layers` (parameter paths with a non-finite gradient, the layer nearest the output
    first: where the overflow entered backprop), `summary` (what was written to
    ``summary.json``).
    """

    def __init__(self, message: str, *, event: Dict[str, Any], summary: Dict[str, Any]):
        super().__init__(message)
        self.event = event
        self.summary = summary
        self.step = event["step"]
        self.bits = event.get("bits")
        self.grad_bits = event.get("grad_bits")
        self.loss = event.get("loss")
        self.layers = list(event.get("layers", []))


class _StopRequest:
    """SIGINT/SIGTERM handler: the first signal asks the loop to checkpoint and finish;
    a second SIGINT raises KeyboardInterrupt (stop now, no checkpoint)."""

    def __init__(self):
        self.signum: Optional[int] = None
        self._previous: Dict[int, Any] = {}

    def __enter__(self) -> "_StopRequest":
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                try:
                    self._previous[sig] = signal.signal(sig, self._handle)
                except (ValueError, OSError):  # pragma: no cover - exotic platforms
                    pass
        return self

    def _handle(self, signum, frame) -> None:
        if self.signum is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.signum = signum
        logging.warning("Received %s: saving a checkpoint, then finishing with what was "
                        "measured (send SIGINT again to stop at once).",
                        signal.Signals(signum).name)

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


class _Checkpoints:
    """The run's `CheckpointManager` in ``workdir/checkpoints``, created when needed."""

    def __init__(self, workdir: str, keep: int):
        self.directory = os.path.join(workdir, CHECKPOINT_SUBDIR)
        self.keep = keep
        self._manager: Optional[ckpt_lib.CheckpointManager] = None

    @property
    def manager(self) -> ckpt_lib.CheckpointManager:
        if self._manager is None:
            self._manager = ckpt_lib.CheckpointManager(self.directory, keep=self.keep)
        return self._manager

    def exists(self) -> bool:
        return os.path.isdir(self.directory)

    def close(self) -> None:
        if self._manager is not None:
            self._manager.close()


def _nonfinite_event(step: int, metrics, params, ops) -> Dict[str, Any]:
    m = jax.device_get(metrics)
    layers = nonfinite_layers(params, m["grads_finite"])
    # Order by position in the forward pass, nearest the output first (backprop order).
    order = {op.name: i for i, op in enumerate(ops)}

    def rank(path: str) -> int:
        parts = path.split("/")
        for n in range(len(parts) - 1, 0, -1):
            if "/".join(parts[:n]) in order:
                return order["/".join(parts[:n])]
        return -1

    layers = sorted(layers, key=lambda path: -rank(path))
    event = {"step": step, "loss": float(m["loss"]), "layers": layers}
    for k in ("bits", "grad_bits"):
        if k in m:
            event[k] = float(m[k])
    return event


def _nonfinite_message(event: Dict[str, Any]) -> str:
    where = ", ".join(f"{k}={event[k]:g}" for k in ("bits", "grad_bits") if k in event)
    layers = event["layers"]
    if layers:
        more = f" (and {len(layers) - 1} more: {', '.join(layers[1:4])}" \
               f"{', ...' if len(layers) > 4 else ''})" if len(layers) > 1 else ""
        what = f"non-finite gradient in layer {layers[0]}{more}"
    else:
        what = "non-finite loss"
    return (f"training stopped at step {event['step']} ({where or 'full precision'}, "
            f"loss={event['loss']}): {what} [config.nonfinite='stop']")


def _write_records(path: str, records: list) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        for record in records:
            f.write(json.dumps(record) + "\n")
    os.replace(tmp, path)


def train_and_evaluate(config, workdir: str, *, progress: bool = True) -> Dict[str, Any]:
    """Train per `config`, write metrics, plots and ``summary.json`` to `workdir`.

    Returns the summary dict. See the module docstring for the outputs. A `workdir`
    holding a checkpoint (``workdir/checkpoints``) resumes from its newest good one.
    Raises `ValueError` for a bad config (before anything is built), and
    `NonFiniteError` with ``config.nonfinite="stop"`` (after writing the summary).
    """
    validate_config(config)
    os.makedirs(workdir, exist_ok=True)
    t_start = time.time()
    total_steps = int(config.num_steps)
    p = config.precision
    policy = config.get("nonfinite", "skip")

    task = build_task(config)
    fwd_schedule = precision_schedule_from_config(p, total_steps)
    grad_schedule = grad_schedule_from_config(p)
    qmodel = quantize_model(task.model, rules=rules_from_config(p),
                            config=quant_config_from_config(p))
    optimizer = optimizer_from_config(config.optimizer, total_steps)
    rng = jax.random.key(int(config.seed))
    init_rng, data_rng = jax.random.split(rng)
    init_kwargs = {"train": False, **task.apply_kwargs}
    # One compiled init instead of many eager ops (fast start; same values every run).
    state = jax.jit(lambda key: create_train_state(qmodel, optimizer, key, task.sample_inputs,
                                                   **init_kwargs))(init_rng)
    ops = cost_lib.count_ops(qmodel, state.variables(), task.sample_inputs, **init_kwargs)
    mesh = parallel.mesh_from_config(config)
    if mesh is not None:
        # "replicate" (data parallel) or "fsdp" (parameters and optimizer state sharded).
        state = parallel.shard_state(state, mesh, str(config.get("param_sharding", "replicate")))

    # Resume: the newest good checkpoint in workdir/checkpoints (torn/corrupt ones are
    # skipped with a warning). The data order is a pure function of (seed, step).
    checkpoint_every = int(config.get("checkpoint_every", 0) or 0)
    checkpoints = _Checkpoints(workdir, int(config.get("keep_checkpoints", 3)))
    metrics_path = os.path.join(workdir, "metrics.jsonl")
    records: list = []
    resumed_from = None
    if checkpoints.exists():
        restored = checkpoints.manager.restore_latest(
            state, check_meta=lambda meta: ckpt_lib.check_resume_compatible(
                meta.get("config", {}), config))
        if restored is not None:
            state = restored.state
            records = list(restored.meta.get("records", []))
            resumed_from = restored.step
            logging.info("Resuming from the checkpoint of step %d in %s", restored.step,
                         checkpoints.directory)
    # metrics.jsonl = the records up to the checkpoint (no duplicates after a resume).
    _write_records(metrics_path, records)
    history = [r for r in records if "eval" not in r]
    evals = [r["eval"] for r in records if "eval" in r]

    train_step = make_train_step(qmodel, optimizer, fwd_schedule, grad_schedule,
                                 loss_fn=task.loss_fn, nonfinite=policy,
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
    metrics_writer = _JsonlWriter(metrics_path)
    step = int(state.step)
    tb_writer = _make_tb_writer(workdir, config, purge_step=step)
    interrupted = False
    stop_event: Optional[Dict[str, Any]] = None
    last_saved = step
    pbar = _progress_bar(total_steps, progress, initial=step)
    t_train = time.time()
    last_t, last_step = t_train, step

    def emit(record: Dict[str, Any]) -> None:
        records.append(record)
        metrics_writer.write(record)

    def save_checkpoint() -> None:
        nonlocal last_saved
        if tb_writer is not None:
            tb_writer.flush()
        checkpoints.manager.save(step, state, {
            "config": ckpt_lib.config_to_json(config), "records": records,
            "data_order": "a pure function of (config.seed, step): nothing else to restore"})
        last_saved = step

    with _StopRequest() as stop:
        try:
            while step < total_steps and stop.signum is None:
                batch = task.train_batch(state.step, data_rng)
                if mesh is not None:
                    batch = parallel.shard_batch(batch, mesh)
                state, metrics = train_step(state, batch)
                step += 1
                if policy == "stop" and not bool(metrics["finite"]):
                    stop_event = _nonfinite_event(step, metrics, state.params, ops)
                    logging.error(_nonfinite_message(stop_event))
                    break
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
                    emit(record)
                    _tb_log(tb_writer, record, step)
                    if pbar is not None:
                        pbar.set_postfix(bits=record.get("bits", 32),
                                         loss=f"{record['loss']:.3f}", it_s=f"{rate:.1f}")
                        pbar.update(step - pbar.n)
                if eval_every and step % eval_every == 0 and step < total_steps:
                    res = _evaluate(task, eval_step, state, eval_bits)
                    rec = {"step": step, "eval_bits": eval_bits}
                    for split, r in res.items():
                        rec[f"{split}_{task.metric}"] = _metric_of(task, r)
                        rec[f"{split}_loss"] = r["loss"]
                    evals.append(rec)
                    emit({"eval": rec})
                    _tb_log(tb_writer, rec, step)
                if checkpoint_every and (step % checkpoint_every == 0 or step == total_steps):
                    save_checkpoint()
            if stop.signum is not None:
                interrupted = True
                if step > last_saved:
                    save_checkpoint()
                logging.warning("Stopped by %s at step %d; rerun with the same --workdir to "
                                "resume.", signal.Signals(stop.signum).name, step)
        except KeyboardInterrupt:
            interrupted = True
            logging.warning("Interrupted at step %d: evaluating and writing what was measured "
                            "(no checkpoint).", step)
        finally:
            if pbar is not None:
                pbar.close()
    checkpoints.close()
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
        "steps_per_s": (done_steps - (resumed_from or 0)) / max(train_time, 1e-9),
        "interrupted": interrupted,
        "resumed_from_step": resumed_from,
        "skipped_steps": int(state.skipped_steps),
        "nonfinite_policy": policy,
        "total_macs_per_example_batch": cost_lib.total_macs(ops),
        "num_quantized_ops": sum(op.quantized for op in ops),
        "num_full_precision_ops": sum(not op.quantized for op in ops),
    }
    if stop_event is not None:
        summary["nonfinite_stop"] = stop_event
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
    if config.get("plots", True):
        try:
            _plot_run(workdir, history, evals + [{"step": done_steps, **{
                f"test_{task.metric}": summary.get(f"final_test_{task.metric}")}}], task)
            if fwd_schedule is not None:
                sched_lib.plot_schedules({"forward bits": fwd_schedule}, total_steps,
                                         os.path.join(workdir, "bits.png"),
                                         title="precision schedule")
        except Exception as exc:  # plots must never lose a run's results
            logging.warning("plotting failed: %s", exc)
    if tb_writer is not None:
        _tb_log(tb_writer, {k: v for k, v in summary.items() if isinstance(v, (int, float))},
                done_steps, prefix="final/")
        tb_writer.close()
    if stop_event is not None:
        raise NonFiniteError(_nonfinite_message(stop_event), event=stop_event, summary=summary)
    return summary


def _progress_bar(total: int, enabled: bool, initial: int = 0):
    if not enabled:
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:  # pragma: no cover
        return None
    return tqdm(total=total, initial=initial, desc="train", unit="step", dynamic_ncols=True,
                mininterval=1.0)


def _make_tb_writer(workdir: str, config, purge_step: int = 0):
    """TensorBoard events in ``workdir/tensorboard``. `purge_step` hides the events at
    steps >= it written by an earlier (interrupted) run: resumed curves do not double."""
    if not config.get("tensorboard", True):
        return None
    try:
        SummaryWriter = _import_summary_writer()
    except ImportError:  # pragma: no cover
        logging.info("tensorboardX not installed: no TensorBoard events")
        return None
    return SummaryWriter(os.path.join(workdir, "tensorboard"), purge_step=int(purge_step))


def _import_summary_writer():
    """``tensorboardX.SummaryWriter`` without importing PyTorch: tensorboardX imports
    torch when it is installed (seconds and ~1 GB, unused for scalars); it is hidden
    for the duration of the import unless the process already loaded it."""
    import sys

    hide = "torch" not in sys.modules
    if hide:
        sys.modules["torch"] = None  # `import torch` raises ImportError
    try:
        from tensorboardX import SummaryWriter
    finally:
        if hide and sys.modules.get("torch", 0) is None:
            del sys.modules["torch"]
    return SummaryWriter


def _tb_log(writer, record: Dict[str, Any], step: int, prefix: str = "") -> None:
    if writer is None:
        return
    for k, v in record.items():
        if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool):
            writer.add_scalar(prefix + k, v, step)
