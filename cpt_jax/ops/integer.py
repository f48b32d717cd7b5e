"""Integer products: ``op(x_q, W_q)`` and ``op(x_q, y_q)`` computed from int8 codes.

Every grid value is ``v = s c + z`` (`cpt_jax.ops.grids`). For a bilinear ``op`` (a
dot_general or a convolution):

    op(x_q, W_q) = s_x (s_w op(c_x, c_w) + z_w op(c_x, 1_W)) + z_x op(1_x, W_q)

``op(c_x, c_w)``: int8 x int8 accumulated in int32 (`cpt_jax.ops.int8.accumulate_codes`);
``op(c_x, 1_W)``: the activation codes summed under each window; ``op(1_x, W_q)``:
the dequantized weights summed over each window's valid inputs (zero padding stays
exactly zero). Two activations (attention): ``s_x s_y op(c_x, c_y) + s_x z_y op(c_x,
1) + z_x s_y op(1, c_y) + z_x z_y op(1, 1)``.
"""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp
from jax import lax

from cpt_jax.ops.grids import channel_shape, raw_codes
from cpt_jax.ops.int8 import accumulate_codes
from cpt_jax.ops.product_op import ProductOp

Array = jax.Array


INPUT_LEAVES = ("input_scale", "input_origin", "input_code_min", "input_code_max",
                "input_code_shift")
"""Per-layer scalars of the static activation grid (float32)."""


KERNEL_LEAVES = ("kernel_scale", "kernel_offset")
"""Per-output-channel scale and offset of int8 weight codes (float32): ``<param>_scale``
and ``<param>_offset`` beside the parameter (``kernel_scale`` for a ``kernel``)."""


@dataclasses.dataclass(frozen=True)
class ProductLayout:
    """Axes of one product `kind` ("dot_general" or "conv"): `lhs_free` (set to 1 in
    ``1_x``: they do not change the window sums), `lhs_summed` (the input-channel
    axes, summed before ``op(c_x, 1_W)``), `rhs_out` (the kernel's output axes) and
    `out_channel` (the output's channel axis, where the scales broadcast);
    `window_sum` sums a one-channel input over each window (convolutions).
    """

    kind: str
    lhs_free: tuple[int, ...]
    lhs_summed: tuple[int, ...]
    rhs_out: tuple[int, ...]
    out_channel: int
    window_sum: Callable | None = None


def product_layout(op: ProductOp, lhs_shape, rhs_shape) -> ProductLayout:
    """The `ProductLayout` of a dot_general or convolution `ProductOp`."""
    if op.kind == "dot_general":
        (lc, rc), (lb, rb) = op.dimension_numbers
        if lb or rb:
            raise ValueError("export supports dot_general products without batch dimensions")
        return ProductLayout("dot_general", tuple(d for d in range(len(lhs_shape)) if d not in lc),
                             tuple(lc), tuple(d for d in range(len(rhs_shape)) if d not in rc), -1)
    dn = op.dimension_numbers
    if op.feature_group_count != 1 or op.batch_group_count != 1:
        raise ValueError("export supports convolutions without feature or batch groups")
    window_sum = functools.partial(
        _conv_window_sum, kernel_shape=tuple(rhs_shape), window_strides=op.window_strides,
        padding=op.padding, lhs_dilation=op.lhs_dilation, rhs_dilation=op.rhs_dilation, dn=dn)
    return ProductLayout("conv", (dn.lhs_spec[0],), (dn.lhs_spec[1],), (dn.rhs_spec[0],),
                         dn.out_spec[1], window_sum)


def _conv_window_sum(x, *, kernel_shape, window_strides, padding, lhs_dilation, rhs_dilation,
                     dn) -> Array:
    """``conv(x, ones)`` of a one-channel `x` as `lax.reduce_window` (a box sum), in the
    convolution's output layout: XLA's CPU one-channel convolution is 10x slower."""
    n = len(dn.lhs_spec) - 2
    lhs_dil = tuple(lhs_dilation or (1,) * n)
    rhs_dil = tuple(rhs_dilation or (1,) * n)
    window, strides, base, wdil = [1] * x.ndim, [1] * x.ndim, [1] * x.ndim, [1] * x.ndim
    for i in range(n):
        axis = dn.lhs_spec[2 + i]
        window[axis] = kernel_shape[dn.rhs_spec[2 + i]]
        strides[axis], base[axis], wdil[axis] = window_strides[i], lhs_dil[i], rhs_dil[i]
    if isinstance(padding, str):
        dilated_in = [(x.shape[dn.lhs_spec[2 + i]] - 1) * lhs_dil[i] + 1 for i in range(n)]
        dilated_k = [(window[dn.lhs_spec[2 + i]] - 1) * rhs_dil[i] + 1 for i in range(n)]
        padding = lax.padtype_to_pads(dilated_in, dilated_k, window_strides, padding)
    pads = [(0, 0)] * x.ndim
    for i, pad in enumerate(padding):
        pads[dn.lhs_spec[2 + i]] = tuple(pad)
    summed = lax.reduce_window(x, 0.0, lax.add, tuple(window), tuple(strides), tuple(pads),
                               tuple(base), tuple(wdil))
    perm = [0] * x.ndim
    for k in range(x.ndim):
        perm[dn.out_spec[k]] = dn.lhs_spec[k]
    return jnp.transpose(summed, perm)


def _window_sums(x: Array, layout: ProductLayout) -> Array:
    """``op(x, 1_W)``: `x` summed over each window (channels first, then the window)."""
    summed = jnp.sum(x, axis=layout.lhs_summed, keepdims=layout.kind == "conv")
    if layout.kind == "conv":
        return layout.window_sum(summed)
    return jnp.expand_dims(summed, tuple(range(summed.ndim, summed.ndim + len(layout.rhs_out))))


def integer_product(lhs: Array, w_codes: Array, leaves: Mapping[str, Array], op: ProductOp
                    ) -> Array:
    """``op(x_q, W_q)`` from int8 codes (module docstring):

    ``s_x (s_w op(c_x, c_w) + z_w op(c_x, 1_W)) + z_x op(1_x, W_q)``, or without
    ``input_*`` leaves (float activations) ``s_w op(x, c_w) + z_w op(x, 1_W)``.

    Args:
      lhs: the float activation.
      w_codes: the kernel's integer codes (any dtype holding them exactly).
      leaves: the layer's ``kernel_*`` and ``input_*`` arrays (`export_model`).
      op: the product's `ProductOp` (dot_general or conv).

    Returns:
      The product, float32.
    """
    layout = product_layout(op, lhs.shape, w_codes.shape)
    w_codes = w_codes.astype(jnp.float32)
    s_w, z_w = leaves["kernel_scale"], leaves["kernel_offset"]
    if "input_scale" not in leaves:
        y = op.apply(lhs, w_codes)
        shape = channel_shape(y.ndim, layout.out_channel)
        return s_w.reshape(shape) * y + z_w.reshape(shape) * _window_sums(lhs, layout)
    s_x, origin, shift = leaves["input_scale"], leaves["input_origin"], leaves["input_code_shift"]
    x_codes = raw_codes(lhs, origin, s_x, leaves["input_code_min"],
                        leaves["input_code_max"]) - shift
    acc = accumulate_codes(x_codes.astype(jnp.int8), w_codes.astype(jnp.int8), op)
    shape = channel_shape(acc.ndim, layout.out_channel)
    ones_x = jnp.ones(tuple(1 if d in layout.lhs_free else n for d, n in enumerate(lhs.shape)))
    valid_weights = op.apply(ones_x, w_codes * s_w + z_w)
    z_x = origin + shift * s_x
    return (s_x * (s_w.reshape(shape) * acc + z_w.reshape(shape) * _window_sums(x_codes, layout))
            + z_x * valid_weights)


def _input_codes(x: Array, grids: Mapping[str, Array], prefix: str) -> tuple[Array, Array, Array]:
    """``(codes, s, z)`` of `x` on the static grid stored under `prefix` (``input``,
    ``lhs``, ``rhs``): ``x_q = s * codes + z``."""
    s, origin, shift = grids[f"{prefix}_scale"], grids[f"{prefix}_origin"], grids[f"{prefix}_code_shift"]
    codes = raw_codes(x, origin, s, grids[f"{prefix}_code_min"], grids[f"{prefix}_code_max"])
    return codes - shift, s, origin + shift * s


def activation_product(lhs: Array, rhs: Array, grids: Mapping[str, Array], op: ProductOp
                       ) -> Array:
    """``op(x_q, y_q)`` of two activations on static grids (attention's ``q.k`` and
    ``weights.v``), from int8 codes:

    ``s_x s_y op(c_x, c_y) + s_x z_y op(c_x, 1) + z_x s_y op(1, c_y) + z_x z_y op(1, 1)``,
    ``op(c_x, c_y)`` int8 x int8 accumulated in int32.

    Args:
      lhs, rhs: the float activations.
      grids: the product's ``lhs_*`` and ``rhs_*`` grid scalars (`export_model`).
      op: the product's `ProductOp` (an einsum).

    Returns:
      The product, float32.
    """
    c_x, s_x, z_x = _input_codes(lhs, grids, "lhs")
    c_y, s_y, z_y = _input_codes(rhs, grids, "rhs")
    acc = op.apply(c_x.astype(jnp.int8), c_y.astype(jnp.int8),
                   preferred_element_type=jnp.int32).astype(jnp.float32)
    ones_x, ones_y = jnp.ones_like(c_x), jnp.ones_like(c_y)
    return (s_x * s_y * acc + s_x * z_y * op.apply(c_x, ones_y) + z_x * s_y * op.apply(ones_x, c_y)
            + z_x * z_y * op.apply(ones_x, ones_y))
