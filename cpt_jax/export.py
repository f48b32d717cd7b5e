"""Export: a low-precision-trained model as a real integer model in an int8 container.

A quantized ``nn.Dense`` or ``nn.Conv`` product (one whose `quantize_model` rule gives
a `QuantConfig`) computes at ``b`` bits ``y = op(Q(x), Q(W)) + bias``, with ``op`` a
dot_general or a convolution and ``Q`` an integer grid. Every grid value is
``v = s c + z``: an integer code ``c`` that fits int8 for ``2 <= b <= 8``, a scale
``s`` and an offset ``z``:

==============  ================================================  =====================
grid            code ``c``                                        ``s``, ``z``
==============  ================================================  =====================
`AffineInt`     ``clip(round((x - lo)/s), 0, 2^b-1) - 2^(b-1)``   ``s = (hi-lo)/(2^b-1)``,
                                                                  ``z = lo + 2^(b-1) s``
`SymmetricInt`  ``clip(round(x/s), -L, L)``, ``L = 2^(b-1)-1``    ``s = max|x|/L``, ``z = 0``
==============  ================================================  =====================

(``s`` is at least 1e-8, as in `cpt_jax.formats`). Weights get one ``(s, z)`` per
output channel, from the weights themselves: the training's grid, code for code.
Activations get one static ``(s, z)`` per product from a range ``[lo, hi]``: the
run's running activation ranges (`running_ranges`, CPT's evaluation protocol,
``QuantConfig(activation_range="running")``) when it kept them, else `calibrate`
(min and max of the product's activation over training batches, through the
fake-quant model at ``b`` bits), since a deployed model cannot measure a range per
batch. The integer product of a bilinear ``op`` is then (`integer_product`)

    op(x_q, W_q) = s_x (s_w op(c_x, c_w) + z_w op(c_x, 1_W)) + z_x op(1_x, W_q)

``op(c_x, c_w)``: int8 x int8 accumulated in int32; ``op(c_x, 1_W)``: the sums of
the activation codes under each window (channels summed, then a box sum);
``op(1_x, W_q)``: the dequantized weights summed over each window's *valid* inputs
(one example, so zero padding stays exactly zero). XLA's CPU backend has no fast
int8 convolution: there a convolution runs on the same codes held in float32
(every partial sum an integer below 2^24 while ``kh kw C_in * 128^2 < 2^24``, so
equal to int32); dots are int8 everywhere. An ``nn.Embed`` lookup whose table is
quantized stores the table as int8 codes (one grid per row) and gathers dequantized
rows; an attention product (two activations) gets a static grid per operand and an
int8 einsum (`activation_product`).

Everything plugs into the interception seam (`cpt_jax.interception`): `calibrate`
runs the model with a `CalibrationProvider`, `fake_quant_apply` with a
`StaticRangeProvider` (the reference: CPT's fake quantization with the same static
activation grids, `cpt_jax.scaling.quantize_with_range`), `int8_apply` with
`INT8_EXPORT`, which computes every product whose layer holds exported leaves.

Kept in floating point: the products the rules keep in fp32 (the classifier by
default; ``export_model(..., fp32_layers="int8_weights")`` stores their weights as
int8 codes with float activations instead), biases, BatchNorm (kept, not folded:
folding it into the weights before quantization would change the codes the model
was trained on; its inference affine follows the rescale, and XLA fuses the two
into one elementwise pass), and every other op.

Example:
  >>> qmodel = cpt_jax.quantize_model(nn.Sequential([nn.Dense(3)]))
  >>> x = jax.random.normal(jax.random.key(0), (8, 4))
  >>> variables = qmodel.init(jax.random.key(1), x)
  >>> ranges = calibrate(qmodel, variables, [x], bits=8)
  >>> exported = export_model(qmodel, variables, 8, ranges, x)
  >>> exported.variables["params"]["layers_0"]["kernel"].dtype
  dtype('int8')
  >>> y_int8 = int8_apply(exported, x)
  >>> y_ref = fake_quant_apply(qmodel, variables, x, bits=8, ranges=ranges)
  >>> bool(jnp.allclose(y_int8, y_ref, atol=1e-5))
  True
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import math
import os
from typing import Any, Callable, Dict, Iterable, Mapping, Optional, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import serialization, struct, traverse_util
from jax import lax

from cpt_jax.activation_ranges import COLLECTION as RANGES_COLLECTION, range_variable_name
from cpt_jax.context import precision
from cpt_jax.formats import MIN_SCALE, AffineInt, SymmetricInt, quantize
from cpt_jax.int8 import accumulate_codes
from cpt_jax.interception import ACTIVATION, WEIGHT, Operand, Product, ProductOp
from cpt_jax.providers import FakeQuantProvider, operand_quant
from cpt_jax.quant_config import QuantConfig
from cpt_jax.scaling import quantize_with_range
from cpt_jax.transform import QuantizedModel, quantize_model

Array = jax.Array
Ranges = Dict[str, Tuple[float, float]]

MIN_EXPORT_BITS, MAX_EXPORT_BITS = 2, 8
FP32_LAYER_MODES = ("keep", "int8_weights")
EXPORT_FORMAT_VERSION = 2
INPUT_LEAVES = ("input_scale", "input_origin", "input_code_min", "input_code_max",
                "input_code_shift")
"""Per-layer scalars of the static activation grid (float32)."""
KERNEL_LEAVES = ("kernel_scale", "kernel_offset")
"""Per-output-channel scale and offset of int8 weight codes (float32): ``<param>_scale``
and ``<param>_offset`` beside the parameter (``kernel_scale`` for a ``kernel``)."""


# --------------------------------------------------------------------------- checks

def check_export_bits(bits: Any, name: str = "bits") -> int:
    """`bits` as an int in ``[2, 8]`` (the codes' int8 container), else ValueError.

    Example:
      >>> check_export_bits(8.0)
      8
    """
    try:
        value = float(bits)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be an integer in [2, 8], got {bits!r}") from None
    if (not MIN_EXPORT_BITS <= value <= MAX_EXPORT_BITS) or value != int(value):
        raise ValueError(f"{name} must be an integer in [2, 8] (an int8 container), got {bits!r}")
    return int(value)


def _check_quantized_model(qmodel: Any) -> QuantizedModel:
    if not isinstance(qmodel, QuantizedModel):
        raise ValueError("export needs a model from cpt_jax.quantize_model(...), "
                         f"got {type(qmodel).__name__}")
    return qmodel


def grid_kind(fmt: Any, what: str) -> str:
    """``"affine"`` for `AffineInt`, ``"symmetric"`` for `SymmetricInt`, else ValueError.

    Example:
      >>> grid_kind(AffineInt(), "weight")
      'affine'
    """
    if isinstance(fmt, AffineInt):
        return "affine"
    if isinstance(fmt, SymmetricInt):
        return "symmetric"
    raise ValueError(f"export supports AffineInt and SymmetricInt grids; the {what} "
                     f"format is {type(fmt).__name__}")


def layer_bits(bits: int, cfg: QuantConfig, path: str) -> int:
    """The layer's width ``bits + cfg.bits_offset``, checked to fit int8."""
    return check_export_bits(bits + cfg.bits_offset, f"bits of layer {path!r} (bits + bits_offset)")


# --------------------------------------------------------------------------- grids

def code_bounds(kind: str, bits: int) -> Tuple[int, int, int]:
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


def grid_from_range(kind: str, bits: int, lo: Array, hi: Array) -> Tuple[Array, Array]:
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


def _channel_shape(ndim: int, axis: int) -> Tuple[int, ...]:
    shape = [1] * ndim
    shape[axis] = -1
    return tuple(shape)


def _finite_min_max(x: Array, axes) -> Tuple[Array, Array]:
    finite = jnp.isfinite(x)
    lo = jnp.min(jnp.where(finite, x, jnp.inf), axis=axes)
    hi = jnp.max(jnp.where(finite, x, -jnp.inf), axis=axes)
    ok = jnp.isfinite(lo)
    return jnp.where(ok, lo, 0.0), jnp.where(ok, hi, 0.0)


def kernel_codes(kernel: Array, bits: int, kind: str, channel_axis=-1
                 ) -> Tuple[Array, Array, Array]:
    """``(codes int8, scale (C,), offset (C,))`` of a weight, one grid per index of
    `channel_axis` (an axis, a tuple of axes whose indices together make one channel,
    or None: one grid, shape (1,)).

    ``kernel_q = codes * scale + offset`` (broadcast along `channel_axis`) is the
    training's fake-quantized weight, code for code.

    Example:
      >>> w = jnp.array([[0.0, -1.0], [3.0, 1.0]])
      >>> c, s, z = kernel_codes(w, 2, "affine", channel_axis=-1)
      >>> c.tolist(), bool(jnp.allclose(c * s + z, quantize(w, 2, AffineInt(-1))))
      ([[-2, -2], [1, 1]], True)
    """
    kernel = jnp.asarray(kernel, jnp.float32)
    if channel_axis is None:
        keep = ()
    else:
        axes = channel_axis if isinstance(channel_axis, tuple) else (channel_axis,)
        keep = tuple(sorted(a % kernel.ndim for a in axes))
    reduce = tuple(d for d in range(kernel.ndim) if d not in keep) or None
    lo, hi = _finite_min_max(kernel, reduce if keep else None)
    shape = tuple(kernel.shape[d] if d in keep else 1 for d in range(kernel.ndim))
    lo, hi = jnp.reshape(lo, shape), jnp.reshape(hi, shape)
    origin, scale = grid_from_range(kind, bits, lo, hi)
    code_min, code_max, shift = code_bounds(kind, bits)
    codes = raw_codes(kernel, origin, scale, code_min, code_max)
    return ((codes - shift).astype(jnp.int8), scale.reshape(-1),
            (origin + shift * scale).reshape(-1))


def param_channel_axes(operand_shape, channel_axis: Optional[int], param_shape
                       ) -> Optional[Tuple[int, ...]]:
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


# --------------------------------------------------------------------------- products
#
# Everything below plugs into the interception seam (`cpt_jax.interception`): a
# provider computes one `Product` (its path, config, `ProductOp` and Linen module).

SUPPORTED_OPS = ("dot_general", "conv")
"""Products exported with integer weights: dot_generals (any ``@``, einsum, Dense,
attend...) without batch dimensions and convolutions whose right operand is a
weight; embedding lookups (int8 table rows, dequantized); products of two
activations (attention) on two static grids."""


@dataclasses.dataclass(frozen=True)
class ProductLayout:
    """Axes of one product `kind` ("dot_general" or "conv"): `lhs_free` (set to 1 in
    ``1_x``: they do not change the window sums), `lhs_summed` (the input-channel
    axes, summed before ``op(c_x, 1_W)``), `rhs_out` (the kernel's output axes) and
    `out_channel` (the output's channel axis, where the scales broadcast);
    `window_sum` sums a one-channel input over each window (convolutions).
    """

    kind: str
    lhs_free: Tuple[int, ...]
    lhs_summed: Tuple[int, ...]
    rhs_out: Tuple[int, ...]
    out_channel: int
    window_sum: Optional[Callable] = None


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
        shape = _channel_shape(y.ndim, layout.out_channel)
        return s_w.reshape(shape) * y + z_w.reshape(shape) * _window_sums(lhs, layout)
    s_x, origin, shift = leaves["input_scale"], leaves["input_origin"], leaves["input_code_shift"]
    x_codes = raw_codes(lhs, origin, s_x, leaves["input_code_min"],
                        leaves["input_code_max"]) - shift
    acc = accumulate_codes(x_codes.astype(jnp.int8), w_codes.astype(jnp.int8), op)
    shape = _channel_shape(acc.ndim, layout.out_channel)
    ones_x = jnp.ones(tuple(1 if d in layout.lhs_free else n for d, n in enumerate(lhs.shape)))
    valid_weights = op.apply(ones_x, w_codes * s_w + z_w)
    z_x = origin + shift * s_x
    return (s_x * (s_w.reshape(shape) * acc + z_w.reshape(shape) * _window_sums(x_codes, layout))
            + z_x * valid_weights)


def _input_codes(x: Array, grids: Mapping[str, Array], prefix: str) -> Tuple[Array, Array, Array]:
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


def product_key(product: Product) -> str:
    """Where a product's grids and ranges live: its module's path in the variable tree
    plus its name below the module (``"conv1"``, ``"attn/query_key"``, ``"einsum_0"``
    for a product of the root module)."""
    return _leaf_key(product.owner, product.local.replace("/", "_"))


def _grids(flat: Mapping[str, Array], product: Product, names) -> dict:
    prefix = product_key(product)
    return {name: flat[_leaf_key(prefix, name)] for name in names
            if _leaf_key(prefix, name) in flat}


GRID_NAMES = INPUT_LEAVES + tuple(f"{side}_{leaf}" for side in ("lhs", "rhs") for leaf in (
    "scale", "origin", "code_min", "code_max", "code_shift"))


@dataclasses.dataclass(frozen=True, eq=False)
class Int8Provider:
    """Computes every product of an exported model from the exported leaves (`flat`:
    the exported ``params``, flattened with ``/``): `integer_product` when its weight
    has codes, `activation_product` when both operands have static grids, the float
    product elsewhere."""

    flat: Any = None

    def compute(self, product: Product, lhs: Array, rhs: Array, state, apply: Callable) -> Array:
        """The integer product of an exported product, else ``apply(lhs, rhs)``."""
        flat, weight = self.flat, product.rhs.param if product.rhs.role == WEIGHT else None
        if weight is not None and f"{weight}_scale" in flat:
            scale, offset = flat[f"{weight}_scale"], flat[f"{weight}_offset"]
            if product.kind == "lookup":
                shape = _channel_shape(rhs.ndim, 0)
                return apply(lhs, rhs.astype(jnp.float32) * scale.reshape(shape)
                             + offset.reshape(shape))
            leaves = {"kernel_scale": scale, "kernel_offset": offset,
                      **_grids(flat, product, INPUT_LEAVES)}
            return integer_product(lhs, rhs, leaves, product.op).astype(lhs.dtype)
        grids = _grids(flat, product, GRID_NAMES)
        if "lhs_scale" in grids:
            return activation_product(lhs, rhs, grids, product.op).astype(lhs.dtype)
        return apply(lhs, rhs)




def range_key(product: Product, operand: Operand) -> str:
    """The key of an activation operand's range: `product_key` for its left operand,
    ``+ ":rhs"`` for a right activation (the attention products)."""
    key = product_key(product)
    return key if operand is product.lhs else f"{key}:rhs"


CALIBRATION_COLLECTION = "export_calibration"
"""The variable collection where `calibrate` accumulates ``[min, max]`` per activation."""


def _merge_range(module, name: str, lo: Array, hi: Array) -> None:
    if module.has_variable(CALIBRATION_COLLECTION, name):
        old = module.get_variable(CALIBRATION_COLLECTION, name)
        lo, hi = jnp.minimum(old[0], lo), jnp.maximum(old[1], hi)
    module.put_variable(CALIBRATION_COLLECTION, name, jnp.stack([lo, hi]))


@dataclasses.dataclass(frozen=True, eq=False)
class CalibrationProvider(FakeQuantProvider):
    """CPT's fake quantization that accumulates each activation operand's finite
    ``[min, max]`` in the product's module (collection `CALIBRATION_COLLECTION`, named
    as `cpt_jax.activation_ranges.range_variable_name`; carried through ``nn.scan``)."""

    def prepare(self, product: Product, lhs, rhs) -> None:
        """At ``init``: an empty range ``[inf, -inf]`` per activation, so that the
        collection has its final structure before any ``nn.scan`` carries it."""
        module = product.module
        if module is None or not module.is_mutable_collection(CALIBRATION_COLLECTION):
            return
        for operand in (product.lhs, product.rhs):
            name = range_variable_name(product, operand)
            if (operand.role == ACTIVATION and operand_quant(product, operand) is not None
                    and not module.has_variable(CALIBRATION_COLLECTION, name)):
                module.put_variable(CALIBRATION_COLLECTION, name,
                                    jnp.array([jnp.inf, -jnp.inf], jnp.float32))

    def quantize_operand(self, product: Product, operand: Operand, x: Array, bits, state):
        """Accumulate ``(min, max)`` of an activation, then `fake_quant` it."""
        if (operand.role == ACTIVATION and operand_quant(product, operand) is not None
                and product.module is not None):
            lo, hi = _finite_min_max(lax.stop_gradient(jnp.asarray(x, jnp.float32)), None)
            _merge_range(product.module, range_variable_name(product, operand), lo, hi)
        return super().quantize_operand(product, operand, x, bits, state)


CALIBRATION = CalibrationProvider()
"""The provider of `calibrate`."""


def range_key_of_variable(key: str) -> Optional[str]:
    """The `range_key` of a range variable at flat path `key` (its module's path and
    `cpt_jax.activation_ranges.range_variable_name`), None for another leaf.

    Example:
      >>> range_key_of_variable("conv1/lhs"), range_key_of_variable("attn/query_key_rhs")
      ('conv1', 'attn/query_key:rhs')
    """
    module, _, name = key.rpartition("/")
    if name not in ("lhs", "rhs") and not name.endswith(("_lhs", "_rhs")):
        return None
    below, side = name[:-4] if len(name) > 3 else "", name[-3:]
    path = "/".join(p for p in (module, below) if p)
    return path if side == "lhs" else f"{path}:rhs"


def _ranges_of_collection(collection) -> Ranges:
    """``{range_key: (lo, hi)}`` from the calibration collection's variables."""
    flat = traverse_util.flatten_dict(dict(collection), sep="/")
    out = {}
    for key, value in flat.items():
        if not float(value[0]) <= float(value[1]):
            continue  # never computed
        out[range_key_of_variable(key)] = (float(value[0]), float(value[1]))
    return dict(sorted(out.items()))


@dataclasses.dataclass(frozen=True, eq=False)
class StaticRangeProvider(FakeQuantProvider):
    """CPT's fake quantization with each activation on the grid of a given range
    (`cpt_jax.scaling.quantize_with_range`, as the running-range evaluation)."""

    ranges: Any = None

    def quantize_operand(self, product: Product, operand: Operand, x: Array, bits, state):
        """Activations on the static grid of ``ranges[product.path]``; weights as CPT."""
        tq = operand_quant(product, operand)
        if operand.role != ACTIVATION or tq is None:
            return super().quantize_operand(product, operand, x, bits, state)
        key = range_key(product, operand)
        if key not in self.ranges:
            raise ValueError(f"no activation range for product {key!r}; calibrate first")
        lo, hi = self.ranges[key]
        return quantize_with_range(x, lo, hi, bits, tq.fmt)


def with_provider(qmodel: QuantizedModel, provider, rules=None, config=None) -> QuantizedModel:
    """`qmodel` (same model, rules and default config unless given) with `provider`."""
    env = _check_quantized_model(qmodel).cpt_interception
    return quantize_model(qmodel, env.rules if rules is None else rules,
                          env.config if config is None else config, provider=provider)


# --------------------------------------------------------------------------- calibration

def calibrate(qmodel: QuantizedModel, variables: Mapping, batches: Iterable[Any], bits,
              **apply_kwargs) -> Ranges:
    """Static activation ranges: ``[lo, hi]`` of each quantized product's activation.

    ``lo = min_batches min(x)``, ``hi = max_batches max(x)`` (finite values), with
    the model run as the fake-quant model at `bits` (the training's forward, ranges
    per batch).

    Args:
      qmodel: the model from `cpt_jax.quantize_model`.
      variables: its trained variables (``params``, ``batch_stats``, ...).
      batches: model inputs (e.g. a few training batches' ``"inputs"``).
      bits: the export width, 2..8.
      **apply_kwargs: passed to ``apply`` (e.g. ``train=False``).

    Returns:
      ``{range_key: (lo, hi)}``: the product's path (a right-hand activation, as in
      attention: ``path + ":rhs"``).
    """
    bits = check_export_bits(bits)
    model = with_provider(qmodel, CALIBRATION)

    @jax.jit
    def run(variables, inputs):
        with precision(bits):
            _, updates = model.apply(variables, inputs, mutable=[CALIBRATION_COLLECTION],
                                     **apply_kwargs)
        return updates.get(CALIBRATION_COLLECTION, {})

    batches = iter(batches)
    first = next(batches, None)
    if first is None:
        raise ValueError("calibrate needs at least one batch of inputs")
    init = jax.jit(lambda x: model.init(jax.random.key(0), x, **apply_kwargs))(first)
    collection = init.get(CALIBRATION_COLLECTION, {})
    variables = {k: v for k, v in dict(variables).items() if k != CALIBRATION_COLLECTION}
    for inputs in itertools.chain([first], batches):
        collection = run({**variables, CALIBRATION_COLLECTION: collection}, inputs)
    return _ranges_of_collection(jax.device_get(collection))


def running_ranges(variables: Mapping) -> Ranges:
    """The ranges of a run trained with ``activation_range="running"``:
    ``{range_key: (zero_point, zero_point + range)}`` of each running range."""
    collection = serialization.to_state_dict(dict(variables.get(RANGES_COLLECTION, {})))
    flat = traverse_util.flatten_dict(collection, sep="/")
    out = {}
    for key, value in flat.items():
        path, _, leaf = key.rpartition("/")
        name = range_key_of_variable(path) if leaf == "zero_point" else None
        if name is not None:
            zp = float(value)
            out[name] = (zp, zp + float(flat[f"{path}/range"]))
    return dict(sorted(out.items()))


# --------------------------------------------------------------------------- export

@struct.dataclass
class ExportedModel:
    """A model with integer kernels: the Linen `model` (float or quantized: only its
    class and fields are used), its exported `variables` and the export width `bits`.
    A pytree (variables are its leaves), so ``jax.jit(int8_apply)(exported, x)`` works.

    In ``variables["params"]`` each exported layer's ``kernel`` holds int8 codes, beside
    ``kernel_scale``/``kernel_offset`` (per output channel) and, unless its activations
    stay float, the ``input_*`` scalars of its static activation grid.
    """

    variables: Any
    model: nn.Module = struct.field(pytree_node=False)
    bits: int = struct.field(pytree_node=False)

    def layers(self) -> Tuple[str, ...]:
        """The exported products' keys (static activation grids) and the modules
        holding int8 weights (``"conv1"``, ``"attn/query_key"``)."""
        flat = traverse_util.flatten_dict(dict(self.variables.get("params", {})), sep="/")
        keys = set()
        for key in flat:
            owner, _, leaf = key.rpartition("/")
            if leaf in ("input_scale", "lhs_scale") or (
                    leaf.endswith("_scale") and f"{key[:-len('_scale')]}_offset" in flat):
                keys.add(owner)
        return tuple(sorted(k for k in keys if k))


def _leaf_key(path: str, name: str) -> str:
    return "/".join(p for p in (path, name) if p)


def _grid_leaves(prefix: str, side: str, fmt, bits: int, lo: float, hi: float) -> dict:
    """The static grid of one activation: ``<prefix>/<side>_scale``, ``_origin``, code
    bounds and shift (``side`` ``input`` for a weight product's activation)."""
    kind = grid_kind(fmt, f"activation of {prefix!r}")
    origin, scale = grid_from_range(kind, bits, lo, hi)
    code_min, code_max, shift = code_bounds(kind, bits)
    values = {"scale": scale, "origin": origin, "code_min": jnp.float32(code_min),
              "code_max": jnp.float32(code_max), "code_shift": jnp.float32(shift)}
    return {_leaf_key(prefix, f"{side}_{name}"): v for name, v in values.items()}


def _range(ranges: Ranges, key: str) -> Tuple[float, float]:
    if key not in ranges:
        raise ValueError(f"no activation range for product {key!r}; calibrate first")
    return ranges[key]


def _weight_leaves(record, flat, cfg: QuantConfig, bits: int) -> dict:
    """The weight of a product as int8 codes, with its per-channel scale and offset."""
    product = record.product
    param = product.rhs.param
    if cfg.weight is None:
        raise ValueError(f"product {product.path!r} has no weight quantizer; export needs one")
    kind = grid_kind(cfg.weight.fmt, f"weight of product {product.path!r}")
    axes = None
    if getattr(cfg.weight.fmt, "channel_axis", None) is not None:
        axes = param_channel_axes(record.rhs_shape, product.rhs.channel_axis, flat[param].shape)
        if axes is None:
            raise ValueError(f"product {product.path!r}: cannot map its weight's channel axis "
                             f"onto parameter {param!r}; keep it in fp32 with a rule")
    codes, scale, offset = kernel_codes(flat[param], bits, kind, axes)
    return {param: codes, f"{param}_scale": scale, f"{param}_offset": offset}


def _check_exportable(product: Product) -> None:
    if product.lhs.role == WEIGHT and product.rhs.role != WEIGHT:
        raise ValueError(f"product {product.path!r} has its weight on the left; export "
                         "expects it on the right (x @ w), or keep it in fp32 with a rule")
    if product.kind == "lookup":
        return
    if product.op is None or product.op.kind not in SUPPORTED_OPS:
        raise ValueError(f"product {product.path!r} ({product.kind}) is quantized; export "
                         f"handles {SUPPORTED_OPS} products and embedding lookups (keep it "
                         "in fp32 with a rule)")


def _product_leaves(record, flat, bits: int, ranges: Ranges, fp32_layers: str) -> dict:
    """The exported leaves of one product (none when it stays as it is)."""
    product, cfg = record.product, record.product.config
    has_weight = product.rhs.role == WEIGHT and product.rhs.param in flat
    if cfg is None:
        if fp32_layers == "keep" or not has_weight or product.kind == "lookup":
            return {}
        _check_exportable(product)
        return _weight_leaves(record, flat, QuantConfig(activation=None), 8)
    _check_exportable(product)
    width, prefix = layer_bits(bits, cfg, product.path), product_key(product)
    if not has_weight:
        if cfg.activation is None:
            raise ValueError(f"product {product.path!r} of two activations needs an "
                             "activation quantizer")
        return {**_grid_leaves(prefix, "lhs", cfg.activation.fmt, width,
                               *_range(ranges, prefix)),
                **_grid_leaves(prefix, "rhs", cfg.activation.fmt, width,
                               *_range(ranges, f"{prefix}:rhs"))}
    leaves = _weight_leaves(record, flat, cfg, width)
    if cfg.activation is not None and product.kind != "lookup":
        leaves.update(_grid_leaves(prefix, "input", cfg.activation.fmt, width,
                                   *_range(ranges, prefix)))
    return leaves


def export_model(qmodel: QuantizedModel, variables: Mapping, bits, ranges: Ranges,
                 sample_inputs: Any, *, fp32_layers: str = "keep", **apply_kwargs
                 ) -> ExportedModel:
    """The integer model: int8 weight codes + per-channel scales + static input grids.

    Every quantized product whose right operand is a weight (a parameter, or its
    transpose/reshape: ``nn.Dense``, ``nn.Conv``, ``x @ w``, ``jnp.einsum`` on
    ``self.param``s, a tied ``attend``) at ``b = bits + bits_offset`` gets its
    parameter ``w`` replaced by int8 codes, ``w_q = codes * w_scale + w_offset``
    (``<param>_scale``/``_offset`` beside it, per output channel), and its activation
    the static grid of ``ranges[product_key]`` (``input_*`` leaves under the product's
    key); a product of two activations (attention) gets both grids (``lhs_*``,
    ``rhs_*``); an embedding lookup stores its table as codes. Products kept in
    fp32 stay fp32 (`fp32_layers` ``"keep"``) or get int8 weight codes (8-bit
    affine, per channel) with float activations (``"int8_weights"``). A parameter
    shared by several products (a tied embedding) gets the codes of the first.
    Every other variable (biases, BatchNorm) is unchanged; the running
    ``activation_ranges`` collection, now in the input grids, is dropped.

    Args:
      qmodel: the model from `cpt_jax.quantize_model`.
      variables: its trained variables.
      bits: the export width, 2..8 (ValueError otherwise).
      ranges: from `calibrate` or `running_ranges`.
      sample_inputs: inputs of the model (shapes only: its products are traced).
      fp32_layers: ``"keep"`` or ``"int8_weights"``.
      **apply_kwargs: passed to ``apply`` (e.g. ``train=False``).

    Returns:
      An `ExportedModel`; run it with `int8_apply`.
    """
    from cpt_jax.cost import count_ops
    qmodel = _check_quantized_model(qmodel)
    bits = check_export_bits(bits)
    if fp32_layers not in FP32_LAYER_MODES:
        raise ValueError(f"fp32_layers must be one of {FP32_LAYER_MODES}, got {fp32_layers!r}")
    flat = traverse_util.flatten_dict(serialization.to_state_dict(dict(variables["params"])),
                                      sep="/")
    out, written = dict(flat), set()
    for record in count_ops(qmodel, variables, sample_inputs, **apply_kwargs):
        for key, value in _product_leaves(record, flat, bits, ranges, fp32_layers).items():
            if key not in written:  # a shared parameter keeps its first product's codes
                out[key] = value
                written.add(key)
    # The running ranges live on in the input grids: the collection is not exported.
    exported = {k: v for k, v in dict(variables).items() if k != RANGES_COLLECTION}
    exported["params"] = traverse_util.unflatten_dict(out, sep="/")
    return ExportedModel(variables=exported, model=qmodel, bits=bits)


def int8_apply(exported: ExportedModel, inputs: Any, **apply_kwargs) -> Any:
    """Run the exported model: integer products (`integer_product`) in every exported
    layer, the model's float ops elsewhere.

    Equal to `fake_quant_apply` with the ranges it was exported from, up to float
    rounding. Jittable: ``jax.jit(int8_apply)(exported, x)``.

    Args:
      exported: from `export_model` or `restore_exported`.
      inputs: the model's inputs.
      **apply_kwargs: passed to ``apply`` (e.g. ``train=False``).

    Returns:
      The model's outputs.
    """
    if not any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree_util.tree_leaves(
            (exported, inputs))):   # weights are found through their traced producers
        return jax.jit(functools.partial(int8_apply, **apply_kwargs))(exported, inputs)
    flat = traverse_util.flatten_dict(serialization.to_state_dict(
        dict(exported.variables.get("params", {}))), sep="/")
    model = quantize_model(exported.model, rules=(), config=QuantConfig(),
                           provider=Int8Provider(flat))
    with precision(exported.bits):
        return model.apply(exported.variables, inputs, **apply_kwargs)


def fake_quant_apply(qmodel: QuantizedModel, variables: Mapping, inputs: Any, *, bits,
                     ranges: Ranges, **apply_kwargs) -> Any:
    """The trained fake-quant model at `bits` with static activation grids.

    Every quantized product computes ``op(Q_[lo,hi](x), Q_b(W))``: the weight through
    `cpt_jax.fake_quant` (the training's quantizer), the activation on the grid of
    ``ranges[path]`` (`cpt_jax.scaling.quantize_with_range`, as the running-range
    evaluation does). The reference of `int8_apply`.

    Args:
      qmodel: the model from `cpt_jax.quantize_model`.
      variables: its trained variables.
      inputs: the model's inputs.
      bits: the width, 2..8.
      ranges: from `calibrate` or `running_ranges` (values may be traced).
      **apply_kwargs: passed to ``apply``.

    Returns:
      The model's outputs.
    """
    bits = check_export_bits(bits)
    model = with_provider(qmodel, StaticRangeProvider(ranges=ranges))
    with precision(bits):
        return model.apply(variables, inputs, **apply_kwargs)


# --------------------------------------------------------------------------- storage

def param_bytes(tree: Any) -> int:
    """``sum(leaf.nbytes)`` over a pytree of arrays (an `ExportedModel`: its variables).

    Example:
      >>> param_bytes({"w": jnp.zeros((4, 4)), "c": jnp.zeros(4, jnp.int8)})
      68
    """
    if isinstance(tree, ExportedModel):
        tree = tree.variables
    return int(sum(np.asarray(leaf).nbytes for leaf in jax.tree_util.tree_leaves(tree)))


def to_numpy_dict(exported: ExportedModel) -> Dict[str, np.ndarray]:
    """A flat dict of numpy arrays any code can read (``np.savez`` it).

    Keys: ``"bits"``, ``"format_version"`` and ``"variables/<collection>/<path>/<leaf>"``,
    e.g. ``"variables/params/conv1/kernel"`` (int8 codes).
    """
    state = serialization.to_state_dict(jax.device_get(dict(exported.variables)))
    flat = traverse_util.flatten_dict(state, sep="/")
    arrays = {f"variables/{k}": np.asarray(v) for k, v in flat.items()}
    arrays["bits"] = np.asarray(exported.bits, np.int32)
    arrays["format_version"] = np.asarray(EXPORT_FORMAT_VERSION, np.int32)
    return arrays


def from_numpy_dict(arrays: Mapping[str, Any], model: nn.Module) -> ExportedModel:
    """The `ExportedModel` of `to_numpy_dict`'s arrays (or a loaded ``.npz``) and `model`."""
    if "bits" not in arrays or "format_version" not in arrays:
        raise ValueError("not an exported model: the arrays lack 'bits' and 'format_version'")
    version = int(np.asarray(arrays["format_version"]))
    if version != EXPORT_FORMAT_VERSION:
        raise ValueError(f"exported model format_version={version}; this cpt_jax reads "
                         f"{EXPORT_FORMAT_VERSION}")
    flat = {k[len("variables/"):]: jnp.asarray(np.asarray(v)) for k, v in arrays.items()
            if k.startswith("variables/")}
    variables = traverse_util.unflatten_dict(flat, sep="/")
    return ExportedModel(variables=variables, model=model,
                         bits=check_export_bits(int(np.asarray(arrays["bits"]))))


def save_exported(directory: str, exported: ExportedModel) -> str:
    """Save with orbax (``directory/model``) plus ``directory/export.npz``
    (`to_numpy_dict`) and ``directory/export_meta.json``; returns `directory`."""
    import orbax.checkpoint as ocp

    directory = os.path.abspath(os.path.expanduser(directory))
    os.makedirs(directory, exist_ok=True)
    arrays = to_numpy_dict(exported)
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(os.path.join(directory, "model"), arrays, force=True)
        checkpointer.wait_until_finished()
    np.savez(os.path.join(directory, "export.npz"), **arrays)
    meta = {"bits": exported.bits, "format_version": EXPORT_FORMAT_VERSION,
            "layers": list(exported.layers()), "param_bytes": param_bytes(exported)}
    with open(os.path.join(directory, "export_meta.json"), "w") as f:
        json.dump(meta, f, indent=2)
    return directory


def restore_exported(directory: str, model: nn.Module) -> ExportedModel:
    """The `ExportedModel` saved by `save_exported` in `directory`, for `model`
    (the float Linen model it was exported from)."""
    import orbax.checkpoint as ocp

    path = os.path.join(os.path.abspath(os.path.expanduser(directory)), "model")
    if not os.path.isdir(path):
        raise ValueError(f"no exported model in {directory!r} (expected {path})")
    with ocp.StandardCheckpointer() as checkpointer:
        arrays = checkpointer.restore(path)
    return from_numpy_dict(arrays, model)
