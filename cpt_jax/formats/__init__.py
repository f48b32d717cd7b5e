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
* Every grid is finite on finite inputs, up to ``+-3.4e38``: a range wider than
  float32 (`affine_grid`), a top code one ulp past the maximum, or a scale below the
  smallest normal float32 (`fp_scale`) is handled, never turned into Inf or NaN.

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
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array
Bits = int | float | Array

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

    channel_axis: int | None = None


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

    channel_axis: int | None = None


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

    channel_axis: int | None = None


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
      >>> quantize(jnp.array([1000., 0.1]), 8, Float(exp_bits=4)).tolist()
      [480.0, 0.1015625]
    """

    exp_bits: int = 4

    def __post_init__(self):
        if not isinstance(self.exp_bits, (int, np.integer)) or not 1 <= self.exp_bits <= 8:
            raise ValueError(f"Float.exp_bits must be an int in [1, 8], got {self.exp_bits!r}")

    @property
    def bias(self) -> int:
        return 2 ** (self.exp_bits - 1) - 1


# --------------------------------------------------------------------------- hardware formats

@dataclasses.dataclass(frozen=True)
class ElementSpec:
    """One OCP element type: width, mantissa bits, exponent bias and largest value.

    Normal numbers ``2^e (1 + k 2^-m)`` for ``e >= emin = 1 - bias``; subnormals
    ``k 2^(emin - m)`` below ``2^emin``; ``largest`` is the biggest finite value
    (no Inf for the ``fn`` types; e5m2 has Inf, saturated to ``largest`` here).
    ``emax = floor(log2 largest)`` is the OCP MX ``emax_elem``.
    """

    name: str
    width: int
    man_bits: int
    bias: int
    largest: float
    dtype_name: str

    @property
    def emin(self) -> int:
        return 1 - self.bias

    @property
    def emax(self) -> int:
        return int(np.floor(np.log2(self.largest)))

    @property
    def dtype(self):
        """The `jnp`/ml_dtypes dtype of the element (e.g. ``float8_e4m3fn``)."""
        return jnp.dtype(self.dtype_name)


ELEMENTS = {
    "e4m3": ElementSpec("e4m3", 8, 3, 7, 448.0, "float8_e4m3fn"),
    "e5m2": ElementSpec("e5m2", 8, 2, 15, 57344.0, "float8_e5m2"),
    "e3m2": ElementSpec("e3m2", 6, 2, 3, 28.0, "float6_e3m2fn"),
    "e2m3": ElementSpec("e2m3", 6, 3, 1, 7.5, "float6_e2m3fn"),
    "e2m1": ElementSpec("e2m1", 4, 1, 1, 6.0, "float4_e2m1fn"),
}
"""OCP 8-bit FP (OFP8) and OCP MX v1.0 element types (float6/float4 are the MX ones)."""

MX_ELEMENTS = tuple(ELEMENTS) + ("int8", "int", "float")
"""`MX` elements: the OCP ones, MXINT8, and the traced-width ``"int"`` / ``"float"``."""

MX_FLOAT_BY_BITS = ((8, "e4m3"), (6, "e2m3"), (4, "e2m1"))
"""`MX("float")`: the element used at ``bits`` is the widest one with width <= bits."""

SCALED_GRANULARITIES = ("tensor", "row", "tile", "block")

MX_SCALE_ROUNDINGS = ("floor", "up")
"""`MX.scale_rounding`: the OCP spec's floor, or JAX's / cuDNN's round-up of ``amax / max``."""


def _check_axis(value, name: str) -> None:
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool):
        raise ValueError(f"{name} must be an int axis, got {value!r}")


def repr_without_defaults(obj, always: Sequence[str]) -> str:
    """``Name(f=v, ...)``: the fields in `always`, then the others that differ from
    their defaults (so a format's repr is unchanged by a new option left at its default).

    Example:
      >>> repr_without_defaults(MX("e2m1", scale_rounding="up"), ("element",))
      "MX(element='e2m1', scale_rounding='up')"
    """
    parts = []
    for field in dataclasses.fields(obj):
        value = getattr(obj, field.name)
        if field.name in always or value != field.default:
            parts.append(f"{field.name}={value!r}")
    return f"{type(obj).__name__}({', '.join(parts)})"


@dataclasses.dataclass(frozen=True)
class OCPFloat:
    """An OCP element type as a saturating cast: ``q = dtype(clip(x, -max, max))``.

    Elements (OCP OFP8 spec v1.0 and OCP Microscaling spec v1.0, section 5.3):
    ``"e4m3"`` (float8_e4m3fn, max 448), ``"e5m2"`` (max 57344), ``"e3m2"``
    (float6_e3m2fn, max 28), ``"e2m3"`` (float6_e2m3fn, max 7.5), ``"e2m1"``
    (float4_e2m1fn, max 6). No scale: values are cast as they are, so this is the
    element grid itself; the width is the element's and any ``bits < 32`` gives it
    (``bits >= 32``: identity). Nearest rounding is half to even, as ml_dtypes.

    Example:
      >>> quantize(jnp.array([1000., 0.3, -17.]), 8, OCPFloat("e4m3")).tolist()
      [448.0, 0.3125, -16.0]
    """

    element: str = "e4m3"

    def __post_init__(self):
        if self.element not in ELEMENTS:
            raise ValueError(f"OCPFloat.element must be one of {tuple(ELEMENTS)}, got {self.element!r}")

    @property
    def spec(self) -> ElementSpec:
        return ELEMENTS[self.element]


@dataclasses.dataclass(frozen=True)
class MX:
    """OCP Microscaling (MX spec v1.0): blocks of `block_size` share a power-of-two scale.

    Consecutive blocks of `block_size` elements along `axis` (zero-padded at the
    end) share ``X = 2^clip(floor(log2 amax) - emax_elem, -127, 127)`` (an E8M0
    scale); elements are the saturating casts of ``x / X``; ``q = X * elem``.

    * ``"e4m3" "e5m2" "e3m2" "e2m3" "e2m1"``: MXFP8/MXFP6/MXFP4, ``emax_elem`` =
      8, 15, 4, 2, 2 (`OCPFloat` elements).
    * ``"int8"``: MXINT8, ``elem = clip(rint(64 x/X), -127, 127) / 64``, emax 0.
    * ``"int"`` (traced width ``b``, 2..8 are the MX widths):
      ``elem = clip(rint(2^(b-2) x/X), -(2^(b-1)-1), 2^(b-1)-1) / 2^(b-2)``
      (MXINT8 at 8).
    * ``"float"`` (traced width): bits 4/6/8 use e2m1/e2m3/e4m3; between them the
      widest element not above ``bits`` (5 -> e2m1, 7 -> e2m3).

    `axis` should be the dimension the product contracts (see docs/formats.md).

    `scale_rounding` picks the shared exponent of a float element:

    * ``"floor"`` (the OCP spec, section 6.3): ``floor(log2 amax) - emax_elem``;
      the block's largest element can exceed the element's maximum and saturate
      (e4m3: amax in ``[448, 512) * X``).
    * ``"up"`` (JAX's ``jax.nn.get_scaled_dot_general_config`` and cuDNN):
      ``X = 2^ceil(log2(amax / largest))``, the E8M0 cast of ``amax / largest``
      rounded up: nothing saturates, the largest element may use one binade less.

    Example:
      >>> quantize(jnp.array([3.0, 0.26, -0.1, 0.0]), 4, MX("e2m1", block_size=4)).tolist()
      [3.0, 0.25, -0.0, 0.0]
      >>> x = jnp.array([500.0, 1.0])      # floor: X = 1, 500 saturates; up: X = 2
      >>> [quantize(x, 8, MX(block_size=2, scale_rounding=r)).tolist() for r in ("floor", "up")]
      [[448.0, 1.0], [512.0, 1.0]]
    """

    element: str = "e4m3"
    block_size: int = 32
    axis: int = -1
    scale_rounding: str = dataclasses.field(default="floor", repr=False)

    def __post_init__(self):
        if self.element not in MX_ELEMENTS:
            raise ValueError(f"MX.element must be one of {MX_ELEMENTS}, got {self.element!r}")
        if not isinstance(self.block_size, (int, np.integer)) or self.block_size < 1:
            raise ValueError(f"MX.block_size must be an int >= 1, got {self.block_size!r}")
        _check_axis(self.axis, "MX.axis")
        if self.scale_rounding not in MX_SCALE_ROUNDINGS:
            raise ValueError(f"MX.scale_rounding must be one of {MX_SCALE_ROUNDINGS}, "
                             f"got {self.scale_rounding!r}")
        if self.scale_rounding == "up" and self.element in ("int8", "int"):
            raise ValueError(f"MX.scale_rounding='up' needs a float element, got "
                             f"{self.element!r}")

    def __repr__(self) -> str:
        return repr_without_defaults(self, ("element", "block_size", "axis"))


@dataclasses.dataclass(frozen=True)
class NVFP4:
    """NVIDIA NVFP4: e2m1 elements, blocks of 16 with an E4M3 scale, an fp32 tensor scale.

    As NVIDIA describes it (NVIDIA Technical Blog, "Introducing NVFP4 for
    Efficient and Accurate Low-Precision Inference", 2025; Transformer Engine's
    NVFP4 recipe): ``s_t = 448 * 6 / amax(x)`` (fp32, per tensor; 1 if amax is 0);
    per block of 16 along `axis` ``s_b = e4m3(amax_b / 6 * s_t)`` (the stored
    E4M3 scale, round to nearest); ``q = e2m1(x / (s_b / s_t)) * s_b / s_t``
    (saturating; a block whose scale rounds to 0 becomes 0). The width is 4;
    ``bits >= 32`` is identity.

    ``block_2d=True`` (the NVFP4 *training* recipe's weights, NVIDIA "Pretraining
    Large Language Models with NVFP4", 2025): blocks of 16 x 16 over `axis` and
    `other_axis` (default: the last axis that is not `axis`), so a weight and its
    transpose are quantized to the same values; a 1-D tensor keeps 1 x 16 blocks.

    Example:
      >>> quantize(jnp.array([6.0, 1.1, -0.4, 0.0]), 4, NVFP4())
      Array([ 6. ,  1. , -0.5,  0. ], dtype=float32)
      >>> w = jax.random.normal(jax.random.key(0), (32, 48))
      >>> q = quantize(w, 4, NVFP4(axis=0, block_2d=True))
      >>> bool(jnp.all(q.T == quantize(w.T, 4, NVFP4(axis=0, block_2d=True))))
      True
    """

    axis: int = -1
    block_size: int = 16
    block_2d: bool = dataclasses.field(default=False, repr=False)
    other_axis: int | None = dataclasses.field(default=None, repr=False)

    def __post_init__(self):
        _check_axis(self.axis, "NVFP4.axis")
        if self.block_size != 16:
            raise ValueError(f"NVFP4.block_size is 16 (NVIDIA's format), got {self.block_size!r}")
        if not isinstance(self.block_2d, (bool, np.bool_)):
            raise ValueError(f"NVFP4.block_2d must be a bool, got {self.block_2d!r}")
        if self.other_axis is not None:
            _check_axis(self.other_axis, "NVFP4.other_axis")

    def __repr__(self) -> str:
        return repr_without_defaults(self, ("axis", "block_size"))


@dataclasses.dataclass(frozen=True)
class ScaledFloat:
    """An OCP float element with an fp32 scale ``X = amax / max``: the FP8 training recipes.

    ``q = X * dtype(x / X)`` (saturating), ``X = amax / largest`` over a group
    (``X = 1`` where amax is 0), with `granularity`:

    * ``"tensor"``: one scale (Transformer Engine's per-tensor current scaling);
    * ``"row"``: one scale per slice along `axis` (rowwise: amax over the
      contracted dimension, one scale per row of the operand);
    * ``"tile"``: blocks of ``1 x tile`` along `axis` (DeepSeek-V3's activations);
    * ``"block"``: ``tile x tile`` blocks over `axis` and `other_axis` (default:
      the last axis that is not `axis`; DeepSeek-V3's 128x128 weight blocks).

    Example:
      >>> q = quantize(jnp.array([1000., 0.3, -17.]), 8, ScaledFloat("e4m3"))
      >>> [round(v, 3) for v in q.tolist()]  # scale 1000/448; 0.3 -> 9/64 * 1000/448
      [1000.0, 0.314, -16.741]
    """

    element: str = "e4m3"
    granularity: str = "tensor"
    axis: int = -1
    tile: int = 128
    other_axis: int | None = None

    def __post_init__(self):
        if self.element not in ELEMENTS:
            raise ValueError(f"ScaledFloat.element must be one of {tuple(ELEMENTS)}, got {self.element!r}")
        if self.granularity not in SCALED_GRANULARITIES:
            raise ValueError(f"ScaledFloat.granularity must be one of {SCALED_GRANULARITIES}, "
                             f"got {self.granularity!r}")
        _check_axis(self.axis, "ScaledFloat.axis")
        if self.other_axis is not None:
            _check_axis(self.other_axis, "ScaledFloat.other_axis")
        if not isinstance(self.tile, (int, np.integer)) or self.tile < 1:
            raise ValueError(f"ScaledFloat.tile must be an int >= 1, got {self.tile!r}")

    @property
    def spec(self) -> ElementSpec:
        return ELEMENTS[self.element]


Format = (AffineInt | SymmetricInt | FixedPoint | BlockFloat | Float | OCPFloat | MX | NVFP4
          | ScaledFloat)
FORMATS = (AffineInt, SymmetricInt, FixedPoint, BlockFloat, Float, OCPFloat, MX, NVFP4,
           ScaledFloat)
HARDWARE_FORMATS = (OCPFloat, MX, NVFP4, ScaledFloat)


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


def _threefry_key_words(key: Array) -> tuple[Array, Array] | None:
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


def _round(v: Array, rounding: str, key: Array | None) -> Array:
    if rounding == "nearest":
        return jnp.round(v)  # half to even
    noise = uniform_noise(key, v.shape, dtype=v.dtype)
    return jnp.floor(v + noise)


def _reduce_axes(ndim: int, channel_axis: int | None) -> tuple | None:
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
    the plain min/max/absmax reductions run first: they propagate NaN and show an
    Inf as an infinite extreme, so their own (small) outputs tell whether every
    element was finite, and ``lax.cond`` keeps them (the same result then) or
    computes ``masked(x)``. No extra pass over `x` (a finiteness ``sum(x)`` before
    the reductions cost a 1024x1024 weight 0.8 ms per step on jax 0.12's CPU).
    """
    if x.size < _FAST_REDUCTION_MIN_SIZE:
        return masked(x)

    def cpu(x):
        out = plain(x)
        finite = jnp.all(jnp.stack([jnp.all(jnp.isfinite(o)) for o in jax.tree.leaves(out)]))
        return jax.lax.cond(finite, lambda x: out, masked, x)

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

# Scales at or above 2^64 are computed on a range scaled by 2^-64 (`prescale`).
_HUGE_SCALE = 2.0 ** 64


def prescale(width: Array, levels: Array) -> Array:
    """``f = 2^-64`` where a grid's step ``width / levels`` is >= 2^64 or Inf, else 1.

    A range wider than float32 (``hi - lo = Inf`` for ``[-3e38, 3e38]``) or a step so
    large that its reciprocal is subnormal (XLA divides by a broadcast scale as a
    multiply by its reciprocal, and CPU flushes subnormals to 0: every code would
    be 0) is computed on ``f x``; ``f`` is a power of two, so scaling is exact and
    ``f = 1`` leaves the usual formulas bit for bit.

    Example:
      >>> float(prescale(jnp.float32(jnp.inf), 15.0)), float(prescale(jnp.float32(3.0), 3.0))
      (5.421010862427522e-20, 1.0)
    """
    return jnp.where(width / levels < _HUGE_SCALE, 1.0, 1.0 / _HUGE_SCALE).astype(jnp.float32)


def affine_grid(lo: Array, hi: Array, levels: Array) -> tuple[Array, Array, Array]:
    """`AffineInt`'s grid on ``[lo, hi]``, computed where nothing can overflow.

    With ``f = prescale(hi - lo, levels)``: ``lo_f = f lo``,
    ``s_f = max((f hi - f lo) / levels, 1e-8)``; the real grid's step is ``s_f / f``
    and its points are ``(c s_f + lo_f) / f``, ``c = 0 .. levels``. For every range
    narrower than ``2^64 levels`` (all but the extreme ones) ``f = 1``: the CPT
    formula ``s = max((max - min) / (2^b - 1), 1e-8)`` bit for bit.

    Args:
      lo, hi: the finite range (broadcastable, e.g. per channel).
      levels: ``2^b - 1``.

    Returns:
      ``(f, lo_f, s_f)``.

    Example:
      >>> f, lo_f, s_f = affine_grid(jnp.float32(-3e38), jnp.float32(3e38), 15.0)
      >>> float(s_f / f)  # (3e38 - -3e38) / 15, beyond float32 as hi - lo
      3.999999973526325e+37
    """
    f = prescale(hi - lo, levels)
    lo_f = lo * f
    return f, lo_f, jnp.maximum((hi * f - lo_f) / levels, MIN_SCALE)


def _affine(x, bits, fmt: AffineInt, rounding, key):
    lo, hi = _finite_min_max(x, _reduce_axes(x.ndim, fmt.channel_axis))
    levels = pow2(bits) - 1.0
    f, lo_f, scale = affine_grid(lo, hi, levels)
    codes = jnp.clip(_round((x * f - lo_f) / scale, rounding, key), 0.0, levels)
    # On a prescaled range the top point may round one ulp past hi * f: keep it <= hi.
    cap = jnp.where(f < 1.0, hi * f, jnp.inf)
    return jnp.minimum(codes * scale + lo_f, cap) / f


def _symmetric_scale(amax: Array, top: Array) -> tuple[Array, Array, Array]:
    """``(f, s_f, s)`` of `SymmetricInt`: ``s = max(max|x| / max(L, 1), 1e-8)`` computed on
    ``f max|x|`` (`prescale`), capped so that ``L s`` stays finite at ``max|x| ~ 3.4e38``."""
    levels = jnp.maximum(top, 1.0)
    f = prescale(amax, levels)  # 1 unless the step is >= 2^64
    scale_f = jnp.maximum(amax * f / levels, MIN_SCALE)
    cap = jnp.finfo(jnp.float32).max * (1.0 - 2.0 ** -20) / levels
    return f, scale_f, jnp.minimum(scale_f / f, cap)


def _symmetric_codes(x, bits, fmt: SymmetricInt, rounding, key):
    amax = _finite_absmax(x, _reduce_axes(x.ndim, fmt.channel_axis))
    top = pow2(bits - 1.0) - 1.0
    f, scale_f, scale = _symmetric_scale(amax, top)
    return jnp.clip(_round(x * f / scale_f, rounding, key), -top, top), scale


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


# --------------------------------------------------------------------------- hardware grids

def float_elements(v: Array, man_bits, emin, largest, rounding: str = "nearest",
                   key: Array | None = None) -> Array:
    """Round `v` to a small-float element grid, saturating (parameters may be traced).

    ``a = min(|v|, largest)``, ``e = max(floor(log2 a), emin)``,
    ``q = sign(v) min(round(a 2^(m-e)) 2^(e-m), largest)``: normals, subnormals
    below ``2^emin`` and no Inf. With ``(m, emin, largest)`` of an `ElementSpec`
    it equals the ml_dtypes cast of ``clip(v, -largest, largest)``.

    Args:
      v: float32 values in element units.
      man_bits, emin, largest: the element's mantissa bits, smallest normal
        exponent and largest value (scalars, possibly traced).
      rounding: ``"nearest"`` (half to even) or ``"stochastic"``.
      key: PRNG key for stochastic rounding.

    Returns:
      float32 array of element values.

    Example:
      >>> float_elements(jnp.array([0.3, 7.0]), 1, 0, 6.0)
      Array([0.5, 6. ], dtype=float32)
    """
    a = jnp.minimum(jnp.abs(v), largest)
    e = jnp.maximum(floor_log2(jnp.where(a > 0, a, 1.0)), emin)
    mag = mul_pow2(_round(mul_pow2(a, man_bits - e), rounding, key), e - man_bits)
    return jnp.sign(v) * jnp.minimum(mag, largest)


def _normal_axis(ndim: int, axis: int, name: str = "axis") -> int:
    if not -ndim <= axis < ndim:
        raise ValueError(f"{name}={axis} is out of range for a tensor of rank {ndim}")
    return axis % ndim


def block_view(x: Array, axes_sizes: Sequence[tuple]) -> tuple:
    """`x` reshaped so each block is a set of inner dims: ``(view, inner_axes, restore)``.

    Each ``(axis, size)`` splits `axis` into ``(n_blocks, size)`` after zero-padding
    it to a multiple of `size`; `inner_axes` are the ``size`` dims of `view` (reduce
    over them for one value per block); ``restore(view)`` undoes the reshape, the
    padding and the transpose.

    Example:
      >>> v, inner, restore = block_view(jnp.arange(5.0), [(0, 2)])
      >>> v.shape, inner, restore(v).shape
      ((3, 2), (1,), (5,))
    """
    axes = [a for a, _ in axes_sizes]
    perm = [d for d in range(x.ndim) if d not in axes] + axes
    xt = jnp.transpose(x, perm)
    n_lead = x.ndim - len(axes)
    pads = [(0, 0)] * n_lead + [(0, (-xt.shape[n_lead + i]) % size)
                                for i, (_, size) in enumerate(axes_sizes)]
    xp = jnp.pad(xt, pads) if any(p for _, p in pads) else xt
    shape = list(xp.shape[:n_lead])
    for i, (_, size) in enumerate(axes_sizes):
        shape += [xp.shape[n_lead + i] // size, size]
    view = xp.reshape(shape)
    inner = tuple(n_lead + 2 * i + 1 for i in range(len(axes)))
    inverse = tuple(int(i) for i in np.argsort(perm))

    def restore(v):
        y = v.reshape(xp.shape)[tuple(slice(0, n) for n in xt.shape)]
        return jnp.transpose(y, inverse)

    return view, inner, restore


def _masked_absmax(x: Array, axes) -> Array:
    return jnp.max(jnp.where(jnp.isfinite(x), jnp.abs(x), 0.0), axis=axes, keepdims=True)


def mx_element_params(fmt: MX, bits: Array) -> tuple:
    """``(kind, man_bits, emin, largest, emax)`` of `fmt`'s element at `bits` (traceable).

    `kind` is ``"float"`` or ``"int"``; for ``"int"`` the parameters are
    ``(2^(b-2) units, levels 2^(b-1)-1)`` in place of (man_bits, emin) and largest
    is unused. ``MX("float")`` selects e4m3/e2m3/e2m1 with `jnp.where` on `bits`.
    """
    if fmt.element in ELEMENTS:
        spec = ELEMENTS[fmt.element]
        return "float", float(spec.man_bits), float(spec.emin), spec.largest, float(spec.emax)
    if fmt.element in ("int8", "int"):
        b = jnp.float32(8.0) if fmt.element == "int8" else jnp.asarray(bits, jnp.float32)
        return "int", b - 2.0, pow2(b - 1.0) - 1.0, None, 0.0
    params = [(ELEMENTS[name].man_bits, ELEMENTS[name].emin, ELEMENTS[name].largest,
               ELEMENTS[name].emax) for _, name in MX_FLOAT_BY_BITS]
    (m8, n8, l8, x8), (m6, n6, l6, x6), (m4, n4, l4, x4) = params
    b = jnp.asarray(bits, jnp.float32)

    def pick(v8, v6, v4):
        return jnp.where(b >= 8, float(v8), jnp.where(b >= 6, float(v6), float(v4)))

    return "float", pick(m8, m6, m4), pick(n8, n6, n4), pick(l8, l6, l4), pick(x8, x6, x4)


def mx_shared_exponent(amax: Array, fmt: MX, largest, emax) -> Array:
    """The E8M0 exponent of each block, ``clip(e, -127, 127)`` (0 for an all-zero block).

    ``fmt.scale_rounding == "floor"`` (OCP): ``e = floor(log2 amax) - emax``;
    ``"up"`` (JAX, cuDNN): ``e = ceil(log2(amax / largest))``.

    Example:
      >>> a = jnp.array([500.0, 448.0, 0.0])
      >>> [mx_shared_exponent(a, MX(scale_rounding=r), 448.0, 8.0).tolist() for r in ("floor", "up")]
      [[0.0, 0.0, 0.0], [1.0, 0.0, 0.0]]
    """
    positive = amax > 0
    if fmt.scale_rounding == "up":
        ratio = jnp.where(positive, amax / largest, 1.0)
        e = floor_log2(ratio)
        shared = jnp.where(mul_pow2(jnp.ones_like(ratio), e) < ratio, e + 1.0, e)
        shared = jnp.where(positive, shared, 0.0)
    else:
        shared = jnp.where(positive, floor_log2(jnp.where(positive, amax, 1.0)) - emax, 0.0)
    return jnp.clip(shared, -127.0, 127.0)


def mx_parts(x: Array, bits, fmt: MX, rounding: str = "nearest",
             key: Array | None = None) -> tuple:
    """`MX` as its parts: ``quantize(x) == restore(elements * 2^shared)``.

    Args:
      x: float32 array.
      bits: the width (read by ``MX("int")`` / ``MX("float")``).
      fmt: the `MX` format (blocks along ``fmt.axis``).
      rounding, key: as `quantize`.

    Returns:
      ``(elements, shared, restore)``: the element values in the block view of
      `block_view` (float32, each exactly an element of the grid), the E8M0
      exponent of each block (broadcastable to `elements`) and ``restore``, which
      maps a block view back to the shape of `x`.

    Example:
      >>> e, shared, restore = mx_parts(jnp.array([3.0, 0.26]), 4, MX("e2m1", block_size=2))
      >>> e.tolist(), shared.tolist()
      ([[6.0, 0.5]], [[-1.0]])
    """
    view, inner, restore = block_view(x, [(_normal_axis(x.ndim, fmt.axis, "MX.axis"),
                                           fmt.block_size)])
    kind, p1, p2, largest, emax = mx_element_params(fmt, bits)
    shared = mx_shared_exponent(_masked_absmax(view, inner), fmt, largest, emax)
    v = mul_pow2(view, -shared)
    if kind == "int":
        elem = mul_pow2(jnp.clip(_round(mul_pow2(v, p1), rounding, key), -p2, p2), -p1)
    else:
        elem = float_elements(v, p1, p2, largest, rounding, key)
    return elem, shared, restore


def _mx(x, bits, fmt: MX, rounding, key):
    elem, shared, restore = mx_parts(x, bits, fmt, rounding, key)
    return restore(mul_pow2(elem, shared))


def _ocp_float(x, bits, fmt: OCPFloat, rounding, key):
    spec = fmt.spec
    return float_elements(x, float(spec.man_bits), float(spec.emin), spec.largest, rounding, key)


def nvfp4_view(x: Array, fmt: NVFP4) -> tuple:
    """`block_view` of `x` in NVFP4 blocks: 16 along ``fmt.axis``, or 16 x 16 with
    ``fmt.block_2d`` (along ``fmt.other_axis``, default the last other axis).

    Example:
      >>> x = jnp.zeros((32, 48))
      >>> nvfp4_view(x, NVFP4(axis=0))[0].shape, nvfp4_view(x, NVFP4(axis=0, block_2d=True))[0].shape
      ((48, 2, 16), (3, 16, 2, 16))
    """
    axis = _normal_axis(x.ndim, fmt.axis, "NVFP4.axis")
    if not fmt.block_2d or x.ndim < 2:
        return block_view(x, [(axis, 16)])
    if fmt.other_axis is None:
        other = [d for d in range(x.ndim) if d != axis][-1]
    else:
        other = _normal_axis(x.ndim, fmt.other_axis, "NVFP4.other_axis")
    if other == axis:
        raise ValueError(f"NVFP4.other_axis must differ from axis, got {fmt.other_axis}")
    return block_view(x, [(other, 16), (axis, 16)])


def nvfp4_parts(x: Array, fmt: NVFP4, rounding: str = "nearest",
                key: Array | None = None) -> tuple:
    """`NVFP4` as its parts: ``quantize(x) == restore(elements * (s_b / s_t))``.

    Args:
      x: float32 array.
      fmt: the `NVFP4` format.
      rounding, key: as `quantize` (the elements' rounding).

    Returns:
      ``(elements, s_b, s_t, restore)``: e2m1 element values in the block view
      (`nvfp4_view`), the E4M3 block scales (float32 values, broadcastable to
      `elements`), the fp32 tensor scale ``s_t = 448 * 6 / amax`` (a scalar) and
      ``restore`` (block view -> the shape of `x`).

    Example:
      >>> e, s_b, s_t, restore = nvfp4_parts(jnp.array([6.0, 1.1, -0.4, 0.0]), NVFP4())
      >>> e[0, :4].tolist(), float(s_b[0, 0]), float(s_t)
      ([6.0, 1.0, -0.5, 0.0], 448.0, 448.0)
    """
    e4m3, e2m1 = ELEMENTS["e4m3"], ELEMENTS["e2m1"]
    view, inner, restore = nvfp4_view(x, fmt)
    amax_t = _masked_absmax(x, None)
    # The tensor scale is capped at 2^127: below amax ~ 1.6e-35 it would overflow to inf.
    s_t = jnp.where(amax_t > 0, jnp.minimum((e4m3.largest * e2m1.largest)
                                            / jnp.where(amax_t > 0, amax_t, 1.0), 2.0 ** 127),
                    1.0).reshape(())
    s_b = float_elements(_masked_absmax(view, inner) / e2m1.largest * s_t,
                         float(e4m3.man_bits), float(e4m3.emin), e4m3.largest)
    scale = s_b / s_t
    v = jnp.where(scale > 0, view / jnp.where(scale > 0, scale, 1.0), 0.0)
    elem = float_elements(v, float(e2m1.man_bits), float(e2m1.emin), e2m1.largest, rounding, key)
    return elem, s_b, s_t, restore


def _nvfp4(x, bits, fmt: NVFP4, rounding, key):
    elem, s_b, s_t, restore = nvfp4_parts(x, fmt, rounding, key)
    return restore(elem * (s_b / s_t))


def fp_scale(amax: Array, largest: float) -> Array:
    """The scale of a scaled FP format: ``s = max(amax / largest, 2^-126)`` (1 if amax = 0).

    The floor keeps ``s`` a normal float32: below it ``amax / largest`` would be
    flushed to 0 on CPU and ``x / s`` would be NaN; elements that small round to 0.

    Example:
      >>> fp_scale(jnp.float32(896.0), 448.0), fp_scale(jnp.float32(1e-37), 448.0)
      (Array(2., dtype=float32), Array(1.1754944e-38, dtype=float32))
    """
    tiny = jnp.finfo(jnp.float32).tiny
    return jnp.where(amax > 0, jnp.maximum(amax / largest, tiny), 1.0)


def _scaled_groups(x, fmt: ScaledFloat) -> tuple:
    if fmt.granularity == "tensor":
        return x, tuple(range(x.ndim)) or None, lambda v: v
    axis = _normal_axis(x.ndim, fmt.axis, "ScaledFloat.axis")
    if fmt.granularity == "row":
        return x, (axis,), lambda v: v
    if fmt.granularity == "tile":
        return block_view(x, [(axis, fmt.tile)])
    others = [d for d in range(x.ndim) if d != axis]
    if fmt.other_axis is not None:
        other = _normal_axis(x.ndim, fmt.other_axis, "ScaledFloat.other_axis")
    elif others:
        other = others[-1]
    else:
        return block_view(x, [(axis, fmt.tile)])
    if other == axis:
        raise ValueError(f"ScaledFloat.other_axis must differ from axis, got {fmt.other_axis}")
    return block_view(x, [(other, fmt.tile), (axis, fmt.tile)])


def scaled_float_parts(x: Array, fmt: ScaledFloat, rounding: str = "nearest",
                       key: Array | None = None) -> tuple:
    """`ScaledFloat` as its parts: ``quantize(x) == restore(elements * scale)``.

    Returns:
      ``(elements, scale, restore)``: the element values in the group view (the
      tensor, rows along ``fmt.axis``, or `block_view`'s tiles / blocks), the fp32
      scale ``amax / largest`` of each group (broadcastable) and ``restore``.

    Example:
      >>> e, scale, restore = scaled_float_parts(jnp.array([896.0, 1.0]), ScaledFloat("e4m3"))
      >>> e.tolist(), scale.tolist()
      ([448.0, 0.5], [2.0])
    """
    spec = fmt.spec
    view, inner, restore = _scaled_groups(x, fmt)
    scale = fp_scale(_masked_absmax(view, inner), spec.largest)
    elem = float_elements(view / scale, float(spec.man_bits), float(spec.emin), spec.largest,
                          rounding, key)
    return elem, scale, restore


def _scaled_float(x, bits, fmt: ScaledFloat, rounding, key):
    elem, scale, restore = scaled_float_parts(x, fmt, rounding, key)
    return restore(elem * scale)


def scaled_codes(x: Array, fmt: ScaledFloat | OCPFloat, *, rounding: str = "nearest",
                 key: Array | None = None) -> tuple[Array, Array]:
    """The element codes and scale of a per-tensor or per-row FP format: ``q = codes * scale``.

    `ScaledFloat` with granularity ``"tensor"`` (scale ``amax / max``, shape
    ``(1,) * ndim``) or ``"row"`` (one scale per slice along ``fmt.axis``,
    broadcastable to `x`), or `OCPFloat` (scale 1). `codes` are the element values
    in the element's own dtype (e.g. ``float8_e4m3fn``), exact; with the scale
    they equal `quantize` on finite inputs up to the rounding of the product.
    Real FP8 products take the codes (`cpt_jax.providers.block_formats`).

    Example:
      >>> codes, scale = scaled_codes(jnp.array([896., 1.0]), ScaledFloat("e4m3"))
      >>> codes.dtype, codes.astype(jnp.float32).tolist(), scale.tolist()
      (dtype(float8_e4m3fn), [448.0, 0.5], [2.0])
    """
    if isinstance(fmt, OCPFloat):
        spec, scale = fmt.spec, jnp.ones((1,) * jnp.ndim(x), jnp.float32)
        xf = jnp.asarray(x, jnp.float32)
    elif isinstance(fmt, ScaledFloat) and fmt.granularity in ("tensor", "row"):
        spec = fmt.spec
        xf = jnp.asarray(x, jnp.float32)
        view, inner, _ = _scaled_groups(xf, fmt)
        scale = fp_scale(_masked_absmax(view, inner), spec.largest)
    else:
        raise ValueError(f"scaled_codes needs OCPFloat or ScaledFloat('tensor'/'row'), got {fmt!r}")
    check_rounding(rounding, key)
    elem = float_elements(xf / scale, float(spec.man_bits), float(spec.emin), spec.largest,
                          rounding, key)
    return elem.astype(spec.dtype), scale


_GRIDS = {
    OCPFloat: _ocp_float,
    MX: _mx,
    NVFP4: _nvfp4,
    ScaledFloat: _scaled_float,
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


def check_rounding(rounding: str, key: Array | None) -> None:
    """Raise ValueError for an unknown rounding or stochastic rounding without a key."""
    if rounding not in ROUNDINGS:
        raise ValueError(f"rounding must be one of {ROUNDINGS}, got {rounding!r}")
    if rounding == "stochastic" and key is None:
        raise ValueError("rounding='stochastic' needs a PRNG `key` (got key=None)")


def check_format(fmt: Any) -> None:
    if type(fmt) not in _GRIDS:
        raise ValueError(
            f"fmt must be one of {[f.__name__ for f in FORMATS]}, got {fmt!r}")


def check_format_bits(fmt: Format, bits: Any) -> None:
    """Raise ValueError for a static `bits` below what `fmt` has: MX("int") 2, MX("float") 4."""
    if isinstance(bits, jax.core.Tracer) or not isinstance(fmt, MX):
        return
    lowest = {"int": 2, "float": 4}.get(fmt.element)
    if lowest is not None and np.min(np.asarray(bits)) < lowest:
        raise ValueError(f"bits must be >= {lowest} for {fmt}, got {bits!r}")


def element_width(fmt: Format, bits: Bits) -> Array:
    """Bits of one stored element of `fmt` at word length `bits` (scales not counted).

    `OCPFloat`/`ScaledFloat`: the element's width; `MX`: the element's
    (``bits`` for ``"int"``, 4/6/8 for ``"float"``); `NVFP4`: 4; the papers'
    formats: ``bits``. ``bits >= 32`` (full precision) is 32.

    Example:
      >>> float(element_width(MX("float"), 7))
      6.0
    """
    b = jnp.asarray(bits, jnp.float32)
    if isinstance(fmt, (OCPFloat, ScaledFloat)):
        width = jnp.float32(fmt.spec.width)
    elif isinstance(fmt, NVFP4):
        width = jnp.float32(4.0)
    elif isinstance(fmt, MX) and fmt.element in ELEMENTS:
        width = jnp.float32(ELEMENTS[fmt.element].width)
    elif isinstance(fmt, MX) and fmt.element == "int8":
        width = jnp.float32(8.0)
    elif isinstance(fmt, MX) and fmt.element == "float":
        width = jnp.where(b >= 8, 8.0, jnp.where(b >= 6, 6.0, 4.0))
    else:
        width = b
    return jnp.where(b >= 32, 32.0, width)


def bits_per_element(fmt: Format, bits: Bits) -> Array:
    """Stored bits per element including the block scales: what the cost counts.

    ``element_width + scale_bits / block``: `MX` ``+ 8 / block_size`` (E8M0, so
    8 per 32 elements), `NVFP4` ``+ 8 / 16`` (16 x 16 blocks: ``+ 8 / 256``; its
    fp32 tensor scale is not counted), `ScaledFloat` ``+ 32 / tile`` (tile) or ``+ 32 / tile^2`` (block);
    per-tensor and per-row scales are not counted (O(1/K)), nor the papers'
    formats' per-tensor or per-channel ranges. ``bits >= 32`` is 32.

    Example:
      >>> float(bits_per_element(MX("e4m3"), 8))
      8.25
    """
    width = element_width(fmt, bits)
    overhead = 0.0
    if isinstance(fmt, MX):
        overhead = 8.0 / fmt.block_size
    elif isinstance(fmt, NVFP4):
        overhead = 8.0 / (fmt.block_size ** 2 if fmt.block_2d else fmt.block_size)
    elif isinstance(fmt, ScaledFloat) and fmt.granularity == "tile":
        overhead = 32.0 / fmt.tile
    elif isinstance(fmt, ScaledFloat) and fmt.granularity == "block":
        overhead = 32.0 / fmt.tile ** 2
    return jnp.where(width >= 32, 32.0, width + overhead)


# --------------------------------------------------------------------------- quantize

def quantize(x: Array, bits: Bits, fmt: Format = AffineInt(), *, rounding: str = "nearest",
             key: Array | None = None) -> Array:
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
    check_format_bits(fmt, bits)
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
                    rounding: str = "nearest", key: Array | None = None
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
        f, _, scale = affine_grid(lo, hi, pow2(b) - 1.0)
        return scale / f
    if isinstance(fmt, SymmetricInt):
        amax = _finite_absmax(xf, _reduce_axes(xf.ndim, fmt.channel_axis))
        return _symmetric_scale(amax, pow2(b - 1.0) - 1.0)[2]
    if isinstance(fmt, FixedPoint):
        return pow2(-float(fmt.frac_bits)) * jnp.ones_like(xf)
    if isinstance(fmt, BlockFloat):
        amax = _finite_absmax(xf, _reduce_axes(xf.ndim, fmt.channel_axis))
        e = jnp.where(amax > 0, floor_log2(jnp.where(amax > 0, amax, 1.0)), 0.0)
        return pow2(e + 2.0 - b)
    if isinstance(fmt, OCPFloat):
        a = jnp.minimum(jnp.abs(xf), fmt.spec.largest)
        e = jnp.maximum(floor_log2(jnp.where(a > 0, a, 1.0)), float(fmt.spec.emin))
        return pow2(e - fmt.spec.man_bits)
    if isinstance(fmt, HARDWARE_FORMATS):
        raise ValueError(f"grid_step: {type(fmt).__name__} is block-scaled; quantize and compare")
    if isinstance(fmt, Float):
        man = jnp.maximum(b - 1.0 - fmt.exp_bits, 0.0)
        a = jnp.abs(xf)
        e = jnp.maximum(floor_log2(jnp.where(a > 0, a, 1.0)), 1.0 - fmt.bias)
        return pow2(e - man)
    check_format(fmt)
    raise AssertionError  # unreachable


def representable_range(bits: Bits, fmt: Format, x: Array | None = None) -> tuple[Array, Array]:
    """(lowest, highest) value the grid can take (for data-dependent grids, given `x`)."""
    b = jnp.asarray(bits, jnp.float32)
    if isinstance(fmt, FixedPoint):
        top = pow2(b - fmt.frac_bits - 1.0)
        return -top, top - pow2(-float(fmt.frac_bits))
    if isinstance(fmt, Float):
        man = jnp.maximum(b - 1.0 - fmt.exp_bits, 0.0)
        largest = pow2(float(2 ** (fmt.exp_bits - 1))) * (2.0 - pow2(-man))
        return -largest, largest
    if isinstance(fmt, OCPFloat):
        return jnp.float32(-fmt.spec.largest), jnp.float32(fmt.spec.largest)
    if isinstance(fmt, HARDWARE_FORMATS):
        raise ValueError(f"representable_range: {type(fmt).__name__} has one range per block")
    if x is None:
        raise ValueError(f"{type(fmt).__name__} is data-dependent: pass x")
    xf = jnp.asarray(x, jnp.float32)
    axes = _reduce_axes(xf.ndim, getattr(fmt, "channel_axis", None))
    if isinstance(fmt, AffineInt):
        return _finite_min_max(xf, axes)
    step = grid_step(xf, b, fmt)
    top = jnp.maximum(pow2(b - 1.0) - 1.0, 0.0)
    return -top * step, top * step
