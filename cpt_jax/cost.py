"""Cost accounting: MACs read from traced shapes, BitOps from the schedules.

Every product (dot_general, conv, einsum, attention, embedding lookup) records its
shapes at trace time as an `OpRecord`; MACs are exact: a Dense ``(B, K) x (K, N)``
is ``B K N`` MACs, a conv is ``|output| * K`` with ``K = kh kw C_in / groups``; a
product inside a ``lax.scan`` body (``nn.scan``, ``nnx.scan``) counts once per
iteration, a product under ``vmap`` (``nn.vmap``, ``nnx.vmap``, ``jax.vmap``)
once per instance and one under ``shard_map`` once per shard (`trace_ops` reads trip
counts, batch sizes and shard counts from the traced program). The BitOps
of one step:

    BitOps = sum_ops MACs * (b_w b_a + 2 b g)

(the forward product at ``b_w x b_a`` bits and the two backward products, error x
weight and error x activation, at ``b x g``; REFERENCE.md). Ops kept in full
precision count at 32 bits. Relative to fp32 a uniformly quantized step costs
``(b^2 + 2 b g) / (3 * 32^2)``; a run's cost is the sum over its schedule.

Example:
  >>> s = cpt_jax.cpt(3, 8, num_cycles=32, total_steps=64_000)
  >>> round(run_cost(s, cpt_jax.constant(8), 64_000)["relative_cost_static8"], 2)
  0.63
"""
from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from cpt_jax import context
from cpt_jax.interception import OpRecord, as_config, isolated_call
from cpt_jax.quant_config import operand_bits
from cpt_jax.schedules import PrecisionSchedule, schedule_values

FP_BITS = 32.0


def trace_ops(fn: Callable, *args, **kwargs) -> list:
    """Trace ``fn(*args, **kwargs)`` abstractly and return the `OpRecord` of every op.

    Nothing is computed (``jax.make_jaxpr``). Each op's MACs are multiplied by the
    trip counts of the ``lax.scan`` loops, the sizes of the ``vmap`` s and the shard
    counts of the ``shard_map`` s around it (``calls``); an op traced but
    absent from the program (e.g. a shape-inference trace of a scanned body) is
    dropped. ``while`` loops have no static trip count: their body counts once.

    Example:
      >>> m = cpt_jax.quantize_model(nn.Dense(10))
      >>> v = m.init(jax.random.key(0), jnp.ones((4, 3)))
      >>> [op.macs for op in trace_ops(lambda v, x: m.apply(v, x), v, jnp.ones((4, 3)))]
      [120]
    """
    with context.recording() as records:
        closed = jax.make_jaxpr(functools.partial(fn, **kwargs))(*args)
    scopes = {r.scope for r in records if r.scope}
    calls = scope_calls(closed.jaxpr, scopes)
    sizes = scope_product_sizes(closed.jaxpr, scopes)
    present = {r.name for r in records if calls.get(r.scope, 0) > 0}
    out = []
    for r in records:
        n = calls.get(r.scope, 0)
        if n == 0 and r.name in present:
            continue  # traced (e.g. for shapes), but not in the program
        n = max(n, 1) * batch_factor(sizes.get(r.scope, ()), r.out_shape)
        out.append(dataclasses.replace(r, macs=r.macs * n, calls=n))
    return out


PRODUCT_PRIMITIVES = frozenset({"dot_general", "conv_general_dilated", "ragged_dot",
                                "ragged_dot_general"})


def scope_product_sizes(jaxpr, scopes, out=None) -> dict:
    """``{scope: [output sizes of its product equations]}`` as the program has them.

    Under ``vmap`` an op records the shapes of one instance while the program's
    equations carry the mapped axes (a scan body batched as a whole included).
    """
    out = {} if out is None else out
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in PRODUCT_PRIMITIVES:
            size = sum(int(np.prod(v.aval.shape)) for v in eqn.outvars)
            for name in _stack_names(eqn):
                if name in scopes:
                    out.setdefault(name, []).append(size)
        for value in eqn.params.values():
            for sub in _sub_jaxprs(value):
                scope_product_sizes(sub, scopes, out)
    return out


def batch_factor(program_sizes: Sequence[int], out_shape: Sequence[int]) -> int:
    """Instances of one recorded product the program computes: ``min |y_prog| / |y|``.

    The product's own equation has ``|y_prog| = instances * |y|``; other product
    equations in its scope (block partial products of an emulated scaled GEMM) are
    larger, never smaller. 1 when no equation's size is a whole multiple.
    """
    size = int(np.prod(out_shape)) if len(out_shape) else 1
    ratios = [s // size for s in program_sizes if size and s >= size and s % size == 0]
    return min(ratios) if ratios else 1


def _sub_jaxprs(value):
    if hasattr(value, "eqns"):
        yield value
    elif hasattr(value, "jaxpr") and hasattr(value.jaxpr, "eqns"):
        yield value.jaxpr
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from _sub_jaxprs(v)


def _stack_names(eqn) -> list[str]:
    """The scope names on an equation's name stack, transforms' wrappers removed
    (``vmap(cpt_op3)/dense`` -> ``["vmap", "cpt_op3", "dense"]``)."""
    return re.split(r"[/()]", str(eqn.source_info.name_stack))


def _body_executions(eqn) -> int:
    """How often one execution of `eqn` runs its body: a scan's ``length``, a
    ``shard_map``'s shard count (the sizes of the mesh axes it makes manual), else 1."""
    if eqn.primitive.name == "scan":
        return int(eqn.params.get("length", 1))
    if eqn.primitive.name == "shard_map" and "mesh" in eqn.params:
        mesh = eqn.params["mesh"]
        axes = eqn.params.get("newly_manual_axes", mesh.axis_names)
        return int(np.prod([dict(mesh.shape)[a] for a in axes]))
    return 1


def scope_calls(jaxpr, scopes, multiplier: int = 1, out=None) -> dict:
    """``{scope: executions per call of jaxpr}`` for the named scopes in `scopes`.

    An equation whose name stack holds a scope counts `multiplier` times; the
    body of a ``scan`` multiplies by its ``length``, the body of a ``shard_map``
    (which records the shapes of one shard) by its number of shards.
    """
    out = {} if out is None else out
    for eqn in jaxpr.eqns:
        for name in _stack_names(eqn):
            if name in scopes:
                out[name] = max(out.get(name, 0), multiplier)
        inner = multiplier * _body_executions(eqn)
        for value in eqn.params.values():
            for sub in _sub_jaxprs(value):
                scope_calls(sub, scopes, inner, out)
    return out


def count_ops(model: Any, *args, **kwargs) -> list:
    """The ops a Flax model computes on these inputs (see `trace_ops`).

    ``count_ops(linen_model, variables, *inputs, **apply_kwargs)`` traces
    ``model.apply`` (``mutable`` and ``method=`` handled);
    ``count_ops(nnx_model, *inputs, method="__call__", **call_kwargs)`` traces an
    isolated copy of the NNX model and of the graph nodes among the arguments (an
    ``nnx.Rngs`` passed as ``rngs=``): nothing is computed or mutated. The model
    must be quantized (`cpt_jax.quantize_model`) or use the explicit doors, so its
    products are recorded.

    Example:
      >>> m = cpt_jax.quantize_model(nn.Dense(10))
      >>> v = m.init(jax.random.key(0), jnp.ones((4, 3)))
      >>> count_ops(m, v, jnp.ones((4, 3)))[0].macs
      120
      >>> from flax import nnx
      >>> count_ops(cpt_jax.quantize_model(nnx.Linear(3, 10, rngs=nnx.Rngs(0))),
      ...           jnp.ones((4, 3)))[0].macs
      120
    """
    from flax import nnx
    if isinstance(model, nnx.Module):
        method = kwargs.pop("method", "__call__")
        run, operands = isolated_call(model, method, args, kwargs)
        return trace_ops(run, *operands)
    check_linen_arguments("count_ops", model, args)
    variables, *inputs = args

    def apply(v, *xs):
        return model.apply(v, *xs, **kwargs)

    return trace_ops(apply, variables, *inputs)


def check_linen_arguments(caller: str, model: Any, args: tuple) -> None:
    """ValueError naming the expected signature unless ``args`` start with a Linen
    model's variables (``{"params": ...}``, what ``model.init`` returns).

    Example:
      >>> check_linen_arguments("f", nn.Dense(2), (jnp.ones((1, 3)),))  # doctest: +ELLIPSIS
      Traceback (most recent call last):
      ...
      ValueError: f(linen_model, variables, ...): variables ({'params': ...}) expected, got an array of shape (1, 3)
    """
    expected = (f"{caller}(linen_model, variables, *inputs, **apply_kwargs): variables "
                f"({{'params': ...}}) expected")
    if not args:
        raise ValueError(f"{expected}, got no arguments")
    variables = args[0]
    if not isinstance(variables, Mapping):
        shape = getattr(variables, "shape", None)
        got = (f"an array of shape {tuple(shape)}" if shape is not None
               else f"a {type(variables).__name__}")
        raise ValueError(f"{expected}, got {got}")


def total_macs(ops: Sequence[OpRecord]) -> int:
    """``sum_ops MACs`` of one forward pass."""
    return int(sum(op.macs for op in ops))


def _op_bits(op: OpRecord, bits, grad_bits):
    if not op.quantized:
        return jnp.float32(FP_BITS), jnp.float32(FP_BITS)
    b = jnp.clip(jnp.asarray(bits, jnp.float32) + op.bits_offset, 1.0, FP_BITS)
    if grad_bits is None:
        g = jnp.float32(FP_BITS)
    else:
        g = jnp.clip(jnp.asarray(grad_bits, jnp.float32) + op.grad_bits_offset, 1.0, FP_BITS)
    return b, g


def _op_bitops_per_mac(b, g, config):
    """``b_w b_a + b_g (b_w + b_a)``; with a `QuantConfig`, stored bits incl. scales."""
    if config is None:
        return b * b + 2.0 * b * g
    w, a, e = operand_bits(config, b, g)
    return w * a + e * (w + a)


def bitops_per_step(ops: Sequence[OpRecord] | None, bits, grad_bits=None, config=None):
    """``sum_ops MACs (b^2 + 2 b g)`` for one training step (traceable in `bits`).

    Without `ops` one op of 1 MAC is assumed, i.e. ``b^2 + 2 b g``. With a
    `QuantConfig` `config` (the quantized ops' recipe) each tensor counts its
    stored bits per element (`quant_config.operand_bits`: element width plus block
    scale bits, e.g. 8 + 8/32 for MXFP8): ``MACs (b_w b_a + b_g (b_w + b_a))``; a
    preset name (``"mxfp8"``) is its config.
    """
    config = as_config(config, "bitops_per_step config")
    if not ops:
        b = jnp.minimum(jnp.asarray(bits, jnp.float32), FP_BITS)
        g = FP_BITS if grad_bits is None else jnp.minimum(jnp.asarray(grad_bits, jnp.float32), FP_BITS)
        return _op_bitops_per_mac(b, g, config)
    total = jnp.float32(0.0)
    for op in ops:
        b, g = _op_bits(op, bits, grad_bits)
        total = total + op.macs * _op_bitops_per_mac(b, g, config if op.quantized else None)
    return total


def fp32_bitops_per_step(ops: Sequence[OpRecord] | None) -> float:
    """``sum_ops MACs * 3 * 32^2``: the same step in full precision."""
    macs = total_macs(ops) if ops else 1
    return float(macs) * 3.0 * FP_BITS * FP_BITS


def relative_cost_per_step(ops, bits, grad_bits=None):
    """BitOps of a step relative to fp32: ``bitops_per_step / fp32_bitops_per_step``."""
    return bitops_per_step(ops, bits, grad_bits) / fp32_bitops_per_step(ops)


def relative_step_costs(schedule: PrecisionSchedule | None,
                        grad_schedule: PrecisionSchedule | None, total_steps: int,
                        ops: Sequence[OpRecord] | None = None, config=None) -> np.ndarray:
    """Every step's BitOps relative to fp32: ``c_t = BitOps(b_t, g_t) / BitOps(32, 32)``.

    ``BitOps(b, g) = sum_ops MACs (b_w b_a + b_g (b_w + b_a))`` (`bitops_per_step`, with
    `config`'s stored bits incl. block scales) at the schedules' bits of step
    ``t = 0 .. total_steps-1``; ``BitOps(32, 32) = sum_ops MACs 3 * 32^2``
    (`fp32_bitops_per_step`). `schedule` None: full precision, ``c_t = 1``;
    `grad_schedule` None: errors at ``g_t = 32`` (each op's ``grad_bits_offset``
    applied, clipped to 32). A run's logged running cost is ``cumsum(c) / T``.

    Returns:
      ``c``, shape ``(total_steps,)``, float64 (each step computed in float32).

    Example:
      >>> relative_step_costs(cpt_jax.constant(8), cpt_jax.constant(8), 2)
      array([0.0625, 0.0625])
    """
    if schedule is None:
        return np.ones(total_steps)
    bits = schedule_values(schedule, total_steps)
    grads = (np.full(total_steps, FP_BITS, np.float32) if grad_schedule is None
             else schedule_values(grad_schedule, total_steps))
    fp32 = fp32_bitops_per_step(ops)
    cost_fn = jax.jit(jax.vmap(lambda b, g: bitops_per_step(ops, b, g, config=config) / fp32))
    return np.asarray(cost_fn(jnp.asarray(bits), jnp.asarray(grads)), np.float64)


def full_precision_run_cost(ops: Sequence[OpRecord] | None = None, total_steps: int = 1,
                            baseline_bits: int = 8) -> dict:
    """`run_cost` of a run in full precision: every step at ``BitOps(32, 32)``.

    ``relative_cost_fp32 = 1``, ``relative_cost_static8 = BitOps(32, 32) / BitOps(b8, b8)``
    with ``b8 = baseline_bits`` (``3 * 32^2 / (3 * 8^2) = 16`` for a uniform model),
    ``mean_bits = mean_grad_bits = 32``, ``total_bitops = T BitOps(32, 32)``.

    Example:
      >>> full_precision_run_cost()["relative_cost_static8"]
      16.0
    """
    fp32 = fp32_bitops_per_step(ops)
    return {
        "relative_cost_fp32": 1.0,
        "relative_cost_static8": fp32 / float(bitops_per_step(ops, float(baseline_bits),
                                                              float(baseline_bits))),
        "mean_bits": FP_BITS,
        "mean_grad_bits": FP_BITS,
        "total_bitops": fp32 * total_steps,
    }


def run_cost(schedule: PrecisionSchedule | None, grad_schedule: PrecisionSchedule | None,
             total_steps: int, ops: Sequence[OpRecord] | None = None,
             baseline_bits: int = 8, config=None) -> dict:
    """A run's cost from its schedules: ``sum_t BitOps(b_t, g_t)`` against baselines.

    Returns a dict with ``relative_cost_fp32`` (vs 32/32 every step),
    ``relative_cost_static8`` (vs `baseline_bits` forward and backward every step,
    the key keeps its name for any baseline), ``mean_bits``, ``mean_grad_bits`` and
    ``total_bitops``. `config` (a `QuantConfig`) counts stored bits incl. block scales
    (see `bitops_per_step`); the baselines stay plain ``b^2 + 2 b g``. `schedule`
    None: a full-precision run (`full_precision_run_cost`).
    """
    if schedule is None:
        return full_precision_run_cost(ops, total_steps, baseline_bits)
    b = schedule_values(schedule, total_steps).astype(np.float64)
    if grad_schedule is None:
        g = None
        mean_g = FP_BITS
    else:
        g = schedule_values(grad_schedule, total_steps).astype(np.float64)
        mean_g = float(g.mean())
    per_step = jax.vmap(lambda bb, gg: bitops_per_step(ops, bb, gg, config))
    if g is None:
        cost = jax.vmap(lambda bb: bitops_per_step(ops, bb, None, config))(jnp.asarray(b, jnp.float32))
    else:
        cost = per_step(jnp.asarray(b, jnp.float32), jnp.asarray(g, jnp.float32))
    total = float(np.sum(np.asarray(cost, np.float64)))
    fp32 = fp32_bitops_per_step(ops) * total_steps
    base = float(bitops_per_step(ops, float(baseline_bits), float(baseline_bits))) * total_steps
    return {
        "relative_cost_fp32": total / fp32,
        "relative_cost_static8": total / base,
        "mean_bits": float(b.mean()),
        "mean_grad_bits": mean_g,
        "total_bitops": total,
    }


def steps_done_cost(per_step: np.ndarray, totals: Mapping[str, float],
                    done_steps: int) -> dict[str, float]:
    """The cost of the first ``n = done_steps`` steps of a run of ``T = len(per_step)``.

    ``relative_cost_fp32 = (1/n) sum_{t<n} c_t`` with ``c`` the run's
    `relative_step_costs`, ``relative_cost_static8 = relative_cost_fp32 * S / F`` with
    ``S / F`` the ratio of the run's `run_cost` `totals` (the baseline costs the same
    every step); ``n = 0`` or ``n >= T``: the totals themselves. ``mean_bits`` and
    ``mean_grad_bits`` are the totals' (the schedules' over the whole run).

    Example:
      >>> c = np.array([0.25, 0.75, 0.5, 0.5])
      >>> steps_done_cost(c, {"relative_cost_fp32": 0.5, "relative_cost_static8": 8.0,
      ...                     "mean_bits": 4.0, "mean_grad_bits": 8.0}, 2)
      {'relative_cost_fp32': 0.5, 'relative_cost_static8': 8.0, 'mean_bits': 4.0, 'mean_grad_bits': 8.0}
    """
    if 0 < done_steps < len(per_step):
        frac = float(np.sum(per_step[:done_steps]) / done_steps)
        costs = {"relative_cost_fp32": frac,
                 "relative_cost_static8": frac * totals["relative_cost_static8"]
                 / max(totals["relative_cost_fp32"], 1e-12)}
    else:
        costs = {"relative_cost_fp32": float(totals["relative_cost_fp32"]),
                 "relative_cost_static8": float(totals["relative_cost_static8"])}
    costs["mean_bits"] = float(totals["mean_bits"])
    costs["mean_grad_bits"] = float(totals["mean_grad_bits"])
    return costs
