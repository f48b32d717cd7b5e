"""`FakeQuantProvider`: CPT's fake quantization of a product's operands and error.

With the widths of the enclosing `precision` context,

    y = Q_g^bwd( apply(Q_b(lhs), Q_b(rhs)) )

where ``Q_b`` is the forward fake quantizer (straight-through) at ``b = bits +
offset`` (`config.activation` for activation operands, `config.weight` for
weights, with the weight's format made per output channel along the product's
channel axis) and ``Q_g^bwd`` quantizes the output's cotangent at ``g = grad_bits
+ offset`` (`config.error`). Stochastic rounding draws one key per quantized
tensor from the context, in the order activation, weight, error. The other
providers subclass it and override one piece.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax

from cpt_jax.context import PrecisionState, effective_bits
from cpt_jax.formats import tile_sizes
from cpt_jax.interception import ACTIVATION, WEIGHT, Operand, Product
from cpt_jax.ops.fake_quant import fake_quant, quantize_grad
from cpt_jax.quant_config import TensorQuant

Array = jax.Array


def with_channel_axis(tq: TensorQuant | None, axis: int | None) -> TensorQuant | None:
    """`tq` with a per-channel format's ``channel_axis`` set to `axis` (else unchanged).

    Example:
      >>> tq = with_channel_axis(cpt_jax.TensorQuant(cpt_jax.AffineInt(channel_axis=-1)), 0)
      >>> tq.fmt.channel_axis
      0
    """
    if tq is None or axis is None or getattr(tq.fmt, "channel_axis", None) is None:
        return tq
    return dataclasses.replace(tq, fmt=dataclasses.replace(tq.fmt, channel_axis=axis))  # type: ignore[type-var]


def contracted_block_axis(kind: str, axes) -> int | None:
    """The one contracted axis a block or tile runs along (None if `axes` is empty).

    ``axes[0]`` for a conv (it lists its feature axis first, then the window),
    ``axes[-1]`` for a dot, einsum or ragged dot (the innermost of several contracted
    axes: a ``(heads, head_dim)`` contraction blocks ``head_dim``, the order the
    contraction flattens in).

    Example:
      >>> contracted_block_axis("conv", (2, 0, 1)), contracted_block_axis("einsum", (1, 3))
      (2, 3)
    """
    if not axes:
        return None
    return axes[0] if kind == "conv" else axes[-1]


def along_product(tq: TensorQuant | None, operand: Operand,
                  kind: str = "dot_general") -> TensorQuant | None:
    """`tq` with a ``scale_axes`` format's scales laid along this product's contraction.

    A format given ``scale_axes`` (e.g. ``SymmetricInt(scale_axes=(-1,))``, per token)
    scales, inside a product of this `kind`, over the operand's contracted axes: one
    scale per row of the GEMM (per token for an activation, per output channel for a
    weight). A ``tile`` blocks the contracted axis an MX block runs along
    (`contracted_block_axis`: the features; a conv kernel's input features, its
    window inside each scale). Over several contracted axes of a dot or einsum the
    tiles run along the innermost one, each index of the others its own row of tiles
    (``(heads, head_dim)``: ``1 x t`` tiles of each head), so a tile is ``t``
    contracted elements when that axis has ``t`` or more (fewer: the whole axis);
    a 2-D tile on a weight blocks that axis and the output channel (128 x 128 blocks).
    Other formats are returned unchanged.

    Example:
      >>> from cpt_jax.interception import Operand
      >>> tq = cpt_jax.TensorQuant(cpt_jax.SymmetricInt(scale_axes=(-1,), tile=128))
      >>> along_product(tq, Operand("weight", (0,), channel_axis=1)).fmt.scale_axes
      (0,)
      >>> along_product(tq, Operand("activation", (1, 3)), "einsum").fmt.scale_axes
      (3,)
    """
    if tq is None or getattr(tq.fmt, "scale_axes", None) is None or not operand.contracting:
        return tq
    tiled = contracted_block_axis(kind, operand.contracting)
    axes = (*(a for a in operand.contracting if a != tiled), tiled)
    if len(tile_sizes(tq.fmt)) == 1 and kind != "conv":
        axes = (tiled,)  # tiles of the innermost axis, one row of them per other index
    if len(tile_sizes(tq.fmt)) >= 2:
        if operand.channel_axis is None:
            raise ValueError(f"{tq.fmt!r}: a 2-D tile needs a weight with an output "
                             f"channel, got the {operand.role} of a product")
        axes = (*axes, operand.channel_axis)
    fmt: Any = tq.fmt  # AffineInt, SymmetricInt or BlockFloat (it has scale_axes)
    return dataclasses.replace(tq, fmt=dataclasses.replace(fmt, scale_axes=axes))


def per_group_channel(tq: TensorQuant | None, operand: Operand) -> TensorQuant | None:
    """A ragged dot's per-channel weight format scaled per group and channel.

    The weight of ``ragged_dot`` stacks one matrix per group (an MoE's experts) along
    its group axis; "per output channel" there is per (group, channel): the range is
    reduced over the contracted axes only (``scale_axes = contracting``), so an
    expert's scales are its own. A per-tensor, tiled or ``scale_axes`` format is
    returned unchanged.

    Example:
      >>> from cpt_jax.interception import Operand
      >>> tq = cpt_jax.TensorQuant(cpt_jax.AffineInt(channel_axis=2))
      >>> per_group_channel(tq, Operand("weight", (1,), channel_axis=2)).fmt.scale_axes
      (1,)
    """
    fmt = getattr(tq, "fmt", None)
    if (tq is None or getattr(fmt, "channel_axis", None) is None or not operand.contracting
            or not hasattr(fmt, "scale_axes") or tile_sizes(fmt)):
        return tq
    scaled: Any = fmt  # AffineInt, SymmetricInt or BlockFloat (it has scale_axes)
    return dataclasses.replace(tq, fmt=dataclasses.replace(
        scaled, channel_axis=None, scale_axes=tuple(operand.contracting)))


def operand_quant(product: Product, operand: Operand) -> TensorQuant | None:
    """The `TensorQuant` of one operand: ``config.activation`` or the per-channel
    ``config.weight`` (None: the operand stays in full precision); a format with
    ``scale_axes`` scaled along the product's contraction (`along_product`)."""
    cfg = product.config
    if cfg is None:
        return None
    if operand.role == ACTIVATION:
        return along_product(cfg.activation, operand, product.kind)
    if operand.role == WEIGHT:
        tq = with_channel_axis(cfg.weight, operand.channel_axis)
        if product.kind == "ragged_dot":  # one matrix per group: scales per group too
            tq = per_group_channel(tq, operand)
        return along_product(tq, operand, product.kind)
    return None  # an index (embedding lookup) is not quantized


def key_for(tq: TensorQuant | None, state: PrecisionState, what: str) -> Array | None:
    """The context's next key when `tq` rounds stochastically (ValueError without rng)."""
    if tq is None or tq.rounding != "stochastic":
        return None
    key = state.next_key()
    if key is None:
        raise ValueError(f"stochastic rounding of {what} needs `rng` in "
                         f"cpt_jax.precision(bits, grad_bits, rng=...)")
    return key


@dataclasses.dataclass(frozen=True)
class FakeQuantProvider:
    """CPT's fake quantization of a product's operands and error (module docstring)."""

    def quantize_operand(self, product: Product, operand: Operand, x: Array, bits,
                         state: PrecisionState) -> Array:
        """``Q_b(x)`` for one operand (identity when its `TensorQuant` is None)."""
        tq = operand_quant(product, operand)
        if tq is None:
            return x
        key = key_for(tq, state, f"an operand ({operand.role})")
        return fake_quant(x, bits, tq.fmt, rounding=tq.rounding, key=key)

    def quantize_error(self, product: Product, y: Array, state: PrecisionState) -> Array:
        """``Q_g^bwd(y)``: identity forward, the cotangent quantized at the grad bits."""
        cfg = product.config
        if cfg is None or cfg.error is None or state.grad_bits is None:
            return y
        g = effective_bits(state.grad_bits, cfg.grad_bits_offset)
        key = key_for(cfg.error, state, "the error")
        return quantize_grad(y, g, cfg.error.fmt, rounding=cfg.error.rounding, key=key)

    def compute(self, product: Product, lhs: Array, rhs: Array, state: PrecisionState,
                apply: Callable) -> Array:
        """``Q_g^bwd(apply(Q_b(lhs), Q_b(rhs)))`` at the context's widths."""
        bits = effective_bits(state.bits, product.config.bits_offset)
        lhs_q = self.quantize_operand(product, product.lhs, lhs, bits, state)
        rhs_q = self.quantize_operand(product, product.rhs, rhs, bits, state)
        return self.quantize_error(product, apply(lhs_q, rhs_q), state)


FAKE_QUANT = FakeQuantProvider()
"""The default provider (CPT's fake quantization)."""

__all__ = ["FAKE_QUANT", "FakeQuantProvider", "along_product", "contracted_block_axis", "key_for",
           "operand_quant", "per_group_channel", "with_channel_axis"]
