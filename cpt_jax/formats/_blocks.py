"""The hardware formats' parts: elements, block scales and the view they live in.

`OCPFloat` is the element cast itself; `MX` shares an E8M0 exponent per block
(`mx_shared_exponent`); `NVFP4` has E4M3 block scales under an fp32 tensor scale
(`nvfp4_view`, `nvfp4_parts`); `ScaledFloat` has fp32 scales per tensor, row, tile or
block. Each ``*_parts`` returns what real low-precision products store, and
``restore(elements * scale)`` is `quantize`'s result (``*_grid``). The formats
themselves (`_hardware`) call these; they read a format's fields only.
"""
from __future__ import annotations

from typing import Any, TypeAlias

import jax
import jax.numpy as jnp

from cpt_jax.formats._elements import (
    ELEMENTS,
    MX_FLOAT_BY_BITS,
    float_elements,
    floor_log2,
    mul_pow2,
    pow2,
)
from cpt_jax.formats._rounding import round_to_integer
from cpt_jax.formats._scaling import block_view, fp_scale, masked_absmax, normal_axis

Array = jax.Array
MX: TypeAlias = Any
NVFP4: TypeAlias = Any
OCPFloat: TypeAlias = Any
ScaledFloat: TypeAlias = Any
"""The formats these parts compute (`cpt_jax.formats.MX`, ...): their modules import this
one, so it names them without importing them (no import cycle, not even for types)."""


def mx_element_params(fmt: MX, bits: Array) -> tuple:
    """``(kind, man_bits, emin, largest, emax)`` of `fmt`'s element at `bits` (traceable).

    `kind` is ``"float"`` or ``"int"``; for ``"int"`` the parameters are
    ``(2^(b-2) units, levels 2^(b-1)-1)`` in place of (man_bits, emin) and largest
    is unused. ``MX("float")`` selects e4m3/e2m3/e2m1 with `jnp.where` on `bits`.
    """
    if fmt.element in ELEMENTS:
        spec = ELEMENTS[fmt.element]
        return "float", float(spec.man_bits), float(spec.emin), spec.largest, float(spec.emax)
    if fmt.element in ("int8", "int"):
        b = jnp.float32(8.0) if fmt.element == "int8" else jnp.asarray(bits, jnp.float32)
        return "int", b - 2.0, pow2(b - 1.0) - 1.0, None, 0.0
    params = [(ELEMENTS[name].man_bits, ELEMENTS[name].emin, ELEMENTS[name].largest,
               ELEMENTS[name].emax) for _, name in MX_FLOAT_BY_BITS]
    (m8, n8, l8, x8), (m6, n6, l6, x6), (m4, n4, l4, x4) = params
    b = jnp.asarray(bits, jnp.float32)

    def pick(v8, v6, v4):
        return jnp.where(b >= 8, float(v8), jnp.where(b >= 6, float(v6), float(v4)))

    return "float", pick(m8, m6, m4), pick(n8, n6, n4), pick(l8, l6, l4), pick(x8, x6, x4)


def mx_shared_exponent(amax: Array, fmt: MX, largest, emax) -> Array:
    """The E8M0 exponent of each block, ``clip(e, -127, 127)`` (0 for an all-zero block).

    ``fmt.scale_rounding == "floor"`` (OCP): ``e = floor(log2 amax) - emax``;
    ``"up"`` (JAX, cuDNN): ``e = ceil(log2(amax / largest))``.

    Example:
      >>> from cpt_jax.formats import MX
      >>> a = jnp.array([500.0, 448.0, 0.0])
      >>> [mx_shared_exponent(a, MX(scale_rounding=r), 448.0, 8.0).tolist() for r in ("floor", "up")]
      [[0.0, 0.0, 0.0], [1.0, 0.0, 0.0]]
    """
    positive = amax > 0
    if fmt.scale_rounding == "up":
        ratio = jnp.where(positive, amax / largest, 1.0)
        e = floor_log2(ratio)
        shared = jnp.where(mul_pow2(jnp.ones_like(ratio), e) < ratio, e + 1.0, e)
        shared = jnp.where(positive, shared, 0.0)
    else:
        shared = jnp.where(positive, floor_log2(jnp.where(positive, amax, 1.0)) - emax, 0.0)
    return jnp.clip(shared, -127.0, 127.0)


def mx_parts(x: Array, bits, fmt: MX, rounding: str = "nearest",
             key: Array | None = None) -> tuple:
    """`MX` as its parts: ``quantize(x) == restore(elements * 2^shared)``.

    Args:
      x: float32 array.
      bits: the width (read by ``MX("int")`` / ``MX("float")``).
      fmt: the `MX` format (blocks along ``fmt.axis``).
      rounding, key: as `quantize`.

    Returns:
      ``(elements, shared, restore)``: the element values in the block view of
      `block_view` (float32, each exactly an element of the grid), the E8M0
      exponent of each block (broadcastable to `elements`) and ``restore``, which
      maps a block view back to the shape of `x`.

    Example:
      >>> from cpt_jax.formats import MX
      >>> e, shared, restore = mx_parts(jnp.array([3.0, 0.26]), 4, MX("e2m1", block_size=2))
      >>> e.tolist(), shared.tolist()
      ([[6.0, 0.5]], [[-1.0]])
    """
    view, inner, restore = block_view(x, [(normal_axis(x.ndim, fmt.axis, "MX.axis"),
                                           fmt.block_size)])
    kind, p1, p2, largest, emax = mx_element_params(fmt, bits)
    shared = mx_shared_exponent(masked_absmax(view, inner), fmt, largest, emax)
    v = mul_pow2(view, -shared)
    if kind == "int":
        elem = mul_pow2(jnp.clip(round_to_integer(mul_pow2(v, p1), rounding, key), -p2, p2), -p1)
    else:
        elem = float_elements(v, p1, p2, largest, rounding, key)
    return elem, shared, restore


def mx_grid(x, bits, fmt: MX, rounding, key):
    """`MX`'s grid: ``restore(elements * 2^shared)`` of `mx_parts`."""
    elem, shared, restore = mx_parts(x, bits, fmt, rounding, key)
    return restore(mul_pow2(elem, shared))


def ocp_grid(x, bits, fmt: OCPFloat, rounding, key):
    """`OCPFloat`'s grid: the saturating element cast."""
    spec = fmt.spec
    return float_elements(x, float(spec.man_bits), float(spec.emin), spec.largest, rounding, key)


def nvfp4_view(x: Array, fmt: NVFP4) -> tuple:
    """`block_view` of `x` in NVFP4 blocks: 16 along ``fmt.axis``, or 16 x 16 with
    ``fmt.block_2d`` (along ``fmt.other_axis``, default the last other axis).

    Example:
      >>> from cpt_jax.formats import NVFP4
      >>> x = jnp.zeros((32, 48))
      >>> nvfp4_view(x, NVFP4(axis=0))[0].shape, nvfp4_view(x, NVFP4(axis=0, block_2d=True))[0].shape
      ((48, 2, 16), (3, 16, 2, 16))
    """
    axis = normal_axis(x.ndim, fmt.axis, "NVFP4.axis")
    if not fmt.block_2d or x.ndim < 2:
        return block_view(x, [(axis, 16)])
    if fmt.other_axis is None:
        other = [d for d in range(x.ndim) if d != axis][-1]
    else:
        other = normal_axis(x.ndim, fmt.other_axis, "NVFP4.other_axis")
    if other == axis:
        raise ValueError(f"NVFP4.other_axis must differ from axis, got {fmt.other_axis}")
    return block_view(x, [(other, 16), (axis, 16)])


def nvfp4_parts(x: Array, fmt: NVFP4, rounding: str = "nearest",
                key: Array | None = None) -> tuple:
    """`NVFP4` as its parts: ``quantize(x) == restore(elements * (s_b / s_t))``.

    Args:
      x: float32 array.
      fmt: the `NVFP4` format.
      rounding, key: as `quantize` (the elements' rounding).

    Returns:
      ``(elements, s_b, s_t, restore)``: e2m1 element values in the block view
      (`nvfp4_view`), the E4M3 block scales (float32 values, broadcastable to
      `elements`), the fp32 tensor scale ``s_t = 448 * 6 / amax`` (a scalar) and
      ``restore`` (block view -> the shape of `x`).

    Example:
      >>> from cpt_jax.formats import NVFP4
      >>> e, s_b, s_t, restore = nvfp4_parts(jnp.array([6.0, 1.1, -0.4, 0.0]), NVFP4())
      >>> e[0, :4].tolist(), float(s_b[0, 0]), float(s_t)
      ([6.0, 1.0, -0.5, 0.0], 448.0, 448.0)
    """
    e4m3, e2m1 = ELEMENTS["e4m3"], ELEMENTS["e2m1"]
    view, inner, restore = nvfp4_view(x, fmt)
    amax_t = masked_absmax(x, None)
    # The tensor scale is capped at 2^127: below amax ~ 1.6e-35 it would overflow to inf.
    s_t = jnp.where(amax_t > 0, jnp.minimum((e4m3.largest * e2m1.largest)
                                            / jnp.where(amax_t > 0, amax_t, 1.0), 2.0 ** 127),
                    1.0).reshape(())
    s_b = float_elements(masked_absmax(view, inner) / e2m1.largest * s_t,
                         float(e4m3.man_bits), float(e4m3.emin), e4m3.largest)
    scale = s_b / s_t
    v = jnp.where(scale > 0, view / jnp.where(scale > 0, scale, 1.0), 0.0)
    elem = float_elements(v, float(e2m1.man_bits), float(e2m1.emin), e2m1.largest, rounding, key)
    return elem, s_b, s_t, restore


def nvfp4_grid(x, bits, fmt: NVFP4, rounding, key):
    """`NVFP4`'s grid: ``restore(elements * s_b / s_t)`` of `nvfp4_parts`."""
    elem, s_b, s_t, restore = nvfp4_parts(x, fmt, rounding, key)
    return restore(elem * (s_b / s_t))


def scaled_groups(x, fmt: ScaledFloat) -> tuple:
    """``(view, reduced axes, restore)``: the groups one `ScaledFloat` scale covers."""
    if fmt.granularity == "tensor":
        return x, tuple(range(x.ndim)) or None, lambda v: v
    axis = normal_axis(x.ndim, fmt.axis, "ScaledFloat.axis")
    if fmt.granularity == "row":
        return x, (axis,), lambda v: v
    if fmt.granularity == "tile":
        return block_view(x, [(axis, fmt.tile)])
    others = [d for d in range(x.ndim) if d != axis]
    if fmt.other_axis is not None:
        other = normal_axis(x.ndim, fmt.other_axis, "ScaledFloat.other_axis")
    elif others:
        other = others[-1]
    else:
        return block_view(x, [(axis, fmt.tile)])
    if other == axis:
        raise ValueError(f"ScaledFloat.other_axis must differ from axis, got {fmt.other_axis}")
    return block_view(x, [(other, fmt.tile), (axis, fmt.tile)])


def scaled_float_parts(x: Array, fmt: ScaledFloat, rounding: str = "nearest",
                       key: Array | None = None) -> tuple:
    """`ScaledFloat` as its parts: ``quantize(x) == restore(elements * scale)``.

    Returns:
      ``(elements, scale, restore)``: the element values in the group view (the
      tensor, rows along ``fmt.axis``, or `block_view`'s tiles / blocks), the fp32
      scale ``amax / largest`` of each group (broadcastable) and ``restore``.

    Example:
      >>> from cpt_jax.formats import ScaledFloat
      >>> e, scale, restore = scaled_float_parts(jnp.array([896.0, 1.0]), ScaledFloat("e4m3"))
      >>> e.tolist(), scale.tolist()
      ([448.0, 0.5], [2.0])
    """
    spec = fmt.spec
    view, inner, restore = scaled_groups(x, fmt)
    scale = fp_scale(masked_absmax(view, inner), spec.largest)
    elem = float_elements(view / scale, float(spec.man_bits), float(spec.emin), spec.largest,
                          rounding, key)
    return elem, scale, restore


def scaled_float_grid(x, bits, fmt: ScaledFloat, rounding, key):
    """`ScaledFloat`'s grid: ``restore(elements * scale)`` of `scaled_float_parts`."""
    elem, scale, restore = scaled_float_parts(x, fmt, rounding, key)
    return restore(elem * scale)


__all__ = ["mx_element_params", "mx_grid", "mx_parts", "mx_shared_exponent", "nvfp4_grid",
           "nvfp4_parts", "nvfp4_view", "ocp_grid", "scaled_float_grid", "scaled_float_parts",
           "scaled_groups"]
