"""Number formats: frozen descriptions of a grid, applied by one `quantize` function.

A format describes *which* values are representable at a given word length; the
word length itself (`bits`) is data, so it may be a traced value inside `jit` and a
whole cyclic-precision run compiles once. Every format follows the same contract:

* `bits >= 32` means full precision: the input is returned unchanged.
* Nearest rounding is round-half-to-even; stochastic rounding is
  `floor(v + U[0, 1))`, unbiased: `E[q(v)] = v` inside the range.
* Non-finite inputs pass through unchanged (NaN stays NaN, +-Inf stays +-Inf) and do
  not take part in computing ranges, scales or shared exponents, so one overflowed
  element cannot turn a whole tensor into NaN, and a caller can still detect it.
* A constant tensor (zero range) and an all-zero tensor are returned exactly: no
  NaN is ever created by a zero range or a zero maximum.

Formats:

=================  ==========================================================
`AffineInt`        CPT's min-max grid: ``s = max((max-min)/(2^b-1), 1e-8)``,
                   ``q = clip(round((x-min)/s), 0, 2^b-1) * s + min``.
`SymmetricInt`     max-abs grid: ``s = max|x| / (2^(b-1)-1)``,
                   ``q = clip(round(x/s), -(2^(b-1)-1), 2^(b-1)-1) * s``.
`FixedPoint`       QPyTorch fixed point, word ``b``, ``f`` fractional bits:
                   ``q = clip(round(x 2^f) 2^-f, -2^(b-f-1), 2^(b-f-1) - 2^-f)``.
`BlockFloat`       QPyTorch block floating point: shared exponent
                   ``e = floor(log2 max|x|)``, unit ``u = 2^(e+2-b)``,
                   ``q = u * clip(round(x/u), -(2^(b-1)-1), 2^(b-1)-1)``.
`Float`            small float with ``exp_bits`` exponent and ``b-1-exp_bits``
                   mantissa bits, QPyTorch semantics (no Inf/NaN codes, so the top
                   exponent is usable; saturating; subnormals).
=================  ==========================================================
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array
Bits = Union[int, float, Array]

ROUNDINGS = ("nearest", "stochastic")

# Smallest scale of the integer grids (CPT's clamp), so a zero range never divides by 0.
MIN_SCALE = 1e-8


@dataclasses.dataclass(frozen=True)
class AffineInt:
    """CPT's affine min-max integer grid on ``[0, 2^b - 1]``.

    ``s = max((max - min) / (2^b - 1), 1e-8)``,
    ``q = clip(round((x - min) / s), 0, 2^b - 1) * s + min``.

    `channel_axis=None` uses one (min, max) for the whole tensor; an int keeps one
    range per index along that axis (e.g. ``-1`` for the output channel of a Dense
    kernel ``(in, out)`` or a conv kernel ``HWIO``).

    Example:
      >>> quantize(jnp.array([0., 0.3, 1.]), 2, AffineInt())
      Array([0.        , 0.33333334, 1.        ], dtype=float32)
    """

    channel_axis: Optional[int] = None


@dataclasses.dataclass(frozen=True)
class SymmetricInt:
    """Symmetric max-abs integer grid, levels ``-(2^(b-1)-1) .. 2^(b-1)-1``.

    ``s = max(max|x| / (2^(b-1) - 1), 1e-8)``, ``q = clip(round(x / s), -L, L) * s``
    with ``L = 2^(b-1) - 1``. The integer codes ``round(x/s)`` fit a real int8 at
    ``b <= 8``. At ``b = 1`` there is no nonzero level and the result is all zeros.

    Example:
      >>> quantize(jnp.array([-1., 0.2, 0.7]), 2, SymmetricInt())
      Array([-1.,  0.,  1.], dtype=float32)
    """

    channel_axis: Optional[int] = None


@dataclasses.dataclass(frozen=True)
class FixedPoint:
    """QPyTorch fixed point: word length ``b`` (traced), ``frac_bits`` fractional bits.

    Unit ``2^-f``; range ``[-2^(b-f-1), 2^(b-f-1) - 2^-f]``; round first, then
    saturate: ``q = clip(round(x 2^f) 2^-f, lo, hi)``.

    Example:
      >>> quantize(jnp.array([0.3, 5.0]), 4, FixedPoint(frac_bits=2))
      Array([0.25, 1.75], dtype=float32)
    """

    frac_bits: int = 4

    def __post_init__(self):
        if not isinstance(self.frac_bits, (int, np.integer)) or self.frac_bits < 0:
            raise ValueError(f"FixedPoint.frac_bits must be an int >= 0, got {self.frac_bits!r}")


@dataclasses.dataclass(frozen=True)
class BlockFloat:
    """QPyTorch block floating point with word length ``b`` and one shared exponent.

    ``e = floor(log2 max|x|)`` over the block (the tensor, or each index along
    `channel_axis`), unit ``u = 2^(e + 2 - b)``,
    ``q = u * clip(round(x / u), -(2^(b-1) - 1), 2^(b-1) - 1)``.

    Example:
      >>> quantize(jnp.array([1.0, 0.3, -0.05]), 4, BlockFloat())
      Array([ 1.  ,  0.25, -0.  ], dtype=float32)
    """

    channel_axis: Optional[int] = None


@dataclasses.dataclass(frozen=True)
class Float:
    """Small float: 1 sign, ``exp_bits`` exponent, ``m = b - 1 - exp_bits`` mantissa bits.

    QPyTorch semantics: bias ``2^(E-1) - 1``; no Inf/NaN codes, so the largest
    exponent is ``2^(E-1)`` (one more than IEEE) and the maximum is
    ``2^(2^(E-1)) (2 - 2^-m)``; values beyond it saturate; subnormals below
    ``2^(1-bias)`` have spacing ``2^(1-bias-m)``. Rounding is to the nearest
    representable value, half to even (QPyTorch's CUDA kernel rounds half away
    from zero; ties are measure-zero for real data).

    e4m3 is ``Float(4)`` at 8 bits: max 480, smallest subnormal 2^-9.
    e5m2 is ``Float(5)`` at 8 bits: max 114688, smallest subnormal 2^-16.

    Example:
      >>> quantize(jnp.array([1000., 0.1]), 8, Float(exp_bits=4))
      Array([480.     ,   0.1015625], dtype=float32)
    """

    exp_bits: int = 4

    def __post_init__(self):
        if not isinstance(self.exp_bits, (int, np.integer)) or not 1 <= self.exp_bits <= 8:
            raise ValueError(f"Float.exp_bits must be an int in [1, 8], got {self.exp_bits!r}")

    @property
    def bias(self) -> int:
        return 2 ** (self.exp_bits - 1) - 1


Format = Union[AffineInt, SymmetricInt, FixedPoint, BlockFloat, Float]
FORMATS = (AffineInt, SymmetricInt, FixedPoint, BlockFloat, Float)


# --------------------------------------------------------------------------- helpers

def pow2(e: Array) -> Array:
    """Exact ``2.0 ** e`` in float32 for integer-valued ``e`` (clamped to [-126, 127]).

    Built from the exponent field, so it is exact where ``jnp.exp2`` may not be.
    """
    e = jnp.clip(jnp.asarray(e, jnp.float32), -126, 127).astype(jnp.int32)
    return jax.lax.bitcast_convert_type((e + 127) << 23, jnp.float32)


def floor_log2(a: Array) -> Array:
    """Exact ``floor(log2(a))`` for finite ``a > 0`` (via frexp), as float32."""
    _, ex = jnp.frexp(a)
    return (ex - 1).astype(jnp.float32)


def _round(v: Array, rounding: str, key: Optional[Array]) -> Array:
    if rounding == "nearest":
        return jnp.round(v)  # half to even
    noise = jax.random.uniform(key, v.shape, dtype=v.dtype)
    return jnp.floor(v + noise)


def _reduce_axes(ndim: int, channel_axis: Optional[int]) -> Optional[tuple]:
    if channel_axis is None or ndim == 0:
        return None
    axis = channel_axis % ndim if -ndim <= channel_axis < ndim else None
    if axis is None:
        raise ValueError(
            f"channel_axis={channel_axis} is out of range for a tensor of rank {ndim}")
    return tuple(i for i in range(ndim) if i != axis)


def _finite_min_max(x: Array, axes) -> tuple[Array, Array]:
    finite = jnp.isfinite(x)
    lo = jnp.min(jnp.where(finite, x, jnp.inf), axis=axes, keepdims=True)
    hi = jnp.max(jnp.where(finite, x, -jnp.inf), axis=axes, keepdims=True)
    # An all-non-finite block has no range: use 0 so no NaN is created.
    lo = jnp.where(jnp.isfinite(lo), lo, 0.0)
    hi = jnp.where(jnp.isfinite(hi), hi, 0.0)
    return lo, hi


def _finite_absmax(x: Array, axes) -> Array:
    return jnp.max(jnp.where(jnp.isfinite(x), jnp.abs(x), 0.0), axis=axes, keepdims=True)


# --------------------------------------------------------------------------- grids

def _affine(x, bits, fmt: AffineInt, rounding, key):
    lo, hi = _finite_min_max(x, _reduce_axes(x.ndim, fmt.channel_axis))
    levels = pow2(bits) - 1.0
    scale = jnp.maximum((hi - lo) / levels, MIN_SCALE)
    codes = jnp.clip(_round((x - lo) / scale, rounding, key), 0.0, levels)
    return codes * scale + lo


def _symmetric(x, bits, fmt: SymmetricInt, rounding, key):
    amax = _finite_absmax(x, _reduce_axes(x.ndim, fmt.channel_axis))
    top = pow2(bits - 1.0) - 1.0
    scale = jnp.maximum(amax / jnp.maximum(top, 1.0), MIN_SCALE)
    return jnp.clip(_round(x / scale, rounding, key), -top, top) * scale


def _fixed_point(x, bits, fmt: FixedPoint, rounding, key):
    unit = pow2(-float(fmt.frac_bits))
    top = pow2(bits - fmt.frac_bits - 1.0)
    q = _round(x / unit, rounding, key) * unit
    return jnp.clip(q, -top, top - unit)


def _block_float(x, bits, fmt: BlockFloat, rounding, key):
    amax = _finite_absmax(x, _reduce_axes(x.ndim, fmt.channel_axis))
    e = jnp.where(amax > 0, floor_log2(jnp.where(amax > 0, amax, 1.0)), 0.0)
    unit = pow2(e + 2.0 - bits)
    top = pow2(bits - 1.0) - 1.0
    return unit * jnp.clip(_round(x / unit, rounding, key), -top, top)


def _small_float(x, bits, fmt: Float, rounding, key):
    man = jnp.maximum(bits - 1.0 - fmt.exp_bits, 0.0)
    emin = 1.0 - fmt.bias
    emax = float(2 ** (fmt.exp_bits - 1))
    largest = pow2(emax) * (2.0 - pow2(-man))
    a = jnp.abs(x)
    e = jnp.maximum(floor_log2(jnp.where(a > 0, a, 1.0)), emin)
    spacing = pow2(e - man)
    mag = _round(a / spacing, rounding, key) * spacing
    return jnp.sign(x) * jnp.minimum(mag, largest)


_GRIDS = {
    AffineInt: _affine,
    SymmetricInt: _symmetric,
    FixedPoint: _fixed_point,
    BlockFloat: _block_float,
    Float: _small_float,
}


# --------------------------------------------------------------------------- checks

def check_bits(bits: Any, name: str = "bits", minimum: int = 1) -> None:
    """Raise ValueError for a static (Python/numpy) bit-width below `minimum`.

    Traced bit-widths cannot be checked at trace time and are accepted.
    """
    if isinstance(bits, jax.core.Tracer):
        return
    try:
        value = np.asarray(bits)
    except Exception as exc:  # pragma: no cover - defensive
        raise ValueError(f"{name} must be a number, got {bits!r}") from exc
    if value.dtype.kind not in "iuf":
        raise ValueError(f"{name} must be a number, got {bits!r}")
    if value.size and (np.any(np.isnan(value)) or np.min(value) < minimum):
        raise ValueError(f"{name} must be >= {minimum} (full precision is >= 32), got {bits!r}")


def check_rounding(rounding: str, key: Optional[Array]) -> None:
    """Raise ValueError for an unknown rounding or stochastic rounding without a key."""
    if rounding not in ROUNDINGS:
        raise ValueError(f"rounding must be one of {ROUNDINGS}, got {rounding!r}")
    if rounding == "stochastic" and key is None:
        raise ValueError("rounding='stochastic' needs a PRNG `key` (got key=None)")


def check_format(fmt: Any) -> None:
    if type(fmt) not in _GRIDS:
        raise ValueError(
            f"fmt must be one of {[f.__name__ for f in FORMATS]}, got {fmt!r}")


# --------------------------------------------------------------------------- quantize

def quantize(x: Array, bits: Bits, fmt: Format = AffineInt(), *, rounding: str = "nearest",
             key: Optional[Array] = None) -> Array:
    """Quantize `x` to the grid of `fmt` at word length `bits` (fake quantization).

    The result has the dtype and shape of `x` and holds only values of the grid.
    `bits` may be a Python number or a (traced) scalar array; ``bits >= 32`` returns
    `x` unchanged. See the module docstring for each format's formula.

    Args:
      x: array to quantize (floating point).
      bits: word length; ints or integer-valued floats, possibly traced.
      fmt: one of `AffineInt`, `SymmetricInt`, `FixedPoint`, `BlockFloat`, `Float`.
      rounding: ``"nearest"`` (half to even) or ``"stochastic"`` (``floor(v + U)``).
      key: PRNG key, required for stochastic rounding.

    Example:
      >>> x = jnp.array([-1.0, -0.6, 0.1, 0.9])
      >>> quantize(x, 2, SymmetricInt())
      Array([-1., -1.,  0.,  1.], dtype=float32)
    """
    check_format(fmt)
    check_rounding(rounding, key)
    check_bits(bits)
    if isinstance(fmt, Float) and not isinstance(bits, jax.core.Tracer):
        if np.min(np.asarray(bits)) < fmt.exp_bits + 1:
            raise ValueError(
                f"bits must be >= exp_bits + 1 = {fmt.exp_bits + 1} for {fmt}, got {bits!r}")
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"x must be a floating-point array, got dtype {x.dtype}")
    if not isinstance(bits, jax.core.Tracer) and np.min(np.asarray(bits)) >= 32:
        return x
    dtype = x.dtype
    xf = x.astype(jnp.float32)
    b = jnp.asarray(bits, jnp.float32)
    q = _GRIDS[type(fmt)](xf, b, fmt, rounding, key)
    q = jnp.where(jnp.isfinite(xf), q, xf)
    q = jnp.where(b >= 32, xf, q)
    return q.astype(dtype)


def grid_step(x: Array, bits: Bits, fmt: Format) -> Array:
    """The spacing of the grid that `quantize(x, bits, fmt)` uses, broadcastable to `x`.

    For integer formats the scale ``s``; for `FixedPoint` ``2^-f``; for `BlockFloat`
    the shared unit; for `Float` the spacing of each element's binade. Used by tests
    and error bounds (nearest: ``|q - x| <= step/2`` inside the range).
    """
    xf = jnp.asarray(x, jnp.float32)
    b = jnp.asarray(bits, jnp.float32)
    if isinstance(fmt, AffineInt):
        lo, hi = _finite_min_max(xf, _reduce_axes(xf.ndim, fmt.channel_axis))
        return jnp.maximum((hi - lo) / (pow2(b) - 1.0), MIN_SCALE)
    if isinstance(fmt, SymmetricInt):
        amax = _finite_absmax(xf, _reduce_axes(xf.ndim, fmt.channel_axis))
        return jnp.maximum(amax / jnp.maximum(pow2(b - 1.0) - 1.0, 1.0), MIN_SCALE)
    if isinstance(fmt, FixedPoint):
        return pow2(-float(fmt.frac_bits)) * jnp.ones_like(xf)
    if isinstance(fmt, BlockFloat):
        amax = _finite_absmax(xf, _reduce_axes(xf.ndim, fmt.channel_axis))
        e = jnp.where(amax > 0, floor_log2(jnp.where(amax > 0, amax, 1.0)), 0.0)
        return pow2(e + 2.0 - b)
    if isinstance(fmt, Float):
        man = jnp.maximum(b - 1.0 - fmt.exp_bits, 0.0)
        a = jnp.abs(xf)
        e = jnp.maximum(floor_log2(jnp.where(a > 0, a, 1.0)), 1.0 - fmt.bias)
        return pow2(e - man)
    check_format(fmt)
    raise AssertionError  # unreachable


def representable_range(bits: Bits, fmt: Format, x: Optional[Array] = None) -> tuple[Array, Array]:
    """(lowest, highest) value the grid can take (for data-dependent grids, given `x`)."""
    b = jnp.asarray(bits, jnp.float32)
    if isinstance(fmt, FixedPoint):
        top = pow2(b - fmt.frac_bits - 1.0)
        return -top, top - pow2(-float(fmt.frac_bits))
    if isinstance(fmt, Float):
        man = jnp.maximum(b - 1.0 - fmt.exp_bits, 0.0)
        largest = pow2(float(2 ** (fmt.exp_bits - 1))) * (2.0 - pow2(-man))
        return -largest, largest
    if x is None:
        raise ValueError(f"{type(fmt).__name__} is data-dependent: pass x")
    xf = jnp.asarray(x, jnp.float32)
    axes = _reduce_axes(xf.ndim, getattr(fmt, "channel_axis", None))
    if isinstance(fmt, AffineInt):
        return _finite_min_max(xf, axes)
    step = grid_step(xf, b, fmt)
    top = jnp.maximum(pow2(b - 1.0) - 1.0, 0.0)
    return -top * step, top * step
