"""What a caller needs to know about a format, asked of the format, not of its type.

`format_traits(fmt)` describes any format as one frozen `FormatTraits`: its
family, how its scale is shared, whether a provider aligns its blocks with a
contraction, its OCP element, its block length. Code outside this package reads
those traits (or the one-line predicates below) instead of testing
``isinstance(fmt, ...)``, so a format's meaning is written down once, here.

Anything that is not a format (``None`` included) has the traits `NOT_A_FORMAT`:
``family=None`` and every predicate false, so a check on an optional format needs
no separate ``None`` test.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from cpt_jax.formats._composed import Quantizer
from cpt_jax.formats._named import (
    MX,
    NVFP4,
    AffineInt,
    BlockFloat,
    FixedPoint,
    Float,
    OCPFloat,
    ScaledFloat,
    SymmetricInt,
)

FAMILIES = ("affine_int", "symmetric_int", "fixed_point", "block_float", "float", "ocp_float",
            "mx", "nvfp4", "scaled_float", "quantizer")
SCALES = ("none", "tensor", "channel", "axes", "tile", "row", "block", "two_level")
RANGE_GRIDS = ("affine", "symmetric", "float")
FP8_ELEMENTS = ("e4m3", "e5m2")


@dataclasses.dataclass(frozen=True)
class FormatTraits:
    """The facts about one format that code outside `cpt_jax.formats` acts on.

    * `family`: one name per format class (`FAMILIES`: ``"affine_int"`` for
      `AffineInt`, ..., ``"scaled_float"`` for `ScaledFloat`, ``"quantizer"`` for a
      composed `Quantizer`); None: not a format.
    * `scale`: what one scale covers (`SCALES`):

      - ``"none"``: no scale, the element grid itself (`FixedPoint`, `Float`, `OCPFloat`);
      - ``"tensor"``: the whole tensor;
      - ``"channel"``: one index along ``channel_axis``;
      - ``"axes"``: one slice over ``scale_axes``;
      - ``"tile"``: a tile of those slices (``scale_axes`` with ``tile``), or a 1-D
        block along ``axis`` (`MX`, `ScaledFloat` ``"tile"``);
      - ``"row"``: one slice along ``axis`` (`ScaledFloat` ``"row"``);
      - ``"block"``: a ``tile x tile`` block (`ScaledFloat` ``"block"``);
      - ``"two_level"``: E4M3 block scales under an fp32 tensor scale (`NVFP4`).
    * `blocked`: a block-scaled hardware format (`MX`, `NVFP4`, `ScaledFloat` of
      any granularity) whose ``axis`` a provider sets along the contraction.
    * `axis`: that ``axis`` (None when not `blocked`).
    * `block_size`: elements per block along ``axis`` (``block_size`` of `MX` and
      `NVFP4`, ``tile`` of a ``"tile"`` / ``"block"`` `ScaledFloat`), else None.
    * `two_d`: blocks span ``axis`` and ``other_axis`` (`NVFP4` ``block_2d``,
      `ScaledFloat` ``"block"``).
    * `element`: the element's name: an `ELEMENTS` key (`OCPFloat`, `ScaledFloat`,
      `MX`, ``"e2m1"`` for `NVFP4`) or `MX`'s ``"int8"`` / ``"int"`` / ``"float"``;
      None for the papers' formats and a `Quantizer` (a fake-quant format: no real
      low-precision product takes it; `as_quantizer`'s named twin does).
    * `range_grid`: the grid a given range ``[lo, hi]`` places (`RANGE_GRIDS`):
      ``"affine"`` (`AffineInt`, min-max), ``"symmetric"`` (`SymmetricInt`,
      max-abs), ``"float"`` (`Float`, max-abs onto its largest value); else None.
    """

    family: str | None = None
    scale: str | None = None
    blocked: bool = False
    axis: int | None = None
    block_size: int | None = None
    two_d: bool = False
    element: str | None = None
    range_grid: str | None = None


NOT_A_FORMAT = FormatTraits()
"""The traits of anything that is not a format: no family, every predicate false."""


def _integer_scale(fmt) -> str:
    """The scale of a papers' format with ``channel_axis`` / ``scale_axes`` / ``tile``."""
    if fmt is None:
        return "none"
    if fmt.channel_axis is not None:
        return "channel"
    if fmt.tile is not None:
        return "tile"
    return "tensor" if fmt.scale_axes is None else "axes"


def _scaled_float(fmt: ScaledFloat) -> FormatTraits:
    blocks = fmt.granularity in ("tile", "block")
    return FormatTraits("scaled_float", fmt.granularity, True, fmt.axis,
                        fmt.tile if blocks else None, fmt.granularity == "block", fmt.element)


_TRAITS: tuple[tuple[type, Callable[[Any], FormatTraits]], ...] = (
    (AffineInt, lambda f: FormatTraits("affine_int", _integer_scale(f), range_grid="affine")),
    (SymmetricInt, lambda f: FormatTraits("symmetric_int", _integer_scale(f),
                                          range_grid="symmetric")),
    (FixedPoint, lambda f: FormatTraits("fixed_point", "none")),
    (BlockFloat, lambda f: FormatTraits("block_float", _integer_scale(f))),
    (Float, lambda f: FormatTraits("float", "none", range_grid="float")),
    (OCPFloat, lambda f: FormatTraits("ocp_float", "none", element=f.element)),
    (MX, lambda f: FormatTraits("mx", "tile", True, f.axis, f.block_size, False, f.element)),
    (NVFP4, lambda f: FormatTraits("nvfp4", "two_level", True, f.axis, f.block_size,
                                   bool(f.block_2d), "e2m1")),
    (ScaledFloat, _scaled_float),
    (Quantizer, lambda f: FormatTraits("quantizer", _integer_scale(f.scaling))),
)


def format_traits(fmt: Any) -> FormatTraits:
    """The `FormatTraits` of `fmt`; `NOT_A_FORMAT` for anything that is not a format.

    Example:
      >>> t = format_traits(MX("e2m1", block_size=16, axis=0))
      >>> t.family, t.scale, t.blocked, t.axis, t.block_size, t.element
      ('mx', 'tile', True, 0, 16, 'e2m1')
      >>> format_traits(SymmetricInt(channel_axis=-1)).scale, format_traits(None).family
      ('channel', None)
    """
    for cls, traits in _TRAITS:
        if isinstance(fmt, cls):
            return traits(fmt)
    return NOT_A_FORMAT


def is_blocked(fmt: Any) -> bool:
    """Whether `fmt` is block-scaled hardware (`MX`, `NVFP4`, `ScaledFloat`), its
    ``axis`` set along a product's contraction.

    Example:
      >>> is_blocked(NVFP4()), is_blocked(ScaledFloat()), is_blocked(AffineInt())
      (True, True, False)
    """
    return format_traits(fmt).blocked


def is_per_tensor_scaled(fmt: Any) -> bool:
    """Whether `fmt` is a `ScaledFloat` with one scale ``X = amax / max`` per tensor.

    Example:
      >>> is_per_tensor_scaled(ScaledFloat()), is_per_tensor_scaled(ScaledFloat(granularity="row"))
      (True, False)
    """
    t = format_traits(fmt)
    return t.family == "scaled_float" and t.scale == "tensor"


def has_fp8_codes(fmt: Any) -> bool:
    """Whether ``q = c * s`` with float8 codes ``c`` (e4m3 / e5m2) and a scale ``s``
    that factors out of a product (none, per tensor, per row): `OCPFloat` or a
    ``"tensor"`` / ``"row"`` `ScaledFloat` with an 8-bit element.

    Example:
      >>> has_fp8_codes(OCPFloat("e5m2")), has_fp8_codes(ScaledFloat(granularity="tile"))
      (True, False)
      >>> has_fp8_codes(MX("e4m3")), has_fp8_codes(OCPFloat("e2m1"))
      (False, False)
    """
    t = format_traits(fmt)
    return t.element in FP8_ELEMENTS and t.scale in ("none", "tensor", "row")
