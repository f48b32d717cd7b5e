"""Element grids: the OCP element types and the exact power-of-two math of every grid.

`ElementSpec` describes one OCP element (``2^e (1 + k 2^-m)`` for ``e >= 1 - bias``,
subnormals below, largest finite value ``largest``); `ELEMENTS` are the OFP8 and MX
ones. `float_elements` rounds to any small-float element grid (parameters may be
traced), built from `pow2` / `mul_pow2` / `floor_log2`, which are exact in float32.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from cpt_jax.formats._rounding import round_to_integer

Array = jax.Array


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


def pow2(e: ArrayLike) -> Array:
    """Exact ``2.0 ** e`` in float32 for integer-valued ``e`` (clamped to [-126, 127]).

    Built from the exponent field, so it is exact where ``jnp.exp2`` may not be.
    """
    e = jnp.clip(jnp.asarray(e, jnp.float32), -126, 127).astype(jnp.int32)
    return jax.lax.bitcast_convert_type((e + 127) << 23, jnp.float32)


def mul_pow2(v: Array, k: ArrayLike) -> Array:
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
    mag = mul_pow2(round_to_integer(mul_pow2(a, man_bits - e), rounding, key), e - man_bits)
    return jnp.sign(v) * jnp.minimum(mag, largest)
