"""`PROVIDERS`: the one table from a `QuantConfig` to the provider that computes it.

``QuantConfig.compute`` names a row (``"int"``, ``"fp8"``, a registered provider); with
``"auto"`` (the default) the rows with a predicate are asked, highest priority first,
and the first that applies computes the product, else CPT's fake quantization
(``"fake"`` asks only the rows that compute in float32). A new provider is one module
that calls `cpt_jax.register_provider` (`cpt_jax.extensions.bf16` is the worked example).

======================  ========  =====================================  ==================
row                     priority  ``"auto"`` / ``"fake"`` when            provider
======================  ========  =====================================  ==================
``running_ranges``      50        ``activation_range="running"``         `RUNNING_RANGES`
``format_switch``       40        a `FormatSwitch` (format schedule)     `FORMAT_SWITCH`
``lowp_gemm``           30        ``gemm=LowpGemm(...)`` (auto only)     `LOWP_GEMM`
``block_formats``       20        an MX / NVFP4 / ScaledFloat tensor     `BLOCK_FORMATS`
``int``                 10        integer grids, on the platforms of     `INTEGER`
                                  `integer_gemm_platforms` (auto only)
``fp8``                 --        by name only (``compute="fp8"``)       `FP8_COMPUTE`
======================  ========  =====================================  ==================

A format schedule computes each of its formats with the rows marked
``in_format_schedules`` (`branch_provider`).
"""
from __future__ import annotations

import jax

from cpt_jax.formats import is_blocked
from cpt_jax.providers._table import (
    PROVIDERS,
    ProviderRow,
    add_builtin,
    branch_provider,
    default_provider,
    register_provider,
    unregister_provider,
)
from cpt_jax.providers.block_formats import BLOCK_FORMATS, FP8_COMPUTE
from cpt_jax.providers.fake_quant import FAKE_QUANT
from cpt_jax.providers.format_switch import FORMAT_SWITCH
from cpt_jax.providers.integer import INTEGER, auto_integer, integer_path
from cpt_jax.providers.lowp_gemm import LOWP_GEMM
from cpt_jax.providers.running_ranges import RUNNING_RANGES
from cpt_jax.quant_config import FormatSwitch


def uses_block_format(config) -> bool:
    """Whether any of the config's weight, activation or error formats is block-scaled
    (`MX`, `NVFP4`, `ScaledFloat`)."""
    tensors = (config.weight, config.activation, config.error)
    return any(tq is not None and is_blocked(tq.fmt) for tq in tensors)


for _row in (
        ProviderRow("running_ranges", RUNNING_RANGES,
                    lambda c: getattr(c, "activation_range", "") == "running", 50),
        ProviderRow("format_switch", FORMAT_SWITCH, lambda c: isinstance(c, FormatSwitch), 40),
        ProviderRow("lowp_gemm", LOWP_GEMM, lambda c: getattr(c, "gemm", None) is not None, 30,
                    real=True, in_format_schedules=True),
        ProviderRow("block_formats", BLOCK_FORMATS, uses_block_format, 20,
                    in_format_schedules=True),
        ProviderRow("int", INTEGER, auto_integer, 10, real=True),
        ProviderRow("fp8", FP8_COMPUTE, real=True, in_format_schedules=True)):
    add_builtin(_row)


def compute_path(record, platform: str | None = None) -> str:
    """What computes one recorded product (a `cpt_jax.cost.OpRecord`) on `platform`
    (default: jax's default backend): ``"fp32"`` (not quantized), ``"fake"`` (fake
    quantization), ``"int"`` (three integer GEMMs), ``"int8_forward"``, or the name of
    the provider row (``"block_formats"``, ``"lowp_gemm"``, ``"fp8"``, ...).

    Example:
      >>> model = cpt_jax.quantize_model(nn.Dense(3), config=cpt_jax.get_preset("int8"))
      >>> x = jnp.ones((2, 4))
      >>> [compute_path(op) for op in cpt_jax.count_ops(model, model.init(jax.random.key(0), x), x)]
      ['int']
    """
    product = getattr(record, "product", None)
    if product is None or product.config is None or not record.quantized:
        return "fp32"
    provider = default_provider(product.config)
    if provider is INTEGER:
        return integer_path(product, len(record.lhs_shape), len(record.rhs_shape),
                            platform=platform or jax.default_backend())
    if provider is FAKE_QUANT:
        return "fake"
    return next((row.name for row in PROVIDERS.values() if row.provider is provider),
                type(provider).__name__)


def compute_paths(records, platform: str | None = None) -> dict[str, int]:
    """How many recorded products each `compute_path` computes (``summary.json``)."""
    counts: dict[str, int] = {}
    for record in records:
        path = compute_path(record, platform)
        counts[path] = counts.get(path, 0) + 1
    return dict(sorted(counts.items()))


__all__ = ["PROVIDERS", "ProviderRow", "branch_provider", "compute_path", "compute_paths",
           "default_provider",
           "register_provider", "unregister_provider", "uses_block_format"]
