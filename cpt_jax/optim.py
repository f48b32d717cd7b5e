"""Low-precision optimizers: LP-SGD (QPyTorch's OptimLP), SWALP, and HALP with SVRG.

Three families, one module:

* **Quantized optax transformations** (QPyTorch's ``OptimLP`` semantics). Gradients,
  weights, momentum and an optional high-precision accumulator are each quantized to
  any `cpt_jax` format with nearest or stochastic rounding. `optim_lp` wraps any optax
  optimizer in QPyTorch's exact order::

      g   <- Q_grad(g)                                   # gradient quantize
      a   <- acc if an accumulator is kept else w        # swap in the accumulator
      a'  <- a + inner.update(g, state, params=a)        # optimizer step
      acc <- Q_acc(a')                                   # accumulator quantize
      w'  <- Q_w(acc)   (Q_w(a') without accumulator)    # weight quantize
      m   <- Q_mom(m)   for the momentum leaves of state # momentum quantize

  and returns the optax update ``u = w' - w`` so that ``optax.apply_updates(w, u)``
  gives the quantized weights (see `quantize_weights` for when this is exact).
  `lp_sgd` is SGD (momentum, Nesterov, weight decay) built this way. The PRNG key for
  stochastic rounding lives in the optimizer state; step ``t`` uses
  ``fold_in(key, t)`` and leaf ``i`` ``fold_in(that, i)``: deterministic and jittable.
  Every bit-width may be a number, a traced scalar, or a schedule ``bits(count)``;
  all are compatible with ``optax.inject_hyperparams``.

* **SWALP** (Yang et al. 2019): `swa` keeps a high-precision running mean of the
  iterates every ``swa_freq`` steps from ``swa_start``; `swalp` is `swa` around
  `lp_sgd` with a constant learning rate after ``swa_start``.
  `recompute_batch_stats` recomputes BatchNorm statistics for the averaged weights as
  SWA's ``bn_update`` does.

* **SVRG, LP-SVRG and HALP** (De Sa et al. 2018). These need a full-gradient pass
  every epoch, which is not an optax update, so they are epoch functions
  ``epoch(params, data, key) -> params``: `svrg_epoch` (fp32), `lp_svrg_epoch`
  (iterates on a fixed b-bit grid), `halp_epoch` (bit centering), and the jitted
  factories `svrg`, `lp_svrg`, `halp`. The HALP state (`HALPState`: fp32 anchor,
  full gradient, int8/int16 codes of the offset and its scale) is public for custom
  loops: ``state.recenter(full_grad, mu=...)``, ``state.inner_step(...)``,
  ``state.params``.
"""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import struct

from cpt_jax import formats
from cpt_jax.formats import BlockFloat, Format, quantize

Array = jax.Array
Params = Any
BitsLike = Union[int, float, Array, Callable[[Array], Any], None]
"""A bit-width: a number, a (traced) scalar, a schedule ``count -> bits``, or None
(no quantization). ``>= 32`` is full precision."""

MOMENTUM_FIELDS = ("trace", "mu", "nu")
"""Names of optax state fields that `optim_lp` quantizes as momentum: ``trace``
(``optax.trace``, SGD momentum), ``mu`` and ``nu`` (Adam's moments), as QPyTorch
quantizes ``momentum_buffer``, ``exp_avg`` and ``exp_avg_sq``."""


# --------------------------------------------------------------------------- helpers

def _as_key(seed: Any) -> Array:
    """A PRNG key from an int seed, a raw uint32[2] key or a typed key."""
    if isinstance(seed, jax.Array) and jnp.issubdtype(seed.dtype, jax.dtypes.prng_key):
        return seed
    arr = jnp.asarray(seed)
    if arr.dtype == jnp.uint32 and arr.shape == (2,):
        return arr
    if arr.shape != () or not jnp.issubdtype(arr.dtype, jnp.integer):
        raise ValueError(f"seed must be an int or a PRNG key, got {seed!r}")
    return jax.random.PRNGKey(arr)


def _check_bits_like(bits: BitsLike, name: str) -> None:
    if bits is None or callable(bits):
        return
    formats.check_bits(bits, name)


def _resolve_bits(bits: BitsLike, count: Array) -> Any:
    """Evaluate a schedule at ``count``; numbers and arrays pass through."""
    if callable(bits):
        return jnp.asarray(bits(count), jnp.float32)
    return bits


def _is_float(x: Any) -> bool:
    return hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating)


def quantize_tree(tree: Any, bits: Any, fmt: Format = BlockFloat(), *,
                  rounding: str = "stochastic", key: Optional[Array] = None) -> Any:
    """Quantize every floating-point leaf of a pytree, each as its own tensor.

    Leaf ``i`` (in ``jax.tree_util`` order) uses the key ``fold_in(key, i)``, so
    leaves get independent rounding noise. Non-float leaves pass through; ``bits``
    None or ``>= 32`` leaves the tree unchanged.

    Example:
      >>> t = {"w": jnp.array([0.3, -1.2]), "b": jnp.array([0.05])}
      >>> quantize_tree(t, 4, FixedPoint(frac_bits=2), rounding="nearest")
      {'b': Array([0.], dtype=float32), 'w': Array([ 0.25, -1.25], dtype=float32)}
    """
    if bits is None:
        return tree
    formats.check_format(fmt)
    formats.check_rounding(rounding, key)
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    out = []
    for i, leaf in enumerate(leaves):
        if not _is_float(leaf):
            out.append(leaf)
            continue
        k = jax.random.fold_in(key, i) if rounding == "stochastic" else None
        out.append(quantize(leaf, bits, fmt, rounding=rounding, key=k))
    return jax.tree_util.tree_unflatten(treedef, out)


@dataclasses.dataclass(frozen=True)
class LPQuant:
    """How one kind of optimizer tensor is quantized: ``Q(x) = quantize(x, bits, fmt)``.

    Attributes:
      bits: word length: a number, a traced scalar, or a schedule ``count -> bits``
        evaluated on the optimizer's step count. ``>= 32`` is full precision.
      fmt: a `cpt_jax` format (`BlockFloat`, `FixedPoint`, `SymmetricInt`, ...).
      rounding: ``"stochastic"`` (``floor(v + U)``, SWALP's choice) or ``"nearest"``.

    Example:
      >>> LPQuant(8, BlockFloat())               # SWALP's 8-bit block float
      >>> LPQuant(lambda t: 4 + 4 * (t > 100))   # 4 bits, then 8
    """

    bits: Any = 8
    fmt: Format = BlockFloat()
    rounding: str = "stochastic"

    def __post_init__(self):
        if self.bits is None:
            raise ValueError("LPQuant.bits must be a number, an array or a schedule, got None "
                             "(pass quant=None to the optimizer to skip quantization)")
        _check_bits_like(self.bits, "LPQuant.bits")
        formats.check_format(self.fmt)
        if self.rounding not in formats.ROUNDINGS:
            raise ValueError(
                f"LPQuant.rounding must be one of {formats.ROUNDINGS}, got {self.rounding!r}")

    def __call__(self, tree: Any, count: Array, key: Array) -> Any:
        return quantize_tree(tree, _resolve_bits(self.bits, count), self.fmt,
                             rounding=self.rounding, key=key)


def _quant_or_none(bits: BitsLike, fmt: Format, rounding: str, name: str) -> Optional[LPQuant]:
    if bits is None:
        return None
    _check_bits_like(bits, name)
    return LPQuant(bits, fmt, rounding)


# Independent random streams of the four quantizers of one optimizer.
_GRAD, _ACC, _WEIGHT, _MOMENTUM = 0, 1, 2, 3


def _stream(key: Array, count: Array, role: int) -> Array:
    return jax.random.fold_in(jax.random.fold_in(key, count), role)


def _apply(params: Params, updates: Params) -> Params:
    return optax.apply_updates(params, updates)


def _updates_to(target: Params, params: Params) -> Params:
    """The optax update ``u = target - params`` (so ``params + u == target``)."""
    return jax.tree_util.tree_map(
        lambda t, p: (jnp.asarray(t) - jnp.asarray(p)).astype(jnp.asarray(p).dtype),
        target, params)


def _momentum_leaves(state: Any, quant: LPQuant, count: Array, key: Array,
                     fields: Sequence[str]) -> Any:
    """Quantize the floating leaves of `state` that sit under a field in `fields`."""
    leaves_with_path, treedef = jax.tree_util.tree_flatten_with_path(state)
    bits = _resolve_bits(quant.bits, count)
    out = []
    for i, (path, leaf) in enumerate(leaves_with_path):
        names = {getattr(k, "name", None) for k in path} | {getattr(k, "key", None)
                                                            for k in path}
        if _is_float(leaf) and names & set(fields):
            k = jax.random.fold_in(key, i) if quant.rounding == "stochastic" else None
            leaf = quantize(leaf, bits, quant.fmt, rounding=quant.rounding, key=k)
        out.append(leaf)
    return jax.tree_util.tree_unflatten(treedef, out)


# --------------------------------------------------------------------------- transforms

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
      >>> opt = optax.chain(quantize_gradients(8, BlockFloat()), optax.sgd(0.1))
      >>> state = opt.init(params)
      >>> updates, state = opt.update(grads, state, params)
    """
    quant = _quant_or_none(bits, fmt, rounding, "bits")

    def init_fn(params):
        del params
        return QuantizeState(jnp.zeros([], jnp.int32), _as_key(seed))

    def update_fn(updates, state, params=None):
        del params
        if quant is not None:
            updates = quant(updates, state.count, _stream(state.key, state.count, _GRAD))
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
      >>> opt = quantize_momentum(optax.sgd(0.1, momentum=0.9), 8, BlockFloat())
    """
    quant = _quant_or_none(bits, fmt, rounding, "bits")

    def init_fn(params):
        return QuantizeMomentumState(jnp.zeros([], jnp.int32), _as_key(seed),
                                     inner.init(params))

    def update_fn(updates, state, params=None):
        updates, inner_state = inner.update(updates, state.inner_state, params)
        if quant is not None:
            inner_state = _momentum_leaves(inner_state, quant, state.count,
                                           _stream(state.key, state.count, _MOMENTUM), fields)
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
      >>> opt = optax.chain(optax.sgd(0.1), quantize_weights(8, BlockFloat()))
      >>> updates, state = opt.update(grads, opt.init(params), params)
      >>> params = optax.apply_updates(params, updates)   # on the 8-bit grid
    """
    quant = _quant_or_none(bits, fmt, rounding, "bits")
    acc_quant = _quant_or_none(acc_bits, acc_fmt, acc_rounding, "acc_bits")

    def init_fn(params):
        acc = (jax.tree_util.tree_map(lambda p: jnp.array(p, copy=True), params)
               if acc_quant is not None else None)
        return QuantizeWeightsState(jnp.zeros([], jnp.int32), _as_key(seed), acc)

    def update_fn(updates, state, params=None):
        if params is None:
            raise ValueError("quantize_weights needs params: call update(updates, state, "
                             "params)")
        new = _apply(state.acc if acc_quant is not None else params, updates)
        acc = None
        if acc_quant is not None:
            acc = new = acc_quant(new, state.count, _stream(state.key, state.count, _ACC))
        if quant is not None:
            new = quant(new, state.count, _stream(state.key, state.count, _WEIGHT))
        return _updates_to(new, params), QuantizeWeightsState(
            optax.safe_int32_increment(state.count), state.key, acc)

    return optax.GradientTransformation(init_fn, update_fn)


class OptimLPState(NamedTuple):
    """State of `optim_lp`: count, key, accumulator (or None), the inner state."""

    count: Array
    key: Array
    acc: Any
    inner_state: Any


def optim_lp(inner: optax.GradientTransformation, *,
             weight_quant: Optional[LPQuant] = None,
             grad_quant: Optional[LPQuant] = None,
             momentum_quant: Optional[LPQuant] = None,
             acc_quant: Optional[LPQuant] = None,
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

    Example:
      >>> q8 = LPQuant(8, BlockFloat(), "stochastic")
      >>> opt = optim_lp(optax.adam(1e-3), weight_quant=q8, grad_quant=q8,
      ...                momentum_quant=q8, acc_quant=LPQuant(32))
      >>> state = opt.init(params)
      >>> updates, state = opt.update(grads, state, params)
      >>> params = optax.apply_updates(params, updates)
    """
    for name, q in (("weight_quant", weight_quant), ("grad_quant", grad_quant),
                    ("momentum_quant", momentum_quant), ("acc_quant", acc_quant)):
        if q is not None and not isinstance(q, LPQuant):
            raise ValueError(f"{name} must be an LPQuant or None, got {q!r}")

    def init_fn(params):
        acc = (jax.tree_util.tree_map(lambda p: jnp.array(p, copy=True), params)
               if acc_quant is not None else None)
        return OptimLPState(jnp.zeros([], jnp.int32), _as_key(seed), acc,
                            inner.init(acc if acc is not None else params))

    def update_fn(grads, state, params=None):
        if params is None and weight_quant is not None:
            raise ValueError("optim_lp with weight_quant needs params: call "
                             "update(grads, state, params)")
        count, key = state.count, state.key
        if grad_quant is not None:
            grads = grad_quant(grads, count, _stream(key, count, _GRAD))
        base = state.acc if acc_quant is not None else params
        updates, inner_state = inner.update(grads, state.inner_state, base)
        acc = None
        if acc_quant is not None or weight_quant is not None:
            new = _apply(base, updates)
            if acc_quant is not None:
                acc = new = acc_quant(new, count, _stream(key, count, _ACC))
            if weight_quant is not None:
                new = weight_quant(new, count, _stream(key, count, _WEIGHT))
            updates = _updates_to(new, params)
        if momentum_quant is not None:
            inner_state = _momentum_leaves(inner_state, momentum_quant, count,
                                           _stream(key, count, _MOMENTUM), momentum_fields)
        return updates, OptimLPState(optax.safe_int32_increment(count), key, acc,
                                     inner_state)

    return optax.GradientTransformation(init_fn, update_fn)


def _is_static_zero(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x == 0


def lp_sgd(learning_rate: Union[float, optax.Schedule], momentum: Optional[float] = 0.0, *,
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

    Example:
      >>> opt = lp_sgd(0.05, momentum=0.9, weight_decay=5e-4)
      >>> state = opt.init(params)
      >>> updates, state = opt.update(grads, state, params)
      >>> params = optax.apply_updates(params, updates)    # on the 8-bit grid
      >>> # bits that change every step, without recompiling:
      >>> opt = optax.inject_hyperparams(lp_sgd, static_args=("seed",))(
      ...     learning_rate=0.05, weight_bits=8)
      >>> state.hyperparams["weight_bits"] = jnp.asarray(6)
    """
    if not callable(learning_rate):
        _check_positive(learning_rate, "learning_rate", allow_zero=True)
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
        weight_quant=_quant_or_none(weight_bits, weight_fmt, rounding, "weight_bits"),
        grad_quant=_quant_or_none(grad_bits, grad_fmt, rounding, "grad_bits"),
        momentum_quant=_quant_or_none(momentum_bits, momentum_fmt, rounding, "momentum_bits"),
        acc_quant=_quant_or_none(acc_bits, acc_fmt, rounding, "acc_bits"),
        seed=seed)


# --------------------------------------------------------------------------- SWA(LP)

class SWAState(NamedTuple):
    """State of `swa`: step count, number averaged, the fp32 average, inner state."""

    count: Array
    n_averaged: Array
    average: Params
    inner_state: Any


def swa(inner: optax.GradientTransformation, *, swa_start: int, swa_freq: int = 1
        ) -> optax.GradientTransformation:
    """Stochastic weight averaging of the iterates of `inner`, kept in float32.

    After step ``t`` (1-based: the params after ``t`` updates), when ``t >= swa_start``
    and ``(t - swa_start) % swa_freq == 0``::

        n <- n + 1,   avg <- avg + (w_t - avg) / n

    so ``avg`` is the mean of the averaged iterates. The updates of `inner` pass
    through unchanged; read the average with `swa_params`. Needs ``params``.

    Example:
      >>> opt = swa(lp_sgd(0.05, 0.9), swa_start=1000, swa_freq=100)
      >>> ...                                    # train as usual
      >>> averaged = swa_params(state)           # then `recompute_batch_stats`
    """
    _check_int(swa_start, "swa_start", 0)
    _check_int(swa_freq, "swa_freq", 1)

    def init_fn(params):
        avg = jax.tree_util.tree_map(lambda p: jnp.zeros(jnp.shape(p), jnp.float32), params)
        return SWAState(jnp.zeros([], jnp.int32), jnp.zeros([], jnp.int32), avg,
                        inner.init(params))

    def update_fn(updates, state, params=None):
        if params is None:
            raise ValueError("swa needs params: call update(updates, state, params)")
        updates, inner_state = inner.update(updates, state.inner_state, params)
        count = optax.safe_int32_increment(state.count)
        take = (count >= swa_start) & ((count - swa_start) % swa_freq == 0)
        n = state.n_averaged + take.astype(jnp.int32)
        new_params = _apply(params, updates)
        avg = jax.tree_util.tree_map(
            lambda a, w: jnp.where(take, a + (jnp.asarray(w, jnp.float32) - a)
                                   / jnp.maximum(n, 1).astype(jnp.float32), a),
            state.average, new_params)
        return updates, SWAState(count, n, avg, inner_state)

    return optax.GradientTransformation(init_fn, update_fn)


def swa_params(opt_state: Any) -> Params:
    """The averaged weights held by the (first) `SWAState` inside ``opt_state``.

    Example:
      >>> averaged = swa_params(state)
    """
    found = [s for s in jax.tree_util.tree_leaves(
        opt_state, is_leaf=lambda x: isinstance(x, SWAState)) if isinstance(s, SWAState)]
    if not found:
        raise ValueError("opt_state holds no SWAState: build the optimizer with swa/swalp")
    return found[0].average


def swa_count(opt_state: Any) -> Array:
    """How many iterates the `SWAState` inside ``opt_state`` has averaged."""
    found = [s for s in jax.tree_util.tree_leaves(
        opt_state, is_leaf=lambda x: isinstance(x, SWAState)) if isinstance(s, SWAState)]
    if not found:
        raise ValueError("opt_state holds no SWAState: build the optimizer with swa/swalp")
    return found[0].n_averaged


def swalp(learning_rate: Union[float, optax.Schedule], momentum: float = 0.9, *,
          swa_start: int, swa_freq: int, swa_lr: Optional[float] = None,
          weight_decay: float = 0.0, bits: BitsLike = 8, fmt: Format = BlockFloat(),
          rounding: str = "stochastic", seed: Any = 0, **lp_kwargs: Any
          ) -> optax.GradientTransformation:
    """SWALP: low-precision SGD, then an fp32 average of its iterates.

    ``lp_sgd`` with weights, gradients and momentum at `bits` in `fmt` (8-bit block
    float, stochastic rounding: SWALP's recipe), learning rate `learning_rate` until
    ``swa_start`` and the constant ``swa_lr`` from then on (when given), averaged by
    `swa` every ``swa_freq`` steps (SWALP: once per epoch) from ``swa_start``.
    Extra keyword arguments go to `lp_sgd` (e.g. ``acc_bits=32``, ``weight_fmt``).
    Before evaluating ``swa_params(state)`` on a BatchNorm model, recompute its
    statistics with `recompute_batch_stats`.

    Example:
      >>> opt = swalp(0.05, 0.9, swa_start=30 * steps, swa_freq=steps, swa_lr=0.01)
      >>> state = opt.init(params)
      >>> ...                                      # usual optax loop
      >>> averaged = swa_params(state)
    """
    _check_int(swa_start, "swa_start", 0)
    lr = learning_rate
    if swa_lr is not None:
        _check_positive(swa_lr, "swa_lr", allow_zero=True)
        first = learning_rate if callable(learning_rate) else optax.constant_schedule(
            learning_rate)
        lr = optax.join_schedules([first, optax.constant_schedule(swa_lr)], [swa_start])
    kw = dict(weight_bits=bits, grad_bits=bits, momentum_bits=bits, weight_fmt=fmt,
              grad_fmt=fmt, momentum_fmt=fmt, rounding=rounding, seed=seed)
    kw.update(lp_kwargs)
    return swa(lp_sgd(lr, momentum, weight_decay=weight_decay, **kw),
               swa_start=swa_start, swa_freq=swa_freq)


def recompute_batch_stats(model_apply: Callable[[Any, Any], Any], variables: Any,
                          batches: Iterable[Any], *, stats_key: str = "batch_stats") -> Any:
    """BatchNorm statistics of `variables` recomputed on `batches` (SWA's bn_update).

    ``model_apply(variables, batch)`` must run a train-mode forward pass and return
    the updated statistics collection, e.g.::

        lambda v, x: model.apply(v, x, train=True, mutable=["batch_stats"])[1]["batch_stats"]

    Each running statistic is assumed to follow ``r <- m r + (1 - m) s_batch`` (flax
    ``nn.BatchNorm``, any momentum ``m``). Running the forward from ``r = 0`` and from
    ``r = 1`` gives ``m`` and the batch statistic ``s_batch = r(0) / (1 - m)``; the
    result is the batch-size weighted mean of ``s_batch`` over `batches` (the mean of
    the batch means and of the batch variances), which is what SWA's ``bn_update``
    computes with its cumulative momentum ``b / (n + b)``. Statistics the forward
    does not update keep their value. Runs ``len(batches) + 1`` forward passes.

    Args:
      model_apply: ``(variables, batch) -> new statistics`` (jitted here).
      variables: the model variables with the (averaged) ``params`` and a
        ``stats_key`` collection whose values are replaced.
      batches: an iterable of batches (a batch is any pytree with leading batch dim).
      stats_key: name of the statistics collection.

    Example:
      >>> variables = {"params": swa_params(opt_state), "batch_stats": batch_stats}
      >>> apply = lambda v, x: model.apply(v, x, train=True,
      ...                                  mutable=["batch_stats"])[1]["batch_stats"]
      >>> batch_stats = recompute_batch_stats(apply, variables, train_batches)
    """
    if stats_key not in variables:
        raise ValueError(f"variables must hold a {stats_key!r} collection, got keys "
                         f"{list(variables)}")
    stats = variables[stats_key]
    zeros = jax.tree_util.tree_map(jnp.zeros_like, stats)
    ones = jax.tree_util.tree_map(jnp.ones_like, stats)

    @jax.jit
    def run(old, batch):
        return model_apply({**variables, stats_key: old}, batch)

    total, count, momentum = None, 0, None
    for batch in batches:
        size = int(jnp.shape(jax.tree_util.tree_leaves(batch)[0])[0])
        from_zero = run(zeros, batch)
        if momentum is None:
            momentum = jax.tree_util.tree_map(lambda a, b: a - b, run(ones, batch), from_zero)
        stat = jax.tree_util.tree_map(
            lambda r0, m: r0 / jnp.where(1.0 - m > 1e-6, 1.0 - m, 1.0), from_zero, momentum)
        weighted = jax.tree_util.tree_map(lambda s: s * size, stat)
        total = weighted if total is None else jax.tree_util.tree_map(jnp.add, total, weighted)
        count += size
    if total is None:
        raise ValueError("batches is empty: recompute_batch_stats needs at least one batch")
    return jax.tree_util.tree_map(
        lambda t, m, old: jnp.where(1.0 - m > 1e-6, t / count, old).astype(old.dtype),
        total, momentum, stats)


# --------------------------------------------------------------------------- SVRG / HALP

def _check_positive(x: Any, name: str, allow_zero: bool = False) -> None:
    if isinstance(x, jax.core.Tracer):
        return
    try:
        v = float(np.asarray(x))
    except Exception as exc:  # noqa: BLE001
        raise ValueError(f"{name} must be a number, got {x!r}") from exc
    if not np.isfinite(v) or v < 0 or (v == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{name} must be finite and {bound}, got {x!r}")


def _check_int(x: Any, name: str, minimum: int) -> None:
    if not isinstance(x, (int, np.integer)) or isinstance(x, bool) or x < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {x!r}")


def code_dtype(bits: int) -> jnp.dtype:
    """Smallest signed integer dtype holding ``[-2^(b-1), 2^(b-1) - 1]``.

    Example:
      >>> code_dtype(8), code_dtype(12)
      (dtype('int8'), dtype('int16'))
    """
    _check_int(bits, "bits", 2)
    if bits > 32:
        raise ValueError(f"bits must be an int in [2, 32], got {bits!r}")
    return jnp.dtype(jnp.int8 if bits <= 8 else jnp.int16 if bits <= 16 else jnp.int32)


def quantize_to_codes(u: Array, scale: Array, bits: Any, *, key: Array,
                      dtype: Any = jnp.int32) -> Array:
    """Integer codes of HALP's quantizer ``Q_{s,b}(u) = s * codes``.

    ``codes = clamp(floor(u / s + U), -2^(b-1), 2^(b-1) - 1)`` with ``U ~ U[0, 1)``
    (unbiased stochastic rounding inside the range). A zero scale gives zero codes.

    Example:
      >>> c = quantize_to_codes(jnp.array([0.26, -9.0]), 0.1, 4,
      ...                       key=jax.random.PRNGKey(0), dtype=jnp.int8)
      >>> c                                   # 2 or 3, and -8 (clamped)
    """
    b = jnp.asarray(bits, jnp.float32)
    lo, hi = -formats.pow2(b - 1.0), formats.pow2(b - 1.0) - 1.0
    s = jnp.asarray(scale, jnp.float32)
    safe = jnp.where(s > 0, s, 1.0)
    v = jnp.where(s > 0, jnp.asarray(u, jnp.float32) / safe, 0.0)
    noise = jax.random.uniform(key, jnp.shape(u), jnp.float32)
    return jnp.clip(jnp.floor(v + noise), lo, hi).astype(dtype)


def _tree_norm(tree: Params) -> Array:
    return jnp.sqrt(sum(jnp.sum(jnp.square(jnp.asarray(x, jnp.float32)))
                        for x in jax.tree_util.tree_leaves(tree)))


def halp_scale(full_grad: Params, mu: Any, bits: Any) -> Array:
    """HALP's bit-centering scale ``s = ||g~|| / (mu (2^(b-1) - 1))`` (global 2-norm).

    The grid ``s * [-2^(b-1), 2^(b-1) - 1]`` then has radius about ``||g~|| / mu``:
    for a ``mu``-strongly convex loss it covers the distance to the optimum.

    Example:
      >>> halp_scale({"w": jnp.array([3.0, 4.0])}, mu=0.1, bits=8)   # 5 / 12.7
      Array(0.39370078, dtype=float32)
    """
    b = jnp.asarray(bits, jnp.float32)
    return _tree_norm(full_grad) / (jnp.asarray(mu, jnp.float32)
                                    * (formats.pow2(b - 1.0) - 1.0))


@struct.dataclass
class HALPState:
    """Bit-centered iterate of HALP: ``w = anchor + scale * codes``.

    Attributes:
      anchor: the centre ``w~`` (float32), where the full gradient was taken.
      full_grad: ``g~ = grad f(w~)`` (float32).
      codes: the offset ``z = scale * codes`` as integers (int8 for b <= 8,
        int16 for b <= 16).
      scale: ``s = ||g~|| / (mu (2^(b-1) - 1))``.
      bits: word length ``b`` of the codes (may be traced; codes stay in
        ``[-2^(b-1), 2^(b-1) - 1]``).

    Example (a custom loop; `halp_epoch` does this for you)::

      state = halp_init(params, bits=8)
      for epoch in range(E):
          g = full_gradient(loss_fn, state.params, data)
          state = state.recenter(g, mu=0.1)              # w~ <- w~ + z, z <- 0
          for t in range(T):
              batch = ...
              gw = jax.grad(loss_fn)(state.params, batch)
              ga = jax.grad(loss_fn)(state.anchor, batch)
              state = state.inner_step(gw, ga, learning_rate=0.1, key=keys[t])
      params = state.params
    """

    anchor: Params
    full_grad: Params
    codes: Params
    scale: Array
    bits: Array

    @property
    def params(self) -> Params:
        """The current iterate ``w~ + s * codes`` (float32)."""
        return jax.tree_util.tree_map(
            lambda a, c: a + self.scale * c.astype(jnp.float32), self.anchor, self.codes)

    @property
    def offset(self) -> Params:
        """The offset ``z = s * codes`` (float32)."""
        return jax.tree_util.tree_map(lambda c: self.scale * c.astype(jnp.float32),
                                      self.codes)

    def recenter(self, full_grad: Params, *, mu: Any = 0.1) -> "HALPState":
        """Bit centering: ``w~ <- w~ + z``, ``g~ <- full_grad`` (taken at the new
        ``w~``, i.e. at ``self.params``), ``s <- ||g~|| / (mu (2^(b-1) - 1))``,
        ``z <- 0``."""
        _check_positive(mu, "mu")
        return self.replace(
            anchor=self.params,
            full_grad=jax.tree_util.tree_map(lambda g: jnp.asarray(g, jnp.float32),
                                             full_grad),
            codes=jax.tree_util.tree_map(jnp.zeros_like, self.codes),
            scale=halp_scale(full_grad, mu, self.bits))

    def inner_step(self, grad_at_params: Params, grad_at_anchor: Params,
                   learning_rate: Any, key: Array) -> "HALPState":
        """``z <- Q_{s,b}(z - lr (grad_i(w~ + z) - grad_i(w~) + g~))`` on the codes.

        Leaf ``j`` rounds with ``fold_in(key, j)``.
        """
        leaves_c, treedef = jax.tree_util.tree_flatten(self.codes)
        leaves_gw = treedef.flatten_up_to(grad_at_params)
        leaves_ga = treedef.flatten_up_to(grad_at_anchor)
        leaves_g = treedef.flatten_up_to(self.full_grad)
        out = []
        for j, (c, gw, ga, g) in enumerate(zip(leaves_c, leaves_gw, leaves_ga, leaves_g)):
            v = gw - ga + g
            u = self.scale * c.astype(jnp.float32) - learning_rate * v
            out.append(quantize_to_codes(u, self.scale, self.bits,
                                         key=jax.random.fold_in(key, j), dtype=c.dtype))
        return self.replace(codes=jax.tree_util.tree_unflatten(treedef, out))


def halp_init(params: Params, *, bits: Any = 8, dtype: Any = None) -> HALPState:
    """A `HALPState` centred at `params` with ``z = 0`` (call `recenter` before steps).

    Codes are stored in `dtype`, by default `code_dtype(bits)` (int8 at 8 bits);
    with a traced `bits` pass `dtype` large enough for its largest value.

    Example:
      >>> state = halp_init({"w": jnp.zeros(3)}, bits=8)
      >>> state.codes["w"].dtype
      dtype('int8')
    """
    if dtype is None:
        if isinstance(bits, jax.core.Tracer):
            raise ValueError("halp_init with a traced bits needs an explicit dtype")
        bits_v = np.asarray(bits)
        if bits_v.shape != () or float(bits_v) != int(bits_v):
            raise ValueError(f"bits must be an integer in [2, 32], got {bits!r}")
        dtype = code_dtype(int(bits_v))
    elif not isinstance(bits, jax.core.Tracer):
        b = int(np.asarray(bits))
        if not 2 <= b <= jnp.iinfo(dtype).bits:
            raise ValueError(f"bits must be in [2, {jnp.iinfo(dtype).bits}] for codes of "
                             f"dtype {jnp.dtype(dtype)}, got {bits!r}")
    anchor = jax.tree_util.tree_map(lambda p: jnp.asarray(p, jnp.float32), params)
    return HALPState(
        anchor=anchor,
        full_grad=jax.tree_util.tree_map(jnp.zeros_like, anchor),
        codes=jax.tree_util.tree_map(lambda p: jnp.zeros(jnp.shape(p), dtype), anchor),
        scale=jnp.zeros([], jnp.float32),
        bits=jnp.asarray(bits, jnp.float32))


def full_gradient(loss_fn: Callable[[Params, Any], Array], params: Params, data: Any, *,
                  batch_size: Optional[int] = None) -> Params:
    """Gradient of the mean loss over all of `data`: ``g = (1/N) sum_i grad f_i(w)``.

    `loss_fn(params, batch)` returns the mean loss of a batch. With `batch_size` the
    data is processed in chunks (``lax.scan``) and the chunk gradients are averaged
    with weights ``len(chunk) / N``; otherwise one call on the whole data.

    Example:
      >>> g = full_gradient(loss_fn, params, (x, y), batch_size=1000)
    """
    n = _num_examples(data)
    grad_fn = jax.grad(loss_fn)
    if batch_size is None or batch_size >= n:
        return grad_fn(params, data)
    _check_int(batch_size, "batch_size", 1)
    full, rem = divmod(n, batch_size)
    head = jax.tree_util.tree_map(
        lambda a: a[: full * batch_size].reshape((full, batch_size) + a.shape[1:]), data)

    def body(acc, chunk):
        g = grad_fn(params, chunk)
        return jax.tree_util.tree_map(lambda s, x: s + x * (batch_size / n), acc, g), None

    zero = jax.tree_util.tree_map(lambda p: jnp.zeros(jnp.shape(p), jnp.float32), params)
    total, _ = jax.lax.scan(body, zero, head)
    if rem:
        tail = jax.tree_util.tree_map(lambda a: a[full * batch_size:], data)
        total = jax.tree_util.tree_map(lambda s, x: s + x * (rem / n), total,
                                       grad_fn(params, tail))
    return total


def _num_examples(data: Any) -> int:
    leaves = jax.tree_util.tree_leaves(data)
    if not leaves:
        raise ValueError("data must be a non-empty pytree of arrays with a leading "
                         "example dimension")
    n = int(jnp.shape(leaves[0])[0])
    for leaf in leaves:
        if jnp.shape(leaf)[0] != n:
            raise ValueError(f"every leaf of data must have the same leading dimension, "
                             f"got {[jnp.shape(x)[0] for x in leaves]}")
    return n


def minibatch_indices(key: Array, n: int, batch_size: int, num_steps: int) -> Array:
    """``(num_steps, batch_size)`` example indices: consecutive slices of random
    permutations of ``range(n)`` (a fresh permutation, ``fold_in(key, p)``, for pass
    ``p`` once ``n // batch_size`` batches are used; the remainder is dropped)."""
    per_pass = n // batch_size
    passes = -(-num_steps // per_pass)
    perms = jax.vmap(lambda p: jax.random.permutation(jax.random.fold_in(key, p), n))(
        jnp.arange(passes))
    return perms[:, : per_pass * batch_size].reshape(-1, batch_size)[:num_steps]


def _check_epoch_args(data: Any, learning_rate: Any, batch_size: int,
                      num_steps: Optional[int]) -> tuple[int, int]:
    n = _num_examples(data)
    _check_positive(learning_rate, "learning_rate")
    _check_int(batch_size, "batch_size", 1)
    if batch_size > n:
        raise ValueError(f"batch_size must be in [1, N={n}], got {batch_size}")
    if num_steps is None:
        num_steps = n // batch_size
    _check_int(num_steps, "num_steps", 1)
    return n, num_steps


def _take(data: Any, idx: Array) -> Any:
    return jax.tree_util.tree_map(lambda a: a[idx], data)


def svrg_epoch(loss_fn: Callable[[Params, Any], Array], params: Params, data: Any,
               key: Array, *, learning_rate: Any, batch_size: int,
               num_steps: Optional[int] = None, full_batch_size: Optional[int] = None
               ) -> Params:
    """One outer iteration of full-precision SVRG (Johnson & Zhang 2013).

    ``w~ = w``, ``g~ = grad f(w~)``; then ``T = num_steps`` (default one pass,
    ``N // batch_size``) steps ``w <- w - lr (grad_i(w) - grad_i(w~) + g~)`` on
    minibatches ``i``; returns the last iterate.

    Example:
      >>> params = svrg_epoch(loss_fn, params, (x, y), jax.random.PRNGKey(0),
      ...                     learning_rate=0.5, batch_size=16)
    """
    n, num_steps = _check_epoch_args(data, learning_rate, batch_size, num_steps)
    grad_fn = jax.grad(loss_fn)
    anchor = params
    g_full = full_gradient(loss_fn, anchor, data, batch_size=full_batch_size)
    idx = minibatch_indices(key, n, batch_size, num_steps)

    def body(w, i):
        batch = _take(data, i)
        v = jax.tree_util.tree_map(lambda a, b, c: a - b + c, grad_fn(w, batch),
                                   grad_fn(anchor, batch), g_full)
        return jax.tree_util.tree_map(lambda p, d: p - learning_rate * d, w, v), None

    params, _ = jax.lax.scan(body, params, idx)
    return params


def lp_svrg_epoch(loss_fn: Callable[[Params, Any], Array], params: Params, data: Any,
                  key: Array, *, learning_rate: Any, batch_size: int, scale: Any,
                  bits: int = 8, num_steps: Optional[int] = None,
                  full_batch_size: Optional[int] = None) -> Params:
    """One outer iteration of low-precision SVRG on a fixed grid (no re-centering).

    The iterates are stored as `bits`-bit integer codes of a fixed scale ``s``:
    ``w = s * c``. Start ``c = Q_{s,b}(params)``, ``w~ = s c``, ``g~ = grad f(w~)``,
    then ``T`` steps ``c <- codes of Q_{s,b}(w - lr (grad_i(w) - grad_i(w~) + g~))``.
    The grid never shrinks, so the iterates stall at a floor set by ``s``.

    Example:
      >>> params = lp_svrg_epoch(loss_fn, params, (x, y), key, learning_rate=0.5,
      ...                        batch_size=16, scale=2.0 ** -6, bits=8)
    """
    n, num_steps = _check_epoch_args(data, learning_rate, batch_size, num_steps)
    _check_positive(scale, "scale")
    dtype = code_dtype(bits)
    grad_fn = jax.grad(loss_fn)
    k_start, k_batches, k_steps = jax.random.split(key, 3)
    leaves, treedef = jax.tree_util.tree_flatten(params)
    codes = jax.tree_util.tree_unflatten(treedef, [
        quantize_to_codes(p, scale, bits, key=jax.random.fold_in(k_start, j), dtype=dtype)
        for j, p in enumerate(leaves)])
    value = lambda c: jax.tree_util.tree_map(  # noqa: E731
        lambda x: scale * x.astype(jnp.float32), c)
    anchor = value(codes)
    g_full = full_gradient(loss_fn, anchor, data, batch_size=full_batch_size)
    idx = minibatch_indices(k_batches, n, batch_size, num_steps)

    def body(c, ti):
        t, i = ti
        batch = _take(data, i)
        w = value(c)
        v = jax.tree_util.tree_map(lambda a, b, g: a - b + g, grad_fn(w, batch),
                                   grad_fn(anchor, batch), g_full)
        k = jax.random.fold_in(k_steps, t)
        new = [quantize_to_codes(x - learning_rate * d, scale, bits,
                                 key=jax.random.fold_in(k, j), dtype=dtype)
               for j, (x, d) in enumerate(zip(treedef.flatten_up_to(w),
                                              treedef.flatten_up_to(v)))]
        return jax.tree_util.tree_unflatten(treedef, new), None

    codes, _ = jax.lax.scan(body, codes, (jnp.arange(num_steps), idx))
    return value(codes)


def halp_epoch(loss_fn: Callable[[Params, Any], Array], params: Params, data: Any,
               key: Array, *, learning_rate: Any, batch_size: int, mu: Any = 0.1,
               bits: int = 8, num_steps: Optional[int] = None,
               full_batch_size: Optional[int] = None) -> Params:
    """One outer iteration of HALP (SVRG with bit centering, De Sa et al. 2018).

    ::

        w~ = params,  g~ = grad f(w~)                      (full precision)
        s  = ||g~|| / (mu (2^(b-1) - 1)),  z = 0           (bit centering)
        repeat T times, minibatch i:
            z <- Q_{s,b}(z - lr (grad_i(w~ + z) - grad_i(w~) + g~))
        return w~ + z                                      (anchor update)

    with ``Q_{s,b}(u) = s clamp(floor(u/s + U), -2^(b-1), 2^(b-1) - 1)`` and ``z``
    held as int8 codes at ``b <= 8``. The grid radius ``~||g~||/mu`` shrinks with
    the gradient, so at 8 bits HALP converges linearly like SVRG. ``mu`` plays the
    role of the strong-convexity constant (smaller: wider, coarser grid).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> x = jax.random.normal(jax.random.PRNGKey(0), (256, 5))
      >>> y = x @ jnp.arange(5.0)
      >>> def loss_fn(w, batch):
      ...     xb, yb = batch
      ...     return 0.5 * jnp.mean((xb @ w - yb) ** 2) + 0.5e-2 * jnp.sum(w ** 2)
      >>> w = jnp.zeros(5)
      >>> for e in range(10):
      ...     w = halp_epoch(loss_fn, w, (x, y), jax.random.PRNGKey(e),
      ...                    learning_rate=0.05, batch_size=8, mu=1.0, bits=8)
      >>> float(jnp.linalg.norm(full_gradient(loss_fn, w, (x, y)))) < 1e-4
      True
    """
    n, num_steps = _check_epoch_args(data, learning_rate, batch_size, num_steps)
    _check_positive(mu, "mu")
    grad_fn = jax.grad(loss_fn)
    state = halp_init(params, bits=bits)
    state = state.recenter(full_gradient(loss_fn, state.params, data,
                                         batch_size=full_batch_size), mu=mu)
    k_batches, k_steps = jax.random.split(key)
    idx = minibatch_indices(k_batches, n, batch_size, num_steps)
    anchor = state.anchor

    def body(st, ti):
        t, i = ti
        batch = _take(data, i)
        return st.inner_step(grad_fn(st.params, batch), grad_fn(anchor, batch),
                             learning_rate, jax.random.fold_in(k_steps, t)), None

    state, _ = jax.lax.scan(body, state, (jnp.arange(num_steps), idx))
    return state.params


def _epoch_factory(epoch_fn, loss_fn, kwargs):
    fn = functools.partial(epoch_fn, loss_fn, **kwargs)
    return jax.jit(lambda params, data, key: fn(params, data, key))


def svrg(loss_fn: Callable[[Params, Any], Array], *, learning_rate: float, batch_size: int,
         num_steps: Optional[int] = None, full_batch_size: Optional[int] = None
         ) -> Callable[[Params, Any, Array], Params]:
    """Jitted `svrg_epoch`: ``epoch(params, data, key) -> params``.

    Example:
      >>> epoch = svrg(loss_fn, learning_rate=0.5, batch_size=16)
      >>> for e in range(20):
      ...     params = epoch(params, (x, y), jax.random.PRNGKey(e))
    """
    _check_positive(learning_rate, "learning_rate")
    _check_int(batch_size, "batch_size", 1)
    return _epoch_factory(svrg_epoch, loss_fn, dict(
        learning_rate=learning_rate, batch_size=batch_size, num_steps=num_steps,
        full_batch_size=full_batch_size))


def lp_svrg(loss_fn: Callable[[Params, Any], Array], *, learning_rate: float,
            batch_size: int, scale: float, bits: int = 8, num_steps: Optional[int] = None,
            full_batch_size: Optional[int] = None) -> Callable[[Params, Any, Array], Params]:
    """Jitted `lp_svrg_epoch` (fixed grid ``scale * [-2^(b-1), 2^(b-1)-1]``).

    Example:
      >>> epoch = lp_svrg(loss_fn, learning_rate=0.5, batch_size=16, scale=2.0 ** -6)
      >>> params = epoch(params, (x, y), jax.random.PRNGKey(0))
    """
    _check_positive(learning_rate, "learning_rate")
    _check_positive(scale, "scale")
    code_dtype(bits)
    return _epoch_factory(lp_svrg_epoch, loss_fn, dict(
        learning_rate=learning_rate, batch_size=batch_size, scale=scale, bits=bits,
        num_steps=num_steps, full_batch_size=full_batch_size))


def halp(loss_fn: Callable[[Params, Any], Array], *, learning_rate: float, batch_size: int,
         mu: float = 0.1, bits: int = 8, num_steps: Optional[int] = None,
         full_batch_size: Optional[int] = None) -> Callable[[Params, Any, Array], Params]:
    """Jitted `halp_epoch`: ``epoch(params, data, key) -> params``.

    Example:
      >>> epoch = halp(loss_fn, learning_rate=0.5, batch_size=16, mu=0.1, bits=8)
      >>> for e in range(20):
      ...     params = epoch(params, (x, y), jax.random.PRNGKey(e))
    """
    _check_positive(learning_rate, "learning_rate")
    _check_positive(mu, "mu")
    code_dtype(bits)
    return _epoch_factory(halp_epoch, loss_fn, dict(
        learning_rate=learning_rate, batch_size=batch_size, mu=mu, bits=bits,
        num_steps=num_steps, full_batch_size=full_batch_size))


__all__ = [
    "BitsLike", "HALPState", "LPQuant", "MOMENTUM_FIELDS", "OptimLPState", "QuantizeState",
    "QuantizeMomentumState", "QuantizeWeightsState", "SWAState", "code_dtype",
    "full_gradient", "halp", "halp_epoch", "halp_init", "halp_scale", "lp_sgd", "lp_svrg",
    "lp_svrg_epoch", "minibatch_indices", "optim_lp", "quantize_gradients",
    "quantize_momentum", "quantize_to_codes", "quantize_tree", "quantize_weights",
    "recompute_batch_stats", "svrg", "svrg_epoch", "swa", "swa_count", "swa_params",
    "swalp",
]
