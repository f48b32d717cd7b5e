"""Export: a low-precision-trained model as a real integer model in an int8 container.

A quantized layer (an ``nn.Dense`` or ``nn.Conv`` whose `QuantizedModel` rule gives a
`QuantConfig`) computes at ``b`` bits ``y = op(Q(x), Q(W)) + bias``, with ``op`` a
dot_general or a convolution and ``Q`` an integer grid. Every grid value is
``v = s c + z``: an integer code ``c`` that fits int8 for ``2 <= b <= 8``, a scale
``s`` and an offset ``z``:

==============  ============================================  ===================
grid            code ``c``                                    ``s``, ``z``
==============  ============================================  ===================
`AffineInt`     ``clip(round((x - lo)/s), 0, 2^b-1) - 2^(b-1)``  ``s = (hi-lo)/(2^b-1)``,
                                                              ``z = lo + 2^(b-1) s``
`SymmetricInt`  ``clip(round(x/s), -L, L)``, ``L = 2^(b-1)-1``  ``s = max|x| / L``, ``z = 0``
==============  ============================================  ===================

(``s`` is at least 1e-8, as in `cpt_jax.formats`). Weights get one ``(s, z)`` per
output channel, from the weights themselves: the training's grid, code for code.
Activations get one static ``(s, z)`` per layer from a range ``[lo, hi]``
(`calibrate`: min and max of the layer's input over training batches, through the
fake-quant model at ``b`` bits), since a deployed model cannot measure a range per
batch. The integer product of a bilinear ``op`` is then

    op(x_q, W_q) = s_x (s_w op(c_x, c_w) + z_w op(c_x, 1_W)) + z_x op(1_x, W_q)

``op(c_x, c_w)``: int8 x int8 accumulated in int32; ``op(c_x, 1_W)``: the sums of
the activation codes under each window (a one-channel product); ``op(1_x, W_q)``:
the dequantized weights summed over each window's *valid* inputs (one example, so
zero padding stays exactly zero). XLA's CPU backend has no fast int8 convolution:
there the convolution runs on the same codes held in float32 (every partial sum an
integer below 2^24 while ``kh kw C_in * 128^2 < 2^24``, so equal to int32); dots
are int8 everywhere.

What is kept in floating point: the layers the rules keep in fp32 (the classifier,
by default; `export_model(..., fp32_layers="int8_weights")` stores their weights as
int8 codes with float activations instead), biases, BatchNorm (kept, not folded:
folding it into the weights before quantization would change the codes the model
was trained on; its inference affine follows the rescale and XLA fuses the two into
one elementwise pass) and every non-product op.

`fake_quant_apply` evaluates the trained fake-quant model with the *same* static
activation ranges: the reference the integer model equals up to float rounding.

Example:
  >>> qmodel = cpt_jax.quantize_model(nn.Dense(3))
  >>> x = jax.random.normal(jax.random.key(0), (8, 4))
  >>> variables = qmodel.init(jax.random.key(1), x)
  >>> ranges = calibrate(qmodel, variables, [x], bits=8)
  >>> exported = export_model(qmodel, variables, 8, ranges)
  >>> exported.variables["params"]["kernel"].dtype
  dtype('int8')
  >>> y_int8 = int8_apply(exported, x)
  >>> y_ref = fake_quant_apply(qmodel, variables, x, bits=8, ranges=ranges)
  >>> bool(jnp.allclose(y_int8, y_ref, atol=1e-5))
  True
"""
from __future__ import annotations

import dataclasses
import functools
import json
import os
import threading
from typing import Any, Callable, Dict, Iterable, Mapping, Optional, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import struct, traverse_util
from jax import lax

from cpt_jax.fake_quant import fake_quant
from cpt_jax.formats import MIN_SCALE, AffineInt, SymmetricInt, quantize
from cpt_jax.quant_config import QuantConfig
from cpt_jax.transform import QuantizedModel, resolve_config

Array = jax.Array
Ranges = Dict[str, Tuple[float, float]]

MIN_EXPORT_BITS, MAX_EXPORT_BITS = 2, 8
FP32_LAYER_MODES = ("keep", "int8_weights")
EXPORT_FORMAT_VERSION = 1
INPUT_LEAVES = ("input_scale", "input_origin", "input_code_min", "input_code_max",
                "input_code_shift")
"""Per-layer scalars of the static activation grid (float32)."""
KERNEL_LEAVES = ("kernel_scale", "kernel_offset")
"""Per-output-channel scale and offset of the int8 kernel codes (float32)."""

_PRODUCT_MODULES = (nn.Dense, nn.Conv)
_UNSUPPORTED_MODULES = (nn.DenseGeneral, nn.Einsum, nn.ConvTranspose, nn.ConvLocal)


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
    if value != int(value) or not MIN_EXPORT_BITS <= value <= MAX_EXPORT_BITS:
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


def _finite_min_max(x: Array, axes) -> Tuple[Array, Array]:
    finite = jnp.isfinite(x)
    lo = jnp.min(jnp.where(finite, x, jnp.inf), axis=axes)
    hi = jnp.max(jnp.where(finite, x, -jnp.inf), axis=axes)
    ok = jnp.isfinite(lo)
    return jnp.where(ok, lo, 0.0), jnp.where(ok, hi, 0.0)


def kernel_codes(kernel: Array, bits: int, kind: str, per_channel: bool
                 ) -> Tuple[Array, Array, Array]:
    """``(codes int8, scale (C,), offset (C,))`` of a kernel, output channel last.

    ``kernel_q = codes * scale + offset`` (broadcast on the last axis) is the
    training's fake-quantized kernel; `per_channel` False gives one scale (shape (1,)).

    Example:
      >>> w = jnp.array([[0.0, -1.0], [3.0, 1.0]])
      >>> c, s, z = kernel_codes(w, 2, "affine", per_channel=True)
      >>> c.tolist(), bool(jnp.allclose(c * s + z, quantize(w, 2, AffineInt(-1))))
      ([[-2, -2], [1, 1]], True)
    """
    kernel = jnp.asarray(kernel, jnp.float32)
    axes = tuple(range(kernel.ndim - 1)) if per_channel else None
    lo, hi = _finite_min_max(kernel, axes)
    lo, hi = jnp.atleast_1d(lo), jnp.atleast_1d(hi)
    origin, scale = grid_from_range(kind, bits, lo, hi)
    code_min, code_max, shift = code_bounds(kind, bits)
    codes = raw_codes(kernel, origin, scale, code_min, code_max) - shift
    return codes.astype(jnp.int8), scale, origin + shift * scale


# --------------------------------------------------------------------------- products
#
# A product handler is ``handler(lhs, rhs, op, layout) -> y`` where ``op(a, b,
# out_type=None)`` is the layer's bilinear op with everything but its operands
# bound and `layout` says how its axes broadcast (see `ProductLayout`).

@dataclasses.dataclass(frozen=True)
class ProductLayout:
    """Axes of one product `kind` ("dot" or "conv"): `lhs_free` (set to 1 in ``1_x``:
    they do not change the window sums), `lhs_summed` / `rhs_summed` (the reduced
    input-channel axes, summed before ``op(c_x, 1_W)``), `rhs_out` (the kernel's output
    axes, 1 in ``1_W``) and `out_channel` (the output's channel axis: scales broadcast).
    """

    kind: str
    lhs_free: Tuple[int, ...]
    lhs_summed: Tuple[int, ...]
    rhs_summed: Tuple[int, ...]
    rhs_out: Tuple[int, ...]
    out_channel: int
    window_sum: Optional[Callable] = None


def _dot_general_door(handler: Callable) -> Callable:
    """`handler` behind `lax.dot_general`'s signature (for ``nn.Dense(dot_general=)``)."""
    def dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None,
                    **kwargs):
        (lc, rc), (lb, rb) = dimension_numbers
        if lb or rb:
            raise ValueError("export supports dot_general products without batch dimensions")

        def op(a, b, out_type=None):
            return lax.dot_general(a, b, dimension_numbers, precision=precision,
                                   preferred_element_type=out_type)

        layout = ProductLayout(
            "dot", lhs_free=tuple(d for d in range(lhs.ndim) if d not in lc),
            lhs_summed=tuple(lc), rhs_summed=tuple(rc),
            rhs_out=tuple(d for d in range(rhs.ndim) if d not in rc), out_channel=-1)
        return handler(lhs, rhs, op, layout)

    return dot_general


def _conv_door(handler: Callable) -> Callable:
    """`handler` behind `lax.conv_general_dilated`'s signature (for ``nn.Conv``)."""
    def conv(lhs, rhs, window_strides, padding, lhs_dilation=None, rhs_dilation=None,
             dimension_numbers=None, feature_group_count=1, batch_group_count=1,
             precision=None, preferred_element_type=None, **kwargs):
        dn = lax.conv_dimension_numbers(lhs.shape, rhs.shape, dimension_numbers)

        def op(a, b, out_type=None):
            return lax.conv_general_dilated(
                a, b, window_strides, padding, lhs_dilation=lhs_dilation,
                rhs_dilation=rhs_dilation, dimension_numbers=dn,
                feature_group_count=feature_group_count, batch_group_count=batch_group_count,
                precision=precision, preferred_element_type=out_type)

        # Grouped convolutions keep full-size ones (channels cannot be summed across groups).
        grouped = feature_group_count != 1 or batch_group_count != 1
        window_sum = None if grouped else functools.partial(
            _conv_window_sum, kernel_shape=rhs.shape, window_strides=tuple(window_strides),
            padding=padding, lhs_dilation=lhs_dilation, rhs_dilation=rhs_dilation, dn=dn)
        layout = ProductLayout("conv", lhs_free=(dn.lhs_spec[0],),
                               lhs_summed=() if grouped else (dn.lhs_spec[1],),
                               rhs_summed=() if grouped else (dn.rhs_spec[1],),
                               rhs_out=() if grouped else (dn.rhs_spec[0],),
                               out_channel=dn.out_spec[1], window_sum=window_sum)
        return handler(lhs, rhs, op, layout)

    return conv


class _Guard(threading.local):
    depth: int = 0


_GUARD = _Guard()


def layer_path(module: nn.Module) -> str:
    """A bound module's path, ``"stage1_block1/conv1"``: the key of its variables."""
    return "/".join(str(p) for p in module.path)


def _intercept_products(handler_for: Callable[[nn.Module, str], Optional[Callable]]):
    """An `nn.intercept_methods` interceptor running ``handler_for(module, path)``'s
    handler as the product of every ``nn.Dense`` / ``nn.Conv`` (None: unchanged)."""
    def interceptor(next_fun, args, kwargs, ctx):
        module = ctx.module
        if (ctx.method_name != "__call__" or _GUARD.depth or module.scope is None
                or not isinstance(module, _PRODUCT_MODULES + _UNSUPPORTED_MODULES)):
            return next_fun(*args, **kwargs)
        handler = handler_for(module, layer_path(module))
        if handler is None:
            return next_fun(*args, **kwargs)
        if isinstance(module, nn.Dense):
            clone = module.clone(parent=None, dot_general=_dot_general_door(handler),
                                 dot_general_cls=None)
        else:
            clone = module.clone(parent=None, conv_general_dilated=_conv_door(handler),
                                 conv_general_dilated_cls=None)
        _GUARD.depth += 1
        try:
            return clone.apply(module.variables, *args, **kwargs)
        finally:
            _GUARD.depth -= 1

    return interceptor


def _channel_shape(ndim: int, axis: int) -> Tuple[int, ...]:
    shape = [1] * ndim
    shape[axis] = -1
    return tuple(shape)


def _ones_like_axes(x: Array, axes: Tuple[int, ...], dtype) -> Array:
    shape = tuple(1 if d in axes else n for d, n in enumerate(x.shape))
    return jnp.ones(shape, dtype)


def _weight_tq(cfg: QuantConfig, rhs: Array):
    """The config's weight format with its channel axis on the kernel's last axis."""
    tq = cfg.weight
    if getattr(tq.fmt, "channel_axis", None) is None:
        return tq
    return dataclasses.replace(tq, fmt=dataclasses.replace(tq.fmt, channel_axis=rhs.ndim - 1))


def _accumulate(x_codes: Array, w_codes: Array, op, layout: ProductLayout) -> Array:
    """``op(c_x, c_w)`` of int8 codes accumulated in int32, returned as float32.

    A convolution on CPU runs on the codes held in float32 (exact while every partial
    sum is below 2^24): XLA's CPU backend has no fast int8 convolution.
    """
    def int8(a, b):
        return op(a, b, jnp.int32).astype(jnp.float32)

    if layout.kind != "conv":
        return int8(x_codes, w_codes)

    def codes_in_float(a, b):
        return op(a.astype(jnp.float32), b.astype(jnp.float32))

    return lax.platform_dependent(x_codes, w_codes, cpu=codes_in_float, default=int8)


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


def _window_sums(x: Array, rhs: Array, op, layout: ProductLayout) -> Array:
    """``op(x, 1_W)``: `x` summed over each window (channels first, then the window)."""
    if layout.kind == "dot":
        summed = jnp.sum(x, axis=layout.lhs_summed)
        return jnp.expand_dims(summed, tuple(range(summed.ndim, summed.ndim + len(layout.rhs_out))))
    if layout.window_sum is not None:
        return layout.window_sum(jnp.sum(x, axis=layout.lhs_summed, keepdims=True))
    return op(x, jnp.ones_like(rhs, x.dtype))


def _int8_handler(leaves: Mapping[str, Array]) -> Callable:
    """The integer product of one exported layer (module docstring's formula)."""
    def handler(lhs, rhs, op, layout: ProductLayout):
        w_codes = rhs.astype(jnp.float32)  # flax promoted the int8 kernel to float: exact
        s_w, z_w = leaves["kernel_scale"], leaves["kernel_offset"]
        if "input_scale" not in leaves:  # int8 weights, float activations
            y = op(lhs, w_codes)
            shape = _channel_shape(y.ndim, layout.out_channel)
            return (s_w.reshape(shape) * y
                    + z_w.reshape(shape) * _window_sums(lhs, rhs, op, layout)).astype(lhs.dtype)
        s_x, origin = leaves["input_scale"], leaves["input_origin"]
        shift = leaves["input_code_shift"]
        x_codes = raw_codes(lhs, origin, s_x, leaves["input_code_min"],
                            leaves["input_code_max"]) - shift
        acc = _accumulate(x_codes.astype(jnp.int8), w_codes.astype(jnp.int8), op, layout)
        shape = _channel_shape(acc.ndim, layout.out_channel)
        code_sums = _window_sums(x_codes, rhs, op, layout)
        valid_weights = op(_ones_like_axes(lhs, layout.lhs_free, jnp.float32), w_codes * s_w + z_w)
        z_x = origin + shift * s_x
        y = s_x * (s_w.reshape(shape) * acc + z_w.reshape(shape) * code_sums) + z_x * valid_weights
        return y.astype(lhs.dtype)

    return handler


def _calibration_handler(cfg: Optional[QuantConfig], bits: int, record: Callable) -> Callable:
    """Record the input's finite (min, max), then the fake-quant product (dynamic ranges)."""
    def handler(lhs, rhs, op, layout):
        lo, hi = _finite_min_max(jnp.asarray(lhs, jnp.float32), None)
        jax.debug.callback(record, lo, hi)
        if cfg is None:
            return op(lhs, rhs)
        x = lhs if cfg.activation is None else fake_quant(lhs, bits, cfg.activation.fmt)
        return op(x, fake_quant(rhs, bits, _weight_tq(cfg, rhs).fmt)).astype(lhs.dtype)

    return handler


def _static_fake_quant_handler(cfg: QuantConfig, bits: int, lo, hi) -> Callable:
    """The fake-quant product with the activation on the static grid of ``[lo, hi]``."""
    def handler(lhs, rhs, op, layout):
        x = lhs
        if cfg.activation is not None:
            x = static_quantize(lhs, bits, grid_kind(cfg.activation.fmt, "activation"), lo, hi)
        return op(x, fake_quant(rhs, bits, _weight_tq(cfg, rhs).fmt)).astype(lhs.dtype)

    return handler


# --------------------------------------------------------------------------- layers

def layer_config(qmodel: QuantizedModel, module: nn.Module, path: str) -> Optional[QuantConfig]:
    """The `QuantConfig` of the layer at `path` (None: kept in fp32), checked for export.

    ValueError when a quantized layer is not an ``nn.Dense``/``nn.Conv`` or its grids
    are not `AffineInt`/`SymmetricInt` with a weight quantizer.
    """
    cfg = resolve_config(path, qmodel.rules, qmodel.config)
    if cfg is None:
        return None
    if not isinstance(module, _PRODUCT_MODULES):
        raise ValueError(f"layer {path!r} is an nn.{type(module).__name__}; export supports "
                         "quantized nn.Dense and nn.Conv layers (keep it in fp32 with a rule)")
    if cfg.weight is None:
        raise ValueError(f"layer {path!r} has no weight quantizer; export needs one")
    grid_kind(cfg.weight.fmt, f"weight of layer {path!r}")
    if cfg.activation is not None:
        grid_kind(cfg.activation.fmt, f"activation of layer {path!r}")
        if getattr(cfg.activation.fmt, "channel_axis", None) is not None:
            raise ValueError(f"layer {path!r}: export needs a per-tensor activation grid")
    return cfg


class _RangeSink:
    """Running (min, max) per layer path, updated from `jax.debug.callback`."""

    def __init__(self):
        self.ranges: Dict[str, Tuple[float, float]] = {}
        self._lock = threading.Lock()

    def update(self, path: str, lo, hi) -> None:
        lo, hi = float(lo), float(hi)
        with self._lock:
            old = self.ranges.get(path)
            self.ranges[path] = (lo, hi) if old is None else (min(old[0], lo), max(old[1], hi))


def calibrate(qmodel: QuantizedModel, variables: Mapping, batches: Iterable[Any], bits,
              **apply_kwargs) -> Ranges:
    """Static activation ranges: ``[lo, hi]`` of each layer's input over `batches`.

    ``lo = min_batches min(x)``, ``hi = max_batches max(x)`` (finite values), with
    the model run as the fake-quant model at `bits` (the training's forward, ranges
    per batch): the input of every ``nn.Dense`` / ``nn.Conv``, fp32 layers included.

    Args:
      qmodel: the model from `cpt_jax.quantize_model`.
      variables: its trained variables (``params``, ``batch_stats``, ...).
      batches: model inputs (e.g. a few training batches' ``"inputs"``).
      bits: the export width, 2..8.
      **apply_kwargs: passed to ``apply`` (e.g. ``train=False``).

    Returns:
      ``{layer_path: (lo, hi)}``.
    """
    qmodel = _check_quantized_model(qmodel)
    bits = check_export_bits(bits)
    sink = _RangeSink()

    def handler_for(module, path):
        cfg = layer_config(qmodel, module, path)
        if cfg is None and not isinstance(module, _PRODUCT_MODULES):
            return None
        width = bits if cfg is None else layer_bits(bits, cfg, path)
        return _calibration_handler(cfg, width, functools.partial(sink.update, path))

    @jax.jit
    def run(variables, inputs):
        with nn.intercept_methods(_intercept_products(handler_for)):
            return qmodel.model.apply(variables, inputs, **apply_kwargs)

    seen = 0
    for inputs in batches:
        jax.block_until_ready(run(variables, inputs))
        seen += 1
    jax.effects_barrier()
    if not seen:
        raise ValueError("calibrate needs at least one batch of inputs")
    if not sink.ranges:
        raise ValueError("calibration found no nn.Dense or nn.Conv layer in the model")
    return dict(sorted(sink.ranges.items()))


# --------------------------------------------------------------------------- export

@struct.dataclass
class ExportedModel:
    """A model with integer kernels: the float Linen `model`, its exported `variables`
    and the export width `bits`. A pytree (variables are its leaves), so
    ``jax.jit(int8_apply)(exported, x)`` works.

    In ``variables["params"]`` each exported layer's ``kernel`` holds int8 codes, beside
    ``kernel_scale``/``kernel_offset`` (per output channel) and, unless its activations
    stay float, the ``input_*`` scalars of its static activation grid.
    """

    variables: Any
    model: nn.Module = struct.field(pytree_node=False)
    bits: int = struct.field(pytree_node=False)

    def layers(self) -> Tuple[str, ...]:
        """Paths of the layers with integer kernels."""
        flat = traverse_util.flatten_dict(dict(self.variables.get("params", {})), sep="/")
        return tuple(sorted(k[: -len("kernel_scale")].rstrip("/") for k in flat
                            if k.split("/")[-1] == "kernel_scale"))


def _leaf_key(path: str, name: str) -> str:
    return f"{path}/{name}" if path else name


def _quantized_leaves(kernel, bits: int, cfg: QuantConfig, lo: float, hi: float) -> dict:
    per_channel = getattr(cfg.weight.fmt, "channel_axis", None) is not None
    codes, scale, offset = kernel_codes(kernel, bits, grid_kind(cfg.weight.fmt, "weight"),
                                        per_channel)
    leaves = {"kernel": codes, "kernel_scale": scale, "kernel_offset": offset}
    if cfg.activation is not None:
        kind = grid_kind(cfg.activation.fmt, "activation")
        origin, scale = grid_from_range(kind, bits, lo, hi)
        code_min, code_max, shift = code_bounds(kind, bits)
        leaves.update(input_scale=scale, input_origin=origin,
                      input_code_min=jnp.float32(code_min), input_code_max=jnp.float32(code_max),
                      input_code_shift=jnp.float32(shift))
    return leaves


def export_model(qmodel: QuantizedModel, variables: Mapping, bits, ranges: Ranges, *,
                 fp32_layers: str = "keep") -> ExportedModel:
    """The integer model: int8 kernel codes + per-channel scales + static input grids.

    Each quantized layer (every path of `ranges` whose rule gives a `QuantConfig`)
    at ``b = bits + bits_offset`` gets ``kernel = codes`` (int8),
    ``kernel_q = codes * kernel_scale + kernel_offset`` and the activation grid of
    its range (module docstring). Layers kept in fp32 stay fp32 (`fp32_layers`
    ``"keep"``) or get int8 weight codes (8-bit affine, per channel) with float
    activations (``"int8_weights"``: smaller, no longer the trained fp32 layer).
    Every other variable (biases, BatchNorm statistics) is unchanged.

    Args:
      qmodel: the model from `cpt_jax.quantize_model`.
      variables: its trained variables.
      bits: the export width, 2..8 (ValueError otherwise).
      ranges: from `calibrate`.
      fp32_layers: ``"keep"`` or ``"int8_weights"``.

    Returns:
      An `ExportedModel`; run it with `int8_apply`.
    """
    qmodel = _check_quantized_model(qmodel)
    bits = check_export_bits(bits)
    if fp32_layers not in FP32_LAYER_MODES:
        raise ValueError(f"fp32_layers must be one of {FP32_LAYER_MODES}, got {fp32_layers!r}")
    flat = traverse_util.flatten_dict(dict(variables["params"]), sep="/")
    out = dict(flat)
    for path, (lo, hi) in ranges.items():
        if _leaf_key(path, "kernel") not in flat:
            raise ValueError(f"layer {path!r} of the ranges has no kernel in variables['params']")
        cfg = resolve_config(path, qmodel.rules, qmodel.config)
        if cfg is None and fp32_layers == "keep":
            continue
        if cfg is None:
            cfg, width = QuantConfig(activation=None), 8
        else:
            width = layer_bits(bits, cfg, path)
        kernel = flat[_leaf_key(path, "kernel")]
        for name, value in _quantized_leaves(kernel, width, cfg, lo, hi).items():
            out[_leaf_key(path, name)] = value
    exported = {**dict(variables), "params": traverse_util.unflatten_dict(out, sep="/")}
    return ExportedModel(variables=exported, model=qmodel.model, bits=bits)


def _exported_handler_for(module: nn.Module, path: str) -> Optional[Callable]:
    params = module.variables.get("params", {})
    if "kernel_scale" not in params:
        return None
    if not isinstance(module, _PRODUCT_MODULES):
        raise ValueError(f"layer {path!r} has integer kernels but is an "
                         f"nn.{type(module).__name__} (export runs nn.Dense and nn.Conv)")
    return _int8_handler({k: params[k] for k in INPUT_LEAVES + KERNEL_LEAVES if k in params})


def int8_apply(exported: ExportedModel, inputs: Any, **apply_kwargs) -> Any:
    """Run the exported model: integer products (module docstring) in every exported
    layer, the float model's own ops elsewhere.

    Equal to ``fake_quant_apply`` with the ranges it was exported from, up to float
    rounding. Jittable: ``jax.jit(int8_apply)(exported, x)``.

    Args:
      exported: from `export_model` or `restore_exported`.
      inputs: the model's inputs.
      **apply_kwargs: passed to ``apply`` (e.g. ``train=False``).

    Returns:
      The model's outputs.
    """
    with nn.intercept_methods(_intercept_products(_exported_handler_for)):
        return exported.model.apply(exported.variables, inputs, **apply_kwargs)


def fake_quant_apply(qmodel: QuantizedModel, variables: Mapping, inputs: Any, *, bits,
                     ranges: Ranges, **apply_kwargs) -> Any:
    """The trained fake-quant model at `bits` with static activation grids.

    Every quantized layer computes ``op(Q_static(x), Q_b(W))``: the weight through
    `cpt_jax.fake_quant` (the training's quantizer), the activation on the grid of
    its calibrated range (`static_quantize`). The reference of `int8_apply`.

    Args:
      qmodel: the model from `cpt_jax.quantize_model`.
      variables: its trained variables.
      inputs: the model's inputs.
      bits: the width, 2..8.
      ranges: from `calibrate` (values may be traced).
      **apply_kwargs: passed to ``apply``.

    Returns:
      The model's outputs.
    """
    qmodel = _check_quantized_model(qmodel)
    bits = check_export_bits(bits)

    def handler_for(module, path):
        cfg = layer_config(qmodel, module, path)
        if cfg is None:
            return None
        if path not in ranges:
            raise ValueError(f"no activation range for layer {path!r}; calibrate first")
        lo, hi = ranges[path]
        return _static_fake_quant_handler(cfg, layer_bits(bits, cfg, path), lo, hi)

    with nn.intercept_methods(_intercept_products(handler_for)):
        return qmodel.model.apply(variables, inputs, **apply_kwargs)


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
    flat = traverse_util.flatten_dict(jax.device_get(dict(exported.variables)), sep="/")
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
