"""Integer codes plus scales: `IntCodes`, what an `AffineInt` / `SymmetricInt` tensor stores.

`encode_affine` / `encode_symmetric` (checked: `cpt_jax.formats.encode`) are the one
computation of the integer formats' codes and scales, at every scaling they have (per
tensor, per index along ``channel_axis``, per ``scale_axes`` group such as per token,
per 1-D / 2-D ``tile``: `scaled_statistic`), and `IntCodes.decode` is their value:

    quantize(x, bits, fmt) == encode(x, bits, fmt).decode()

bit for bit on finite ``x`` (the same jnp operations, which XLA fuses as one pass).
`quantize` runs them as its integer grids; `cpt_jax.ops.grids.kernel_codes` stores
the codes of an exported weight; `IntCodes.bits_per_element` is what the cost counts.

affine (`AffineInt`), ``levels = 2^b - 1``, ``f = prescale(hi - lo, levels)`` (1 for
every range narrower than ``2^64 levels``, `affine_grid`):

    lo_f = f lo,   s = max((f hi - lo_f) / levels, 1e-8)
    c = clip(round((f x - lo_f) / s), 0, levels)
    q = min(c s + lo_f, cap) / f,   cap = f hi if f < 1 else +inf

symmetric (`SymmetricInt`), ``L = 2^(b-1) - 1`` (`symmetric_scale`):

    s_f = max(f max|x| / max(L, 1), 1e-8),   c = clip(round(f x / s_f), -L, L)
    s = min(s_f / f, cap),   q = c s     (cap keeps L s finite near 3.4e38)

Non-finite inputs take no part in the ranges; their codes are what the formulas give:
NaN for NaN, the end codes for +-Inf (affine ``levels`` / ``0``, symmetric ``+-L``).
`quantize` passes such inputs through, `IntCodes.decode` does not.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, TypeAlias

import jax
import jax.numpy as jnp

from cpt_jax.formats._elements import pow2
from cpt_jax.formats._rounding import round_to_integer
from cpt_jax.formats._scaling import (
    affine_grid,
    finite_absmax,
    finite_min_max,
    scale_elements,
    scaled_statistic,
    symmetric_scale,
)

AffineInt: TypeAlias = Any
SymmetricInt: TypeAlias = Any
"""`cpt_jax.formats.AffineInt` / `SymmetricInt`: their module imports this one, so it names
them without importing them (no import cycle, not even for types)."""

Array = jax.Array

INT_CODE_KINDS = ("affine", "symmetric")
"""`IntCodes.kind`: the grid of `AffineInt` or of `SymmetricInt`."""


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["codes", "scale", "offset", "prescale", "cap", "bits"],
                   meta_fields=["kind", "scale_bits", "scale_elements"])
@dataclasses.dataclass(frozen=True)
class IntCodes:
    """One tensor of an integer format as codes plus scales (a pytree).

    affine: ``q = min(codes * scale + offset, cap) / prescale``; symmetric:
    ``q = codes * scale`` (`decode`; the module docstring has the formulas).

    Attributes:
      codes: float32 integers in ``code_bounds()``, the shape of the input.
      scale: the step (affine: of the prescaled grid ``s``; symmetric: ``s``),
        broadcastable to `codes` (per tensor, channel, group or tile).
      offset: affine: the prescaled minimum ``lo_f``, as `scale`; symmetric: None.
      prescale: affine: ``f`` (1 unless the range is >= 2^64 steps); symmetric: None.
      cap: affine: the top of the prescaled grid (``f hi``, +inf when ``f = 1``);
        symmetric: None.
      bits: the width ``b`` (float32, possibly traced).
      kind: ``"affine"`` or ``"symmetric"``.
      scale_bits: the bits one counted scale stores (the format's ``tile_scale_bits``).
      scale_elements: the elements one counted scale covers (a tile's size); 0 when
        the scales are per tensor / channel / group, O(1/K) and not counted.

    Example:
      >>> from cpt_jax.formats import SymmetricInt, encode
      >>> c = encode(jnp.array([-1.0, 0.2, 0.7]), 2, SymmetricInt())
      >>> c.codes.tolist(), c.scale.tolist(), c.decode().tolist()
      ([-1.0, 0.0, 1.0], [1.0], [-1.0, 0.0, 1.0])
    """

    codes: Array
    scale: Array
    offset: Array | None
    prescale: Array | None
    cap: Array | None
    bits: Array
    kind: str
    scale_bits: float = 0.0
    scale_elements: int = 0

    def decode(self) -> Array:
        """The codes' values in float32: affine ``min(c s + lo_f, cap) / f``, symmetric
        ``c s`` (exactly `quantize`'s operations).

        Example:
          >>> from cpt_jax.formats import AffineInt, SymmetricInt, encode
          >>> encode(jnp.array([0.0, 0.3, 1.0]), 2, AffineInt()).decode()
          Array([0.        , 0.33333334, 1.        ], dtype=float32)
        """
        if self.kind == "symmetric":
            return self.codes * self.scale
        offset, cap, f = self._affine_terms()
        return jnp.minimum(self.codes * self.scale + offset, cap) / f

    def _affine_terms(self) -> tuple[Array, Array, Array]:
        """``(offset, cap, prescale)`` of affine codes (ValueError for symmetric ones)."""
        if self.offset is None or self.cap is None or self.prescale is None:
            raise ValueError(f"{self.kind} codes have no offset, cap or prescale")
        return self.offset, self.cap, self.prescale

    def step(self) -> Array:
        """The real grid's step, as `scale`: affine ``s / f``, symmetric ``s``.

        Example:
          >>> from cpt_jax.formats import AffineInt, SymmetricInt, encode
          >>> encode(jnp.array([-3e38, 3e38]), 4, AffineInt()).step().tolist()  # f = 2^-64
          [3.999999973526325e+37]
        """
        if self.kind == "symmetric":
            return self.scale
        return self.scale / self._affine_terms()[2]

    def origin(self) -> Array:
        """The real grid's value of code 0, as `scale`: affine ``lo_f / f`` (the
        minimum), symmetric 0. ``decode() ~= codes * step() + origin()`` (the same
        value up to float rounding, and the cap)."""
        if self.kind == "symmetric":
            return jnp.zeros_like(self.scale)
        offset, _, f = self._affine_terms()
        return offset / f

    def code_bounds(self) -> tuple[Array, Array]:
        """``(lowest, highest)`` code: affine ``(0, 2^b - 1)``, symmetric ``(-L, L)``
        with ``L = 2^(b-1) - 1``.

        Example:
          >>> from cpt_jax.formats import AffineInt, SymmetricInt, encode
          >>> [float(v) for v in encode(jnp.ones(2), 4, SymmetricInt()).code_bounds()]
          [-7.0, 7.0]
        """
        if self.kind == "symmetric":
            top = pow2(self.bits - 1.0) - 1.0
            return -top, top
        return jnp.zeros_like(self.bits), pow2(self.bits) - 1.0

    def bits_per_element(self) -> Array:
        """Stored bits per element with the scales counted: ``b + scale_bits /
        scale_elements`` (tiles: `AffineInt` ``b + 64 / |tile|``, `SymmetricInt`
        ``b + 32 / |tile|``), ``b`` when the scales are not counted (per tensor,
        channel or token: O(1/K)), 32 at ``b >= 32``. What
        `cpt_jax.formats.bits_per_element` counts for the format.

        Example:
          >>> from cpt_jax.formats import AffineInt, SymmetricInt, encode
          >>> fmt = SymmetricInt(scale_axes=(-1,), tile=128)
          >>> float(encode(jnp.ones((2, 256)), 4, fmt).bits_per_element())
          4.25
        """
        overhead = self.scale_bits / self.scale_elements if self.scale_elements else 0.0
        return jnp.where(self.bits >= 32, 32.0, self.bits + overhead)


def _scale_count(fmt) -> dict:
    """`IntCodes`' ``scale_bits`` / ``scale_elements`` for `fmt` (a tile's scale is
    counted; per tensor / channel / group scales are not)."""
    return {"scale_bits": fmt.tile_scale_bits, "scale_elements": scale_elements(fmt)}


def encode_affine(x: Array, bits: Array, fmt: AffineInt, rounding: str = "nearest",
                  key: Array | None = None, statistic=finite_min_max) -> IntCodes:
    """`AffineInt`'s codes of float32 `x` at float32 `bits`, unchecked (`encode` checks).

    ``levels = 2^b - 1``, ``(f, lo_f, s) = affine_grid(lo, hi, levels)`` on the finite
    range of each scale group, ``c = clip(round((f x - lo_f) / s), 0, levels)``,
    ``cap = f hi`` if ``f < 1`` (the top point may round one ulp past it) else +inf.
    `statistic`: how a range is reduced (`finite_min_max`; `plain_min_max`: the same on
    finite blocks, a non-finite range where a block holds a non-finite element).
    """
    lo, hi = scaled_statistic(x, fmt, statistic)
    levels = pow2(bits) - 1.0
    f, lo_f, scale = affine_grid(lo, hi, levels)
    codes = jnp.clip(round_to_integer((x * f - lo_f) / scale, rounding, key), 0.0, levels)
    cap = jnp.where(f < 1.0, hi * f, jnp.inf)
    return IntCodes(codes, scale, lo_f, f, cap, bits, "affine", **_scale_count(fmt))


def encode_symmetric(x: Array, bits: Array, fmt: SymmetricInt, rounding: str = "nearest",
                     key: Array | None = None, statistic=finite_absmax) -> IntCodes:
    """`SymmetricInt`'s codes of float32 `x` at float32 `bits`, unchecked (`encode` checks).

    ``L = 2^(b-1) - 1``, ``(f, s_f, s) = symmetric_scale(max|x|, L)`` per scale group,
    ``c = clip(round(f x / s_f), -L, L)``; the value is ``c s``. `statistic`: how the
    amax is reduced (`finite_absmax`, or `plain_absmax`).
    """
    amax = scaled_statistic(x, fmt, statistic)
    top = pow2(bits - 1.0) - 1.0
    f, scale_f, scale = symmetric_scale(amax, top)
    codes = jnp.clip(round_to_integer(x * f / scale_f, rounding, key), -top, top)
    return IntCodes(codes, scale, None, None, None, bits, "symmetric", **_scale_count(fmt))
