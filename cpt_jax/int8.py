"""Real int8 products: ``y = s_x s_w (int8(x/s_x) . int8(W/s_w))`` with int32 accumulation.

The codes are `SymmetricInt`'s at a traced width ``bits <= 8`` (the levels change,
the int8 container does not), computed once from the operands; the activation has
one scale, the weight one per output channel. Backward: straight-through (the float
products of the dequantized operands, rebuilt from the int8 codes, 4x smaller
residuals than float operands).

`Int8Provider` plugs this into the interception seam for products whose
`ProductOp` is a dot_general or a conv with a weight: ``lax.cond(bits <= 8, int8
product, float product of the fake-quantized operands)``; others (opaque modules,
attention) fall back to fake quantization. Configs select it with
``QuantConfig(int8=True)`` (`cpt_jax.INT8_CONFIG`).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp
from jax import lax

from cpt_jax import formats
from cpt_jax.context import PrecisionState, effective_bits
from cpt_jax.fake_quant import fake_quant
from cpt_jax.formats import SymmetricInt
from cpt_jax.interception import Product, ProductOp, conv_op, dot_general_op
from cpt_jax.providers import FakeQuantProvider, key_for, operand_quant
from cpt_jax.quant_config import QuantConfig

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class Int8Spec:
    """A product on int8 codes: the op, the weight's channel axis, where it lands."""

    op: ProductOp
    rhs_channel_axis: int
    out_channel_axis: int


def _codes(lhs, rhs, bits, spec: Int8Spec, keys):
    """Symmetric codes (int8) and scales of both operands, computed once from them."""
    lkey, rkey = keys
    lc, ls = formats.symmetric_codes(lhs, bits, SymmetricInt(),
                                     rounding="nearest" if lkey is None else "stochastic",
                                     key=lkey)
    rc, rs = formats.symmetric_codes(rhs, bits, SymmetricInt(channel_axis=spec.rhs_channel_axis),
                                     rounding="nearest" if rkey is None else "stochastic",
                                     key=rkey)
    return lc.astype(jnp.int8), ls, rc.astype(jnp.int8), rs


def accumulate_codes(lc, rc, op: ProductOp):
    """``op(lc, rc)`` of int8 codes accumulated in int32, as float32.

    XLA's CPU backend has a fast int8 dot but no fast int8 convolution (a naive loop,
    measured 40x slower than the float one on ResNet-20), so on CPU a convolution
    runs on the same integer codes held in float32: every product and partial sum
    is an integer below 2^24 while ``K * 127^2 < 2^24`` (``K`` = kh kw C_in, up to
    1040), so the result is the int32 one exactly there.
    """
    def int8(lc, rc):
        return op.apply(lc, rc, preferred_element_type=jnp.int32).astype(jnp.float32)

    if op.kind != "conv":
        return int8(lc, rc)

    def codes_in_float(lc, rc):
        return op.apply(lc.astype(jnp.float32), rc.astype(jnp.float32))

    return lax.platform_dependent(lc, rc, cpu=codes_in_float, default=int8)


def _product_fwd(lhs, rhs, bits, keys, spec: Int8Spec):
    lc, ls, rc, rs = _codes(lhs, rhs, bits, spec, keys)
    acc = accumulate_codes(lc, rc, spec.op)
    # One scale per output channel: s_x * s_w[c], broadcast along the output channel.
    shape = [1] * acc.ndim
    shape[spec.out_channel_axis] = -1
    y = acc * (ls.reshape(()) * rs.reshape(shape))
    # NaN/Inf in the activation have no int8 code: keep them visible in the output
    # (as the fake-quant path does) so non-finite steps are still detected.
    y = y + jnp.where(jnp.isfinite(jnp.sum(lhs.astype(jnp.float32))), 0.0, jnp.nan)
    # Zero-size arrays carry the operand dtypes to the backward pass.
    dtypes = (jnp.zeros((0,), lhs.dtype), jnp.zeros((0,), rhs.dtype))
    return y.astype(lhs.dtype), (lc, ls, rc, rs, dtypes)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def int8_product(lhs, rhs, bits, keys, spec: Int8Spec):
    """``s_x s_w[o] op(int8 codes)`` (see the module docstring); straight-through VJP."""
    return _product_fwd(lhs, rhs, bits, keys, spec)[0]


def _product_bwd(spec: Int8Spec, residuals, g):
    lc, ls, rc, rs, (ldt, rdt) = residuals
    # Straight-through: the products of the dequantized operands (codes * scale).
    lhs_q = (lc.astype(jnp.float32) * ls).astype(ldt.dtype)
    rhs_q = (rc.astype(jnp.float32) * rs).astype(rdt.dtype)
    _, vjp = jax.vjp(lambda a, b: spec.op.apply(a, b), lhs_q, rhs_q)
    da, db = vjp(g.astype(ldt.dtype))
    return da, db, None, None


int8_product.defvjp(_product_fwd, _product_bwd)


def int8_dot_general(lhs, rhs, dimension_numbers, bits, *, keys=(None, None)) -> Array:
    """``y = s_x s_w (int8(x/s_x) . int8(W/s_w))`` accumulated in int32.

    The activation `lhs` has one scale, the weight `rhs` one per output channel
    (its last non-contracting dim). Equal to the product of the fake-quantized
    operands up to the float rounding of the rescale.

    Args:
      lhs, rhs: activation and weight.
      dimension_numbers: as `lax.dot_general`'s.
      bits: width <= 8 (may be traced).
      keys: PRNG keys for stochastic rounding of (lhs, rhs), or None (nearest).

    Returns:
      The rescaled product, in `lhs`'s dtype.

    Example:
      >>> x, w = jnp.ones((2, 3)), jnp.ones((3, 4))
      >>> int8_dot_general(x, w, (((1,), (0,)), ((), ())), 8).shape
      (2, 4)
    """
    op = dot_general_op(dimension_numbers)
    (_, rc), (_, rb) = op.dimension_numbers
    r_keep = [d for d in range(rhs.ndim) if d not in rc and d not in rb]
    if not r_keep:
        raise ValueError("int8_dot_general needs a weight (rhs) with an output dimension")
    spec = Int8Spec(op, r_keep[-1], -1)
    return int8_product(lhs, rhs, jnp.asarray(bits, jnp.float32), keys, spec)


def int8_conv(lhs, rhs, window_strides, padding, lhs_dilation=None, rhs_dilation=None,
              dimension_numbers=None, feature_group_count=1, batch_group_count=1, *,
              bits, keys=(None, None)) -> Array:
    """`lax.conv_general_dilated` on int8 codes with int32 accumulation, rescaled.

    ``y = s_x s_w[o] conv(int8(x/s_x), int8(W/s_w))``: one activation scale, one
    kernel scale per output feature `o` (``SymmetricInt`` codes at `bits` <= 8).
    Backward: straight-through, as `int8_dot_general`. On CPU, where XLA has no
    fast int8 convolution, the same codes are convolved in float32 (exact while
    ``kh kw C_in * 127^2 < 2^24``); GPU/TPU run the int8 convolution.

    Example:
      >>> x, w = jnp.ones((1, 8, 8, 3)), jnp.ones((3, 3, 3, 4))
      >>> int8_conv(x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"),
      ...           bits=8).shape
      (1, 8, 8, 4)
    """
    op = conv_op(lhs.shape, rhs.shape, window_strides, padding, lhs_dilation, rhs_dilation,
                 dimension_numbers, feature_group_count, batch_group_count)
    dn = op.dimension_numbers
    spec = Int8Spec(op, dn.rhs_spec[0], dn.out_spec[1])
    return int8_product(lhs, rhs, jnp.asarray(bits, jnp.float32), keys, spec)


def check_int8_config(config: QuantConfig) -> None:
    """ValueError unless the activation format is per-tensor `SymmetricInt`."""
    act = config.activation
    if act is None or getattr(act.fmt, "channel_axis", None) is not None:
        raise ValueError(
            "QuantConfig(int8=True) needs a per-tensor activation format "
            f"(SymmetricInt(channel_axis=None)), got {act!r}")


def _int8_spec(product: Product, out_ndim: int):
    op = product.op
    if op is None or op.kind not in ("dot_general", "conv") or product.rhs.channel_axis is None:
        return None
    out_channel = op.dimension_numbers.out_spec[1] if op.kind == "conv" else out_ndim - 1
    return Int8Spec(op, product.rhs.channel_axis, out_channel)


@dataclasses.dataclass(frozen=True)
class Int8Provider(FakeQuantProvider):
    """Products on int8 codes when ``bits <= 8`` (module docstring), else fake quant.

    On CPU a convolution runs on the fake-quantized operands (XLA's CPU backend
    has no fast int8 convolution and runs convolutions inside a conditional's
    branches slowly, measured 18x on ResNet-20); GPU/TPU run the int8 one.
    """

    def compute(self, product: Product, lhs: Array, rhs: Array, state: PrecisionState,
                apply: Callable) -> Array:
        cfg = product.config
        out_ndim = len(jax.eval_shape(apply, lhs, rhs).shape)
        spec = _int8_spec(product, out_ndim)
        if spec is None:
            return super().compute(product, lhs, rhs, state, apply)
        check_int8_config(cfg)
        bits = effective_bits(state.bits, cfg.bits_offset)
        keys = (key_for(cfg.activation, state, "an operand (activation)"),
                key_for(operand_quant(product, product.rhs), state, "an operand (weight)"))
        y = _int8_or_float(product, lhs, rhs, bits, keys, spec, apply)
        return self.quantize_error(product, y, state)


def _int8_or_float(product, lhs, rhs, bits, keys, spec: Int8Spec, apply):
    """``lax.cond(bits <= 8, int8 product, float product of fake-quantized operands)``."""
    def fake(x, operand, key):
        tq = operand_quant(product, operand)
        return fake_quant(x, bits, tq.fmt, rounding=tq.rounding, key=key)

    def float_product(a, b):
        return apply(fake(a, product.lhs, keys[0]), fake(b, product.rhs, keys[1])).astype(lhs.dtype)

    def int8_or_float(a, b):
        return lax.cond(bits <= 8, lambda a, b: int8_product(a, b, bits, keys, spec),
                        float_product, a, b)

    if spec.op.kind == "conv":
        return lax.platform_dependent(lhs, rhs, cpu=float_product, default=int8_or_float)
    return int8_or_float(lhs, rhs)


INT8 = Int8Provider()
"""The int8 provider (selected by ``QuantConfig(int8=True)``)."""
