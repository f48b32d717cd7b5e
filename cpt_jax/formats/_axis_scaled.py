"""Scaling along axes, the base of the papers' range formats and of `Scaling`, and the
repr both use.

A format's scaling is data: one range per tensor (the default), per index along
``channel_axis``, or per group of ``scale_axes`` and per ``tile`` of them
(`cpt_jax.formats.check_scaling`). `AxisScaled` holds it; `integer_scale` names what
one scale covers (`FormatTraits.scale`); `repr_without_defaults` prints only the
fields a user set. Both the named formats (`_named`) and the composed quantizer
(`_composed`) build on this module, so neither imports the other's internals.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from cpt_jax.formats._scaling import check_scaling


def repr_without_defaults(obj, always: Sequence[str]) -> str:
    """``Name(f=v, ...)``: the fields in `always`, then the others that differ from
    their defaults (so a format's repr is unchanged by a new option left at its default).

    Example:
      >>> repr_without_defaults(cpt_jax.MX("e2m1", scale_rounding="up"), ("element",))
      "MX(element='e2m1', scale_rounding='up')"
    """
    parts = []
    for field in dataclasses.fields(obj):
        value = getattr(obj, field.name)
        if field.name in always or value != field.default:
            parts.append(f"{field.name}={value!r}")
    return f"{type(obj).__name__}({', '.join(parts)})"


def integer_scale(fmt) -> str:
    """What one scale of `fmt`'s ``channel_axis`` / ``scale_axes`` / ``tile`` covers
    (`FormatTraits.scale`; ``"none"`` for no scaling).

    Example:
      >>> integer_scale(cpt_jax.AffineInt(channel_axis=-1)), integer_scale(None)
      ('channel', 'none')
    """
    if fmt is None:
        return "none"
    if fmt.channel_axis is not None:
        return "channel"
    if fmt.tile is not None:
        return "tile"
    return "tensor" if fmt.scale_axes is None else "axes"


@dataclasses.dataclass(frozen=True)
class AxisScaled:
    """The scaling of the papers' range formats (`AffineInt`, `SymmetricInt`,
    `BlockFloat`): one range per tensor (the default), per index along
    ``channel_axis``, or per group of ``scale_axes`` and per ``tile`` of them
    (`cpt_jax.formats.check_scaling`). Not a format itself."""

    channel_axis: int | None = None
    scale_axes: tuple[int, ...] | None = None
    tile: int | tuple[int, ...] | None = None

    def __post_init__(self):
        check_scaling(self)

    def __repr__(self):
        return repr_without_defaults(self, ("channel_axis",))
