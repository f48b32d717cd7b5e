"""Precision controllers: bits that answer the run's own statistics, compiled once.

A precision schedule is a function of the step alone. A controller also reads what
the previous step measured, in the optax idiom: ``init() -> state`` and
``update(state, stats, step) -> (bits, state)``, both pure and jittable, the state a
pytree that `cpt_jax.training.TrainState` carries (so it is checkpointed and resumed
bit for bit). The train step calls ``update`` with the statistics of step ``t - 1``
before computing step ``t``:

    bits_t, s_t = update(s_{t-1}, stats_{t-1}, t)        (stats_{-1} = `no_stats()`)

so a statistic acts on the next step (the bits of a step must be known before its
forward pass). `Bits` holds the forward bits and the error (backward) bits, which
may differ. A controller wraps a base: a `PrecisionSchedule` (the adjustment is in
bits) or a `cpt_jax.format_schedule` (the adjustment moves an index into its
formats, narrow to wide), through `adjust`:

    schedule base:  b_t = clip(max(base(t) + r_t, f_t), 1, 32)
    format base:    i_t = clip(max(index(t) + r_t, f_t), 0, n - 1),  b_t = w_{i_t}

with ``r_t`` the controller's raise and ``f_t`` its floor (bits, or a format index).

`StepStats` (what the step measures, cheaply): ``loss``, ``grad_norm`` (the global
L2 norm of the raw gradients), ``nonfinite`` (non-finite gradient elements, plus one
for a non-finite loss) and, when the controller asks for it
(``measure_every > 0``), ``quant_effect``: the quantization's relative effect on the
loss, ``(L_q - L_32) / |L_32|``, from one extra full-precision forward pass on the
same batch, parameters and dropout mask every ``measure_every`` steps (NaN on the
others). A model quantized with ``provider=measure_products()`` also reports each
product's relative quantization error ``|y_q - y| / |y|`` (``metrics["quant_error"]``,
by product path; ``quant_error`` in `StepStats` is the largest).

The built-ins:

===================  ==========================================================
`on_instability`     ``r_t = boost`` for ``hold`` steps after a step whose
                     statistic exceeds ``ratio`` times its running mean (an EMA
                     with `decay`), or whose loss or gradients are non-finite
`on_plateau`         optax ``contrib.reduce_on_plateau`` on the statistic; each
                     reduction raises the floor: ``f = min(floor + k increment,
                     max_floor)`` after ``k`` reductions
`online_range_test`  CPT's precision range test, online: the floor starts at
                     `start` and drops by one each time the mean statistic over
                     `window` steps at the floor stays ``<= threshold``; the first
                     window above it raises the floor back by one and ends the test
`final_phase`        a schedule: ``join([base, constant(bits)])``, the last
                     `fraction` of the steps at `bits`
`scheduled`          no adjustment: the base itself, as a controller
===================  ==========================================================

The main job chooses a controller by name (``--config.precision.controller=NAME``)
from a registry: `register_controller(name, build, doc=..., fields=...)` adds one (its
``config.precision.controller_*`` fields, their defaults, help and allowed values, and
a builder given a `ControllerContext`: the base, the error schedule, the run's length,
ops and cost table); the job's choices, validation, config defaults and ``--help``
read `CONTROLLERS`. The built-ins above are registered so (`_builtins`).

The cost counts the bits actually used: the train step adds each step's
``(forward, error)`` bits to a ``33 x 33`` table of counts (`ControllerCarry`),
and `realized_cost` turns it into BitOps (`cpt_jax.cost.bitops_per_step`).

Example:
  >>> from cpt_jax.models import MLP
  >>> base = cpt_jax.cyclic("cos_growth", min_bits=3, max_bits=8, num_cycles=2,
  ...                       total_steps=8)
  >>> controller = on_instability(base, ratio=2.0, boost=2, hold=3)
  >>> qmodel = cpt_jax.quantize_model(MLP(hidden=(16,), num_classes=3))
  >>> x, y = jnp.ones((8, 4)), jnp.zeros((8,), jnp.int32)
  >>> state = cpt_jax.create_train_state(qmodel, optax.sgd(0.1), jax.random.key(0), x,
  ...                                    controller=controller)
  >>> step = cpt_jax.make_train_step(qmodel, optax.sgd(0.1), controller=controller)
  >>> for _ in range(4):
  ...     state, metrics = step(state, {"inputs": x, "labels": y})
  >>> step.num_compiles, int(state.controller.counts.sum())
  (1, 4)
"""

from __future__ import annotations

from cpt_jax.controllers import _builtins  # noqa: E402,F401  (registers the built-ins)
from cpt_jax.controllers._core import (
    NUM_LEVELS,
    STATISTICS,
    Bits,
    ControllerCarry,
    InstabilityState,
    MeasuredProvider,
    PlateauState,
    PrecisionController,
    RangeTestState,
    StepStats,
    adjust,
    advance_carry,
    bits_histogram,
    bits_level,
    check_base,
    cost_table,
    error_bits,
    final_phase,
    init_carry,
    is_format_schedule,
    measure_products,
    measured_steps,
    no_stats,
    on_instability,
    on_plateau,
    online_range_test,
    product_errors,
    realized_cost,
    scheduled,
    stats_of,
)
from cpt_jax.controllers._registry import (
    CONTROLLERS,
    ControllerContext,
    ControllerField,
    ControllerSpec,
    controller_doc,
    controller_fields,
    controller_names,
    get_controller,
    register_controller,
    unregister_controller,
)

__all__ = [
    "Bits",
    "CONTROLLERS",
    "ControllerCarry",
    "ControllerContext",
    "ControllerField",
    "ControllerSpec",
    "InstabilityState",
    "MeasuredProvider",
    "NUM_LEVELS",
    "PlateauState",
    "PrecisionController",
    "RangeTestState",
    "STATISTICS",
    "StepStats",
    "adjust",
    "advance_carry",
    "bits_histogram",
    "bits_level",
    "check_base",
    "controller_doc",
    "controller_fields",
    "controller_names",
    "cost_table",
    "error_bits",
    "final_phase",
    "get_controller",
    "init_carry",
    "is_format_schedule",
    "measure_products",
    "measured_steps",
    "no_stats",
    "on_instability",
    "on_plateau",
    "online_range_test",
    "product_errors",
    "realized_cost",
    "register_controller",
    "scheduled",
    "stats_of",
    "unregister_controller",
]
