"""Formats as compositions: a `Quantizer` is an element grid times a `Scaling`.

``q = s * elem(x / s)``: the element (`IntElement`, `FixedElement`, `FloatElement`)
is the values one stored number takes; the `Scaling` is which range sets ``s``
(max-abs or min-max), over which elements and how ``s`` is stored. Rounding stays
the caller's (``quantize(..., rounding=)``, `TensorQuant`), so ``TensorQuant(
Quantizer(element, scaling), rounding)`` is the element x scaling x rounding triple.

A `Quantizer` is a format by `FormatProtocol` (its ``grid``). `as_quantizer` writes a
named format as its composition, bit for bit (stochastic rounding too, but for `MX`
and ``ScaledFloat("tile")``, which draw their noise in a padded block view: another
draw of the same distribution).
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from cpt_jax.formats._axis_scaled import AxisScaled, integer_scale, repr_without_defaults
from cpt_jax.formats._elements import ELEMENTS, float_elements, floor_log2, mul_pow2, pow2
from cpt_jax.formats._protocol import FormatTraits
from cpt_jax.formats._rounding import round_to_integer
from cpt_jax.formats._scaling import (
    affine_grid,
    finite_absmax,
    finite_min_max,
    fp_scale,
    scale_elements,
    scaled_statistic,
    symmetric_scale,
)

Array = jax.Array

RANGES = ("absmax", "minmax")
SCALE_FORMATS = ("fp32", "pow2", "e8m0")
"""How a scale is stored: ``"fp32"`` (any float32), ``"pow2"`` (``2^e``, ``e`` unclipped,
`BlockFloat`'s shared exponent), ``"e8m0"`` (``2^clip(e, -127, 127)``, OCP MX)."""

SCALE_BITS = {"fp32": 32.0, "pow2": 8.0, "e8m0": 8.0}
"""Bits one stored scale takes (a min-max range stores two: scale and minimum)."""


def _check_int(value, name: str, lowest: int, optional: bool = False) -> None:
    if optional and value is None:
        return
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < lowest:
        raise ValueError(f"{name} must be an int >= {lowest}, got {value!r}")


# --------------------------------------------------------------------------- elements

@dataclasses.dataclass(frozen=True, repr=False)
class IntElement:
    """Integer codes at word length ``b`` (``width``, or the traced ``bits`` when None).

    Signed: ``-(2^(b-1)-1) .. 2^(b-1)-1`` (symmetric, no ``-2^(b-1)``); unsigned:
    ``0 .. 2^b - 1``. Needs a `Scaling`: ``q = codes * s``.
    """

    signed: bool = True
    width: int | None = None

    def __post_init__(self):
        if not isinstance(self.signed, (bool, np.bool_)):
            raise ValueError(f"IntElement.signed must be a bool, got {self.signed!r}")
        _check_int(self.width, "IntElement.width", 1, optional=True)

    def __repr__(self):
        return repr_without_defaults(self, ("signed",))


@dataclasses.dataclass(frozen=True)
class FixedElement:
    """Two's-complement fixed point, word ``b``, ``frac_bits`` fractional bits:
    ``q = clip(round(x 2^f) 2^-f, -2^(b-f-1), 2^(b-f-1) - 2^-f)``. Its unit ``2^-f`` is its
    scale, so it takes no `Scaling`."""

    frac_bits: int = 4

    def __post_init__(self):
        _check_int(self.frac_bits, "FixedElement.frac_bits", 0)


@dataclasses.dataclass(frozen=True, repr=False)
class FloatElement:
    """Small float: 1 sign, ``exp_bits`` exponent, ``man_bits`` mantissa bits (None:
    ``b - 1 - exp_bits``, traced). Bias ``2^(E-1) - 1``, subnormals, saturating.

    ``ocp=False``: QPyTorch's grid, no Inf/NaN codes, largest ``2^(2^(E-1)) (2 - 2^-m)``
    (`Float`); ``ocp=True``: the OCP element of that name (``man_bits`` given), whose
    largest value leaves out its special codes (e4m3: 448, not 480; e5m2: 57344).
    """

    exp_bits: int = 4
    man_bits: int | None = None
    ocp: bool = False

    def __post_init__(self):
        if not isinstance(self.exp_bits, (int, np.integer)) or not 1 <= self.exp_bits <= 8:
            raise ValueError(f"FloatElement.exp_bits must be an int in [1, 8], got {self.exp_bits!r}")
        _check_int(self.man_bits, "FloatElement.man_bits", 0, optional=True)
        if not isinstance(self.ocp, (bool, np.bool_)):
            raise ValueError(f"FloatElement.ocp must be a bool, got {self.ocp!r}")
        if self.ocp and self.name not in ELEMENTS:
            raise ValueError(f"FloatElement.ocp=True needs (exp_bits, man_bits) of an OCP "
                             f"element {tuple(ELEMENTS)}, got {self.name!r}")

    def __repr__(self):
        return repr_without_defaults(self, ("exp_bits",))

    @property
    def name(self) -> str:
        """``"e4m3"`` etc. (``"e4m?"`` for a traced mantissa)."""
        return f"e{self.exp_bits}m{'?' if self.man_bits is None else self.man_bits}"

    def params(self, bits: Array) -> tuple:
        """``(man_bits, emin, largest, emax)`` at `bits`: ``emin = 2 - 2^(E-1)``,
        ``emax = floor(log2 largest)`` (traced when the mantissa is)."""
        if self.ocp:
            spec = ELEMENTS[self.name]
            return float(spec.man_bits), float(spec.emin), spec.largest, float(spec.emax)
        emax = float(2 ** (self.exp_bits - 1))
        emin = float(2 - 2 ** (self.exp_bits - 1))
        man: Any = (jnp.maximum(bits - 1.0 - self.exp_bits, 0.0) if self.man_bits is None
                    else float(self.man_bits))
        largest = pow2(emax) * (2.0 - pow2(-man))
        return man, emin, largest, floor_log2(largest)


Element = IntElement | FixedElement | FloatElement


# --------------------------------------------------------------------------- scaling

@dataclasses.dataclass(frozen=True, repr=False)
class Scaling(AxisScaled):
    """Which range sets a scale ``s``, over which elements, stored how.

    ``range="absmax"``: ``s`` from ``max|x|`` (symmetric); ``"minmax"``: from
    ``(min, max)``, ``q = codes * s + min`` (affine, unsigned integer codes).
    ``scale_format`` (`SCALE_FORMATS`): ``"fp32"``, ``"pow2"`` (``s = 2^(floor(log2
    max|x|) - emax)``, emax of the element), ``"e8m0"`` (that exponent clipped to
    ``[-127, 127]``). Groups as the range formats': per tensor (default), per
    index along ``channel_axis``, per ``scale_axes`` and ``tile`` (`check_scaling`).
    """

    range: str = "absmax"
    scale_format: str = "fp32"

    def __post_init__(self):
        super().__post_init__()
        if self.range not in RANGES:
            raise ValueError(f"Scaling.range must be one of {RANGES}, got {self.range!r}")
        if self.scale_format not in SCALE_FORMATS:
            raise ValueError(f"Scaling.scale_format must be one of {SCALE_FORMATS}, "
                             f"got {self.scale_format!r}")
        if self.range == "minmax" and self.scale_format != "fp32":
            raise ValueError(f"Scaling.scale_format must be 'fp32' with range='minmax' (a "
                             f"scale and a minimum), got {self.scale_format!r}")

    def __repr__(self):
        return repr_without_defaults(self, ("range",))


def _check_composition(element: Any, scaling: Any) -> None:
    """ValueError naming the field unless `element` and `scaling` make one grid."""
    if not isinstance(element, (IntElement, FixedElement, FloatElement)):
        raise ValueError(f"Quantizer.element must be an IntElement, FixedElement or "
                         f"FloatElement, got {element!r}")
    if scaling is not None and not isinstance(scaling, Scaling):
        raise ValueError(f"Quantizer.scaling must be a Scaling or None, got {scaling!r}")
    if isinstance(element, FixedElement) and scaling is not None:
        raise ValueError(f"Quantizer.scaling must be None for a FixedElement (its unit "
                         f"2^-frac_bits is its scale), got {scaling!r}")
    if isinstance(element, IntElement) and scaling is None:
        raise ValueError("Quantizer.scaling: an IntElement needs a Scaling (for a fixed "
                         "unit use FixedElement), got None")
    if scaling is None:
        return
    if scaling.range == "minmax" and not (isinstance(element, IntElement) and not element.signed):
        raise ValueError(f"Scaling.range='minmax' places 2^b levels from min to max: it "
                         f"needs IntElement(signed=False), got {element!r}")
    if scaling.range == "absmax" and scaling.scale_format != "fp32" and \
            isinstance(element, IntElement) and not element.signed:
        raise ValueError(f"Scaling.scale_format={scaling.scale_format!r} needs a signed "
                         f"element (a shared exponent of max|x|), got {element!r}")


# --------------------------------------------------------------------------- grids

def _fixed(x, bits, element: FixedElement, rounding, key):
    """``clip(round(x 2^f) 2^-f, -2^(b-f-1), 2^(b-f-1) - 2^-f)`` (`FixedPoint`)."""
    unit = pow2(-float(element.frac_bits))
    top = pow2(bits - element.frac_bits - 1.0)
    return jnp.clip(round_to_integer(x / unit, rounding, key) * unit, -top, top - unit)


def _affine(x, bits, scaling: Scaling, rounding, key):
    """``s = max((max - min) / (2^b - 1), 1e-8)``, ``q = clip(round((x - min)/s), 0,
    2^b - 1) s + min`` on a prescaled range (`affine_grid`), capped at ``max``."""
    lo, hi = scaled_statistic(x, scaling, finite_min_max)
    levels = pow2(bits) - 1.0
    f, lo_f, scale = affine_grid(lo, hi, levels)
    codes = jnp.clip(round_to_integer((x * f - lo_f) / scale, rounding, key), 0.0, levels)
    cap = jnp.where(f < 1.0, hi * f, jnp.inf)
    return jnp.minimum(codes * scale + lo_f, cap) / f


def _shared_exponent(amax, emax, scale_format: str):
    """``floor(log2 max|x|) - emax`` (0 where ``max|x| = 0``), clipped to [-127, 127] for e8m0."""
    positive = amax > 0
    e = jnp.where(positive, floor_log2(jnp.where(positive, amax, 1.0)) - emax, 0.0)
    return jnp.clip(e, -127.0, 127.0) if scale_format == "e8m0" else e


def _int_absmax(x, bits, element: IntElement, scaling: Scaling, rounding, key):
    """Integer codes ``c in [lo, L]`` of ``x / s``; ``q = c s``. fp32: ``s = max(max|x| / L,
    1e-8)`` (`symmetric_scale`); pow2 / e8m0: ``s = 2^(e + 2 - b)``, ``e = floor(log2
    max|x|)`` (an element in units ``2^-(b-2)`` has emax 0)."""
    b = bits if element.width is None else jnp.float32(element.width)
    amax = scaled_statistic(x, scaling, finite_absmax)
    top = pow2(b - 1.0) - 1.0 if element.signed else pow2(b) - 1.0
    low = -top if element.signed else 0.0
    if scaling.scale_format == "fp32":
        f, scale_f, scale = symmetric_scale(amax, top)
        return jnp.clip(round_to_integer(x * f / scale_f, rounding, key), low, top) * scale
    shared = _shared_exponent(amax, 0.0, scaling.scale_format)
    if scaling.scale_format == "pow2":  # one exact step, as BlockFloat
        unit_exp = shared + 2.0 - b
        codes = jnp.clip(round_to_integer(mul_pow2(x, -unit_exp), rounding, key), low, top)
        return mul_pow2(codes, unit_exp)
    v = mul_pow2(x, -shared)  # e8m0: element, then scale, as MX
    elem = mul_pow2(jnp.clip(round_to_integer(mul_pow2(v, b - 2.0), rounding, key), low, top),
                    2.0 - b)
    return mul_pow2(elem, shared)


def _float_absmax(x, bits, element: FloatElement, scaling: Scaling, rounding, key):
    """``q = s * elem(x / s)``: fp32 ``s = max(max|x| / largest, 2^-126)`` (`fp_scale`;
    1 where 0); pow2 / e8m0 ``s = 2^(floor(log2 max|x|) - emax)``."""
    man, emin, largest, emax = element.params(bits)
    amax = scaled_statistic(x, scaling, finite_absmax)
    if scaling.scale_format == "fp32":
        scale = fp_scale(amax, largest)
        return float_elements(x / scale, man, emin, largest, rounding, key) * scale
    shared = _shared_exponent(amax, emax, scaling.scale_format)
    elem = float_elements(mul_pow2(x, -shared), man, emin, largest, rounding, key)
    return mul_pow2(elem, shared)


# --------------------------------------------------------------------------- the quantizer

@dataclasses.dataclass(frozen=True)
class Quantizer:
    """A format as ``element x scaling``: ``q = s * element(x / s)``, ``s`` from `scaling`.

    ``scaling=None`` is the element grid itself (`FixedElement`, `FloatElement`).
    Rounding is the caller's (``quantize(..., rounding=)``, `TensorQuant`), not a
    field. A format by `FormatProtocol`: ``quantize(x, bits, Quantizer(...))``,
    `fake_quant`, rules and presets take it; ``bits >= 32`` is the identity.
    Inside a product its axes are used as written (named formats' ``channel_axis``
    / ``scale_axes`` follow the product; a Quantizer's do not).

    Example:
      >>> from cpt_jax.formats import quantize
      >>> q = Quantizer(IntElement(signed=True), Scaling(range="absmax"))  # SymmetricInt()
      >>> quantize(jnp.array([-1., 0.2, 0.7]), 2, q)
      Array([-1.,  0.,  1.], dtype=float32)
    """

    element: Element
    scaling: Scaling | None = None

    def __post_init__(self):
        _check_composition(self.element, self.scaling)

    def check_bits(self, bits: Any) -> None:
        """ValueError for a static width a traced-mantissa float element cannot take
        (below ``exp_bits + 1``)."""
        element = self.element
        if isinstance(element, FloatElement) and element.man_bits is None and \
                np.min(np.asarray(bits)) <= element.exp_bits:
            raise ValueError(f"bits must be >= exp_bits + 1 = {element.exp_bits + 1} for "
                             f"{self}, got {bits!r}")

    def traits(self) -> FormatTraits:
        """Family ``"quantizer"``, the scaling's scale, no element (no real
        low-precision product takes it; `as_quantizer`'s named twin does)."""
        return FormatTraits("quantizer", integer_scale(self.scaling))

    def as_quantizer(self) -> Quantizer:
        return self

    def grid(self, x: Array, bits: Array, rounding: str, key: Array | None) -> Array:
        """`x` (float32) on the composed grid at word length `bits` (traceable)."""
        element, scaling = self.element, self.scaling
        if not isinstance(bits, jax.core.Tracer):
            self.check_bits(bits)
        if isinstance(element, FixedElement):
            return _fixed(x, bits, element, rounding, key)
        if scaling is None:
            assert isinstance(element, FloatElement)  # _check_composition
            man, emin, largest, _ = element.params(bits)
            return float_elements(x, man, emin, largest, rounding, key)
        if scaling.range == "minmax":
            return _affine(x, bits, scaling, rounding, key)
        if isinstance(element, IntElement):
            return _int_absmax(x, bits, element, scaling, rounding, key)
        return _float_absmax(x, bits, element, scaling, rounding, key)

    def element_width(self, bits: Array) -> Array:
        """Bits of one stored element: the element's fixed width, else `bits`."""
        e = self.element
        if isinstance(e, IntElement) and e.width is not None:
            return jnp.float32(e.width)
        if isinstance(e, FloatElement) and e.man_bits is not None:
            return jnp.float32(1 + e.exp_bits + e.man_bits)
        return jnp.asarray(bits, jnp.float32)

    @property
    def scale_bits_per_element(self) -> float:
        """A tile's stored scale over its elements: ``SCALE_BITS / |tile|`` (min-max: two
        values); per tensor / channel / ``scale_axes`` scales are O(1/K), not counted."""
        s = self.scaling
        if s is None or not scale_elements(s):
            return 0.0
        stored = SCALE_BITS[s.scale_format] * (2.0 if s.range == "minmax" else 1.0)
        return stored / scale_elements(s)


# --------------------------------------------------------------------------- named -> composed

def ocp_element(name: str) -> FloatElement:
    """The OCP element `name` (``"e4m3"``, ...) as a `FloatElement`.

    Example:
      >>> ocp_element("e2m1")
      FloatElement(exp_bits=2, man_bits=1, ocp=True)
    """
    return FloatElement(int(name[1]), ELEMENTS[name].man_bits, ocp=True)


def as_quantizer(fmt: Any) -> Quantizer:
    """The named format `fmt` as its `Quantizer` (its own ``as_quantizer()``):
    ``quantize(x, b, as_quantizer(fmt))`` equals ``quantize(x, b, fmt)`` bit for bit.

    AffineInt: unsigned ints, min-max fp32; SymmetricInt: signed ints, max-abs fp32;
    BlockFloat: signed ints, max-abs pow2; FixedPoint: `FixedElement`; Float /
    OCPFloat: `FloatElement`, no scale; ScaledFloat (tensor, row, tile): OCP
    element, fp32 max-abs; MX (OCP / int8 / int, floor): e8m0 tiles along ``axis``.
    ValueError for what is not one composition: NVFP4 (two scale levels), MX("float"),
    MX(scale_rounding="up"), ScaledFloat("block").

    Example:
      >>> from cpt_jax.formats import BlockFloat
      >>> q = as_quantizer(BlockFloat(scale_axes=(-1,)))
      >>> q.element, q.scaling
      (IntElement(signed=True), Scaling(scale_axes=(-1,), range='absmax', scale_format='pow2'))
    """
    method = getattr(fmt, "as_quantizer", None)
    if method is None:
        raise ValueError(f"as_quantizer: {fmt!r} is not a named format")
    return method()
