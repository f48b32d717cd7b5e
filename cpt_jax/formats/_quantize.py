"""`quantize`: a format's grid applied at a word length, and the papers' grids.

``quantize(x, bits, fmt)`` checks its arguments, runs the grid function of
``type(fmt)`` (`_GRIDS`: the papers' formats here, the hardware ones from
`HARDWARE_GRIDS`) in float32, passes non-finite inputs through and returns `x`'s
dtype; ``bits >= 32`` (possibly traced) is the identity.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from cpt_jax.formats._elements import floor_log2, mul_pow2, pow2
from cpt_jax.formats._hardware import HARDWARE_GRIDS
from cpt_jax.formats._int_codes import IntCodes, encode_affine, encode_symmetric
from cpt_jax.formats._named import (
    MX,
    AffineInt,
    Bits,
    BlockFloat,
    FixedPoint,
    Float,
    Format,
    SymmetricInt,
    check_format,
)
from cpt_jax.formats._rounding import check_rounding, round_to_integer
from cpt_jax.formats._scaling import finite_absmax, guarded_on_cpu, scaled_statistic

Array = jax.Array


def _affine(x, bits, fmt: AffineInt, rounding, key):
    return encode_affine(x, bits, fmt, rounding, key).decode()


def _symmetric_codes(x, bits, fmt: SymmetricInt, rounding, key):
    codes = encode_symmetric(x, bits, fmt, rounding, key)
    return codes.codes, codes.scale


def _symmetric(x, bits, fmt: SymmetricInt, rounding, key):
    return encode_symmetric(x, bits, fmt, rounding, key).decode()


def _fixed_point(x, bits, fmt: FixedPoint, rounding, key):
    unit = pow2(-float(fmt.frac_bits))
    top = pow2(bits - fmt.frac_bits - 1.0)
    q = round_to_integer(x / unit, rounding, key) * unit
    return jnp.clip(q, -top, top - unit)


def _block_float(x, bits, fmt: BlockFloat, rounding, key):
    amax = scaled_statistic(x, fmt, finite_absmax)
    e = jnp.where(amax > 0, floor_log2(jnp.where(amax > 0, amax, 1.0)), 0.0)
    unit_exp = e + 2.0 - bits  # u = 2^unit_exp; scaled in two steps (see mul_pow2)
    top = pow2(bits - 1.0) - 1.0
    return mul_pow2(jnp.clip(round_to_integer(mul_pow2(x, -unit_exp), rounding, key), -top, top), unit_exp)


def _small_float(x, bits, fmt: Float, rounding, key):
    man = jnp.maximum(bits - 1.0 - fmt.exp_bits, 0.0)
    emin = 1.0 - fmt.bias
    emax = float(2 ** (fmt.exp_bits - 1))
    largest = pow2(emax) * (2.0 - pow2(-man))
    a = jnp.abs(x)
    e = jnp.maximum(floor_log2(jnp.where(a > 0, a, 1.0)), emin)
    # a / 2^(e - man), rounded, times 2^(e - man); the spacing 2^(e - man) may be
    # below the float32 normal range (exp_bits = 8), so scale in two steps.
    mag = mul_pow2(round_to_integer(mul_pow2(a, man - e), rounding, key), e - man)
    return jnp.sign(x) * jnp.minimum(mag, largest)


_GRIDS: dict[type, Callable[..., Array]] = {
    **HARDWARE_GRIDS,
    AffineInt: _affine,
    SymmetricInt: _symmetric,
    FixedPoint: _fixed_point,
    BlockFloat: _block_float,
    Float: _small_float,
}


# --------------------------------------------------------------------------- checks

def check_bits(bits: Any, name: str = "bits", minimum: int = 1) -> None:
    """Raise ValueError for a static (Python/numpy) bit-width below `minimum`.

    Traced bit-widths cannot be checked at trace time and are accepted.
    """
    if isinstance(bits, jax.core.Tracer):
        return
    try:
        value = np.asarray(bits)
    except Exception as exc:  # pragma: no cover - defensive
        raise ValueError(f"{name} must be a number, got {bits!r}") from exc
    if value.dtype.kind not in "iuf":
        raise ValueError(f"{name} must be a number, got {bits!r}")
    if value.size and (np.any(np.isnan(value)) or np.min(value) < minimum):
        raise ValueError(f"{name} must be >= {minimum} (full precision is >= 32), got {bits!r}")


def at_least_one_bit(bits: Any) -> Array:
    """``max(bits, 1)`` as float32: a traced width below 1 (which `check_bits` cannot
    see) quantizes at 1 bit instead of on an empty grid (NaN).

    Example:
      >>> float(at_least_one_bit(0.0)), float(at_least_one_bit(4))
      (1.0, 4.0)
    """
    return jnp.maximum(jnp.asarray(bits, jnp.float32), 1.0)


def check_format_bits(fmt: Format, bits: Any) -> None:
    """Raise ValueError for a static `bits` below what `fmt` has: MX("int") 2, MX("float") 4."""
    if isinstance(bits, jax.core.Tracer) or not isinstance(fmt, MX):
        return
    lowest = {"int": 2, "float": 4}.get(fmt.element)
    if lowest is not None and np.min(np.asarray(bits)) < lowest:
        raise ValueError(f"bits must be >= {lowest} for {fmt}, got {bits!r}")


# --------------------------------------------------------------------------- quantize

def quantize(x: Array, bits: Bits, fmt: Format = AffineInt(), *, rounding: str = "nearest",
             key: Array | None = None) -> Array:
    """Quantize `x` to the grid of `fmt` at word length `bits` (fake quantization).

    The result has the dtype and shape of `x` and holds only values of the grid.
    `bits` may be a Python number or a (traced) scalar array; ``bits >= 32`` returns
    `x` unchanged; a traced width below 1 quantizes at 1 bit (`at_least_one_bit`).
    See `cpt_jax.formats` for each format's formula.

    Args:
      x: array to quantize (floating point).
      bits: word length; ints or integer-valued floats, possibly traced.
      fmt: one of `AffineInt`, `SymmetricInt`, `FixedPoint`, `BlockFloat`, `Float`.
      rounding: ``"nearest"`` (half to even) or ``"stochastic"`` (``floor(v + U)``).
      key: PRNG key, required for stochastic rounding.

    Example:
      >>> x = jnp.array([-1.0, -0.6, 0.1, 0.9])
      >>> quantize(x, 2, SymmetricInt())
      Array([-1., -1.,  0.,  1.], dtype=float32)
    """
    check_format(fmt)
    check_rounding(rounding, key)
    check_bits(bits)
    if isinstance(fmt, Float) and not isinstance(bits, jax.core.Tracer):
        if np.min(np.asarray(bits)) < fmt.exp_bits + 1:
            raise ValueError(
                f"bits must be >= exp_bits + 1 = {fmt.exp_bits + 1} for {fmt}, got {bits!r}")
    check_format_bits(fmt, bits)
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"x must be a floating-point array, got dtype {x.dtype}")
    if not isinstance(bits, jax.core.Tracer) and np.min(np.asarray(bits)) >= 32:
        return x
    dtype = x.dtype
    xf = x.astype(jnp.float32)
    b = at_least_one_bit(bits)
    grid = _GRIDS.get(type(fmt))
    custom: Any = fmt  # a FormatProtocol format: its own grid

    def quantized(xf):
        q = grid(xf, b, fmt, rounding, key) if grid else custom.grid(xf, b, rounding, key)
        q = jnp.where(jnp.isfinite(xf), q, xf)
        return jnp.where(b >= 32, xf, q)

    if rounding == "stochastic":  # its dither: ~20 ops an element, computed once
        return guarded_on_cpu(quantized, xf).astype(dtype)
    return quantized(xf).astype(dtype)


def symmetric_codes(x: Array, bits: Bits, fmt: SymmetricInt = SymmetricInt(), *,
                    rounding: str = "nearest", key: Array | None = None
                    ) -> tuple[Array, Array]:
    """The integer codes and scale of `SymmetricInt`: ``quantize(x) == codes * scale``.

    ``s = max(max|x| / max(2^(b-1)-1, 1), 1e-8)`` (per tensor, or per index along
    ``fmt.channel_axis``, broadcastable to `x`), ``codes = clip(round(x/s), -L, L)``
    with ``L = 2^(b-1) - 1``, as float32 integers (they fit int8 for ``b <= 8``).
    The same ops as `quantize`, so ``codes * scale`` equals it bit for bit on finite
    inputs (non-finite inputs have no code). Used by the real-int8 products.

    Example:
      >>> c, s = symmetric_codes(jnp.array([-1.0, 0.2, 0.7]), 2)
      >>> c, s
      (Array([-1.,  0.,  1.], dtype=float32), Array([1.], dtype=float32))
    """
    if not isinstance(fmt, SymmetricInt):
        raise ValueError(f"fmt must be a SymmetricInt, got {fmt!r}")
    check_rounding(rounding, key)
    check_bits(bits)
    xf = jnp.asarray(x).astype(jnp.float32)
    return _symmetric_codes(xf, at_least_one_bit(bits), fmt, rounding, key)


def encode(x: Array, bits: Bits, fmt: AffineInt | SymmetricInt, rounding: str = "nearest",
           key: Array | None = None) -> IntCodes:
    """The integer codes and scales of `x` in `fmt` at width `bits`: an `IntCodes`.

    affine: ``c = clip(round((f x - lo_f) / s), 0, 2^b - 1)``, ``q = min(c s + lo_f,
    cap) / f``; symmetric: ``c = clip(round(f x / s_f), -L, L)``, ``q = c s``
    (``f = 1``, ``cap = +inf`` unless a range is >= 2^64 steps; `IntCodes`).
    ``encode(x, bits, fmt, rounding, key).decode()`` is
    ``quantize(x, bits, fmt, rounding=rounding, key=key)`` bit for bit on finite `x`
    at ``bits < 32`` (the same operations, the same noise for the same `key`).

    Args:
      x: the floating-point tensor (computed in float32).
      bits: the width, a number or a (traced) scalar.
      fmt: an `AffineInt` or a `SymmetricInt`, at any of their scalings.
      rounding: ``"nearest"`` (half to even) or ``"stochastic"`` (``floor(v + U)``).
      key: PRNG key of stochastic rounding.

    Example:
      >>> x = jnp.array([[1.0, 0.4], [0.01, 0.004]])
      >>> c = encode(x, 4, SymmetricInt(scale_axes=(-1,)))   # one scale per row
      >>> c.codes.tolist(), c.scale.shape
      ([[7.0, 3.0], [7.0, 3.0]], (2, 1))
    """
    if not isinstance(fmt, (AffineInt, SymmetricInt)):
        raise ValueError(f"encode: fmt must be an AffineInt or a SymmetricInt, got {fmt!r}")
    check_rounding(rounding, key)
    check_bits(bits)
    xf = jnp.asarray(x).astype(jnp.float32)
    b = at_least_one_bit(bits)
    if isinstance(fmt, AffineInt):
        return encode_affine(xf, b, fmt, rounding, key)
    return encode_symmetric(xf, b, fmt, rounding, key)
