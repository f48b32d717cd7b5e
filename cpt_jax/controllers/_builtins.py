"""The built-in controllers as the main job chooses them: each registered by name with
its ``config.precision.controller_*`` fields and a builder (`register_controller`).

===================  =====================================================
``on_instability``   `on_instability` around the run's schedule: a boost of
                     ``controller_boost`` for ``controller_hold`` steps
``on_plateau``       `on_plateau`: the floor rises from the base's low end
                     to its high end by ``controller_boost`` per plateau
``online_range_test``  `online_range_test`: the floor starts at the high end
                     and drops to the low end while the statistic allows
``final_phase``      `final_phase`: the schedules' last fraction at
                     ``controller_bits`` (a schedule, no controller)
===================  =====================================================
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from cpt_jax.controllers._core import (
    STATISTICS,
    final_phase,
    on_instability,
    on_plateau,
    online_range_test,
)
from cpt_jax.controllers._registry import ControllerContext, ControllerField, register_controller

STATISTIC = ControllerField(
    "", "the statistic watched: grad_norm | loss | quant_effect | quant_error (\"\": the "
        "controller's own; quant_error quantizes the model with measure_products())",
    choices=("",) + STATISTICS)


def _statistic(ctx: ControllerContext, default: str) -> str:
    return ctx.config["controller_statistic"] or default


def build_on_instability(ctx: ControllerContext):
    """`on_instability` from the context (statistic default ``grad_norm``)."""
    c = ctx.config
    return on_instability(ctx.base, statistic=_statistic(ctx, "grad_norm"),
                          ratio=c["controller_ratio"], boost=c["controller_boost"],
                          hold=c["controller_hold"], error_base=ctx.error_base,
                          error_boost=c["controller_error_boost"])


def build_on_plateau(ctx: ControllerContext):
    """`on_plateau` from the context: the floor from `low` to `high` (statistic ``loss``)."""
    c = ctx.config
    return on_plateau(ctx.base, floor=ctx.low, max_floor=ctx.high,
                      increment=c["controller_boost"], statistic=_statistic(ctx, "loss"),
                      patience=c["controller_patience"], error_base=ctx.error_base)


def build_online_range_test(ctx: ControllerContext):
    """`online_range_test` from the context: from `high` down to `low` (``quant_effect``)."""
    c = ctx.config
    return online_range_test(ctx.base, start=ctx.high, min_floor=ctx.low,
                             threshold=c["controller_threshold"], window=c["controller_window"],
                             statistic=_statistic(ctx, "quant_effect"),
                             error_base=ctx.error_base)


def final_phase_bits(c: Mapping[str, Any]) -> float:
    """The last phase's bits: ``controller_bits``, or ``max_bits`` when it is 0."""
    return c["controller_bits"] or c["max_bits"]


def final_phase_schedules(c: Mapping[str, Any], fwd, grad, total_steps: int) -> tuple:
    """The schedules' last ``controller_fraction`` at `final_phase_bits` (the errors at
    ``max(grad_bits, that)``: the whole last phase in higher precision)."""
    fraction = c["controller_fraction"]
    if fwd is not None:
        fwd = final_phase(fwd, fraction, final_phase_bits(c), total_steps=total_steps)
    if grad is not None:
        last = max(int(c["grad_bits"]), int(final_phase_bits(c)))
        grad = final_phase(grad, fraction, last, total_steps=total_steps)
    return fwd, grad


def final_phase_eval_bits(c: Mapping[str, Any]) -> float:
    """The highest bits of the run: ``max(max_bits, final_phase_bits)``."""
    return float(max(c["max_bits"], final_phase_bits(c)))


BOOST = "bits (formats, with precision.formats) added while boosted"
register_controller(
    "on_instability", build_on_instability,
    doc="Raise the bits by controller_boost for controller_hold steps when the statistic "
        "passes controller_ratio times its running mean, or the step is not finite.",
    fields={"controller_statistic": STATISTIC,
            "controller_ratio": ControllerField(
                2.0, "triggers when statistic > ratio * its running mean", low=0.0,
                low_open=True),
            "controller_boost": ControllerField(2, BOOST, low=0),
            "controller_error_boost": ControllerField(
                0, "bits added to the errors while boosted", low=0),
            "controller_hold": ControllerField(10, "boosted steps after a trigger", low=1)})
register_controller(
    "on_plateau", build_on_plateau,
    doc="Raise the floor of the bits (from min_bits to max_bits) by controller_boost each "
        "time the statistic has not improved for controller_patience steps (optax).",
    fields={"controller_statistic": STATISTIC,
            "controller_boost": ControllerField(
                2, "the floor's rise per plateau (formats, with precision.formats)", low=1),
            "controller_patience": ControllerField(
                20, "steps without improvement before the floor rises (optax)", low=1)})
register_controller(
    "online_range_test", build_online_range_test,
    doc="CPT's precision range test, online: the floor starts at max_bits and drops to "
        "min_bits while the mean statistic over controller_window steps at the floor "
        "stays <= controller_threshold.",
    fields={"controller_statistic": STATISTIC,
            "controller_window": ControllerField(20, "steps at the floor per decision", low=1),
            "controller_threshold": ControllerField(
                0.02, "largest mean quant_effect, (L_q - L_32) / L_32")})
register_controller(
    "final_phase", schedules=final_phase_schedules, eval_bits=final_phase_eval_bits,
    doc="A schedule: the last controller_fraction of the steps at controller_bits (0: "
        "max_bits), errors too.",
    fields={"controller_fraction": ControllerField(
                0.25, "the last fraction of the steps, at controller_bits", low=0.0, high=1.0),
            "controller_bits": ControllerField(
                0, "bits of the last phase (0: max_bits)", low=0, high=32)})

__all__ = ["build_on_instability", "build_on_plateau", "build_online_range_test",
           "final_phase_eval_bits", "final_phase_schedules"]
