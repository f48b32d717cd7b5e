"""Providers: what a quantized product computes, given the `Product` and the widths.

One stage of the data path (step -> schedule -> precision context -> interception
-> **provider** -> quantized product -> cost). A provider is an object with
``compute(product, lhs, rhs, state, apply) -> y`` (`cpt_jax.interception.Provider`);
the interception hands it every product of a model, the provider decides what that
product computes. One module per provider:

========================  ====================================================
module                    provider
========================  ====================================================
``fake_quant``            `FakeQuantProvider` (`FAKE_QUANT`): CPT's fake quant,
                          the default and the base class of the others
``integer``               `IntegerProvider` (`INTEGER`): all three GEMMs of a product
                          on int8 codes, int32 accumulation (``compute="int"``, and
                          ``"auto"`` on `integer_gemm_platforms`)
``int8``                  `Int8Provider` (`INT8_FORWARD`): int8 forward products
                          (tiles, convolutions) for the integer provider
``block_formats``         `BlockFormatProvider` (`BLOCK_FORMATS`): MX / NVFP4 /
                          ScaledFloat blocks along each product's contraction;
                          `FP8ComputeProvider` (`FP8_COMPUTE`): float8 products
``running_ranges``        `RunningRangeProvider` (`RUNNING_RANGES`): CPT's
                          running activation ranges, evaluation batch-independent
``delayed_scaling``       `DelayedScalingProvider`: activations scaled from a
                          history (delayed scaling, Autoflex); `DelayedFP8Provider`:
                          Transformer Engine's delayed scaling (``fp8_delayed``)
``static_ranges``         `CalibrationProvider`, `StaticRangeProvider`: export's
                          calibration and its fake-quant reference
``exported``              `ExportedModelProvider`: an exported int8 model
``lowp_gemm``             `LowpGemmProvider` (`LOWP_GEMM`): forward and both
                          backward GEMMs on FP8 / MX / NVFP4 codes
``format_switch``         `FormatSwitchProvider` (`FORMAT_SWITCH`): one format
                          per step (``lax.switch``), `cpt_jax.format_schedule`
========================  ====================================================

`PROVIDERS` is the one table from a `QuantConfig` to its provider (`default_provider`;
a new provider is one module plus one row, `register_provider`).
"""
from cpt_jax.providers._default import (
    PROVIDERS,
    ProviderRow,
    branch_provider,
    compute_path,
    compute_paths,
    default_provider,
    register_provider,
    unregister_provider,
)
from cpt_jax.providers.block_formats import (
    BLOCK_FORMATS,
    FP8_COMPUTE,
    BlockFormatProvider,
    FP8ComputeProvider,
    provider_for,
)
from cpt_jax.providers.delayed_scaling import DelayedFP8Provider, DelayedScalingProvider
from cpt_jax.providers.exported import ExportedModelProvider
from cpt_jax.providers.fake_quant import (
    FAKE_QUANT,
    FakeQuantProvider,
    along_product,
    key_for,
    operand_quant,
    with_channel_axis,
)
from cpt_jax.providers.format_switch import FORMAT_SWITCH, FormatSwitchProvider
from cpt_jax.providers.int8 import INT8_FORWARD, Int8Provider
from cpt_jax.providers.int_platforms import integer_gemm_platforms
from cpt_jax.providers.integer import INTEGER, IntegerProvider, integer_path
from cpt_jax.providers.lowp_gemm import LOWP_GEMM, LowpGemmProvider
from cpt_jax.providers.running_ranges import RUNNING_RANGES, RunningRange, RunningRangeProvider
from cpt_jax.providers.static_ranges import CALIBRATION, CalibrationProvider, StaticRangeProvider

__all__ = (
    "FORMAT_SWITCH",
    "FormatSwitchProvider",
    "LOWP_GEMM",
    "LowpGemmProvider",
    "BLOCK_FORMATS",
    "CALIBRATION",
    "CalibrationProvider",
    "DelayedFP8Provider",
    "DelayedScalingProvider",
    "ExportedModelProvider",
    "FAKE_QUANT",
    "FP8ComputeProvider",
    "FP8_COMPUTE",
    "FakeQuantProvider",
    "BlockFormatProvider",
    "INT8_FORWARD",
    "INTEGER",
    "Int8Provider",
    "IntegerProvider",
    "integer_gemm_platforms",
    "integer_path",
    "RUNNING_RANGES",
    "RunningRange",
    "RunningRangeProvider",
    "StaticRangeProvider",
    "along_product",
    "PROVIDERS",
    "ProviderRow",
    "branch_provider",
    "default_provider",
    "register_provider",
    "unregister_provider",
    "compute_path",
    "compute_paths",
    "key_for",
    "operand_quant",
    "provider_for",
    "with_channel_axis",
)
