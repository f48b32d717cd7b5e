"""`default_provider`: the one table from a `QuantConfig` to the provider it asks for."""
from __future__ import annotations

from cpt_jax.providers.block_formats import provider_for
from cpt_jax.providers.fake_quant import FAKE_QUANT
from cpt_jax.providers.format_switch import provider_for as gemm_or_switch_provider
from cpt_jax.providers.int8 import INT8
from cpt_jax.providers.running_ranges import RUNNING_RANGES
from cpt_jax.quant_config import QuantConfig


def default_provider(config: QuantConfig | None):
    """The provider a config asks for.

    ================================  ====================================
    config                            provider
    ================================  ====================================
    ``activation_range="running"``    `RUNNING_RANGES`
    ``gemm=LowpGemm(...)``            `LOWP_GEMM` (three low-precision GEMMs)
    a `FormatSwitch`                  `FORMAT_SWITCH` (one format per step)
    ``fp8_compute``, block formats    `provider_for(config)` (FP8 compute,
                                      `BLOCK_FORMATS`)
    ``int8``                          `INT8`
    anything else, or None            `FAKE_QUANT` (CPT's fake quant)
    ================================  ====================================

    Example:
      >>> default_provider(cpt_jax.CPT_CONFIG) is cpt_jax.providers.FAKE_QUANT
      True
    """
    if config is not None and config.activation_range == "running":
        return RUNNING_RANGES
    hardware = gemm_or_switch_provider(config) or provider_for(config)
    if hardware is not None:
        return hardware
    return INT8 if config is not None and config.int8 else FAKE_QUANT


__all__ = ["default_provider"]
