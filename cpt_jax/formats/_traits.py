"""What a caller needs to know about a format, asked of the format, not of its type.

`format_traits(fmt)` is the format's own ``traits()`` (`FormatProtocol`): its family,
how its scale is shared, whether a provider aligns its blocks with a contraction, its
OCP element, its block length. A format without ``traits()`` is a format of its own
family and nothing more (``FormatTraits(family=<its class, snake_case>)``); anything
that is not a format (``None`` included) has the traits `NOT_A_FORMAT`: ``family=None``
and every predicate false, so a check on an optional format needs no ``None`` test.
Code outside this package reads those traits (or the one-line predicates below)
instead of testing ``isinstance(fmt, ...)``.

`along_contraction(fmt, contraction)` is the format's own ``along(contraction)``: the
format laid along one operand of a product (the axes its scales or blocks span).
"""
from __future__ import annotations

from typing import Any

from cpt_jax.formats._protocol import (
    FP8_ELEMENTS,
    NOT_A_FORMAT,
    Contraction,
    FormatTraits,
    family_name,
    is_format,
)


def format_traits(fmt: Any) -> FormatTraits:
    """The `FormatTraits` of `fmt` (its ``traits()``); `NOT_A_FORMAT` for anything
    that is not a format.

    Example:
      >>> from cpt_jax.formats import MX, SymmetricInt
      >>> t = format_traits(MX("e2m1", block_size=16, axis=0))
      >>> t.family, t.scale, t.blocked, t.axis, t.block_size, t.element
      ('mx', 'tile', True, 0, 16, 'e2m1')
      >>> format_traits(SymmetricInt(channel_axis=-1)).scale, format_traits(None).family
      ('channel', None)
      >>> class Halves:
      ...     def grid(self, x, bits, rounding, key):
      ...         return jnp.round(x * 2) / 2
      >>> format_traits(Halves()).family
      'halves'
    """
    if not is_format(fmt):
        return NOT_A_FORMAT
    traits = getattr(fmt, "traits", None)
    if traits is None:
        return FormatTraits(family=family_name(type(fmt)))
    out = traits()
    if not isinstance(out, FormatTraits):
        raise ValueError(f"{type(fmt).__name__}.traits() must return a "
                         f"cpt_jax.formats.FormatTraits, got {out!r}")
    return out


def along_contraction(fmt: Any, contraction: Contraction) -> Any:
    """`fmt` laid along one operand of a product: its ``along(contraction)``, or `fmt`
    itself for a format whose scales do not follow the product.

    The built-ins: a per-channel range format takes the weight's output channel; a
    ``scale_axes`` one scales over the contracted axes (a ``tile`` blocks the innermost
    one, a 2-D tile that axis and the output channel); on a ragged dot a per-channel
    weight scales per group and channel; a block-scaled hardware format blocks along
    `Contraction.block_axis` (a 128 x 128 `ScaledFloat` block spans it and the output
    channel). What the providers do to each operand, asked of the format.

    Example:
      >>> from cpt_jax.formats import MX, SymmetricInt
      >>> along_contraction(MX("e4m3"), Contraction((0,), channel_axis=1))
      MX(element='e4m3', block_size=32, axis=0)
      >>> along_contraction(SymmetricInt(scale_axes=(-1,)), Contraction((1, 3), "einsum"))
      SymmetricInt(channel_axis=None, scale_axes=(1, 3))
    """
    along = getattr(fmt, "along", None)
    return fmt if along is None else along(contraction)


def is_blocked(fmt: Any) -> bool:
    """Whether `fmt` is block-scaled (`MX`, `NVFP4`, `ScaledFloat`, or another format
    whose traits say so), its ``axis`` set along a product's contraction.

    Example:
      >>> from cpt_jax.formats import NVFP4, AffineInt, ScaledFloat
      >>> is_blocked(NVFP4()), is_blocked(ScaledFloat()), is_blocked(AffineInt())
      (True, True, False)
    """
    return format_traits(fmt).blocked


def is_per_tensor_scaled(fmt: Any) -> bool:
    """Whether `fmt` is a `ScaledFloat` with one scale ``X = amax / max`` per tensor.

    Example:
      >>> from cpt_jax.formats import ScaledFloat
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
      >>> from cpt_jax.formats import MX, OCPFloat, ScaledFloat
      >>> has_fp8_codes(OCPFloat("e5m2")), has_fp8_codes(ScaledFloat(granularity="tile"))
      (True, False)
      >>> has_fp8_codes(MX("e4m3")), has_fp8_codes(OCPFloat("e2m1"))
      (False, False)
    """
    t = format_traits(fmt)
    return t.element in FP8_ELEMENTS and t.scale in ("none", "tensor", "row")


__all__ = ["along_contraction", "format_traits", "has_fp8_codes", "is_blocked",
           "is_per_tensor_scaled"]
