"""What a number format is: `FormatProtocol`, one class with a ``grid`` method.

Every format, the built-in ones included, is an object with

    q = fmt.grid(x, bits, rounding, key)

the fake quantizer of one float32 tensor at a float32 (possibly traced) word length
``bits``; `quantize` does the contract around it (``bits >= 32`` is the identity,
non-finite inputs pass through, dtype and shape kept, rounding and bits checked). A
format may also define any of these methods; the functions of `cpt_jax.formats` call
them, and use the default where one is absent:

=========================  =================================================  ==================
method                     what it answers (who asks)                         default
=========================  =================================================  ==================
``check_bits(bits)``       ValueError for a static width it cannot take       every ``bits >= 1``
                           (`quantize`, before tracing)
``element_width(bits)``    stored bits of one element, scales not counted     ``bits``
                           (`element_width`; a format schedule's widths)
``bits_per_element(bits)`` stored bits per element, scales included (the      ``element_width(bits)
                           cost: `bits_per_element`)                           + scale_bits_per_element``
``traits()``               its `FormatTraits` (`format_traits`: which         ``FormatTraits(family=
                           providers, real products and checks take it)       <its class, snake_case>)``
``along(contraction)``     itself laid along one operand of a product: the    itself
                           axes its scales or blocks run along (`Contraction`,
                           `along_contraction`)
``grid_step(x, bits)``,    the grid's spacing and extremes (tests, error      ValueError
``representable_range``    bounds: `grid_step`, `representable_range`)
``(bits, x)``
=========================  =================================================  ==================

``bits >= 32`` is full precision for every format: the functions answer 32 bits (or
the identity) without asking. `register_format(cls)` names a format class in
`cpt_jax.formats` (``cpt_jax.formats.NormalFloat``) and in the formats `check_format`
lists; a format works unregistered too. docs/formats.md ("Adding a format") writes one.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Any, Protocol, runtime_checkable

import jax

Array = jax.Array

FAMILIES = ("affine_int", "symmetric_int", "fixed_point", "block_float", "float", "ocp_float",
            "mx", "nvfp4", "scaled_float", "quantizer")
"""The built-in formats' families (a format defined elsewhere has its own)."""
SCALES = ("none", "tensor", "channel", "axes", "tile", "row", "block", "two_level")
RANGE_GRIDS = ("affine", "symmetric", "float")
FP8_ELEMENTS = ("e4m3", "e5m2")


@runtime_checkable
class FormatProtocol(Protocol):
    """A number format: ``grid(x, bits, rounding, key) -> q`` (optional methods in the
    module docstring of `cpt_jax.formats._protocol`, docs/formats.md)."""

    def grid(self, x: Array, bits: Array, rounding: str, key: Array | None) -> Array:
        """``x`` (float32) on the format's grid at word length ``bits`` (traceable)."""


@dataclasses.dataclass(frozen=True)
class FormatTraits:
    """The facts about one format that code outside `cpt_jax.formats` acts on
    (a format's ``traits()``; `format_traits`).

    * `family`: the format's kind, one name per class (`FAMILIES` for the built-ins:
      ``"affine_int"`` for `AffineInt`, ..., ``"quantizer"`` for a composed
      `Quantizer`); None: not a format.
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
    * `blocked`: a block-scaled format (`MX`, `NVFP4`, `ScaledFloat` of any
      granularity, or another format saying so) whose ``axis`` a provider sets along
      the contraction (`along_contraction`).
    * `axis`: that ``axis`` (None when not `blocked`).
    * `block_size`: elements per block along ``axis``, else None.
    * `two_d`: blocks span ``axis`` and ``other_axis`` (`NVFP4` ``block_2d``,
      `ScaledFloat` ``"block"``).
    * `element`: the element's name: an `ELEMENTS` key (`OCPFloat`, `ScaledFloat`,
      `MX`, ``"e2m1"`` for `NVFP4`) or `MX`'s ``"int8"`` / ``"int"`` / ``"float"``;
      None for a format no real low-precision product takes.
    * `range_grid`: the grid a given range ``[lo, hi]`` places (`RANGE_GRIDS`):
      ``"affine"`` (`AffineInt`, min-max), ``"symmetric"`` (`SymmetricInt`,
      max-abs), ``"float"`` (`Float`, max-abs onto its largest value); else None
      (export and running / delayed ranges refuse the format).
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


@dataclasses.dataclass(frozen=True)
class Contraction:
    """Where one operand of a product sums: what a format lays its scales along
    (a format's ``along(contraction)``; `along_contraction`).

    Attributes:
      axes: the operand's contracted axes (empty: it contracts nothing, e.g. the
        table of an embedding lookup).
      kind: the product's kind (``"dot_general"``, ``"conv"``, ``"einsum"``,
        ``"ragged_dot"``, ...).
      channel_axis: a weight's output-channel axis (None for an activation or an
        error).
      ndim: the operand's rank, when known (to block a lookup's table).
    """

    axes: tuple[int, ...] = ()
    kind: str = "dot_general"
    channel_axis: int | None = None
    ndim: int | None = None

    @property
    def block_axis(self) -> int | None:
        """The one axis a block or tile runs along: of the contracted axes the feature
        axis of a conv (listed first) or the innermost of a dot (the last); for an
        operand that contracts nothing, of known rank and with a channel axis, its last
        other axis (an embedding's features); else None.

        Example:
          >>> Contraction((2, 0, 1), "conv").block_axis, Contraction((1, 3)).block_axis
          (2, 3)
          >>> Contraction((), channel_axis=0, ndim=2).block_axis   # a (vocab, features) table
          1
        """
        if self.axes:
            return self.axes[0] if self.kind == "conv" else self.axes[-1]
        if self.ndim and self.channel_axis is not None:
            others = [d for d in range(self.ndim) if d != self.channel_axis % self.ndim]
            return others[-1] if others else None
        return None


def is_format(fmt: Any) -> bool:
    """Whether `fmt` is a format: it has a callable ``grid`` (`FormatProtocol`).

    Example:
      >>> class Halves:
      ...     def grid(self, x, bits, rounding, key):
      ...         return jnp.round(x * 2) / 2
      >>> is_format(Halves()), is_format(cpt_jax.AffineInt()), is_format(3)
      (True, True, False)
    """
    return not isinstance(fmt, type) and callable(getattr(fmt, "grid", None))


def family_name(cls: type) -> str:
    """A format class's default family: its name in snake case.

    Example:
      >>> family_name(cpt_jax.formats.AffineInt), family_name(cpt_jax.formats.NVFP4)
      ('affine_int', 'nvfp4')
    """
    name = re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", cls.__name__)
    return name.lower()


_NAMED: dict[str, type] = {}


def register_format(cls: type) -> type:
    """Name the format class `cls` in `cpt_jax.formats` (``cpt_jax.formats.<Name>``,
    `named_formats`, the formats `check_format` lists); returns `cls`, so it decorates.

    A format needs no registration to work (any object with a ``grid`` is one);
    this makes it part of the package's namespace, as the built-in formats are.

    Args:
      cls: a class whose instances have a ``grid`` method.

    Returns:
      `cls`.

    Example:
      >>> @register_format
      ... class Halves:
      ...     def grid(self, x, bits, rounding, key):
      ...         return jnp.round(x * 2) / 2
      >>> cpt_jax.formats.Halves is Halves
      True
      >>> unregister_format(Halves)
    """
    if not isinstance(cls, type) or not callable(getattr(cls, "grid", None)):
        raise ValueError(f"register_format needs a class with a grid(x, bits, rounding, key) "
                         f"method (cpt_jax.formats.FormatProtocol), got {cls!r}")
    old = _NAMED.get(cls.__name__)
    if old is not None and old is not cls:
        raise ValueError(f"a format named {cls.__name__!r} is already registered ({old!r})")
    _NAMED[cls.__name__] = cls
    return cls


def unregister_format(cls: type) -> None:
    """Remove a class `register_format` named (tests, notebooks)."""
    if _NAMED.get(cls.__name__) is not cls:
        raise ValueError(f"{cls!r} is not a registered format; registered: {sorted(_NAMED)}")
    del _NAMED[cls.__name__]


def named_formats() -> dict[str, type]:
    """``{name: class}`` of the formats `register_format` named (a copy)."""
    return dict(_NAMED)


__all__ = ["Contraction", "FAMILIES", "FP8_ELEMENTS", "FormatProtocol", "FormatTraits",
           "NOT_A_FORMAT", "RANGE_GRIDS", "SCALES", "family_name", "is_format", "named_formats",
           "register_format", "unregister_format"]
