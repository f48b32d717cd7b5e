"""The papers' formats: frozen dataclasses that describe a grid, each its own format.

A format is data: which values are representable, given a word length that is not
part of it (`quantize` takes ``bits``). `AffineInt`, `SymmetricInt`, `BlockFloat`
(the range formats: one range per tensor, channel, group or tile), `FixedPoint` and
`Float` follow CPT and QPyTorch; each answers the format protocol itself (``grid``,
``traits``, ``bits_per_element``, ``along``, ``grid_step``, ... : `FormatProtocol`).
The hardware formats are in `_hardware`.
"""
from __future__ import annotations

import dataclasses
import typing
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from cpt_jax.formats._axis_scaled import AxisScaled, integer_scale
from cpt_jax.formats._composed import FixedElement, FloatElement, IntElement, Quantizer, Scaling
from cpt_jax.formats._elements import floor_log2, mul_pow2, pow2
from cpt_jax.formats._int_codes import IntCodes, encode_affine, encode_symmetric
from cpt_jax.formats._protocol import Contraction, FormatTraits
from cpt_jax.formats._rounding import round_to_integer
from cpt_jax.formats._scaling import (
    affine_grid,
    finite_absmax,
    finite_min_max,
    scale_elements,
    scaled_statistic,
    symmetric_scale,
    tile_sizes,
)

Array = jax.Array
Bits = int | float | Array


@dataclasses.dataclass(frozen=True, repr=False)
class RangeFormat(AxisScaled):
    """What the three range formats share: counted tile scales, scales that follow a
    product, their composition. Not a format itself (no ``grid``)."""

    tile_scale_bits: ClassVar[float] = 32.0
    """Bits one tile's stored scale takes (`bits_per_element`)."""
    composition: ClassVar[tuple[bool, str, str]] = (True, "absmax", "fp32")
    """``(signed, range, scale_format)`` of its `Quantizer` (`as_quantizer`)."""

    def bits_per_element(self, bits: Array) -> Array:
        """``b + tile_scale_bits / |tile|`` when tiled, else ``b`` (per tensor, channel
        or group: O(1/K), not counted)."""
        n = scale_elements(self)
        return bits + self.tile_scale_bits / n if n else bits

    def along(self, c: Contraction) -> RangeFormat:
        """The format inside a product (`cpt_jax.formats.along_contraction`): a weight's
        per-channel range along its output channel (on a ragged dot per group and
        channel: over the contracted axes); ``scale_axes`` over the contracted axes, a
        ``tile`` blocking the innermost (`Contraction.block_axis`), one row of tiles per
        index of the others, a 2-D tile that axis and the output channel."""
        fmt = self
        if fmt.channel_axis is not None and c.channel_axis is not None:
            fmt = dataclasses.replace(fmt, channel_axis=c.channel_axis)
            if c.kind == "ragged_dot" and c.axes and not tile_sizes(fmt):
                fmt = dataclasses.replace(fmt, channel_axis=None, scale_axes=tuple(c.axes))
        if fmt.scale_axes is None or not c.axes:
            return fmt
        tiled = typing.cast(int, c.block_axis)  # an axis of c.axes (not empty)
        axes = (*(a for a in c.axes if a != tiled), tiled)
        if len(tile_sizes(fmt)) == 1 and c.kind != "conv":
            axes = (tiled,)  # tiles of the innermost axis, one row of them per other index
        if len(tile_sizes(fmt)) >= 2:
            if c.channel_axis is None:
                raise ValueError(f"{fmt!r}: a 2-D tile needs a weight with an output "
                                 f"channel, got an operand without one")
            axes = (*axes, c.channel_axis)
        return dataclasses.replace(fmt, scale_axes=axes)

    def as_quantizer(self):
        """The `Quantizer` equal to it: integer codes, its range and scale format."""
        signed, range_, scale_format = self.composition
        return Quantizer(IntElement(signed), Scaling(self.channel_axis, self.scale_axes,
                                                     self.tile, range_, scale_format))

    def representable_range(self, bits: Array, x: Array | None) -> tuple[Array, Array]:
        """``+-L step`` with ``L = 2^(b-1) - 1`` and the grid's step on `x`."""
        if x is None:
            raise ValueError(f"{type(self).__name__} is data-dependent: pass x")
        step = self.grid_step(x, bits)  # type: ignore[attr-defined]
        top = jnp.maximum(pow2(bits - 1.0) - 1.0, 0.0)
        return -top * step, top * step


@dataclasses.dataclass(frozen=True, repr=False)
class AffineInt(RangeFormat):
    """CPT's affine min-max integer grid on ``[0, 2^b - 1]``.

    ``s = max((max - min) / (2^b - 1), 1e-8)``,
    ``q = clip(round((x - min) / s), 0, 2^b - 1) * s + min``.

    `channel_axis=None` uses one (min, max) for the whole tensor; an int keeps one
    range per index along that axis (e.g. ``-1`` for the output channel of a Dense
    kernel ``(in, out)`` or a conv kernel ``HWIO``). `scale_axes` and `tile` scale
    per any tuple of axes and per tile (`check_scaling`: per token, 1x128 tiles, ...).

    Example:
      >>> from cpt_jax.formats import quantize
      >>> quantize(jnp.array([0., 0.3, 1.]), 2, AffineInt())
      Array([0.        , 0.33333334, 1.        ], dtype=float32)
    """

    tile_scale_bits: ClassVar[float] = 64.0  # a float32 scale and minimum
    composition: ClassVar[tuple[bool, str, str]] = (False, "minmax", "fp32")

    def grid(self, x: Array, bits: Array, rounding: str, key: Array | None) -> Array:
        """`encode_affine` decoded: the grid of the module docstring."""
        return encode_affine(x, bits, self, rounding, key).decode()

    def encode(self, x: Array, bits: Array, rounding: str = "nearest",
               key: Array | None = None) -> IntCodes:
        """Its integer codes and scales (`cpt_jax.formats.encode`)."""
        return encode_affine(x, bits, self, rounding, key)

    def traits(self) -> FormatTraits:
        return FormatTraits("affine_int", integer_scale(self), range_grid="affine")

    def grid_step(self, x: Array, bits: Array) -> Array:
        lo, hi = scaled_statistic(x, self, finite_min_max)
        f, _, scale = affine_grid(lo, hi, pow2(bits) - 1.0)
        return scale / f

    def representable_range(self, bits: Array, x: Array | None) -> tuple[Array, Array]:
        if x is None:
            raise ValueError("AffineInt is data-dependent: pass x")
        return scaled_statistic(x, self, finite_min_max)


@dataclasses.dataclass(frozen=True, repr=False)
class SymmetricInt(RangeFormat):
    """Symmetric max-abs integer grid, levels ``-(2^(b-1)-1)..2^(b-1)-1``.

    ``s = max(max|x| / (2^(b-1) - 1), 1e-8)``, ``q = clip(round(x / s), -L, L) * s``
    with ``L = 2^(b-1) - 1``. The integer codes ``round(x/s)`` fit a real int8 at
    ``b <= 8``. At ``b = 1`` there is no nonzero level and the result is all zeros.

    Scales per tensor, per index along `channel_axis`, or per `scale_axes` / `tile`.

    Example:
      >>> from cpt_jax.formats import quantize
      >>> quantize(jnp.array([-1., 0.2, 0.7]), 2, SymmetricInt())
      Array([-1.,  0.,  1.], dtype=float32)
      >>> x = jnp.array([[1.0, 0.4], [0.01, 0.004]])   # two tokens, far apart
      >>> quantize(x, 4, SymmetricInt(scale_axes=(-1,)))  # one scale per token (row)
      Array([[1.        , 0.42857146],
             [0.01      , 0.00428571]], dtype=float32)
    """

    tile_scale_bits: ClassVar[float] = 32.0  # a float32 scale

    def grid(self, x: Array, bits: Array, rounding: str, key: Array | None) -> Array:
        """`encode_symmetric` decoded: the grid of the module docstring."""
        return encode_symmetric(x, bits, self, rounding, key).decode()

    def encode(self, x: Array, bits: Array, rounding: str = "nearest",
               key: Array | None = None) -> IntCodes:
        """Its integer codes and scales (`cpt_jax.formats.encode`)."""
        return encode_symmetric(x, bits, self, rounding, key)

    def traits(self) -> FormatTraits:
        return FormatTraits("symmetric_int", integer_scale(self), range_grid="symmetric")

    def grid_step(self, x: Array, bits: Array) -> Array:
        amax = scaled_statistic(x, self, finite_absmax)
        return symmetric_scale(amax, pow2(bits - 1.0) - 1.0)[2]


@dataclasses.dataclass(frozen=True)
class FixedPoint:
    """QPyTorch fixed point: word length ``b`` (traced), ``frac_bits`` fractional bits.

    Unit ``2^-f``; range ``[-2^(b-f-1), 2^(b-f-1) - 2^-f]``; round first, then
    saturate: ``q = clip(round(x 2^f) 2^-f, lo, hi)``.

    Example:
      >>> from cpt_jax.formats import quantize
      >>> quantize(jnp.array([0.3, 5.0]), 4, FixedPoint(frac_bits=2))
      Array([0.25, 1.75], dtype=float32)
    """

    frac_bits: int = 4

    def __post_init__(self):
        if not isinstance(self.frac_bits, (int, np.integer)) or self.frac_bits < 0:
            raise ValueError(f"FixedPoint.frac_bits must be an int >= 0, got {self.frac_bits!r}")

    def grid(self, x: Array, bits: Array, rounding: str, key: Array | None) -> Array:
        unit = pow2(-float(self.frac_bits))
        top = pow2(bits - self.frac_bits - 1.0)
        return jnp.clip(round_to_integer(x / unit, rounding, key) * unit, -top, top - unit)

    def traits(self) -> FormatTraits:
        return FormatTraits("fixed_point", "none")

    def grid_step(self, x: Array, bits: Array) -> Array:
        return pow2(-float(self.frac_bits)) * jnp.ones_like(x)

    def representable_range(self, bits: Array, x: Array | None) -> tuple[Array, Array]:
        top = pow2(bits - self.frac_bits - 1.0)
        return -top, top - pow2(-float(self.frac_bits))

    def as_quantizer(self):
        return Quantizer(FixedElement(self.frac_bits))


@dataclasses.dataclass(frozen=True, repr=False)
class BlockFloat(RangeFormat):
    """QPyTorch block floating point with word length ``b`` and one shared exponent.

    ``e = floor(log2 max|x|)`` over the block (the tensor, or each index along
    `channel_axis`), unit ``u = 2^(e + 2 - b)``,
    ``q = u * clip(round(x / u), -(2^(b-1) - 1), 2^(b-1) - 1)``.

    Example:
      >>> from cpt_jax.formats import quantize
      >>> quantize(jnp.array([1.0, 0.3, -0.05]), 4, BlockFloat())
      Array([ 1.  ,  0.25, -0.  ], dtype=float32)
    """

    tile_scale_bits: ClassVar[float] = 8.0  # an 8-bit shared exponent
    composition: ClassVar[tuple[bool, str, str]] = (True, "absmax", "pow2")

    def grid(self, x: Array, bits: Array, rounding: str, key: Array | None) -> Array:
        unit_exp = self._exponent(x) + 2.0 - bits  # u = 2^unit_exp, scaled in two steps
        top = pow2(bits - 1.0) - 1.0
        codes = jnp.clip(round_to_integer(mul_pow2(x, -unit_exp), rounding, key), -top, top)
        return mul_pow2(codes, unit_exp)

    def _exponent(self, x: Array) -> Array:
        amax = scaled_statistic(x, self, finite_absmax)
        return jnp.where(amax > 0, floor_log2(jnp.where(amax > 0, amax, 1.0)), 0.0)

    def traits(self) -> FormatTraits:
        return FormatTraits("block_float", integer_scale(self))

    def grid_step(self, x: Array, bits: Array) -> Array:
        return pow2(self._exponent(x) + 2.0 - bits)


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
      >>> from cpt_jax.formats import quantize
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

    def check_bits(self, bits: Any) -> None:
        """ValueError below ``exp_bits + 1`` (a sign and the exponent)."""
        if np.min(np.asarray(bits)) < self.exp_bits + 1:
            raise ValueError(
                f"bits must be >= exp_bits + 1 = {self.exp_bits + 1} for {self}, got {bits!r}")

    def _largest(self, man: Array) -> Array:
        return pow2(float(2 ** (self.exp_bits - 1))) * (2.0 - pow2(-man))

    def grid(self, x: Array, bits: Array, rounding: str, key: Array | None) -> Array:
        man = jnp.maximum(bits - 1.0 - self.exp_bits, 0.0)
        a = jnp.abs(x)
        e = jnp.maximum(floor_log2(jnp.where(a > 0, a, 1.0)), 1.0 - self.bias)
        # a / 2^(e - man), rounded, times 2^(e - man); the spacing 2^(e - man) may be
        # below the float32 normal range (exp_bits = 8), so scale in two steps.
        mag = mul_pow2(round_to_integer(mul_pow2(a, man - e), rounding, key), e - man)
        return jnp.sign(x) * jnp.minimum(mag, self._largest(man))

    def traits(self) -> FormatTraits:
        return FormatTraits("float", "none", range_grid="float")

    def grid_step(self, x: Array, bits: Array) -> Array:
        man = jnp.maximum(bits - 1.0 - self.exp_bits, 0.0)
        a = jnp.abs(x)
        e = jnp.maximum(floor_log2(jnp.where(a > 0, a, 1.0)), 1.0 - self.bias)
        return pow2(e - man)

    def representable_range(self, bits: Array, x: Array | None) -> tuple[Array, Array]:
        largest = self._largest(jnp.maximum(bits - 1.0 - self.exp_bits, 0.0))
        return -largest, largest

    def as_quantizer(self):
        return Quantizer(FloatElement(self.exp_bits))


PAPERS_FORMATS = (AffineInt, SymmetricInt, FixedPoint, BlockFloat, Float)
TILE_SCALE_BITS: dict[type, float] = {cls: cls.tile_scale_bits
                                      for cls in (AffineInt, SymmetricInt, BlockFloat)}
"""Bits stored per tile (each class's ``tile_scale_bits``): `AffineInt` a float32 scale
and minimum, `SymmetricInt` a float32 scale, `BlockFloat` an 8-bit shared exponent."""
