"""What a format measures: the bits an element stores, and its grid's step and range.

`element_width` and `bits_per_element` (block scales included) are what the cost
counts; `grid_step` and `representable_range` are the spacing and the extremes of
the grid that `quantize` uses, for tests and error bounds.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from cpt_jax.formats._elements import ELEMENTS, floor_log2, pow2
from cpt_jax.formats._named import (
    FORMATS,
    HARDWARE_FORMATS,
    MX,
    NVFP4,
    AffineInt,
    Bits,
    BlockFloat,
    FixedPoint,
    Float,
    Format,
    OCPFloat,
    ScaledFloat,
    SymmetricInt,
    check_format,
)
from cpt_jax.formats._protocol import custom_element_width, custom_scale_bits, is_custom_format
from cpt_jax.formats._scaling import (
    affine_grid,
    finite_absmax,
    finite_min_max,
    scale_elements,
    scaled_statistic,
    symmetric_scale,
)

Array = jax.Array


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
    elif type(fmt) not in FORMATS and is_custom_format(fmt):
        width = custom_element_width(fmt, b)
    else:
        width = b
    return jnp.where(b >= 32, 32.0, width)


def bits_per_element(fmt: Format, bits: Bits) -> Array:
    """Stored bits per element including the block scales: what the cost counts.

    ``element_width + scale_bits / block``: `MX` ``+ 8 / block_size`` (E8M0, so
    8 per 32 elements), `NVFP4` ``+ 8 / 16`` (16 x 16 blocks: ``+ 8 / 256``; its
    fp32 tensor scale is not counted), `ScaledFloat` ``+ 32 / tile`` (tile) or ``+ 32 / tile^2`` (block),
    a tiled `SymmetricInt` ``+ 32 / |tile|`` (`AffineInt` 64, `BlockFloat` 8);
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
    elif type(fmt) in TILE_SCALE_BITS and scale_elements(fmt):  # tiled integer / block float
        overhead = TILE_SCALE_BITS[type(fmt)] / scale_elements(fmt)
    elif type(fmt) not in FORMATS and is_custom_format(fmt):
        overhead = custom_scale_bits(fmt)
    return jnp.where(width >= 32, 32.0, width + overhead)


TILE_SCALE_BITS: dict[type, float] = {AffineInt: 64.0, SymmetricInt: 32.0, BlockFloat: 8.0}
"""Bits stored per tile: `AffineInt` a float32 scale and minimum, `SymmetricInt` a
float32 scale, `BlockFloat` an 8-bit shared exponent."""


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
        lo, hi = scaled_statistic(xf, fmt, finite_min_max)
        f, _, scale = affine_grid(lo, hi, pow2(b) - 1.0)
        return scale / f
    if isinstance(fmt, SymmetricInt):
        amax = scaled_statistic(xf, fmt, finite_absmax)
        return symmetric_scale(amax, pow2(b - 1.0) - 1.0)[2]
    if isinstance(fmt, FixedPoint):
        return pow2(-float(fmt.frac_bits)) * jnp.ones_like(xf)
    if isinstance(fmt, BlockFloat):
        amax = scaled_statistic(xf, fmt, finite_absmax)
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
    if isinstance(fmt, AffineInt):
        return scaled_statistic(xf, fmt, finite_min_max)
    step = grid_step(xf, b, fmt)
    top = jnp.maximum(pow2(b - 1.0) - 1.0, 0.0)
    return -top * step, top * step
