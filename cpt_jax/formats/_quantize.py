"""`quantize`: a format's grid applied at a word length, and the formats it takes.

``quantize(x, bits, fmt)`` checks its arguments (the format's own ``check_bits``
too), runs ``fmt.grid`` in float32 (every format's, built-in or not: `FormatProtocol`),
passes non-finite inputs through and returns `x`'s dtype; ``bits >= 32`` (possibly
traced) is the identity. `FORMATS` are the built-in format classes, `Format` the type
of any format.
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from cpt_jax.formats._cpu_guard import guarded_on_cpu
from cpt_jax.formats._hardware import HARDWARE_FORMATS, MX, NVFP4
from cpt_jax.formats._int_codes import IntCodes
from cpt_jax.formats._named import (
    PAPERS_FORMATS,
    AffineInt,
    Bits,
    BlockFloat,
    FixedPoint,
    Float,
    SymmetricInt,
)
from cpt_jax.formats._protocol import FormatProtocol, is_format, named_formats
from cpt_jax.formats._rounding import check_rounding
from cpt_jax.formats._scaled import OCPFloat, ScaledFloat
from cpt_jax.formats._traits import format_traits

Array = jax.Array

Format = (AffineInt | SymmetricInt | FixedPoint | BlockFloat | Float | OCPFloat | MX | NVFP4
          | ScaledFloat | FormatProtocol)
"""Any format: a built-in one, or any object with a ``grid`` method (`FormatProtocol`)."""
FORMATS = PAPERS_FORMATS + HARDWARE_FORMATS
"""The built-in format classes (the papers' and the hardware ones)."""


def check_format(fmt: Any) -> None:
    """Raise ValueError unless `fmt` is a format: a built-in one (`FORMATS`) or any object
    with a ``grid`` method (`cpt_jax.formats.FormatProtocol`).

    Example:
      >>> check_format("int8")  # doctest: +ELLIPSIS
      Traceback (most recent call last):
      ValueError: fmt must be one of [...] or an object with a grid(...) method (...), got 'int8'
    """
    if not is_format(fmt):
        names = [f.__name__ for f in FORMATS] + sorted(named_formats())
        raise ValueError(f"fmt must be one of {names} or an object with a grid(x, bits, "
                         f"rounding, key) method (cpt_jax.formats.FormatProtocol), got {fmt!r}")


def is_custom_format(fmt: Any) -> bool:
    """True for a format defined outside cpt_jax's built-ins (a ``grid``, not `FORMATS`).

    Example:
      >>> is_custom_format(cpt_jax.Quantizer(cpt_jax.FloatElement(4))), is_custom_format(MX())
      (True, False)
    """
    return is_format(fmt) and type(fmt) not in FORMATS


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
    """Raise ValueError for a static `bits` below what `fmt` has: the format's own
    ``check_bits`` (e.g. MX("int") 2, MX("float") 4, `Float` ``exp_bits + 1``).

    Example:
      >>> check_format_bits(MX("int"), 1)
      Traceback (most recent call last):
      ValueError: bits must be >= 2 for MX(element='int', block_size=32, axis=-1), got 1
    """
    check = getattr(fmt, "check_bits", None)
    if check is not None and not isinstance(bits, jax.core.Tracer):
        check(bits)


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
      fmt: any format (`FORMATS`, a `Quantizer`, or an object with a ``grid``).
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
    check_format_bits(fmt, bits)
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"x must be a floating-point array, got dtype {x.dtype}")
    if not isinstance(bits, jax.core.Tracer) and np.min(np.asarray(bits)) >= 32:
        return x
    dtype = x.dtype
    xf = x.astype(jnp.float32)
    b = at_least_one_bit(bits)
    grid: Any = fmt.grid

    def quantized(xf):
        q = grid(xf, b, rounding, key)
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
    if format_traits(fmt).family != "symmetric_int":
        raise ValueError(f"fmt must be a SymmetricInt, got {fmt!r}")
    codes = encode(x, bits, fmt, rounding, key)
    return codes.codes, codes.scale


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
      fmt: an `AffineInt` or a `SymmetricInt` (a format whose ``encode`` gives
        `IntCodes`), at any of their scalings.
      rounding: ``"nearest"`` (half to even) or ``"stochastic"`` (``floor(v + U)``).
      key: PRNG key of stochastic rounding.

    Example:
      >>> x = jnp.array([[1.0, 0.4], [0.01, 0.004]])
      >>> c = encode(x, 4, SymmetricInt(scale_axes=(-1,)))   # one scale per row
      >>> c.codes.tolist(), c.scale.shape
      ([[7.0, 3.0], [7.0, 3.0]], (2, 1))
    """
    method = getattr(fmt, "encode", None)
    if method is None or not is_format(fmt):
        raise ValueError(f"encode: fmt must be an AffineInt or a SymmetricInt, got {fmt!r}")
    check_rounding(rounding, key)
    check_bits(bits)
    xf = jnp.asarray(x).astype(jnp.float32)
    return method(xf, at_least_one_bit(bits), rounding, key)


__all__ = ["FORMATS", "Format", "at_least_one_bit", "check_bits", "check_format",
           "check_format_bits", "encode", "is_custom_format", "quantize", "symmetric_codes"]
