"""Integer grids from a given range: fake quantization on a static grid, and its codes.

`cpt_jax.formats` quantizes a tensor on the grid of its *own* range. Several tools
need the same grids on a range given from elsewhere (a running average, a history,
a calibration): this module holds that math once.

==================  ============================================================
function            formula
==================  ============================================================
`quantize_with_range` ``Q(x)`` on the grid of `fmt` spanning ``[lo, hi]``
                    (AffineInt, SymmetricInt, Float), saturating, STE gradient
`grid_from_range`   ``(origin, scale)``: affine ``(lo, max((hi-lo)/(2^b-1), 1e-8))``,
                    symmetric ``(0, max(max(|lo|,|hi|)/(2^(b-1)-1), 1e-8))``
`code_bounds`       the raw codes and their shift into int8
`raw_codes`         ``clip(round((x - origin)/scale), code_min, code_max)``
`kernel_codes`      a weight as int8 codes with a scale/offset per channel
==================  ============================================================

A weight's grid is that of its own range, so `kernel_codes` takes its codes from
`cpt_jax.formats.encode` (`IntCodes`, the codes the training's fake quantization
decodes) and only shifts them into int8. The other grids here are on purpose apart
from it: they span a range given from elsewhere (static activation grids, running
ranges), not the tensor's own, with no prescale (a calibrated range is far below
2^64 steps) and, for the export, int8 code bounds and shift (`code_bounds`).
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from cpt_jax import formats
from cpt_jax.formats import MIN_SCALE, SymmetricInt
from cpt_jax.ops.varying import vary_like

Array = jax.Array


def check_range_format(fmt, what: str = "a grid from a range") -> None:
    """ValueError unless `fmt` is a per-tensor `AffineInt`, `SymmetricInt` or `Float`."""
    if formats.format_traits(fmt).range_grid is None:
        raise ValueError(
            f"fmt must be AffineInt(), SymmetricInt() or Float(e) for {what}, got {fmt!r}")
    if getattr(fmt, "channel_axis", None) is not None:
        raise ValueError(f"{what} is per tensor: fmt.channel_axis must be None, got {fmt!r}")


def _round(v: Array, rounding: str, key: Array | None) -> Array:
    """Half-to-even, or stochastic ``floor(v + U)`` with `formats.dither_noise`."""
    if rounding == "nearest":
        return jnp.round(v)
    return jnp.floor(v + formats.dither_noise(key, v.shape, dtype=v.dtype))


def _grid(x, lo, hi, bits, fmt, rounding, key):
    """Quantize `x` on the grid of `fmt` spanning [lo, hi] (clipping outside)."""
    grid = formats.format_traits(fmt).range_grid
    if grid == "affine":
        levels = formats.pow2(bits) - 1.0
        scale = jnp.maximum((hi - lo) / levels, formats.MIN_SCALE)
        codes = jnp.clip(_round((x - lo) / scale, rounding, key), 0.0, levels)
        return codes * scale + lo
    r = jnp.maximum(jnp.abs(lo), jnp.abs(hi))
    if grid == "symmetric":
        top = formats.pow2(bits - 1.0) - 1.0
        scale = jnp.maximum(r / jnp.maximum(top, 1.0), formats.MIN_SCALE)
        return jnp.clip(_round(x / scale, rounding, key), -top, top) * scale
    # Float: scale so that R lands on the format's largest value, FP8 style.
    _, largest = formats.representable_range(bits, fmt)
    scale = jnp.where(r > 0, r / largest, 1.0)
    y = jnp.clip(x / scale, -largest, largest)
    return formats.quantize(y, bits, fmt, rounding=rounding, key=key) * scale


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _ste_range_quant(x, lo, hi, bits, key, fmt, rounding):
    xf = x.astype(jnp.float32)
    q = _grid(xf, lo, hi, bits, fmt, rounding, key)
    q = jnp.where(jnp.isfinite(xf), q, xf)
    q = jnp.where(bits >= 32, xf, q)
    return q.astype(x.dtype)


def _ste_range_fwd(x, lo, hi, bits, key, fmt, rounding):
    return _ste_range_quant(x, lo, hi, bits, key, fmt, rounding), None


def _ste_range_bwd(fmt, rounding, _, g):
    return g, None, None, None, None


_ste_range_quant.defvjp(_ste_range_fwd, _ste_range_bwd)


def quantize_with_range(x: Array, lo, hi, bits, fmt=SymmetricInt(), *,
                        rounding: str = "nearest", key: Array | None = None) -> Array:
    """Fake-quantize `x` on the grid of `fmt` at `bits` spanning the given range.

    Values outside ``[lo, hi]`` saturate; non-finite values pass through;
    ``bits >= 32`` is identity; straight-through gradient for `x`.

    Example:
      >>> quantize_with_range(jnp.array([-3., 0.4, 0.9]), -1., 1., 2, SymmetricInt())
      Array([-1.,  0.,  1.], dtype=float32)
    """
    formats.check_rounding(rounding, key)
    formats.check_bits(bits)
    check_range_format(fmt)
    lo, hi = jnp.asarray(lo, jnp.float32), jnp.asarray(hi, jnp.float32)
    bits = jnp.asarray(bits, jnp.float32)
    # Under shard_map: x varies wherever its output does (ops.varying).
    return _ste_range_quant(vary_like(jnp.asarray(x), lo, hi, bits, key), lo, hi, bits,
                            key, fmt, rounding)


def code_bounds(kind: str, bits: int) -> tuple[int, int, int]:
    """``(code_min, code_max, shift)``: the grid's raw codes and the shift into int8.

    affine: ``(0, 2^b - 1, 2^(b-1))``; symmetric: ``(-L, L, 0)``, ``L = 2^(b-1) - 1``.

    Example:
      >>> code_bounds("affine", 8), code_bounds("symmetric", 4)
      ((0, 255, 128), (-7, 7, 0))
    """
    if kind == "affine":
        return 0, 2 ** bits - 1, 2 ** (bits - 1)
    top = 2 ** (bits - 1) - 1
    return -top, top, 0


def grid_from_range(kind: str, bits: int, lo: Array, hi: Array) -> tuple[Array, Array]:
    """``(origin, scale)`` of the grid covering ``[lo, hi]`` (as `cpt_jax.formats`).

    affine: ``(lo, max((hi - lo)/(2^b - 1), 1e-8))``;
    symmetric: ``(0, max(max(|lo|, |hi|)/(2^(b-1) - 1), 1e-8))``.

    Example:
      >>> grid_from_range("affine", 2, jnp.float32(0.0), jnp.float32(3.0))
      (Array(0., dtype=float32), Array(1., dtype=float32))
    """
    lo = jnp.asarray(lo, jnp.float32)
    hi = jnp.asarray(hi, jnp.float32)
    if kind == "affine":
        return lo, jnp.maximum((hi - lo) / (2.0 ** bits - 1.0), MIN_SCALE)
    amax = jnp.maximum(jnp.abs(lo), jnp.abs(hi))
    return jnp.zeros_like(lo), jnp.maximum(amax / (2.0 ** (bits - 1) - 1.0), MIN_SCALE)


def raw_codes(x: Array, origin: Array, scale: Array, code_min, code_max) -> Array:
    """``clip(round((x - origin) / scale), code_min, code_max)`` as float32 integers.

    The operations of `cpt_jax.formats`' integer grids, so ``raw_codes * scale +
    origin`` is their fake-quantized value bit for bit.

    Example:
      >>> raw_codes(jnp.array([-0.2, 0.4, 9.0]), 0.0, 0.25, 0, 3)
      Array([0., 2., 3.], dtype=float32)
    """
    x = jnp.asarray(x, jnp.float32)
    return jnp.clip(jnp.round((x - origin) / scale), code_min, code_max)


def static_quantize(x: Array, bits: int, kind: str, lo: Array, hi: Array) -> Array:
    """Fake-quantize `x` on the static grid of ``[lo, hi]``: ``raw_codes * s + origin``.

    Equal to ``cpt_jax.quantize(x, bits, fmt)`` when ``[lo, hi]`` is `x`'s own range.

    Example:
      >>> static_quantize(jnp.array([0.1, 0.9, 5.0]), 2, "affine", 0.0, 3.0)
      Array([0., 1., 3.], dtype=float32)
    """
    origin, scale = grid_from_range(kind, bits, lo, hi)
    code_min, code_max, _ = code_bounds(kind, bits)
    return raw_codes(x, origin, scale, code_min, code_max) * scale + origin


def channel_shape(ndim: int, axis: int) -> tuple[int, ...]:
    """The shape that broadcasts a per-channel vector along `axis` of an `ndim` array.

    Example:
      >>> channel_shape(3, 1)
      (1, -1, 1)
    """
    shape = [1] * ndim
    shape[axis] = -1
    return tuple(shape)


def finite_min_max(x: Array, axes=None) -> tuple[Array, Array]:
    """``(min, max)`` over the finite elements of `x` along `axes` (0 where none).

    Example:
      >>> finite_min_max(jnp.array([jnp.nan, -1.0, 2.0, jnp.inf]))
      (Array(-1., dtype=float32), Array(2., dtype=float32))
    """
    finite = jnp.isfinite(x)
    lo = jnp.min(jnp.where(finite, x, jnp.inf), axis=axes)
    hi = jnp.max(jnp.where(finite, x, -jnp.inf), axis=axes)
    ok = jnp.isfinite(lo)
    return jnp.where(ok, lo, 0.0), jnp.where(ok, hi, 0.0)


def kernel_codes(kernel: Array, bits: int, kind: str, channel_axis=-1
                 ) -> tuple[Array, Array, Array]:
    """``(codes int8, scale (C,), offset (C,))`` of a weight, one grid per index of
    `channel_axis` (an axis, a tuple of axes whose indices together make one channel,
    or None: one grid, shape (1,)).

    The codes are `cpt_jax.formats.encode`'s (an `IntCodes`: the grid the training's
    fake quantization decodes, per channel as ``scale_axes`` = the other axes), shifted
    into int8: ``codes - shift`` with ``shift = 2^(b-1)`` (affine) or 0 (symmetric,
    `code_bounds`), ``scale = IntCodes.step()`` (``s / f``), ``offset =
    IntCodes.origin() + shift * scale`` (``origin``: the minimum ``lo_f / f``, 0 for
    symmetric). So ``kernel_q = codes * scale + offset`` (broadcast along
    `channel_axis`) is the training's fake-quantized weight, code for code (its value
    up to float rounding: the shift re-associates ``c s + lo``).

    Example:
      >>> from cpt_jax.formats import AffineInt, quantize
      >>> w = jnp.array([[0.0, -1.0], [3.0, 1.0]])
      >>> c, s, z = kernel_codes(w, 2, "affine", channel_axis=-1)
      >>> c.tolist(), bool(jnp.allclose(c * s + z, quantize(w, 2, AffineInt(-1))))
      ([[-2, -2], [1, 1]], True)
    """
    kernel = jnp.asarray(kernel, jnp.float32)
    fmt_type = formats.AffineInt if kind == "affine" else formats.SymmetricInt
    if channel_axis is None:
        fmt = fmt_type()
    else:
        axes = channel_axis if isinstance(channel_axis, tuple) else (channel_axis,)
        keep = {a % kernel.ndim for a in axes}
        reduce = tuple(d for d in range(kernel.ndim) if d not in keep)
        if not reduce:
            raise ValueError(f"kernel_codes: channel_axis={channel_axis!r} keeps every axis "
                             f"of a kernel of shape {kernel.shape}; nothing to share a grid")
        fmt = fmt_type(scale_axes=reduce)
    int_codes = formats.encode(kernel, bits, fmt)
    _, _, shift = code_bounds(kind, bits)
    scale = int_codes.step()
    return ((int_codes.codes - shift).astype(jnp.int8), scale.reshape(-1),
            (int_codes.origin() + shift * scale).reshape(-1))


def param_channel_axes(operand_shape, channel_axis: int | None, param_shape
                       ) -> tuple[int, ...] | None:
    """The axes of a parameter that make one channel of the product operand derived
    from it (the operand is the parameter itself, its 2-D transpose, or a reshape
    merging the parameter's leading/trailing axes into the channel axis); None
    when the mapping is not one of these.

    Example:
      >>> param_channel_axes((8, 3), 1, (8, 3)), param_channel_axes((3, 8), 1, (8, 3))
      ((1,), (0,))
      >>> param_channel_axes((4, 6), 1, (4, 2, 3))
      (1, 2)
    """
    operand_shape, param_shape = tuple(operand_shape), tuple(param_shape)
    n, c = len(operand_shape), channel_axis % len(operand_shape)
    if operand_shape == param_shape:
        return (c,)
    if n == 2 and operand_shape == param_shape[::-1]:
        return (1 - c,)
    if math.prod(operand_shape) != math.prod(param_shape):
        return None
    size = operand_shape[c]
    if c == n - 1:
        for k in range(1, len(param_shape) + 1):
            if math.prod(param_shape[-k:]) == size:
                return tuple(range(len(param_shape) - k, len(param_shape)))
    if c == 0:
        for k in range(1, len(param_shape) + 1):
            if math.prod(param_shape[:k]) == size:
                return tuple(range(k))
    return None
