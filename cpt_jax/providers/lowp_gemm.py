"""The provider of low-precision GEMMs: every ``dot_general`` as three GEMMs on codes.

`LowpGemmProvider` (`LOWP_GEMM`, the provider of ``QuantConfig(gemm=LowpGemm(...))``,
the ``*_gemm`` presets) chooses, for each dot product the seam intercepts, the
format of each GEMM operand along its contraction (`along_contraction`), the widths
(the `precision` context's bits, or grad bits for the errors, plus the config's
offsets), the rounding keys and the delayed amaxes, and calls
`cpt_jax.ops.lowp_gemm.lowp_dot_general`: the forward, input-gradient and
weight-gradient GEMMs, each quantizing its own two operands along its own
contraction (the table and formulas in `cpt_jax.ops.lowp_gemm`; codes plus scales
in `cpt_jax.formats.codes`; the block-scaled product in `cpt_jax.ops.scaled_matmul`).

``LowpGemm.compute="fake"`` computes the same quantized operands, dequantized, in
a float32 GEMM (`cpt_jax.formats.quantize` along the same axis): on CPU the real
path equals it to float32 rounding, forward and both gradients (tests).

NVFP4 training recipe (NVIDIA, "Pretraining Large Language Models with NVFP4",
2025), each a switch of ``nvfp4_gemm``: 16x16 weight blocks (``NVFP4(block_2d=
True)``), a random Hadamard transform of size 16 with a fixed seed on both
weight-gradient inputs along the tokens (``LowpGemm.hadamard_size``;
``(H x)^T (H g) = x^T g`` since ``H`` is orthogonal), stochastic rounding of the
errors (``TensorQuant(..., "stochastic")``).

Delayed scaling (``LowpGemm(scaling="delayed")``, per-tensor FP8): the weight and
activation of each product are scaled by ``max(amax history) / 448`` (the
current amax while the history is empty), the history kept in the product's
module (``batch_stats``, carried by `cpt_jax.training.TrainState`); errors stay
current-scaled (their amax is only known in backward, and a train state cannot
carry it out of there).

A width ``>= 32`` (the `precision` context's bits, or grad bits for the errors)
keeps the operands it governs in float32 (a traced width: ``lax.cond``). Products
other than ``dot_general`` (convolutions, ragged dots, lookups) are computed by
`cpt_jax.providers.block_formats.BlockFormatProvider` (fake quantization).

The GEMM math lives in `cpt_jax.ops.lowp_gemm`, `cpt_jax.ops.scaled_matmul` and
`cpt_jax.formats.codes`; its names are re-exported here (``from
cpt_jax.providers.lowp_gemm import lowp_dot_general`` keeps working).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from cpt_jax import formats
from cpt_jax.context import PrecisionState, effective_bits
from cpt_jax.formats import AffineInt, SymmetricInt
from cpt_jax.formats.codes import GemmOperand, fake_operand, operand_codes
from cpt_jax.interception import Product
from cpt_jax.ops.lowp_gemm import (
    GemmLayout,
    GemmSpec,
    Side,
    from_matrix_view,
    gemm,
    gemm_layout,
    lowp_dot_general,
    matrix_view,
    static_width,
)
from cpt_jax.ops.scale_history import ScaleHistory, init_history, predicted_range, update_history
from cpt_jax.ops.scaled_matmul import (
    BXK,
    NATIVE_SCALED_MATMUL,
    hadamard_matrix,
    hadamard_signs,
    jax_version,
    random_hadamard,
    scaled_matmul,
    scaled_matmul_emulation,
    scaled_product,
)
from cpt_jax.providers.block_formats import BlockFormatProvider
from cpt_jax.providers.fake_quant import key_for, operand_quant
from cpt_jax.quant_config import QuantConfig, TensorQuant

Array = jax.Array
HISTORY_COLLECTION = "batch_stats"


def along_contraction(tq: TensorQuant | None) -> TensorQuant | None:
    """`tq` for a ``(B, X, K)`` operand: blocks / rows along ``K`` (axis 2), a 2-D
    block's second axis along ``X`` (axis 1); per-tensor formats unchanged.

    Example:
      >>> from cpt_jax.formats import MX
      >>> along_contraction(TensorQuant(MX("e4m3", axis=-2))).fmt
      MX(element='e4m3', block_size=32, axis=2)
    """
    if tq is None:
        return None
    traits = formats.format_traits(tq.fmt)
    if not traits.blocked:
        return tq
    fmt: Any = tq.fmt  # MX, NVFP4 or ScaledFloat: each has `axis`, a 2-D block `other_axis`
    changes = {"axis": 2, "other_axis": 1} if traits.two_d else {"axis": 2}
    return dataclasses.replace(tq, fmt=dataclasses.replace(fmt, **changes))


# --------------------------------------------------------------------------- provider

def history_amax(history: ScaleHistory, x: Array, margin: float = 0.0) -> tuple:
    """``(amax used, current amax)``: the history's ``max * 2^margin``, or the current
    amax of `x` while the history is empty (the first step scales dynamically).

    Example:
      >>> x = jnp.array([-3.0, 1.0])
      >>> [float(a) for a in history_amax(init_history(4), x)]
      [3.0, 3.0]
      >>> h = update_history(init_history(4), -5.0, 5.0, False)
      >>> [float(a) for a in history_amax(h, x)]
      [5.0, 3.0]
    """
    _, hi = predicted_range(history, SymmetricInt(), method="delayed", margin=margin)
    lo, top = formats.representable_range(2, AffineInt(), lax.stop_gradient(x))
    current = jnp.maximum(-lo, top).reshape(())
    return jnp.where(history.count > 0, hi, current), current


def _history_name(product: Product) -> str:
    """The variable holding a product's amax histories in its module."""
    below = product.local.replace("/", "_")
    return f"{below}_lowp_gemm_history" if below else "lowp_gemm_history"


def product_spec(product: Product, state: PrecisionState, lhs, rhs) -> tuple:
    """``(GemmSpec, bits, grad_bits)`` of a dot product under the context's widths
    (``bits + config.bits_offset``; static copies in the spec when they are known at
    trace time; ``grad_bits`` None for float32 errors).

    Example:
      >>> from cpt_jax.context import PrecisionState
      >>> from cpt_jax.interception import make_product
      >>> from cpt_jax.ops.product_op import dot_general_op
      >>> from cpt_jax.quant_config import get_preset
      >>> p = make_product("d", "dot_general", get_preset("mxfp8_gemm"),
      ...                  dot_general_op((((1,), (0,)), ((), ()))), (4, 64), (64, 8))
      >>> spec, bits, grad_bits = product_spec(p, PrecisionState(8, None), jnp.ones((4, 64)),
      ...                                      jnp.ones((64, 8)))
      >>> spec.lhs.fmt, spec.bits, spec.error, grad_bits
      (MX(element='e4m3', block_size=32, axis=2), 8.0, None, None)
    """
    cfg = product.config
    bits = effective_bits(state.bits, cfg.bits_offset)
    static = None if static_width(state.bits) is None else float(
        np.clip(static_width(state.bits) + cfg.bits_offset, 1.0, 32.0))
    error = cfg.error if state.grad_bits is not None else None
    grad_bits = static_grad = None
    if error is not None:
        grad_bits = effective_bits(state.grad_bits, cfg.grad_bits_offset)
        if static_width(state.grad_bits) is not None:
            static_grad = float(np.clip(static_width(state.grad_bits) + cfg.grad_bits_offset,
                                        1.0, 32.0))
    spec = GemmSpec(gemm_layout(product.op.dimension_numbers, jnp.ndim(lhs), jnp.ndim(rhs)),
                    along_contraction(operand_quant(product, product.lhs)),
                    along_contraction(operand_quant(product, product.rhs)),
                    along_contraction(error), cfg.gemm, static, static_grad,
                    jnp.result_type(lhs, rhs))
    return spec, bits, grad_bits


@dataclasses.dataclass(frozen=True)
class LowpGemmProvider(BlockFormatProvider):
    """Every dot_general product of a `QuantConfig` with ``gemm`` as three
    low-precision GEMMs (`lowp_dot_general`); other products as `BlockFormatProvider`.

    Attributes:
      collection: where delayed scaling keeps each product's amax histories.
    """

    collection: str = HISTORY_COLLECTION

    def applies(self, product: Product) -> bool:
        cfg = product.config
        return (cfg is not None and cfg.gemm is not None and product.op is not None
                and product.op.kind == "dot_general")

    def delayed(self, product: Product) -> bool:
        return (self.applies(product) and product.config.gemm.scaling == "delayed"
                and product.module is not None)

    def prepare(self, product: Product, lhs, rhs) -> None:
        """Create empty amax histories (delayed scaling) where the collection is mutable."""
        module, name = product.module, _history_name(product)
        if (self.delayed(product) and module.is_mutable_collection(self.collection)
                and not module.has_variable(self.collection, name)):
            length = product.config.gemm.history_length
            module.put_variable(self.collection, name,
                                {"lhs": init_history(length), "rhs": init_history(length)})

    def delayed_amaxes(self, product: Product, lhs, rhs) -> tuple:
        """The amaxes delayed scaling uses; pushes the current ones into the history."""
        module, name = product.module, _history_name(product)
        gemm_cfg = product.config.gemm
        if module.has_variable(self.collection, name):
            hist = module.get_variable(self.collection, name)
        else:
            hist = {"lhs": init_history(gemm_cfg.history_length),
                    "rhs": init_history(gemm_cfg.history_length)}
        used_l, cur_l = history_amax(hist["lhs"], lhs, gemm_cfg.margin)
        used_r, cur_r = history_amax(hist["rhs"], rhs, gemm_cfg.margin)
        if module.is_mutable_collection(self.collection):
            new = {"lhs": update_history(hist["lhs"], -cur_l, cur_l, False),
                   "rhs": update_history(hist["rhs"], -cur_r, cur_r, False)}
            # Stored as it was read (a state cast to bf16 keeps its dtypes: no retrace).
            module.put_variable(self.collection, name, jax.tree.map(
                lambda n, o: jnp.asarray(n, jnp.result_type(o)), new, hist))
        return used_l, used_r

    def compute(self, product: Product, lhs: Array, rhs: Array, state: PrecisionState,
                apply: Callable) -> Array:
        """`lowp_dot_general` of the product at the context's widths."""
        if not self.applies(product):
            return super().compute(product, lhs, rhs, state, apply)
        spec, bits, grad_bits = product_spec(product, state, lhs, rhs)
        keys = (key_for(spec.lhs, state, "an operand (lhs)"),
                key_for(spec.rhs, state, "an operand (rhs)"),
                key_for(spec.error, state, "the error"), key_for(spec.error, state, "the error"))
        amaxes = self.delayed_amaxes(product, lhs, rhs) if self.delayed(product) else (None, None)
        return lowp_dot_general(spec, lhs, rhs, bits, grad_bits, keys, amaxes)


LOWP_GEMM = LowpGemmProvider()
"""The provider of `QuantConfig(gemm=LowpGemm(...))` (the ``*_gemm`` presets)."""


def provider_for(config: QuantConfig | None) -> LowpGemmProvider | None:
    """`LOWP_GEMM` for a config with ``gemm``, else None.

    Example:
      >>> from cpt_jax.quant_config import get_preset
      >>> provider_for(get_preset("mxfp8_gemm")) is LOWP_GEMM, provider_for(get_preset("mxfp8"))
      (True, None)
    """
    if config is not None and getattr(config, "gemm", None) is not None:
        return LOWP_GEMM
    return None


__all__ = ["BXK", "GemmLayout", "GemmOperand", "GemmSpec", "HISTORY_COLLECTION", "LOWP_GEMM",
           "LowpGemmProvider", "NATIVE_SCALED_MATMUL", "Side", "along_contraction",
           "fake_operand", "from_matrix_view", "gemm", "gemm_layout", "hadamard_matrix",
           "hadamard_signs", "history_amax", "jax_version", "lowp_dot_general", "matrix_view",
           "operand_codes", "product_spec", "provider_for", "random_hadamard", "scaled_matmul",
           "scaled_matmul_emulation", "scaled_product", "static_width"]
