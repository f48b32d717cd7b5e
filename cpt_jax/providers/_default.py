"""`PROVIDERS`: the one table from a `QuantConfig` to the provider that computes it.

Each row is a `ProviderRow`: a name, a predicate on the config and the provider; the
first row whose predicate holds wins, else CPT's fake quantization. A new provider
is one module (a `cpt_jax.interception.Provider`) plus one row, here or through
`register_provider`.

======================  =====================================  =====================
row                     when                                   provider
======================  =====================================  =====================
``running_ranges``      ``activation_range="running"``         `RUNNING_RANGES`
``format_switch``       a `FormatSwitch` (format schedule)     `FORMAT_SWITCH`
``lowp_gemm``           ``gemm=LowpGemm(...)``                 `LOWP_GEMM`
``fp8_compute``         ``fp8_compute=True``                   `FP8_COMPUTE`
``block_formats``       an MX / NVFP4 / ScaledFloat tensor     `BLOCK_FORMATS`
``int8``                ``int8=True``                          `INT8`
======================  =====================================  =====================

A format schedule computes each of its formats with the rows marked
``in_format_schedules`` (`branch_provider`).
"""
from __future__ import annotations

from cpt_jax.formats import is_blocked
from cpt_jax.providers._table import (
    PROVIDERS,
    ProviderRow,
    branch_provider,
    default_provider,
    register_provider,
)
from cpt_jax.providers.block_formats import BLOCK_FORMATS, FP8_COMPUTE
from cpt_jax.providers.format_switch import FORMAT_SWITCH
from cpt_jax.providers.int8 import INT8
from cpt_jax.providers.lowp_gemm import LOWP_GEMM
from cpt_jax.providers.running_ranges import RUNNING_RANGES
from cpt_jax.quant_config import FormatSwitch


def uses_block_format(config) -> bool:
    """Whether any of the config's weight, activation or error formats is block-scaled
    (`MX`, `NVFP4`, `ScaledFloat`)."""
    tensors = (config.weight, config.activation, config.error)
    return any(tq is not None and is_blocked(tq.fmt) for tq in tensors)


PROVIDERS.extend([
    ProviderRow("running_ranges", lambda c: getattr(c, "activation_range", "") == "running",
                RUNNING_RANGES),
    ProviderRow("format_switch", lambda c: isinstance(c, FormatSwitch), FORMAT_SWITCH),
    ProviderRow("lowp_gemm", lambda c: getattr(c, "gemm", None) is not None, LOWP_GEMM,
                in_format_schedules=True),
    ProviderRow("fp8_compute", lambda c: bool(getattr(c, "fp8_compute", False)), FP8_COMPUTE,
                in_format_schedules=True),
    ProviderRow("block_formats", uses_block_format, BLOCK_FORMATS, in_format_schedules=True),
    ProviderRow("int8", lambda c: bool(getattr(c, "int8", False)), INT8),
])

__all__ = ["PROVIDERS", "ProviderRow", "branch_provider", "default_provider",
           "register_provider", "uses_block_format"]
