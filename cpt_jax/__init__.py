"""cpt_jax: cyclic precision training and low-precision tools for JAX/Flax.

The bit-width is data, not configuration: precision schedules are pure functions of
the step (like optax schedules), number formats take a traced `bits`, and a
`precision` context carries the widths to every quantized layer, so a whole cyclic
run compiles once.

Quick start::

    import cpt_jax, flax.linen as nn, jax
    model = cpt_jax.quantize_model(MyFlaxModel(), rules=cpt_jax.CPT_RULES)
    schedule = cpt_jax.cyclic("cos_growth", min_bits=3, max_bits=8,
                              num_cycles=32, total_steps=64_000)

    @jax.jit
    def loss_fn(params, x, y, step, rng):
        with cpt_jax.precision(schedule(step), grad_bits=8, rng=rng):
            logits = model.apply(params, x)
        ...
"""
from cpt_jax.quant_config import (
    CPT_CONFIG,
    FULL_PRECISION,
    INT8_CONFIG,
    PRESETS,
    FormatSwitch,
    LowpGemm,
    QuantConfig,
    TensorQuant,
    get_preset,
)
from cpt_jax.context import current_precision, full_precision, precision
from cpt_jax.cost import (
    OpRecord,
    bitops_per_step,
    count_ops,
    fp32_bitops_per_step,
    relative_cost_per_step,
    run_cost,
    total_macs,
    trace_ops,
)
from cpt_jax.fake_quant import fake_quant, quantize_grad
from cpt_jax.formats import (
    MX,
    NVFP4,
    AffineInt,
    BlockFloat,
    FixedPoint,
    Float,
    OCPFloat,
    ScaledFloat,
    SymmetricInt,
    bits_per_element,
    grid_step,
    quantize,
    representable_range,
)
from cpt_jax.schedules import (
    CONVENTIONS,
    SUITE,
    PrecisionSchedule,
    clip,
    constant,
    cpt,
    critical_period,
    cyclic,
    join,
    mean_bits,
    offset,
    plot_schedule,
    plot_schedules,
    scale,
    schedule_values,
)
from cpt_jax.interception import Product, ProductOp, compute_product
from cpt_jax.providers import FakeQuantProvider
from cpt_jax.activation_ranges import RUNNING_RANGES, RunningRange, RunningRangeProvider
from cpt_jax.format_providers import BLOCK_FORMATS, FP8_COMPUTE, BlockFormatProvider, FP8ComputeProvider
from cpt_jax.lowp_gemm import LOWP_GEMM, LowpGemmProvider
from cpt_jax.format_schedules import FORMAT_SWITCH, FormatSchedule, format_schedule
from cpt_jax.transform import (
    CPT_RULES,
    FP32_ATTENTION,
    LAST_PRODUCT,
    LayerProduct,
    QuantConv,
    QuantConvGeneralDilated,
    QuantDotGeneral,
    QuantEinsum,
    QuantizedModel,
    int8_dot_general,
    quantize_model,
    quantized_conv,
    quantized_dot_general,
    quantized_einsum,
    quantized_layers,
)

__version__ = "0.1.0"

from cpt_jax import optim  # noqa: E402  (lp_sgd, swalp, halp, svrg, lp_svrg, ...)
from cpt_jax import export  # noqa: E402  (calibrate, export_model, int8_apply, ...)
from cpt_jax.optim import HALPState, LPQuant, halp, lp_sgd, lp_svrg, optim_lp, recompute_batch_stats, svrg, swa, swa_params, swalp  # noqa: E402
