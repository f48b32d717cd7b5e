"""The independent measurement of the zoo tests (issues 22 and 29): which products a
program binds, with their concrete operands, known without cpt_jax's records.

It takes the program JAX builds for the loss and for its gradient
(``jax.make_jaxpr``) and evaluates it equation by equation on concrete arrays (scan
bodies once per iteration, jit/remat/custom-derivative bodies inlined, shard_map bodies per shard),
capturing the operands of every ``dot_general`` / ``conv_general_dilated`` /
``ragged_dot_general`` it binds -- the forward products, and the backward ones in
the gradient's program. A ``dot_general`` that contracts nothing (an elementwise
scale written as an einsum) is not a product: it saves no MACs and is left out; its
transpose in the gradient (the scale's gradient, a batched inner product with no free
dimension on either side, computed by JAX's rule as the forward was) is not checked. At
``bits = grad_bits = 2`` a quantized operand lies on at most 4 values per tensor,
or per slice along one axis (a per-channel weight); every captured operand must.
The MACs of cpt_jax's cost records must equal the MACs of the forward products
evaluated.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

import cpt_jax

KEY = jax.random.key(0)
PRODUCTS = ("dot_general", "conv_general_dilated", "ragged_dot_general")
LEVELS = 4  # a 2-bit grid


# --------------------------------------------------------------------------- capture

@dataclasses.dataclass
class Bound:
    primitive: str
    operands: tuple
    macs: int
    inner: bool = False   # a batched inner product: no free dimension on either side


def _inner(eqn) -> bool:
    if eqn.primitive.name != "dot_general":
        return False
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    lhs, rhs = (v.aval.ndim for v in eqn.invars[:2])
    return len(lc) + len(lb) == lhs and len(rc) + len(rb) == rhs


def _macs(name: str, operands, out_shape, params) -> int:
    if name == "conv_general_dilated":
        dn, rhs = params["dimension_numbers"], operands[1].shape
        return math.prod(out_shape) * math.prod(rhs[d] for d in dn.rhs_spec[1:])
    if name == "dot_general":
        (lc, _), _ = params["dimension_numbers"]
    else:
        dims = params["ragged_dot_dimension_numbers"]
        (lc, _), _ = dims.dot_dimension_numbers
        k = math.prod(operands[0].shape[d] for d in lc)
        if any(d in lc for d in dims.lhs_ragged_dimensions):
            k //= operands[2].shape[-1]
        return math.prod(out_shape) * k
    return math.prod(out_shape) * math.prod(operands[0].shape[d] for d in lc)


def _sub(params, *names):
    for name in names:
        value = params.get(name)
        if value is not None:
            return value
    return None


def _scan(eqn, args, bound):
    p = eqn.params
    if "num_consts" in p:
        n, m = p["num_consts"], p["num_carry"]
        consts, carry, xs = args[:n], list(args[n:n + m]), args[n + m:]
    else:  # jax >= 0.12: the groups as a flat tree
        consts, carry, xs = map(list, p["ft_in"].update(args).unpack())
    n_carry, body = len(carry), p["jaxpr"]
    ys = []
    steps = range(p["length"])[::-1] if p["reverse"] else range(p["length"])
    for i in steps:
        out = run_jaxpr(body, [*consts, *carry, *(x[i] for x in xs)], bound)
        carry, y = out[:n_carry], out[n_carry:]
        ys.append(y)
    if p["reverse"]:
        ys = ys[::-1]
    stacked = [jnp.stack([y[j] for y in ys]) for j in range(len(ys[0]))] if ys and ys[0] else []
    return [*carry, *stacked]


# Collectives over a one-device mesh: the identity.
ONE_DEVICE_IDENTITIES = ("psum", "psum_invariant", "pmax", "pmin", "pvary", "pbroadcast")


def _shard_map(eqn, args, bound):
    """A ``shard_map`` body evaluated per shard under ``shard_map`` itself, on a
    one-device mesh (its collectives the identity; the captured operands come out
    whole)."""
    p, inner = eqn.params, []
    assert p["mesh"].size == 1, "the measurement evaluates shard_map on one device"

    def body(*shard_args):
        outs = run_jaxpr(p["jaxpr"], shard_args, inner)
        return outs, [b.operands for b in inner]

    outs, operands = jax.shard_map(body, mesh=p["mesh"], in_specs=tuple(p["in_specs"]),
                                   out_specs=(list(p["out_specs"]), P()),
                                   check_vma=False)(*args)
    bound.extend(dataclasses.replace(b, operands=ops) for b, ops in zip(inner, operands))
    return outs


def _has_products(value) -> bool:
    jaxpr = getattr(value, "jaxpr", value)
    if not hasattr(jaxpr, "eqns"):
        return isinstance(value, tuple) and any(_has_products(v) for v in value)
    return any(e.primitive.name in PRODUCTS or any(_has_products(v) for v in e.params.values())
               for e in jaxpr.eqns)


def contracts(eqn) -> bool:
    """A dot_general that contracts no dimension (an elementwise scale written as an
    einsum) is not a product."""
    if eqn.primitive.name != "dot_general":
        return True
    (lc, _), _ = eqn.params["dimension_numbers"]
    return bool(lc)


def _eval_eqn(eqn, args, bound):
    name, p = eqn.primitive.name, eqn.params
    if name == "shard_map":
        return _shard_map(eqn, args, bound)
    if name in ONE_DEVICE_IDENTITIES:
        return list(args)
    if name == "scan":
        return _scan(eqn, args, bound)
    if name == "cond":
        return run_jaxpr(p["branches"][int(args[0])], args[1:], bound)
    inner = _sub(p, "jaxpr", "call_jaxpr", "fun_jaxpr")
    if inner is not None and name != "while":
        return run_jaxpr(inner, args, bound)
    if any(_has_products(v) for v in p.values()):
        raise NotImplementedError(f"the measurement does not evaluate {name!r} bodies")
    bind = eqn.primitive.get_bind_params(p)          # (subfuns, params) before jax 0.11
    subfuns, params = bind if isinstance(bind, tuple) else ([], bind)
    out = eqn.primitive.bind(*subfuns, *args, **params)
    if name in PRODUCTS and contracts(eqn):
        bound.append(Bound(name, tuple(args[:2]), _macs(name, args, out.shape, p), _inner(eqn)))
    return out if eqn.primitive.multiple_results else [out]


def run_jaxpr(closed, args, bound: list[Bound]):
    """Evaluate a (closed) jaxpr equation by equation, recording its products."""
    jaxpr = getattr(closed, "jaxpr", closed)
    env = dict(zip(jaxpr.constvars, getattr(closed, "consts", [])))
    env.update(zip(jaxpr.invars, args))
    read = lambda v: v.val if isinstance(v, jax.extend.core.Literal) else env[v]  # noqa: E731
    for eqn in jaxpr.eqns:
        env.update(zip(eqn.outvars, _eval_eqn(eqn, [read(v) for v in eqn.invars], bound)))
    return [read(v) for v in jaxpr.outvars]


def on_grid(x: np.ndarray, levels: int = LEVELS) -> bool:
    """At most `levels` values per tensor, or per slice along one axis (a weight per
    output channel), or along two (the same weight as a grouped convolution's
    input-gradient product holds it, its output channels split across two axes)."""
    if np.unique(x).size <= levels:
        return True
    for axes in [(a,) for a in range(x.ndim)] + [(a, b) for a in range(x.ndim)
                                                 for b in range(a + 1, x.ndim)]:
        moved = np.moveaxis(x, axes, tuple(range(len(axes))))
        rows = moved.reshape(math.prod(x.shape[a] for a in axes), -1)
        if rows.shape[1] > levels and all(np.unique(row).size <= levels for row in rows):
            return True
    return False


def evaluate(closed, args) -> list[Bound]:
    """The products of `closed` on `args` with their concrete operands: the
    interpreter is itself compiled once (scan bodies unrolled), its captured
    operands returned as outputs."""
    shapes: list[Bound] = []

    def capture(*args):
        bound: list[Bound] = []
        run_jaxpr(closed, args, bound)
        shapes[:] = bound
        return [b.operands for b in bound]

    operands = jax.jit(capture)(*args)
    return [Bound(b.primitive, tuple(np.asarray(o) for o in ops), b.macs, b.inner)
            for b, ops in zip(shapes, operands)]


def measure(loss: Callable, params) -> tuple:
    """``(forward products of loss, products of its gradient)``, evaluated."""
    leaves = jax.tree_util.tree_leaves(params)
    unflatten = jax.tree_util.tree_structure(params).unflatten
    forward = evaluate(jax.make_jaxpr(lambda *l: loss(unflatten(l)))(*leaves), leaves)
    gradient = evaluate(jax.make_jaxpr(lambda *l: jax.grad(loss)(unflatten(l)))(*leaves),
                        leaves)
    return forward, gradient


def assert_every_product_quantized(loss, params, recorded_macs: int):
    forward, gradient = measure(loss, params)
    assert forward and len(gradient) > len(forward)
    for phase, products in (("forward", forward), ("gradient", gradient)):
        off = [(p.primitive, i, [o.shape for o in p.operands]) for i, p in enumerate(products)
               if not all(on_grid(o) for o in p.operands)
               and not (phase == "gradient" and p.inner)]
        assert not off, f"{phase} products with an operand off the 2-bit grid: {off}"
    assert recorded_macs == sum(p.macs for p in forward)


def precision_loss(apply: Callable, *inputs) -> Callable:
    def loss(params):
        with cpt_jax.precision(2, grad_bits=2, rng=jax.random.key(7)):
            out = apply(params, *inputs)
        leaves = jax.tree_util.tree_leaves(out)
        return sum(jnp.sum(jnp.sin(leaf.astype(jnp.float32) * (1.0 + i)))
                   for i, leaf in enumerate(leaves))
    return loss


def check_linen(model: nn.Module, *inputs, method=None, init_inputs=None, **apply_kwargs):
    qmodel = cpt_jax.quantize_model(model, rules=[])
    kwargs = dict(apply_kwargs, **({"method": method} if method is not None else {}))
    variables = qmodel.init(KEY, *(init_inputs or inputs), **kwargs)
    params, rest = variables["params"], {k: v for k, v in variables.items() if k != "params"}
    loss = precision_loss(lambda p, *x: qmodel.apply({"params": p, **rest}, *x, **kwargs),
                          *inputs)
    macs = cpt_jax.cost.total_macs(cpt_jax.count_ops(qmodel, variables, *inputs, **kwargs))
    assert_every_product_quantized(loss, params, macs)
    return qmodel, variables


def check_nnx(model: nnx.Module, *inputs):
    qmodel = cpt_jax.quantize_model(model, rules=[])
    graphdef, state, rest = nnx.split(qmodel, nnx.Param, ...)
    # the other state (RNG counts) rebuilt inside each trace, so a call may advance it
    loss = precision_loss(lambda s, *x: nnx.merge(graphdef, s, jax.tree.map(jnp.copy, rest))(*x),
                          *inputs)
    macs = cpt_jax.cost.total_macs(cpt_jax.count_ops(qmodel, *inputs))
    assert_every_product_quantized(loss, state, macs)
    return qmodel


def _x(*shape, seed=0):
    return jnp.asarray(np.random.default_rng(seed).normal(size=shape), jnp.float32)


def _tokens(*shape, vocab=11, seed=0):
    return jnp.asarray(np.random.default_rng(seed).integers(0, vocab, size=shape), jnp.int32)


