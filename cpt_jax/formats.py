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


def mul_pow2(v: Array, k: Array) -> Array:
    """Exact ``v * 2^k`` for integer-valued ``k`` with ``|k| <= 252``, as two `pow2` factors.

    Unlike ``v * pow2(k)`` it stays exact when ``2^k`` itself is outside the float32
    normal range (e.g. the spacing ``2^-133`` of bfloat16 near ``2^-126``), as long
    as the result is a normal float32 (CPU flushes subnormals to zero).

    Example:
      >>> mul_pow2(jnp.float32(2.0 ** 100), -200) == 2.0 ** -100  # 2^-200 is not a float32
      Array(True, dtype=bool)
    """
    k = jnp.asarray(k, jnp.float32)
    half = jnp.floor(k / 2.0)
    return v * pow2(half) * pow2(k - half)


def floor_log2(a: Array) -> Array:
    """Exact ``floor(log2(a))`` for finite ``a > 0`` (via frexp), as float32."""
    _, ex = jnp.frexp(a)
    return (ex - 1).astype(jnp.float32)


def _rotl32(v: Array, r: int) -> Array:
    return (v << np.uint32(r)) | (v >> np.uint32(32 - r))


def _threefry2x32(k1: Array, k2: Array, x0: Array, x1: Array) -> tuple[Array, Array]:
    """Threefry-2x32 (20 rounds), unrolled in `jnp` so XLA fuses it into its consumer.

    The same hash as ``jax.random``'s threefry2x32 primitive, whose CPU lowering is a
    rolled loop that materializes the counter state five times per call.
    """
    rotations = ((13, 15, 26, 6), (17, 29, 16, 24))
    ks = (k1, k2, k1 ^ k2 ^ np.uint32(0x1BD11BDA))
    x0 = x0 + ks[0]
    x1 = x1 + ks[1]
    for i in range(5):
        for r in rotations[i % 2]:
            x0 = x0 + x1
            x1 = x0 ^ _rotl32(x1, r)
        x0 = x0 + ks[(i + 1) % 3]
        x1 = x1 + ks[(i + 2) % 3] + np.uint32(i + 1)
    return x0, x1


def _threefry_key_words(key: Array) -> Optional[tuple[Array, Array]]:
    """The two uint32 words of a threefry2x32 key, or None for any other PRNG."""
    key = jnp.asarray(key) if not hasattr(key, "dtype") else key
    if jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
        if str(jax.random.key_impl(key)) != "threefry2x32":
            return None
        data = jax.random.key_data(key)
    elif key.dtype == jnp.uint32 and key.shape == (2,):
        if str(getattr(jax.config, "jax_default_prng_impl", "threefry2x32")) != "threefry2x32":
            return None
        data = key
    else:
        return None
    if data.shape != (2,):
        return None
    return data[0], data[1]


def uniform_noise(key: Array, shape: tuple, dtype=jnp.float32) -> Array:
    """``jax.random.uniform(key, shape, dtype)``, bit for bit, as fusible elementwise ops.

    For a threefry key (JAX's default, with ``jax_threefry_partitionable``, the
    default) and float32, element ``i`` (row-major) is
    ``bitcast((b_i >> 9) | 0x3f800000) - 1`` with ``b_i = xor(threefry2x32(key,
    (0, i)))``, computed from iotas inside the consumer's loop: no random tensor is
    materialized. Any other key, dtype or a tensor of ``>= 2^32`` elements falls back
    to ``jax.random.uniform``.

    Example:
      >>> k = jax.random.key(0)
      >>> bool(jnp.all(uniform_noise(k, (3, 4)) == jax.random.uniform(k, (3, 4))))
      True
    """
    shape = tuple(int(d) for d in shape)
    words = _threefry_key_words(key)
    size = int(np.prod(shape)) if shape else 1
    if (words is None or jnp.dtype(dtype) != jnp.float32 or size >= 2 ** 32
            or not getattr(jax.config, "jax_threefry_partitionable", False)):
        return jax.random.uniform(key, shape, dtype=dtype)
    index = jnp.zeros(shape, jnp.uint32)
    stride = 1
    for d in reversed(range(len(shape))):
        index = index + jax.lax.broadcasted_iota(jnp.uint32, shape, d) * np.uint32(stride)
        stride *= shape[d]
    b0, b1 = _threefry2x32(words[0], words[1], jnp.zeros(shape, jnp.uint32), index)
    mantissa = ((b0 ^ b1) >> np.uint32(9)) | np.uint32(0x3F800000)
    return jax.lax.bitcast_convert_type(mantissa, jnp.float32) - 1.0


def _round(v: Array, rounding: str, key: Optional[Array]) -> Array:
    if rounding == "nearest":
        return jnp.round(v)  # half to even
    noise = uniform_noise(key, v.shape, dtype=v.dtype)
    return jnp.floor(v + noise)


def _reduce_axes(ndim: int, channel_axis: Optional[int]) -> Optional[tuple]:
    if channel_axis is None or ndim == 0:
        return None
    axis = channel_axis % ndim if -ndim <= channel_axis < ndim else None
    if axis is None:
        raise ValueError(
            f"channel_axis={channel_axis} is out of range for a tensor of rank {ndim}")
    return tuple(i for i in range(ndim) if i != axis)


# Tensors at least this large take the CPU fast path of `_guarded_reduction`.
_FAST_REDUCTION_MIN_SIZE = 1 << 14


def _guarded_reduction(x: Array, plain, masked):
    """``masked(x)`` (the reduction over finite elements), computed cheaply on CPU.

    On GPU/TPU the masked reduction is one fused pass. On CPU, XLA hands plain
    reductions to a fast vectorized library but cannot fuse the ``where(isfinite)``
    mask into them, so the mask was materialized (two extra tensor writes). There
    ``sum(x)`` tells whether every element is finite (NaN and Inf poison the sum),
    and ``lax.cond`` picks ``plain(x)`` (same result then) or ``masked(x)``.
    """
    if x.size < _FAST_REDUCTION_MIN_SIZE:
        return masked(x)

    def cpu(x):
        return jax.lax.cond(jnp.isfinite(jnp.sum(x)), plain, masked, x)

    return jax.lax.platform_dependent(x, cpu=cpu, default=masked)


def _finite_min_max(x: Array, axes) -> tuple[Array, Array]:
    def masked(x):
        finite = jnp.isfinite(x)
        lo = jnp.min(jnp.where(finite, x, jnp.inf), axis=axes, keepdims=True)
        hi = jnp.max(jnp.where(finite, x, -jnp.inf), axis=axes, keepdims=True)
        # An all-non-finite block has no range: use 0 so no NaN is created.
        lo = jnp.where(jnp.isfinite(lo), lo, 0.0)
        hi = jnp.where(jnp.isfinite(hi), hi, 0.0)
        return lo, hi

    def plain(x):
        return (jnp.min(x, axis=axes, keepdims=True), jnp.max(x, axis=axes, keepdims=True))

    return _guarded_reduction(x, plain, masked)


def _finite_absmax(x: Array, axes) -> Array:
    def masked(x):
        return jnp.max(jnp.where(jnp.isfinite(x), jnp.abs(x), 0.0), axis=axes, keepdims=True)

    def plain(x):
        return jnp.max(jnp.abs(x), axis=axes, keepdims=True)

    return _guarded_reduction(x, plain, masked)


# --------------------------------------------------------------------------- grids

def _affine(x, bits, fmt: AffineInt, rounding, key):
    lo, hi = _finite_min_max(x, _reduce_axes(x.ndim, fmt.channel_axis))
    levels = pow2(bits) - 1.0
    scale = jnp.maximum((hi - lo) / levels, MIN_SCALE)
    codes = jnp.clip(_round((x - lo) / scale, rounding, key), 0.0, levels)
    return codes * scale + lo


def _symmetric_codes(x, bits, fmt: SymmetricInt, rounding, key):
    amax = _finite_absmax(x, _reduce_axes(x.ndim, fmt.channel_axis))
    top = pow2(bits - 1.0) - 1.0
    scale = jnp.maximum(amax / jnp.maximum(top, 1.0), MIN_SCALE)
    return jnp.clip(_round(x / scale, rounding, key), -top, top), scale


def _symmetric(x, bits, fmt: SymmetricInt, rounding, key):
    codes, scale = _symmetric_codes(x, bits, fmt, rounding, key)
    return codes * scale


def _fixed_point(x, bits, fmt: FixedPoint, rounding, key):
    unit = pow2(-float(fmt.frac_bits))
    top = pow2(bits - fmt.frac_bits - 1.0)
    q = _round(x / unit, rounding, key) * unit
    return jnp.clip(q, -top, top - unit)


def _block_float(x, bits, fmt: BlockFloat, rounding, key):
    amax = _finite_absmax(x, _reduce_axes(x.ndim, fmt.channel_axis))
    e = jnp.where(amax > 0, floor_log2(jnp.where(amax > 0, amax, 1.0)), 0.0)
    unit_exp = e + 2.0 - bits  # u = 2^unit_exp; scaled in two steps (see mul_pow2)
    top = pow2(bits - 1.0) - 1.0
    return mul_pow2(jnp.clip(_round(mul_pow2(x, -unit_exp), rounding, key), -top, top), unit_exp)


def _small_float(x, bits, fmt: Float, rounding, key):
    man = jnp.maximum(bits - 1.0 - fmt.exp_bits, 0.0)
    emin = 1.0 - fmt.bias
    emax = float(2 ** (fmt.exp_bits - 1))
    largest = pow2(emax) * (2.0 - pow2(-man))
    a = jnp.abs(x)
    e = jnp.maximum(floor_log2(jnp.where(a > 0, a, 1.0)), emin)
    # a / 2^(e - man), rounded, times 2^(e - man); the spacing 2^(e - man) may be
    # below the float32 normal range (exp_bits = 8), so scale in two steps.
    mag = mul_pow2(_round(mul_pow2(a, man - e), rounding, key), e - man)
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


def symmetric_codes(x: Array, bits: Bits, fmt: SymmetricInt = SymmetricInt(), *,
                    rounding: str = "nearest", key: Optional[Array] = None
                    ) -> tuple[Array, Array]:
    """The integer codes and scale of `SymmetricInt`: ``quantize(x) == codes * scale``.

    ``s = max(max|x| / max(2^(b-1)-1, 1), 1e-8)`` (per tensor, or per index along
    ``fmt.channel_axis``, broadcastable to `x`), ``codes = clip(round(x/s), -L, L)``
    with ``L = 2^(b-1) - 1``, as float32 integers (they fit int8 for ``b <= 8``).
    The same ops as `quantize`, so ``codes * scale`` equals it bit for bit on finite
    inputs (non-finite inputs have no code). Used by the real-int8 products.

    Example:
      >>> c, s = symmetric_codes(jnp.array([-1.0, 0.2, 0.7]), 2)
      >>> c, s
      (Array([-1.,  0.,  1.], dtype=float32), Array([1.], dtype=float32))
    """
    if not isinstance(fmt, SymmetricInt):
        raise ValueError(f"fmt must be a SymmetricInt, got {fmt!r}")
    check_rounding(rounding, key)
    check_bits(bits)
    xf = jnp.asarray(x).astype(jnp.float32)
    return _symmetric_codes(xf, jnp.asarray(bits, jnp.float32), fmt, rounding, key)


def grid_step(x: Array, bits: Bits, fmt: Format) -> Array:
    """The spacing of the grid that `quantize(x, bits, fmt)` uses, broadcastable to `x`.

    For integer formats the scale ``s``; for `FixedPoint` ``2^-f``; for `BlockFloat`
    the shared unit; for `Float` the spacing of each element's binade. Used by tests
    and error bounds (nearest: ``|q - x| <= step/2`` inside the range). A spacing
    below the float32 normal range is reported as ``2^-126`` (an upper bound).
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
