"""bf16: products on bfloat16 operands with float32 accumulation; preset ``bf16``.

Written only through cpt_jax's public calls (`cpt_jax.register_provider`,
`cpt_jax.register_preset`, imported from their modules: ``import cpt_jax`` imports this
one), as a user's own provider module would be. Inside a
`cpt_jax.precision` context, every product the preset covers computes

    y  = dot(bf16(x), bf16(W))                 accumulated in float32
    dx = dot(bf16(g), bf16(W)^T),  dW = dot(bf16(x)^T, bf16(g))

(the error cast to bfloat16 in backward when the context has ``grad_bits``; float32
errors otherwise), and at a width ``>= 32`` the float32 product (a traced width:
``lax.cond``), so a schedule can switch it off. The widths below 32 do not change
bfloat16's grid: the cost counts 16 stored bits per operand (``operand_bits``).

Example:
  >>> model = cpt_jax.quantize_model(nn.Dense(3), config="bf16")
  >>> x = jnp.linspace(-1.0, 1.0, 8).reshape(2, 4)
  >>> v = model.init(jax.random.key(0), x)
  >>> with cpt_jax.precision(8, grad_bits=8):
  ...     y = model.apply(v, x)
  >>> y.dtype, bool(jnp.allclose(y, nn.Dense(3).apply(v, x), atol=1e-2))
  (dtype('float32'), True)
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from cpt_jax.providers import register_provider
from cpt_jax.quant_config import QuantConfig, register_preset

BF16_BITS = 16.0


@jax.custom_vjp
def bf16_error(y):
    """Identity forward; the cotangent rounded to bfloat16 in backward (then float32)."""
    return y


bf16_error.defvjp(lambda y: (y, None),
                  lambda _, g: (g.astype(jnp.bfloat16).astype(g.dtype),))


def bf16_product(product, lhs, rhs, apply, errors: bool):
    """The product of the bfloat16-rounded operands accumulated in float32 (`product`'s
    op when it has one, else its `apply` on bfloat16 operands), its error in bfloat16
    when `errors`."""
    a, b = lhs.astype(jnp.bfloat16), rhs.astype(jnp.bfloat16)
    op = product.op
    if op is not None and op.kind in ("dot_general", "conv", "einsum"):
        y = op.apply(a, b, preferred_element_type=jnp.float32)
    else:
        y = apply(a, b).astype(jnp.float32)
    return bf16_error(y) if errors else y


@dataclasses.dataclass(frozen=True)
class Bf16Provider:
    """Products on bfloat16 operands, float32 accumulation (the module docstring)."""

    def compute(self, product, lhs, rhs, state, apply):
        out = jax.eval_shape(apply, lhs, rhs)
        bits = jnp.asarray(state.bits, jnp.float32) + product.config.bits_offset
        errors = state.grad_bits is not None

        def low(a, b):
            return bf16_product(product, a, b, apply, errors).astype(out.dtype)

        def full(a, b):
            return apply(a, b).astype(out.dtype)

        return lax.cond(bits >= 32, full, low, lhs, rhs)


def operand_bits(config, bits, grad_bits):
    """16 stored bits per operand; an error without a width stays float32 (32)."""
    return BF16_BITS, BF16_BITS, 32.0 if grad_bits is None else BF16_BITS


BF16 = Bf16Provider()
"""The provider (``QuantConfig(compute="bf16")``)."""

register_provider("bf16", BF16, operand_bits=operand_bits,
                  doc="bfloat16 operands, float32 accumulation (all three GEMMs)")
register_preset(
    "bf16", QuantConfig(weight=None, activation=None, error=None, compute="bf16"),
    "Every product on bfloat16 operands with float32 accumulation, errors in bfloat16 "
    "(cpt_jax.extensions.bf16); 16 stored bits per operand.")

__all__ = ["BF16", "BF16_BITS", "Bf16Provider", "bf16_error", "bf16_product", "operand_bits"]
