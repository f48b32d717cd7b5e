"""Providers for the hardware formats: blocks along the contraction, real FP8 products.

Both plug into the interception seam (`cpt_jax.interception`, `cpt_jax.providers`).

`BlockFormatProvider` (``BLOCK_FORMATS``) gives every block-scaled format (`MX`,
`NVFP4`, `ScaledFloat` row / tile / block) the axis the product contracts, as
hardware block-scaled matmuls require (OCP MX v1.0 section 6; NVFP4; DeepSeek-V3):

==========================  ===================================================
tensor                      blocks along
==========================  ===================================================
activation (lhs)            its contracted axis (features; conv: input channels)
weight (rhs)                its contracted axis (Dense ``(in, out)``: ``in``;
                            conv ``HWIO``: ``I``); a 128x128 `ScaledFloat` block
                            spans that axis and the output-channel axis
error, for ``dL/dlhs``      the output axis ``g x W`` contracts (Dense: out
                            features; conv: output channels)
error, for ``dL/drhs``      the output axis ``x x g`` contracts (Dense: the
                            batch/tokens axis, the last one if several; conv:
                            the last spatial axis)
==========================  ===================================================

The error is quantized twice, once per backward product, each with its own
stochastic-rounding key. A product with several contracted axes is blocked along
one of them (conv: the feature axis; others: the last), so a block never mixes
elements that are summed into different outputs. Products the provider cannot see
into (``product.op`` None) fall back to `FakeQuantProvider` with the formats'
own axes.

`FP8ComputeProvider` (``FP8_COMPUTE``) runs the forward product on float8 operands
with fp32 accumulation, ``y = (c_x . c_w) s_x s_w`` (``preferred_element_type=
float32``), for per-tensor or per-row 8-bit formats (`ScaledFloat` "tensor"/"row",
`OCPFloat` e4m3/e5m2); its backward is straight-through on the dequantized
operands, errors as `BlockFormatProvider`. On CPU XLA converts float8 operands to
fp32 before the dot, so the result equals the fake-quant product up to
accumulation order; on GPUs with FP8 tensor cores (H100/H200) XLA emits an FP8
GEMM. Other formats fall back to fake quantization.
"""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp

from cpt_jax import formats
from cpt_jax.context import PrecisionState, effective_bits
from cpt_jax.formats import MX, NVFP4, ScaledFloat
from cpt_jax.interception import Operand, Product
from cpt_jax.ops.fake_quant import fake_quant
from cpt_jax.ops.product_op import ProductOp
from cpt_jax.ops.varying import vary_like
from cpt_jax.providers.fake_quant import (
    FakeQuantProvider,
    contracted_block_axis,
    key_for,
    operand_quant,
)
from cpt_jax.quant_config import TensorQuant

Array = jax.Array
BLOCKED = (MX, NVFP4, ScaledFloat)  # the `formats.is_blocked` formats


def block_axis(product: Product, axes) -> int | None:
    """The one axis a block runs along among contracted `axes` (None if there are none).

    A conv lists the feature axis first (then the window), so its feature axis;
    a dot or einsum its last (innermost) contracted axis.

    Example:
      >>> from cpt_jax.interception import make_product
      >>> from cpt_jax.ops.product_op import dot_general_op
      >>> p = make_product("d", "dot_general", None, dot_general_op((((1,), (0,)), ((), ()))),
      ...                  (8, 3), (3, 4))
      >>> block_axis(p, p.lhs.contracting), block_axis(p, p.rhs.contracting)
      (1, 0)
    """
    return contracted_block_axis(product.kind, axes)


def along(tq: TensorQuant | None, axis: int | None,
          other_axis: int | None = None) -> TensorQuant | None:
    """`tq` with a block-scaled format's ``axis`` (and a 2-D block's ``other_axis``) set.

    Formats without blocks, and a None `axis`, are returned unchanged.

    Example:
      >>> along(TensorQuant(MX("e4m3")), 0).fmt
      MX(element='e4m3', block_size=32, axis=0)
    """
    if tq is None or axis is None or not formats.is_blocked(tq.fmt):
        return tq
    changes = {"axis": int(axis)}
    two_d = formats.format_traits(tq.fmt).scale == "block"  # ScaledFloat's tile x tile blocks
    if two_d and other_axis is not None:
        changes["other_axis"] = int(other_axis)
    return dataclasses.replace(tq, fmt=dataclasses.replace(tq.fmt, **changes))  # type: ignore[type-var]


def operand_blocks(product: Product, operand: Operand, ndim: int | None = None
                   ) -> TensorQuant | None:
    """The operand's `TensorQuant` with its blocks along its contracted axis.

    An operand that contracts nothing (an embedding table of a lookup) is blocked
    along its last axis other than the channel axis (the embedding features), when
    its rank `ndim` is given.
    """
    axis = block_axis(product, operand.contracting)
    if axis is None and ndim and operand.channel_axis is not None:
        others = [d for d in range(ndim) if d != operand.channel_axis % ndim]
        axis = others[-1] if others else None
    return along(operand_quant(product, operand), axis, operand.channel_axis)


# --------------------------------------------------------------------------- errors

@dataclasses.dataclass(frozen=True)
class FloatProduct:
    """The forward product of already-quantized operands: ``op(lhs, rhs)`` in float."""

    op: ProductOp

    def forward(self, lhs, rhs, bits) -> tuple:
        """``(y, (lhs, rhs))``: the output and the operands backward differentiates at."""
        del bits
        return self.op.apply(lhs, rhs), (lhs, rhs)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _two_error_product(product, lhs_grad_tq, rhs_grad_tq, lhs, rhs, bits, grad_bits, keys):
    return product.forward(lhs, rhs, bits)[0]


def _two_error_fwd(product, lhs_grad_tq, rhs_grad_tq, lhs, rhs, bits, grad_bits, keys):
    y, operands = product.forward(lhs, rhs, bits)
    return y, (operands, bits, grad_bits, keys)


def _quantize_cotangent(g, grad_bits, tq: TensorQuant | None, key):
    if tq is None or grad_bits is None:
        return g
    return formats.quantize(g, grad_bits, tq.fmt, rounding=tq.rounding, key=key)


def _two_error_bwd(product, lhs_grad_tq, rhs_grad_tq, residuals, g):
    (lhs, rhs), bits, grad_bits, (lhs_key, rhs_key) = residuals
    _, vjp = jax.vjp(product.op.apply, lhs, rhs)
    d_lhs = vjp(_quantize_cotangent(g, grad_bits, lhs_grad_tq, lhs_key).astype(g.dtype))[0]
    d_rhs = vjp(_quantize_cotangent(g, grad_bits, rhs_grad_tq, rhs_key).astype(g.dtype))[1]
    d_grad_bits = None if grad_bits is None else jnp.zeros_like(grad_bits)
    return d_lhs, d_rhs, jnp.zeros_like(bits), d_grad_bits, (None, None)


_two_error_product.defvjp(_two_error_fwd, _two_error_bwd)


def product_with_blocked_errors(product, lhs, rhs, bits, grad_bits, lhs_grad_tq, rhs_grad_tq,
                                keys=(None, None)) -> Array:
    """``y = product.forward(lhs, rhs, bits)``; backward quantizes the error once per product.

    ``dL/dlhs = vjp_lhs(Q1(g))``, ``dL/drhs = vjp_rhs(Q2(g))`` (the float product's
    vjp at the operands `product.forward` reports, straight-through), where ``Q1`` /
    ``Q2`` quantize the cotangent at `grad_bits` with `lhs_grad_tq` / `rhs_grad_tq`
    (each blocked along the axis its product contracts; None: not quantized).

    Args:
      product: a static object with ``op`` (`ProductOp`) and ``forward(lhs, rhs,
        bits) -> (y, (lhs_used, rhs_used))`` (`FloatProduct`, `FP8Product`).
      lhs, rhs: the operands.
      bits: the forward width (traced).
      grad_bits: the error width (traced), or None for fp32 errors.
      lhs_grad_tq, rhs_grad_tq: the error's `TensorQuant` per backward product.
      keys: PRNG keys of the two error quantizations (None for nearest).

    Returns:
      The forward output ``y``.
    """
    gb = None if grad_bits is None else jnp.asarray(grad_bits, jnp.float32)
    bits = jnp.asarray(bits, jnp.float32)
    # Under shard_map both operands vary wherever an input does (ops.varying): a
    # cotangent quantized with a per-device key or width varies.
    lhs, rhs = vary_like((lhs, rhs), bits, gb, keys)
    return _two_error_product(product, lhs_grad_tq, rhs_grad_tq, lhs, rhs, bits, gb,
                              tuple(keys))


@dataclasses.dataclass(frozen=True)
class BlockFormatProvider(FakeQuantProvider):
    """Fake quantization with every block along the contraction (module docstring)."""

    def quantize_operand(self, product: Product, operand: Operand, x: Array, bits,
                         state: PrecisionState) -> Array:
        """``Q_b(x)`` with the operand's blocks along its contracted axis."""
        tq = operand_blocks(product, operand, jnp.ndim(x))
        if tq is None:
            return x
        key = key_for(tq, state, f"an operand ({operand.role})")
        return fake_quant(x, bits, tq.fmt, rounding=tq.rounding, key=key)

    def forward_product(self, product: Product, lhs: Array, rhs: Array, bits,
                        state: PrecisionState) -> tuple:
        """``(forward, lhs', rhs')``: `FloatProduct` of the quantized operands."""
        lhs_q = self.quantize_operand(product, product.lhs, lhs, bits, state)
        rhs_q = self.quantize_operand(product, product.rhs, rhs, bits, state)
        return FloatProduct(product.op), lhs_q, rhs_q

    def compute(self, product: Product, lhs: Array, rhs: Array, state: PrecisionState,
                apply: Callable) -> Array:
        """Quantized operands; the error quantized once per backward product."""
        if product.op is None:
            return super().compute(product, lhs, rhs, state, apply)
        cfg = product.config
        bits = effective_bits(state.bits, cfg.bits_offset)
        forward, lhs_f, rhs_f = self.forward_product(product, lhs, rhs, bits, state)
        error = cfg.error if state.grad_bits is not None else None
        grad_bits = None if error is None else effective_bits(state.grad_bits,
                                                              cfg.grad_bits_offset)
        axes = product.error_axes
        lhs_grad_tq = along(error, block_axis(product, axes.for_lhs_grad))
        rhs_grad_tq = along(error, block_axis(product, axes.for_rhs_grad))
        keys = (key_for(error, state, "the error"), key_for(error, state, "the error"))
        return product_with_blocked_errors(forward, lhs_f, rhs_f, bits, grad_bits, lhs_grad_tq,
                                           rhs_grad_tq, keys).astype(lhs.dtype)


BLOCK_FORMATS = BlockFormatProvider()
"""The provider of block-scaled formats (blocks along each product's contraction)."""


# --------------------------------------------------------------------------- FP8 compute

FP8_ELEMENTS = formats.FP8_ELEMENTS


def fp8_capable(tq: TensorQuant | None) -> bool:
    """Whether `tq` has float8 codes with a scale that factors out of a product:
    `OCPFloat` or per-tensor / per-row `ScaledFloat` with an 8-bit element, nearest.
    """
    return tq is not None and tq.rounding == "nearest" and formats.has_fp8_codes(tq.fmt)


@dataclasses.dataclass(frozen=True)
class FP8Product:
    """``y = (c_x . c_w) s_x s_w`` on float8 codes with fp32 accumulation.

    Per-tensor scales multiply ``y``; per-row scales of a dot enter as ``op(s_x,
    s_w)`` (their outer product, shaped like ``y``), which factors out of the sum
    because they lie along non-contracted axes (`FP8ComputeProvider` checks).
    ``bits >= 32`` computes the float product.
    """

    op: ProductOp
    lhs_fmt: formats.Format
    rhs_fmt: formats.Format

    def fp8(self, lhs, rhs) -> tuple:
        """``(y, (c_x s_x, c_w s_w))`` of the float8 product; dequantized operands."""
        lc, ls = formats.scaled_codes(lhs, self.lhs_fmt)
        rc, rs = formats.scaled_codes(rhs, self.rhs_fmt)
        acc = self.op.apply(lc, rc, preferred_element_type=jnp.float32)
        if ls.size == 1 and rs.size == 1:
            y = acc * (ls.reshape(()) * rs.reshape(()))
        else:  # per-row scales of a dot: their outer product, shaped like y
            y = acc * self.op.apply(ls, rs)
        # A NaN/Inf operand has no float8 code; keep it visible in the output.
        y = y + jnp.where(jnp.isfinite(jnp.sum(lhs.astype(jnp.float32))), 0.0, jnp.nan)
        lhs_q = (lc.astype(jnp.float32) * ls).astype(lhs.dtype)
        rhs_q = (rc.astype(jnp.float32) * rs).astype(rhs.dtype)
        return y.astype(lhs.dtype), (lhs_q, rhs_q)

    def forward(self, lhs, rhs, bits) -> tuple:
        """The float8 product, or at ``bits >= 32`` the float one (full precision)."""
        def full(a, b):
            return self.op.apply(a, b).astype(a.dtype), (a, b)

        return jax.lax.cond(bits >= 32, full, self.fp8, lhs, rhs)


def fp8_operand(product: Product, operand: Operand, tq: TensorQuant | None) -> bool:
    """Whether an operand can enter a real FP8 product: `fp8_capable`, and a per-row
    scale only on a dot/einsum operand with a single contracted axis."""
    if not fp8_capable(tq):
        return False
    if formats.format_traits(tq.fmt).scale == "row":  # a rowwise ScaledFloat
        return product.kind != "conv" and len(operand.contracting) == 1
    return True


@dataclasses.dataclass(frozen=True)
class FP8ComputeProvider(BlockFormatProvider):
    """Forward products on float8 codes with fp32 accumulation where the formats allow.

    Operands whose formats are not `fp8_capable` (and products the seam cannot see
    into) are fake-quantized as by `BlockFormatProvider`.
    """

    def forward_product(self, product: Product, lhs: Array, rhs: Array, bits,
                        state: PrecisionState) -> tuple:
        """`FP8Product` of the raw operands when both can be float8, else fake quant."""
        lhs_tq = operand_blocks(product, product.lhs, jnp.ndim(lhs))
        rhs_tq = operand_blocks(product, product.rhs, jnp.ndim(rhs))
        if not (fp8_operand(product, product.lhs, lhs_tq)
                and fp8_operand(product, product.rhs, rhs_tq)):
            return super().forward_product(product, lhs, rhs, bits, state)
        return FP8Product(product.op, lhs_tq.fmt, rhs_tq.fmt), lhs, rhs


FP8_COMPUTE = FP8ComputeProvider()
"""Real FP8 forward products (float8 operands, fp32 accumulation) where possible."""


def provider_for(config) -> FakeQuantProvider | None:
    """The hardware-format provider a `QuantConfig` asks for, or None.

    ``config.compute == "fp8"``: `FP8_COMPUTE`; any block-scaled format (`MX`, `NVFP4`,
    `ScaledFloat`) among weight, activation, error: `BLOCK_FORMATS`; else None
    (the caller's default).

    Example:
      >>> from cpt_jax.quant_config import get_preset
      >>> provider_for(get_preset("mxfp8")) is BLOCK_FORMATS, provider_for(get_preset("cpt"))
      (True, None)
    """
    if config is None:
        return None
    if getattr(config, "compute", "auto") == "fp8":
        return FP8_COMPUTE
    tensors = (config.weight, config.activation, config.error)
    if any(tq is not None and formats.is_blocked(tq.fmt) for tq in tensors):
        return BLOCK_FORMATS
    return None
