"""`FORMAT_SWITCH`: the provider of a schedule over formats (`cpt_jax.format_schedules`).

A `cpt_jax.quant_config.FormatSwitch` product is computed by

    y = lax.switch(format_index(widths, bits + offset), [provider_f(product in f) for f])

with each format's own provider (`branch_provider`: `LOWP_GEMM` for ``gemm``
recipes, the block-format providers, else fake quantization), so every format is a
branch of the one compiled step. Bits known at trace time pick the branch
directly, without a switch.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import numpy as np
from jax import lax

from cpt_jax.context import PrecisionState, effective_bits
from cpt_jax.interception import Product
from cpt_jax.ops.lowp_gemm import static_width
from cpt_jax.ops.varying import vary_like
from cpt_jax.providers import lowp_gemm
from cpt_jax.providers._table import branch_provider
from cpt_jax.quant_config import FormatSwitch, format_index

Array = jax.Array


def _static_index(config: FormatSwitch, state: PrecisionState) -> int | None:
    """The format index when the context's bits are known at trace time, else None."""
    width = static_width(state.bits)
    if width is None:
        return None
    bits = float(np.clip(width + config.bits_offset, 1.0, 32.0))
    return int(format_index(config.widths, bits))


@dataclasses.dataclass(frozen=True)
class FormatSwitchProvider:
    """Computes a `FormatSwitch` product with the step's format (``lax.switch``)."""

    def branches(self, product: Product, state: PrecisionState, apply: Callable, dtype):
        """One ``(lhs, rhs) -> y`` per format: its provider on the product in that format
        (the switch's bit offsets carried over)."""
        cfg = product.config
        out = []
        for branch in cfg.branches:
            sub = dataclasses.replace(product, config=branch.replace(
                bits_offset=cfg.bits_offset, grad_bits_offset=cfg.grad_bits_offset))
            provider = branch_provider(branch)

            def run(a, b, sub=sub, provider=provider):
                return provider.compute(sub, a, b, state, apply).astype(dtype)

            out.append(run)
        return out

    def compute(self, product: Product, lhs: Array, rhs: Array, state: PrecisionState,
                apply: Callable) -> Array:
        """The product in format ``format_index(widths, bits + offset)``."""
        cfg = product.config
        dtype = jax.eval_shape(apply, lhs, rhs).dtype
        branches = self.branches(product, state, apply, dtype)
        fixed = _static_index(cfg, state)
        if fixed is not None:
            return branches[fixed](lhs, rhs)
        index = format_index(cfg.widths, effective_bits(state.bits, cfg.bits_offset))
        # Under shard_map the operands vary over the widths' and keys' axes too, so
        # every branch returns the same type whichever keys it draws (ops.varying).
        lhs, rhs = vary_like((lhs, rhs), index, state.grad_bits, state.rng, state.salt)
        return lax.switch(index, branches, lhs, rhs)


FORMAT_SWITCH = FormatSwitchProvider()
"""The provider of `FormatSwitch` configs (`cpt_jax.format_schedule`)."""


def provider_for(config):
    """`FORMAT_SWITCH` for a `FormatSwitch`, `cpt_jax.providers.lowp_gemm.LOWP_GEMM` for
    a config with ``gemm``, else None (kept for callers; the choice is made by
    `cpt_jax.providers.PROVIDERS`).

    Example:
      >>> from cpt_jax.format_schedules import format_switch
      >>> provider_for(format_switch(["mxfp4", "mxfp8"])) is FORMAT_SWITCH
      True
    """
    if isinstance(config, FormatSwitch):
        return FORMAT_SWITCH
    return lowp_gemm.provider_for(config)


__all__ = ["FORMAT_SWITCH", "FormatSwitchProvider", "branch_provider", "provider_for"]
