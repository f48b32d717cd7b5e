"""Scales from history: delayed scaling (FP8 style) and Flexpoint's Autoflex.

Dynamic scaling (`cpt_jax.formats.quantize`) needs the range of a tensor *before*
it can quantize it: a reduction over the tensor, then an elementwise pass, two
trips through memory. Scaling from history keeps each tensor's recent ranges in
state and quantizes with a range *predicted* from them, so the quantize pass does
not wait for a reduction; the current range, needed for the next step, is computed
alongside (on GPU XLA fuses it into the same pass, a multi-output fusion).

State of one tensor: `ScaleHistory`, the minima and maxima of the last ``H``
steps (newest first), how many are valid, and Autoflex's headroom bit.

Range used at a step, from the valid history ``f`` (maxima; minima ``l``):

* ``method="delayed"`` (Transformer Engine's "max" algorithm):
  ``hi = max(f) * 2^margin``, ``lo = min(l) * 2^margin``. Overflow (some value
  clipped) is reported; the history just rolls on.
* ``method="autoflex"`` (Flexpoint, Koster et al. 2017): on the max-abs history,
  ``p = max(f) + 3 std(f) + kappa * u16`` with ``u16 = 2^ceil(log2 max(f)) / 2^15``
  (one LSB of a 16-bit mantissa at the current exponent, Flexpoint's kappa term),
  ``R = 2^(ceil(log2 p) + extra)``: a power-of-two range. On overflow
  (``max|x| > R``) the history is cleared (only the current maximum kept) and one
  bit of headroom (``extra = 1``) is added until the history is full again.

With an empty history (the first step) the current range is used (dynamic), so
the first step is as good as dynamic scaling. Grids (`fmt`): `AffineInt` (per
tensor, ``[lo, hi]``), `SymmetricInt` (``[-R, R]`` with ``R = max(|lo|, |hi|)``),
`Float` (``x / s`` with ``s = R / largest``, FP8 style). Gradients are
straight-through.

Two ways to use it:

* the pure function `delayed_scale_quantize(x, bits, history, fmt) ->
  (q, new_history, overflow)`;
* in Flax: ``nn.Dense(..., dot_general_cls=DelayedQuantDotGeneral)`` /
  ``nn.Conv(..., conv_general_dilated_cls=DelayedQuantConv)``, or
  `delayed_scaling_model(model)` for an unmodified model. The activation (input)
  of each op is quantized from its history, kept in a variable collection
  (``"batch_stats"`` by default: the state `cpt_jax.training.TrainState` already
  carries and updates every training step, so `make_train_step`, evaluation and
  checkpoints work unchanged); weights and errors use the op's `QuantConfig`
  (dynamic, per step). The history is updated only where the collection is
  mutable (training), read-only in evaluation.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Optional, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import struct
from jax import lax

from cpt_jax import formats
from cpt_jax.formats import AffineInt, Float, SymmetricInt
from cpt_jax.interception import ACTIVATION, Operand, Product
from cpt_jax.providers import FakeQuantProvider, key_for
from cpt_jax.quant_config import CPT_CONFIG, QuantConfig

Array = jax.Array

METHODS = ("delayed", "autoflex")
HISTORY_LENGTH = 16
DEFAULT_COLLECTION = "batch_stats"


@struct.dataclass
class ScaleHistory:
    """The recent ranges of one tensor (a pytree; newest entry first).

    Attributes:
      lo: f32[H], the minima of the last steps (0 where not valid).
      hi: f32[H], the maxima (for `SymmetricInt` / Autoflex: max |x|).
      count: i32[], how many leading entries are valid (0: empty).
      extra_bits: f32[], Autoflex's headroom after an overflow (0 or 1).
    """

    lo: Array
    hi: Array
    count: Array
    extra_bits: Array

    @property
    def length(self) -> int:
        return int(self.hi.shape[-1])


def init_history(length: int = HISTORY_LENGTH) -> ScaleHistory:
    """An empty history of `length` steps (the first step then scales dynamically).

    Example:
      >>> h = init_history(16)
      >>> h.hi.shape, int(h.count)
      ((16,), 0)
    """
    if not isinstance(length, int) or length < 1:
        raise ValueError(f"length must be an int >= 1, got {length!r}")
    # Distinct buffers (not one shared zeros array), so a train step can donate them.
    return ScaleHistory(lo=jnp.zeros((length,), jnp.float32),
                        hi=jnp.zeros((length,), jnp.float32), count=jnp.zeros((), jnp.int32),
                        extra_bits=jnp.zeros((), jnp.float32))


def _check(fmt, method: str) -> None:
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if not isinstance(fmt, (AffineInt, SymmetricInt, Float)):
        raise ValueError(
            f"fmt must be AffineInt(), SymmetricInt() or Float(e) for scaling from history, "
            f"got {fmt!r}")
    if getattr(fmt, "channel_axis", None) is not None:
        raise ValueError(f"scaling from history is per tensor: fmt.channel_axis must be None, "
                         f"got {fmt!r}")
    if method == "autoflex" and not isinstance(fmt, (SymmetricInt, Float)):
        raise ValueError(f"method='autoflex' predicts a max-abs range: fmt must be "
                         f"SymmetricInt() or Float(e), got {fmt!r}")


def _symmetric_range(fmt) -> bool:
    return isinstance(fmt, (SymmetricInt, Float))


def _observe(x: Array, fmt) -> Tuple[Array, Array]:
    """(lo, hi) of the finite elements of `x` (max-abs grids: (-max|x|, max|x|))."""
    lo, hi = formats.representable_range(2, AffineInt(), x)  # finite min, max
    lo, hi = lo.reshape(()), hi.reshape(())
    if _symmetric_range(fmt):
        amax = jnp.maximum(-lo, hi)
        return -amax, amax
    return lo, hi


def _valid(history: ScaleHistory) -> Array:
    return jnp.arange(history.length) < history.count


def _ceil_log2(v: Array) -> Array:
    """Exact ``ceil(log2 v)`` for finite ``v > 0``."""
    e = formats.floor_log2(v)
    return jnp.where(formats.pow2(e) < v, e + 1.0, e)


def predicted_range(history: ScaleHistory, fmt=SymmetricInt(), *, method: str = "delayed",
                    margin: float = 0.0, kappa: float = 100.0) -> Tuple[Array, Array]:
    """The (lo, hi) range a step quantizes with, from `history` (see module docstring).

    Example:
      >>> h = init_history(4).replace(hi=jnp.array([2., 3., 0., 0.]),
      ...                             lo=-jnp.array([2., 3., 0., 0.]), count=jnp.int32(2))
      >>> predicted_range(h, SymmetricInt())[1]
      Array(3., dtype=float32)
    """
    _check(fmt, method)
    valid = _valid(history)
    if method == "delayed":
        hi = jnp.max(jnp.where(valid, history.hi, -jnp.inf))
        lo = jnp.min(jnp.where(valid, history.lo, jnp.inf))
        scale = 2.0 ** margin
        hi, lo = hi * scale, lo * scale
        hi = jnp.where(jnp.isfinite(hi), hi, 0.0)
        lo = jnp.where(jnp.isfinite(lo), lo, 0.0)
        if _symmetric_range(fmt):
            r = jnp.maximum(jnp.abs(lo), jnp.abs(hi))
            return -r, r
        return lo, hi
    # Autoflex on the max-abs history.
    f = jnp.where(valid, jnp.maximum(jnp.abs(history.hi), jnp.abs(history.lo)), 0.0)
    n = jnp.maximum(history.count, 1).astype(jnp.float32)
    m = jnp.max(f)
    mean = jnp.sum(f) / n
    std = jnp.sqrt(jnp.sum(jnp.where(valid, (f - mean) ** 2, 0.0)) / n)
    positive = m > 0
    u16 = formats.pow2(_ceil_log2(jnp.where(positive, m, 1.0))) / 2.0 ** 15
    p = m + 3.0 * std + kappa * u16
    r = formats.pow2(_ceil_log2(jnp.where(positive, p, 1.0)) + history.extra_bits)
    r = jnp.where(positive, r, 0.0)
    return -r, r


def _round(v: Array, rounding: str, key: Optional[Array]) -> Array:
    """Half-to-even, or stochastic ``floor(v + U)`` with `formats.uniform_noise`."""
    if rounding == "nearest":
        return jnp.round(v)
    return jnp.floor(v + formats.uniform_noise(key, v.shape, dtype=v.dtype))


def _grid(x, lo, hi, bits, fmt, rounding, key):
    """Quantize `x` on the grid of `fmt` spanning [lo, hi] (clipping outside)."""
    if isinstance(fmt, AffineInt):
        levels = formats.pow2(bits) - 1.0
        scale = jnp.maximum((hi - lo) / levels, formats.MIN_SCALE)
        codes = jnp.clip(_round((x - lo) / scale, rounding, key), 0.0, levels)
        return codes * scale + lo
    r = jnp.maximum(jnp.abs(lo), jnp.abs(hi))
    if isinstance(fmt, SymmetricInt):
        top = formats.pow2(bits - 1.0) - 1.0
        scale = jnp.maximum(r / jnp.maximum(top, 1.0), formats.MIN_SCALE)
        return jnp.clip(_round(x / scale, rounding, key), -top, top) * scale
    # Float: scale so that R lands on the format's largest value, FP8 style.
    _, largest = formats.representable_range(bits, fmt)
    scale = jnp.where(r > 0, r / largest, 1.0)
    y = jnp.clip(x / scale, -largest, largest)
    return formats.quantize(y, bits, fmt, rounding=rounding, key=key) * scale


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _ste_range_quant(x, lo, hi, bits, key, fmt, rounding):
    xf = x.astype(jnp.float32)
    q = _grid(xf, lo, hi, bits, fmt, rounding, key)
    q = jnp.where(jnp.isfinite(xf), q, xf)
    q = jnp.where(bits >= 32, xf, q)
    return q.astype(x.dtype)


def _ste_range_fwd(x, lo, hi, bits, key, fmt, rounding):
    return _ste_range_quant(x, lo, hi, bits, key, fmt, rounding), None


def _ste_range_bwd(fmt, rounding, _, g):
    return g, None, None, None, None


_ste_range_quant.defvjp(_ste_range_fwd, _ste_range_bwd)


def quantize_with_range(x: Array, lo, hi, bits, fmt=SymmetricInt(), *,
                        rounding: str = "nearest", key: Optional[Array] = None) -> Array:
    """Fake-quantize `x` on the grid of `fmt` at `bits` spanning the given range.

    Values outside ``[lo, hi]`` saturate; non-finite values pass through;
    ``bits >= 32`` is identity; straight-through gradient for `x`.

    Example:
      >>> quantize_with_range(jnp.array([-3., 0.4, 0.9]), -1., 1., 2, SymmetricInt())
      Array([-1.,  0.,  1.], dtype=float32)
    """
    formats.check_rounding(rounding, key)
    formats.check_bits(bits)
    _check(fmt, "delayed")
    return _ste_range_quant(jnp.asarray(x), jnp.asarray(lo, jnp.float32),
                            jnp.asarray(hi, jnp.float32), jnp.asarray(bits, jnp.float32),
                            key, fmt, rounding)


def update_history(history: ScaleHistory, lo, hi, overflow, *,
                   method: str = "delayed") -> ScaleHistory:
    """Push the observed (lo, hi) (newest first); Autoflex clears it on overflow.

    Example:
      >>> h = update_history(init_history(3), -1., 2., False)
      >>> h.hi.tolist(), int(h.count)
      ([2.0, 0.0, 0.0], 1)
    """
    lo = jnp.asarray(lo, jnp.float32)
    hi = jnp.asarray(hi, jnp.float32)
    length = history.length
    rolled_lo = jnp.concatenate([lo[None], history.lo[:-1]])
    rolled_hi = jnp.concatenate([hi[None], history.hi[:-1]])
    count = jnp.minimum(history.count + 1, length).astype(jnp.int32)
    extra = jnp.where(count >= length, 0.0, history.extra_bits)
    if method == "autoflex":
        reset = jnp.asarray(overflow)
        first = jnp.arange(length) == 0
        rolled_lo = jnp.where(reset, jnp.where(first, lo, 0.0), rolled_lo)
        rolled_hi = jnp.where(reset, jnp.where(first, hi, 0.0), rolled_hi)
        count = jnp.where(reset, 1, count).astype(jnp.int32)
        extra = jnp.where(reset, 1.0, extra)
    return ScaleHistory(lo=rolled_lo, hi=rolled_hi, count=count,
                        extra_bits=extra.astype(jnp.float32))


def delayed_scale_quantize(x: Array, bits, history: ScaleHistory, fmt=SymmetricInt(), *,
                           method: str = "delayed", rounding: str = "nearest",
                           key: Optional[Array] = None, margin: float = 0.0,
                           kappa: float = 100.0) -> Tuple[Array, ScaleHistory, Array]:
    """Quantize `x` with a range predicted from `history`; return the updated history.

    ``(lo, hi) = predicted_range(history)`` (empty history: the range of `x`
    itself), ``q = quantize_with_range(x, lo, hi, bits, fmt)``; the range of `x`
    is observed alongside and pushed into the history; ``overflow`` is True when
    `x` had values outside the range used (they saturated). Pure: call it inside
    `jit` with a traced `bits`; `history` is a pytree to carry between steps.

    Example:
      >>> h = init_history()
      >>> for step in range(3):
      ...   x = jnp.array([-1.0, 0.5, 2.0]) * (step + 1)
      ...   q, h, overflow = delayed_scale_quantize(x, 8, h, SymmetricInt())
      >>> int(h.count), bool(overflow)    # step 2's range (6) is above the history's (4)
      (3, True)
    """
    _check(fmt, method)
    formats.check_rounding(rounding, key)
    formats.check_bits(bits)
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"x must be a floating-point array, got dtype {x.dtype}")
    b = jnp.asarray(bits, jnp.float32)
    lo_ref, hi_ref = predicted_range(history, fmt, method=method, margin=margin, kappa=kappa)
    has_history = history.count > 0

    # Each branch quantizes and observes the range of x in one computation: with a
    # history the quantize does not depend on the observation (XLA can fuse both
    # into one pass); the first step (empty history) scales dynamically.
    def from_history(x):
        q = quantize_with_range(x, lo_ref, hi_ref, b, fmt, rounding=rounding, key=key)
        return (q,) + _observe(lax.stop_gradient(x), fmt)

    def dynamic(x):
        lo, hi = _observe(lax.stop_gradient(x), fmt)
        return quantize_with_range(x, lo, hi, b, fmt, rounding=rounding, key=key), lo, hi

    q, lo_cur, hi_cur = lax.cond(has_history, from_history, dynamic, x)
    overflow = has_history & ((hi_cur > hi_ref) | (lo_cur < lo_ref))
    new_history = update_history(history, lo_cur, hi_cur, overflow, method=method)
    return q, new_history, overflow


# --------------------------------------------------------------------------- Flax

_CHILD = "delayed_quant"
"""Where a layer of `delayed_scaling_model` keeps its history: ``<layer>/delayed_quant``."""


@dataclasses.dataclass(frozen=True)
class DelayedScalingProvider(FakeQuantProvider):
    """A provider (`cpt_jax.interception`) quantizing each layer's input from history.

    The activation (lhs) of a dot_general / conv with a weight is quantized by
    `delayed_scale_quantize`, its `ScaleHistory` kept in ``product.module``'s
    variable ``(collection, *location)``; weights and errors as the product's
    config says (dynamic, as `FakeQuantProvider`). The history is created where
    the collection is mutable (``prepare``, also at init), updated only there.

    Attributes:
      fmt, method, history_length, margin, kappa: see the module docstring.
      collection: the variable collection holding the histories.
      location: the variable's path inside the module: ``("delayed_quant",
        "input_history")`` for models, ``("input_history",)`` for the doors.
    """

    fmt: Any = AffineInt()
    method: str = "delayed"
    history_length: int = HISTORY_LENGTH
    collection: str = DEFAULT_COLLECTION
    margin: float = 0.0
    kappa: float = 100.0
    location: Tuple[str, ...] = (_CHILD, "input_history")

    def _applies(self, product: Product) -> bool:
        cfg = product.config
        return (product.module is not None and cfg is not None and cfg.activation is not None
                and product.kind in ("dot_general", "conv") and product.rhs.role != ACTIVATION)

    def _location(self, product: Product) -> Tuple[str, ...]:
        """`location`, its last name prefixed by the product's path below its module
        when the module computes several products (``einsum_1_input_history``)."""
        below = product.local
        if not below:
            return self.location
        return self.location[:-1] + (f"{below.replace('/', '_')}_{self.location[-1]}",)

    def _read(self, product: Product) -> ScaleHistory:
        module = product.module
        head, *rest = self._location(product)
        if not module.has_variable(self.collection, head):
            return init_history(self.history_length)
        value = module.get_variable(self.collection, head)
        for name in rest:
            if name not in value:
                return init_history(self.history_length)
            value = value[name]
        return value

    def _write(self, product: Product, history: ScaleHistory) -> None:
        module = product.module
        head, *rest = self._location(product)
        value = history
        for name in reversed(rest):
            value = {name: value}
        if rest and module.has_variable(self.collection, head):
            value = {**module.get_variable(self.collection, head), **value}
        module.put_variable(self.collection, head, value)

    def _has(self, product: Product) -> bool:
        module = product.module
        head, *rest = self._location(product)
        if not module.has_variable(self.collection, head):
            return False
        value = module.get_variable(self.collection, head)
        return not rest or rest[0] in value

    def prepare(self, product: Product, lhs, rhs) -> None:
        """Create the (empty) history where the collection is mutable."""
        module = product.module
        if (self._applies(product) and module.is_mutable_collection(self.collection)
                and not self._has(product)):
            self._write(product, init_history(self.history_length))

    def quantize_operand(self, product: Product, operand: Operand, x, bits, state):
        if operand is not product.lhs or not self._applies(product):
            return super().quantize_operand(product, operand, x, bits, state)
        tq = product.config.activation
        key = key_for(tq, state, "an operand (activation)")
        q, new_history, overflow = delayed_scale_quantize(
            x, bits, self._read(product), self.fmt, method=self.method,
            rounding=tq.rounding, key=key, margin=self.margin, kappa=self.kappa)
        if product.module.is_mutable_collection(self.collection):
            self._write(product, new_history)
        product.module.sow("intermediates", "_".join(self.location[:-1] + ("overflow",)),
                           overflow)
        return q


class DelayedQuantDotGeneral(nn.Module):
    """``nn.Dense(..., dot_general_cls=DelayedQuantDotGeneral)``: input scaled from history.

    The input (activation) is quantized by `delayed_scale_quantize` with its
    `ScaleHistory` in the variable ``(collection, "input_history")``; the kernel
    and the error as `config` says (dynamic); widths from the `precision`
    context (full precision outside one, where the history is not touched).

    Example:
      >>> layer = nn.Dense(4, dot_general_cls=DelayedQuantDotGeneral)
      >>> v = layer.init(jax.random.key(0), jnp.ones((2, 3)))
      >>> with cpt_jax.precision(8):
      ...   y, upd = layer.apply(v, jnp.ones((2, 3)), mutable=["batch_stats"])
      >>> int(upd["batch_stats"]["DelayedQuantDotGeneral_0"]["input_history"].count)
      1
    """

    config: Optional[QuantConfig] = CPT_CONFIG
    fmt: Any = AffineInt()
    method: str = "delayed"
    history_length: int = HISTORY_LENGTH
    collection: str = DEFAULT_COLLECTION
    margin: float = 0.0
    kappa: float = 100.0
    op_name: Optional[str] = None

    def _provider(self) -> DelayedScalingProvider:
        _check(self.fmt, self.method)
        # The history variable exists from init on, in this module's own scope.
        self.variable(self.collection, "input_history", init_history, self.history_length)
        return DelayedScalingProvider(self.fmt, self.method, self.history_length,
                                      self.collection, self.margin, self.kappa,
                                      location=("input_history",))

    def _name(self) -> str:
        return self.op_name or "/".join(str(p) for p in self.path)

    @nn.compact
    def __call__(self, lhs, rhs, dimension_numbers, precision=None,
                 preferred_element_type=None, **kwargs):
        from cpt_jax.transform import quantized_dot_general
        return quantized_dot_general(
            lhs, rhs, dimension_numbers, precision, preferred_element_type,
            config=_no_int8(self.config), name=self._name(), provider=self._provider(),
            module=self, **kwargs)


class DelayedQuantConv(DelayedQuantDotGeneral):
    """``nn.Conv(..., conv_general_dilated_cls=DelayedQuantConv)``: input from history."""

    @nn.compact
    def __call__(self, lhs, rhs, window_strides, padding, lhs_dilation=None,
                 rhs_dilation=None, dimension_numbers=None, feature_group_count=1,
                 batch_group_count=1, precision=None, preferred_element_type=None, **kwargs):
        from cpt_jax.transform import quantized_conv
        return quantized_conv(
            lhs, rhs, window_strides, padding, lhs_dilation, rhs_dilation, dimension_numbers,
            feature_group_count, batch_group_count, precision, preferred_element_type,
            config=_no_int8(self.config), name=self._name(), provider=self._provider(),
            module=self, **kwargs)


def _no_int8(config: Optional[QuantConfig]) -> Optional[QuantConfig]:
    return None if config is None else config.replace(int8=False)


def delayed_scaling_model(model: nn.Module, rules=None, config: Optional[QuantConfig] = CPT_CONFIG,
                          *, fmt=AffineInt(), method: str = "delayed",
                          history_length: int = HISTORY_LENGTH,
                          collection: str = DEFAULT_COLLECTION, margin: float = 0.0,
                          kappa: float = 100.0) -> nn.Module:
    """`quantize_model` with each layer's input scaled from its history.

    ``quantize_model(model, rules, config, provider=DelayedScalingProvider(...))``:
    the history of a layer lives at ``(collection, <layer path>/delayed_quant/
    input_history)``.

    Args:
      model: an unmodified Linen model (the input of each dot_general / conv layer
        with a weight is scaled from history; other products as `quantize_model`).
      rules, config: as `cpt_jax.quantize_model` (weights and errors per `config`,
        dynamic; a rule target None keeps a layer in fp32).
      fmt: the input grid: `AffineInt()` (CPT's, default), `SymmetricInt()`,
        `Float(e)`.
      method: ``"delayed"`` or ``"autoflex"``.
      history_length, margin, kappa: see the module docstring.
      collection: where the histories live (``"batch_stats"``: carried and updated
        by `make_train_step` like BatchNorm statistics).

    Returns:
      The quantized model (see `cpt_jax.quantize_model`).

    Example:
      >>> qmodel = delayed_scaling_model(nn.Dense(3))
      >>> v = qmodel.init(jax.random.key(0), jnp.ones((2, 4)))
      >>> int(v["batch_stats"]["delayed_quant"]["input_history"].count)
      0
    """
    from cpt_jax.transform import quantize_model
    _check(fmt, method)
    if not isinstance(model, nn.Module):
        raise ValueError(f"delayed_scaling_model expects a flax.linen Module, got "
                         f"{type(model).__name__}")
    provider = DelayedScalingProvider(fmt, method, history_length, collection, margin, kappa)
    return quantize_model(model, rules, _no_int8(config), provider=provider)
