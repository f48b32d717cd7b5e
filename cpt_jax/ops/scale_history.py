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
  (q, new_history, overflow)` (this module);
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

import jax
import jax.numpy as jnp
from flax import struct
from jax import lax

from cpt_jax import formats
from cpt_jax.formats import AffineInt, SymmetricInt
from cpt_jax.ops.grids import check_range_format, quantize_with_range
from cpt_jax.ops.varying import vary_like

Array = jax.Array


METHODS = ("delayed", "autoflex")


HISTORY_LENGTH = 16


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


def check_history(fmt, method: str) -> None:
    """ValueError unless `fmt` is a per-tensor range grid and `method` in `METHODS`
    (``"autoflex"`` needs a max-abs grid)."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    check_range_format(fmt, "scaling from history")
    if method == "autoflex" and not _symmetric_range(fmt):
        raise ValueError(f"method='autoflex' predicts a max-abs range: fmt must be "
                         f"SymmetricInt() or Float(e), got {fmt!r}")


def _symmetric_range(fmt) -> bool:
    """Whether `fmt`'s grid from a range is max-abs (`SymmetricInt`, `Float`)."""
    return formats.format_traits(fmt).range_grid in ("symmetric", "float")


def _observe(x: Array, fmt) -> tuple[Array, Array]:
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
                    margin: float = 0.0, kappa: float = 100.0) -> tuple[Array, Array]:
    """The (lo, hi) range a step quantizes with, from `history` (see module docstring).

    Example:
      >>> h = init_history(4).replace(hi=jnp.array([2., 3., 0., 0.]),
      ...                             lo=-jnp.array([2., 3., 0., 0.]), count=jnp.int32(2))
      >>> predicted_range(h, SymmetricInt())[1]
      Array(3., dtype=float32)
    """
    check_history(fmt, method)
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
                           key: Array | None = None, margin: float = 0.0,
                           kappa: float = 100.0) -> tuple[Array, ScaleHistory, Array]:
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
    check_history(fmt, method)
    formats.check_rounding(rounding, key)
    formats.check_bits(bits)
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"x must be a floating-point array, got dtype {x.dtype}")
    b = jnp.asarray(bits, jnp.float32)
    lo_ref, hi_ref = predicted_range(history, fmt, method=method, margin=margin, kappa=kappa)
    has_history = history.count > 0
    # Under shard_map a per-device history makes `from_history`'s outputs vary where
    # `dynamic`'s need not: x varies over the history's axes too (ops.varying).
    x = vary_like(x, lo_ref, hi_ref)

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
