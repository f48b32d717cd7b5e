"""What a format measures, asked of the format: stored bits, and its grid's step and range.

`element_width` and `bits_per_element` (block scales included) are what the cost
counts; `grid_step` and `representable_range` are the spacing and the extremes of
the grid that `quantize` uses, for tests and error bounds. Each calls the format's
own method of that name (`FormatProtocol`), with the protocol's default where the
format has none; ``bits >= 32`` (full precision) is 32 bits whatever the format.
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from cpt_jax.formats._protocol import is_format

Array = jax.Array


def _check(fmt: Any, what: str) -> None:
    if not is_format(fmt):
        raise ValueError(f"{what}: fmt must be a format (an object with a grid method, "
                         f"cpt_jax.formats.FormatProtocol), got {fmt!r}")


def element_width(fmt: Any, bits) -> Array:
    """Bits of one stored element of `fmt` at word length `bits` (scales not counted):
    ``fmt.element_width(bits)``, by default ``bits``; ``bits >= 32`` is 32.

    `OCPFloat` / `ScaledFloat`: the element's width; `MX`: the element's (``bits`` for
    ``"int"``, 4/6/8 for ``"float"``); `NVFP4`: 4; the papers' formats: ``bits``.

    Example:
      >>> float(element_width(cpt_jax.MX("float"), 7))
      6.0
    """
    _check(fmt, "element_width")
    b = jnp.asarray(bits, jnp.float32)
    method = getattr(fmt, "element_width", None)
    width = b if method is None else jnp.asarray(method(b), jnp.float32)
    return jnp.where(b >= 32, 32.0, width)


def bits_per_element(fmt: Any, bits) -> Array:
    """Stored bits per element including the block scales: what the cost counts.

    ``fmt.bits_per_element(bits)``; by default ``element_width(bits)`` plus the
    format's ``scale_bits_per_element`` (0 if it has none). The built-ins:
    `MX` ``+ 8 / block_size`` (E8M0, so 8 per 32 elements), `NVFP4` ``+ 8 / 16``
    (16 x 16 blocks: ``+ 8 / 256``; its fp32 tensor scale is not counted),
    `ScaledFloat` ``+ 32 / tile`` (tile) or ``+ 32 / tile^2`` (block), a tiled
    `SymmetricInt` ``+ 32 / |tile|`` (`AffineInt` 64, `BlockFloat` 8); per-tensor and
    per-row scales are not counted (O(1/K)), nor the papers' formats' per-tensor or
    per-channel ranges. ``bits >= 32`` is 32.

    Example:
      >>> float(bits_per_element(cpt_jax.MX("e4m3"), 8))
      8.25
    """
    _check(fmt, "bits_per_element")
    b = jnp.asarray(bits, jnp.float32)
    method = getattr(fmt, "bits_per_element", None)
    if method is not None:
        stored = jnp.asarray(method(b), jnp.float32)
    else:
        stored = element_width(fmt, b) + float(getattr(fmt, "scale_bits_per_element", 0.0))
    return jnp.where(b >= 32, 32.0, stored)


def grid_step(x: Array, bits, fmt: Any) -> Array:
    """The spacing of the grid that `quantize(x, bits, fmt)` uses, broadcastable to `x`
    (``fmt.grid_step(x, bits)``; ValueError for a format without one).

    For integer formats the scale ``s``; for `FixedPoint` ``2^-f``; for `BlockFloat`
    the shared unit; for `Float` the spacing of each element's binade. Used by tests
    and error bounds (nearest: ``|q - x| <= step/2`` inside the range). A spacing
    below the float32 normal range is reported as ``2^-126`` (an upper bound).
    Block-scaled formats have one step per block: quantize and compare.

    Example:
      >>> grid_step(jnp.array([0.0, 1.0]), 3, cpt_jax.FixedPoint(frac_bits=2)).tolist()
      [0.25, 0.25]
    """
    _check(fmt, "grid_step")
    method = getattr(fmt, "grid_step", None)
    if method is None:
        raise ValueError(f"grid_step: {type(fmt).__name__} has no single grid step "
                         f"(block-scaled or not described); quantize and compare")
    return method(jnp.asarray(x, jnp.float32), jnp.asarray(bits, jnp.float32))


def representable_range(bits, fmt: Any, x: Array | None = None) -> tuple[Array, Array]:
    """(lowest, highest) value the grid can take (for data-dependent grids, given `x`):
    ``fmt.representable_range(bits, x)``; ValueError for a format without one.

    Example:
      >>> [float(v) for v in representable_range(4, cpt_jax.FixedPoint(frac_bits=2))]
      [-2.0, 1.75]
    """
    _check(fmt, "representable_range")
    method = getattr(fmt, "representable_range", None)
    if method is None:
        raise ValueError(f"representable_range: {type(fmt).__name__} has no single range "
                         f"(one range per block, or not described)")
    xf = None if x is None else jnp.asarray(x, jnp.float32)
    return method(jnp.asarray(bits, jnp.float32), xf)


__all__ = ["bits_per_element", "element_width", "grid_step", "representable_range"]
