"""cpt_jax: cyclic precision training and low-precision tools for JAX/Flax.

The bit-width is data, not configuration: precision schedules are pure functions of
the step (like optax schedules), number formats take a traced `bits`, and a
`precision` context carries the widths to every product of a quantized model, so a
whole cyclic run compiles once.

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

The package follows one training step (each a subpackage or module):
`schedules` (step -> bits) -> `context` (the `precision` context) ->
`interception` (every product a model computes) -> `providers` (what a product
computes) -> `ops` (the quantized products, pure JAX) -> `formats` (the number
formats) -> `cost` (BitOps); beside them `quant_config`, `doors`
(`quantize_model`), `training`, `optim`, `allocation`, `export`, `data`, `models`,
`distributed`, and `runner` (the main job, not imported by ``import cpt_jax``).
"""
import importlib as _importlib

from cpt_jax import (
    context,
    controllers,
    cost,
    doors,
    extensions,  # noqa: F401  (discovers its modules: each registers what it defines)
    formats,
    interception,
    ops,
    providers,
    quant_config,
    schedules,
    training,
)
from cpt_jax.context import current_precision, full_precision, precision
from cpt_jax.controllers import (
    PrecisionController,
    final_phase,
    on_instability,
    on_plateau,
    online_range_test,
    register_controller,
)
from cpt_jax.cost import bitops_per_step, count_ops, run_cost
from cpt_jax.doors import (
    CPT_RULES,
    FP32_ATTENTION,
    quantize_model,
    quantized_layers,
)
from cpt_jax.format_schedules import format_schedule
from cpt_jax.formats import (
    MX,
    NVFP4,
    AffineInt,
    BlockFloat,
    FixedElement,
    FixedPoint,
    Float,
    FloatElement,
    IntElement,
    OCPFloat,
    Quantizer,
    ScaledFloat,
    Scaling,
    SymmetricInt,
    as_quantizer,
    bits_per_element,
    quantize,
    register_format,
)
from cpt_jax.interception import Product, Provider
from cpt_jax.ops import fake_quant, quantize_grad
from cpt_jax.providers import FakeQuantProvider, register_provider
from cpt_jax.quant_config import (
    CPT_CONFIG,
    PRESETS,
    LowpGemm,
    QuantConfig,
    TensorQuant,
    get_preset,
    register_preset,
)
from cpt_jax.schedules import (
    PrecisionSchedule,
    clip,
    constant,
    cpt,
    critical_period,
    cyclic,
    join,
    mean_bits,
    offset,
    scale,
    schedule_values,
    switch,
)
from cpt_jax.training import TrainState, create_train_state, make_eval_step, make_train_step

__version__ = "0.1.0"

# Imported on first use: they bring heavier dependencies (orbax, TFDS, absl, ...).
_LAZY_SUBPACKAGES = ("allocation", "data", "distributed", "export", "models", "optim", "runner")

# Names that left the top level (issue 42), still resolved where they live now.
_MOVED = {"QuantDotGeneral": "doors", "QuantConvGeneralDilated": "doors", "QuantEinsum": "doors",
          "LAST_PRODUCT": "doors", "compute_product": "interception", "OpRecord": "cost",
          "total_macs": "cost", "relative_cost_per_step": "cost", "INT8_CONFIG": "quant_config"}


def __getattr__(name):
    if name in _LAZY_SUBPACKAGES:
        return _importlib.import_module(f"cpt_jax.{name}")
    if name in _MOVED:
        return getattr(_importlib.import_module(f"cpt_jax.{_MOVED[name]}"), name)
    raise AttributeError(f"module 'cpt_jax' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY_SUBPACKAGES))


# The library's own names: the runner, data, optimizers and distributed pieces are
# imported from their subpackages (`cpt_jax.runner`, `cpt_jax.data`, `cpt_jax.optim`,
# `cpt_jax.distributed`); the explicit layers from `cpt_jax.doors`, op records and MAC
# counts from `cpt_jax.cost`. Names that left this list still resolve as attributes.
__all__ = (
    # precision context
    "precision",
    "full_precision",
    "current_precision",
    # schedules
    "PrecisionSchedule",
    "constant",
    "cyclic",
    "cpt",
    "critical_period",
    "join",
    "switch",
    "offset",
    "scale",
    "clip",
    "schedule_values",
    "mean_bits",
    "format_schedule",
    # precision controllers (bits from the run's statistics)
    "PrecisionController",
    "on_instability",
    "on_plateau",
    "online_range_test",
    "final_phase",
    "register_controller",
    # quantizer configs
    "QuantConfig",
    "TensorQuant",
    "PRESETS",
    "get_preset",
    "register_preset",
    "register_format",
    "register_provider",
    "CPT_CONFIG",
    "LowpGemm",
    # number formats
    "AffineInt",
    "SymmetricInt",
    "FixedPoint",
    "BlockFloat",
    "Float",
    "OCPFloat",
    "MX",
    "NVFP4",
    "ScaledFloat",
    # formats as compositions: element x scaling
    "Quantizer",
    "Scaling",
    "IntElement",
    "FixedElement",
    "FloatElement",
    "as_quantizer",
    "quantize",
    "bits_per_element",
    # quantized products
    "fake_quant",
    "quantize_grad",
    # models
    "quantize_model",
    "quantized_layers",
    "CPT_RULES",
    "FP32_ATTENTION",
    # the seam
    "Product",
    "Provider",
    "FakeQuantProvider",
    # cost
    "count_ops",
    "bitops_per_step",
    "run_cost",
    # training
    "TrainState",
    "create_train_state",
    "make_train_step",
    "make_eval_step",
    # subpackages
    "allocation",
    "context",
    "controllers",
    "cost",
    "doors",
    "export",
    "formats",
    "interception",
    "models",
    "ops",
    "providers",
    "quant_config",
    "schedules",
    "training",
)
