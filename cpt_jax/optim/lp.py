"""LP-SGD: quantized optax transformations with QPyTorch's ``OptimLP`` semantics.

Gradients, weights, momentum and an optional high-precision accumulator are each
quantized to any `cpt_jax` format with nearest or stochastic rounding. `optim_lp`
wraps any optax optimizer in QPyTorch's exact order::

    g   <- Q_grad(g)                                   # gradient quantize
    a   <- acc if an accumulator is kept else w        # swap in the accumulator
    a'  <- a + inner.update(g, state, params=a)        # optimizer step
    acc <- Q_acc(a')                                   # accumulator quantize
    w'  <- Q_w(acc)   (Q_w(a') without accumulator)    # weight quantize
    m   <- Q_mom(m)   for the momentum leaves of state # momentum quantize

and returns the optax update ``u = w' - w``. `lp_sgd` is SGD (momentum, Nesterov,
weight decay) built this way.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from cpt_jax.formats import BlockFloat, Format
from cpt_jax.optim.common import (
    ACC_STREAM,
    GRAD_STREAM,
    MOMENTUM_STREAM,
    WEIGHT_STREAM,
    Array,
    BitsLike,
    LPQuant,
    apply_updates,
    as_key,
    check_positive,
    momentum_leaves,
    quant_or_none,
    stream,
    updates_to,
)

MOMENTUM_FIELDS = ("trace", "mu", "nu")
"""Names of optax state fields that `optim_lp` quantizes as momentum: ``trace``
(``optax.trace``, SGD momentum), ``mu`` and ``nu`` (Adam's moments), as QPyTorch
quantizes ``momentum_buffer``, ``exp_avg`` and ``exp_avg_sq``."""


class QuantizeState(NamedTuple):
    """State of a quantizing transformation: step count and PRNG key."""

    count: Array
    key: Array


def quantize_gradients(bits: BitsLike = 8, fmt: Format = BlockFloat(), *,
                       rounding: str = "stochastic", seed: Any = 0
                       ) -> optax.GradientTransformation:
    """Quantize the incoming updates (gradients): ``g <- Q_{bits,fmt}(g)``.

    Step ``t`` rounds with ``fold_in(fold_in(key, t), 0)``, leaf ``i`` with a further
    ``fold_in(., i)``. `bits` may be a schedule of the step count.

    Example:
      >>> params = {"w": jnp.array([0.3, -1.2, 0.05])}
      >>> grads = {"w": jnp.array([0.1, 0.2, -0.3])}
      >>> opt = optax.chain(quantize_gradients(8, BlockFloat()), optax.sgd(0.1))
      >>> state = opt.init(params)
      >>> updates, state = opt.update(grads, state, params)
      >>> updates["w"].shape, int(state[0].count)
      ((3,), 1)
    """
    quant = quant_or_none(bits, fmt, rounding, "bits")

    def init_fn(params):
        del params
        return QuantizeState(jnp.zeros([], jnp.int32), as_key(seed))

    def update_fn(updates, state, params=None):
        del params
        if quant is not None:
            updates = quant(updates, state.count, stream(state.key, state.count, GRAD_STREAM))
        return updates, QuantizeState(optax.safe_int32_increment(state.count), state.key)

    return optax.GradientTransformation(init_fn, update_fn)


class QuantizeMomentumState(NamedTuple):
    """State of `quantize_momentum`: step count, PRNG key and the wrapped state."""

    count: Array
    key: Array
    inner_state: Any


def quantize_momentum(inner: optax.GradientTransformation, bits: BitsLike = 8,
                      fmt: Format = BlockFloat(), *, rounding: str = "stochastic",
                      seed: Any = 0, fields: Sequence[str] = MOMENTUM_FIELDS
                      ) -> optax.GradientTransformation:
    """Run `inner`, then quantize the momentum leaves of its state.

    The leaves quantized are the floating leaves under a state field named in `fields`
    (default `MOMENTUM_FIELDS`: ``trace`` of ``optax.trace``, ``mu``/``nu`` of Adam):
    ``m <- Q_{bits,fmt}(m)``. The update `inner` returns is not changed (QPyTorch
    quantizes the momentum buffer after the step that used it).

    Example:
      >>> params = {"w": jnp.array([0.3, -1.2, 0.05])}
      >>> grads = {"w": jnp.array([0.1, 0.2, -0.3])}
      >>> opt = quantize_momentum(optax.sgd(0.1, momentum=0.9), 8, BlockFloat())
      >>> updates, state = opt.update(grads, opt.init(params), params)
      >>> updates["w"].shape
      (3,)
    """
    quant = quant_or_none(bits, fmt, rounding, "bits")

    def init_fn(params):
        return QuantizeMomentumState(jnp.zeros([], jnp.int32), as_key(seed),
                                     inner.init(params))

    def update_fn(updates, state, params=None):
        updates, inner_state = inner.update(updates, state.inner_state, params)
        if quant is not None:
            inner_state = momentum_leaves(inner_state, quant, state.count,
                                           stream(state.key, state.count, MOMENTUM_STREAM), fields)
        return updates, QuantizeMomentumState(optax.safe_int32_increment(state.count),
                                              state.key, inner_state)

    return optax.GradientTransformation(init_fn, update_fn)


class QuantizeWeightsState(NamedTuple):
    """State of `quantize_weights`: count, key and the accumulator (None if unused)."""

    count: Array
    key: Array
    acc: Any


def quantize_weights(bits: BitsLike = 8, fmt: Format = BlockFloat(), *,
                     rounding: str = "stochastic", seed: Any = 0,
                     acc_bits: BitsLike = None, acc_fmt: Format = BlockFloat(),
                     acc_rounding: str = "stochastic") -> optax.GradientTransformation:
    """Turn a raw update into one that lands the weights on the weight grid.

    Without an accumulator (``acc_bits=None``)::

        w' = Q_w(w + u),   returned update  u' = w' - w

    With an accumulator (``acc_bits`` a width; 32 keeps it in fp32), a
    high-precision copy ``acc`` of the weights, started at the initial params, takes
    the raw update and the weights are read from it::

        acc' = Q_acc(acc + u),   w' = Q_w(acc'),   u' = w' - w

    so ``optax.apply_updates(w, u') == w'`` whenever ``w' - w`` is a float32 number.
    That holds once the weights lie on a grid (integer, fixed-point and block-float
    grids up to 16 bits: both are multiples of units at most ~2^20 apart). From fp32
    params that are not on the grid, the first step can leave a weight whose new value
    is much smaller than its old one within one float32 ulp of the grid (the next
    step removes it); start from ``quantize_tree(params, bits, fmt,
    rounding="nearest")`` to be exact from step one. Must be the last transformation
    of a chain (it needs the final update) and needs ``params``.

    Example:
      >>> params = {"w": jnp.array([0.3, -1.2, 0.05])}
      >>> grads = {"w": jnp.array([0.1, 0.2, -0.3])}
      >>> from cpt_jax.optim import quantize_tree
      >>> on_grid = lambda t: bool(jnp.all(t["w"] == quantize_tree(t, 8, BlockFloat(),
      ...                                                          rounding="nearest")["w"]))
      >>> opt = optax.chain(optax.sgd(0.1), quantize_weights(8, BlockFloat()))
      >>> updates, state = opt.update(grads, opt.init(params), params)
      >>> on_grid(optax.apply_updates(params, updates))   # on the 8-bit grid
      True
    """
    quant = quant_or_none(bits, fmt, rounding, "bits")
    acc_quant = quant_or_none(acc_bits, acc_fmt, acc_rounding, "acc_bits")

    def init_fn(params):
        acc = (jax.tree_util.tree_map(lambda p: jnp.array(p, copy=True), params)
               if acc_quant is not None else None)
        return QuantizeWeightsState(jnp.zeros([], jnp.int32), as_key(seed), acc)

    def update_fn(updates, state, params=None):
        if params is None:
            raise ValueError("quantize_weights needs params: call update(updates, state, "
                             "params)")
        new = apply_updates(state.acc if acc_quant is not None else params, updates)
        acc = None
        if acc_quant is not None:
            acc = new = acc_quant(new, state.count, stream(state.key, state.count, ACC_STREAM))
        if quant is not None:
            new = quant(new, state.count, stream(state.key, state.count, WEIGHT_STREAM))
        return updates_to(new, params), QuantizeWeightsState(
            optax.safe_int32_increment(state.count), state.key, acc)

    return optax.GradientTransformation(init_fn, update_fn)


class OptimLPState(NamedTuple):
    """State of `optim_lp`: count, key, accumulator (or None), the inner state."""

    count: Array
    key: Array
    acc: Any
    inner_state: Any


def _check_quants(**quants: Any) -> None:
    for name, q in quants.items():
        if q is not None and not isinstance(q, LPQuant):
            raise ValueError(f"{name} must be an LPQuant or None, got {q!r}")


def _land_on_grid(base, updates, params, acc_quant, weight_quant, count, key):
    """``acc = Q_acc(base + u)``, ``w' = Q_w(acc or base + u)``; returns ``(w' - w, acc)``."""
    if acc_quant is None and weight_quant is None:
        return updates, None
    acc = None
    new = apply_updates(base, updates)
    if acc_quant is not None:
        acc = new = acc_quant(new, count, stream(key, count, ACC_STREAM))
    if weight_quant is not None:
        new = weight_quant(new, count, stream(key, count, WEIGHT_STREAM))
    return updates_to(new, params), acc


def optim_lp(inner: optax.GradientTransformation, *,
             weight_quant: LPQuant | None = None,
             grad_quant: LPQuant | None = None,
             momentum_quant: LPQuant | None = None,
             acc_quant: LPQuant | None = None,
             seed: Any = 0,
             momentum_fields: Sequence[str] = MOMENTUM_FIELDS
             ) -> optax.GradientTransformation:
    """QPyTorch's ``OptimLP`` around any optax optimizer, in QPyTorch's order.

    ::

        g   <- Q_grad(g)
        a   <- acc (if acc_quant) else w           # the optimizer steps on `a`
        u, s <- inner.update(g, s, params=a)       # weight decay etc. see `a`
        a'  <- a + u
        acc <- Q_acc(a')                           # if acc_quant
        w'  <- Q_w(acc or a')
        s   <- Q_mom on the momentum leaves of s   # `momentum_fields`
        return u' = w' - w

    A quantizer left None is skipped; ``LPQuant(32)`` keeps that tensor in fp32 (an
    fp32 accumulator is ``acc_quant=LPQuant(32)``). The stochastic-rounding keys are
    ``fold_in(fold_in(key, count), role)`` per role (grad 0, acc 1, weight 2,
    momentum 3), then ``fold_in(., leaf_index)``. See `quantize_weights` for the
    exactness of ``w + u' == w'``.

    Args:
      inner: any optax optimizer (it steps on the accumulator when one is kept).
      weight_quant: `LPQuant` of the weights (None: not quantized).
      grad_quant: `LPQuant` of the incoming gradients.
      momentum_quant: `LPQuant` of the state's momentum leaves.
      acc_quant: `LPQuant` of a high-precision weight accumulator (None: none kept).
      seed: PRNG seed (int or key) of the stochastic rounding.
      momentum_fields: state field names treated as momentum.

    Returns:
      An optax transformation (state `OptimLPState`); needs ``params`` in ``update``.

    Example:
      >>> params = {"w": jnp.array([0.3, -1.2, 0.05])}
      >>> grads = {"w": jnp.array([0.1, 0.2, -0.3])}
      >>> q8 = LPQuant(8, BlockFloat(), "stochastic")
      >>> opt = optim_lp(optax.adam(1e-3), weight_quant=q8, grad_quant=q8,
      ...                momentum_quant=q8, acc_quant=LPQuant(32))
      >>> state = opt.init(params)
      >>> updates, state = opt.update(grads, state, params)
      >>> params = optax.apply_updates(params, updates)
      >>> params["w"].dtype
      dtype('float32')
    """
    _check_quants(weight_quant=weight_quant, grad_quant=grad_quant,
                  momentum_quant=momentum_quant, acc_quant=acc_quant)

    def init_fn(params):
        acc = (jax.tree_util.tree_map(lambda p: jnp.array(p, copy=True), params)
               if acc_quant is not None else None)
        return OptimLPState(jnp.zeros([], jnp.int32), as_key(seed), acc,
                            inner.init(acc if acc is not None else params))

    def update_fn(grads, state, params=None):
        if params is None and weight_quant is not None:
            raise ValueError("optim_lp with weight_quant needs params: call "
                             "update(grads, state, params)")
        count, key = state.count, state.key
        if grad_quant is not None:
            grads = grad_quant(grads, count, stream(key, count, GRAD_STREAM))
        base = state.acc if acc_quant is not None else params
        updates, inner_state = inner.update(grads, state.inner_state, base)
        updates, acc = _land_on_grid(base, updates, params, acc_quant, weight_quant, count,
                                     key)
        if momentum_quant is not None:
            inner_state = momentum_leaves(inner_state, momentum_quant, count,
                                           stream(key, count, MOMENTUM_STREAM), momentum_fields)
        return updates, OptimLPState(optax.safe_int32_increment(count), key, acc,
                                     inner_state)

    return optax.GradientTransformation(init_fn, update_fn)


def _is_static_zero(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x == 0


def lp_sgd(learning_rate: float | optax.Schedule, momentum: float | None = 0.0, *,
           nesterov: bool = False, weight_decay: float = 0.0,
           weight_bits: BitsLike = 8, grad_bits: BitsLike = 8,
           momentum_bits: BitsLike = 8, acc_bits: BitsLike = None,
           weight_fmt: Format = BlockFloat(), grad_fmt: Format = BlockFloat(),
           momentum_fmt: Format = BlockFloat(), acc_fmt: Format = BlockFloat(),
           rounding: str = "stochastic", seed: Any = 0) -> optax.GradientTransformation:
    """Low-precision SGD (PyTorch SGD semantics) wrapped in `optim_lp`.

    With ``g = Q_grad(grad)`` and ``a`` the accumulator or the weights::

        d = g + weight_decay * a
        m = momentum * m + d                    (m quantized after the step)
        step = d + momentum * m if nesterov else m
        a' = a - lr * step,  acc = Q_acc(a'),  w' = Q_w(acc or a')

    Defaults are SWALP's recipe: 8-bit `BlockFloat` weights, gradients and momentum
    with stochastic rounding, no separate accumulator. A width None skips that
    quantizer; 32 is fp32. All numeric arguments may be traced, so the optimizer
    works under ``optax.inject_hyperparams`` (pass ``static_args=("seed",)`` to
    keep the seed static), and bit-widths may be schedules of the step count.

    Args:
      learning_rate: a number or an optax schedule.
      momentum: SGD momentum in [0, 1] (0 or None: none).
      nesterov: Nesterov momentum.
      weight_decay: L2 decay added to the gradient (PyTorch semantics).
      weight_bits, grad_bits, momentum_bits, acc_bits: widths (`BitsLike`; None skips
        that quantizer, 32 is fp32; ``acc_bits=None`` keeps no accumulator).
      weight_fmt, grad_fmt, momentum_fmt, acc_fmt: their number formats.
      rounding: ``"stochastic"`` or ``"nearest"``.
      seed: PRNG seed (int or key) of the stochastic rounding.

    Returns:
      An optax transformation; ``update`` needs ``params``.

    Example:
      >>> params = {"w": jnp.array([0.3, -1.2, 0.05])}
      >>> grads = {"w": jnp.array([0.1, 0.2, -0.3])}
      >>> from cpt_jax.optim import quantize_tree
      >>> on_grid = lambda t: bool(jnp.all(t["w"] == quantize_tree(t, 8, BlockFloat(),
      ...                                                          rounding="nearest")["w"]))
      >>> opt = lp_sgd(0.05, momentum=0.9, weight_decay=5e-4)
      >>> state = opt.init(params)
      >>> updates, state = opt.update(grads, state, params)
      >>> on_grid(optax.apply_updates(params, updates))    # on the 8-bit grid
      True
      >>> # bits that change every step, without recompiling:
      >>> opt = optax.inject_hyperparams(lp_sgd, static_args=("seed",))(
      ...     learning_rate=0.05, weight_bits=8)
      >>> state = opt.init(params)
      >>> state.hyperparams["weight_bits"] = jnp.asarray(6)
      >>> updates, state = opt.update(grads, state, params)
    """
    if not callable(learning_rate):
        check_positive(learning_rate, "learning_rate", allow_zero=True)
    if momentum is not None and not isinstance(momentum, jax.core.Tracer):
        m = np.asarray(momentum)
        if m.size != 1 or not (0.0 <= float(m) < 1.0 + 1e-12):
            raise ValueError(f"momentum must be in [0, 1], got {momentum!r}")
    if not isinstance(weight_decay, jax.core.Tracer) and float(np.asarray(weight_decay)) < 0:
        raise ValueError(f"weight_decay must be >= 0, got {weight_decay!r}")
    parts = []
    if not _is_static_zero(weight_decay):
        parts.append(optax.add_decayed_weights(weight_decay))
    if momentum is not None and not _is_static_zero(momentum):
        parts.append(optax.trace(decay=momentum, nesterov=nesterov))
    parts.append(optax.scale_by_learning_rate(learning_rate))
    return optim_lp(
        optax.chain(*parts),
        weight_quant=quant_or_none(weight_bits, weight_fmt, rounding, "weight_bits"),
        grad_quant=quant_or_none(grad_bits, grad_fmt, rounding, "grad_bits"),
        momentum_quant=quant_or_none(momentum_bits, momentum_fmt, rounding, "momentum_bits"),
        acc_quant=quant_or_none(acc_bits, acc_fmt, rounding, "acc_bits"),
        seed=seed)
