"""The quantized products in pure JAX (no Flax): what providers compute with.

One stage of the data path (... -> provider -> **quantized product** -> cost):

==================  ==========================================================
module              what
==================  ==========================================================
``fake_quant``      `fake_quant` (forward, straight-through) and `quantize_grad`
                    (the error in backward): custom_vjp quantizers
``product_op``      `ProductOp`: a static dot_general / conv / einsum and apply
``int8``            int8 x int8 -> int32 products with rescaling
``integer``         integer products of exported models (zero points, windows)
``grids``           grids from a given range, codes, per-channel weight codes
``scale_history``   delayed scaling and Autoflex: ranges from a history
``lowp_gemm``       `lowp_dot_general`: a dot's forward, input- and weight-gradient
                    GEMMs on low-precision codes (custom_vjp)
``scaled_matmul``   `scaled_product`: the block-scaled GEMM of two codes-plus-scales
                    operands (`cpt_jax.formats.codes`); the random Hadamard transform
``varying``         under ``jax.shard_map``: `varying_axes` of a value, `vary_like`
                    (a custom_vjp's operands, a cond's branches of one type)
==================  ==========================================================
"""
from cpt_jax.ops.fake_quant import fake_quant, quantize_grad
from cpt_jax.ops.grids import quantize_with_range
from cpt_jax.ops.int8 import int8_conv, int8_dot_general
from cpt_jax.ops.product_op import ProductOp

__all__ = (
    "ProductOp",
    "fake_quant",
    "int8_conv",
    "int8_dot_general",
    "quantize_grad",
    "quantize_with_range",
)
