"""A user's own module (outside cpt_jax): a format, a preset and a controller, each
registered with the public calls. Importing it registers them; a ``--config`` file of
the main job that imports it offers them on the command line (tests/test_user_extension.py).
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp

import cpt_jax
from cpt_jax import controllers as ctl
from cpt_jax import formats


@dataclasses.dataclass(frozen=True)
class Thirds:
    """Multiples of ``max|x| / 3`` per tensor (seven levels), whatever the width:
    3-bit codes and one fp32 scale per tensor (not counted)."""

    def grid(self, x, bits, rounding, key):
        scale = jnp.maximum(formats.finite_absmax(x, None) / 3.0, 1e-30)
        return formats.round_to_integer(x / scale, rounding, key) * scale

    def bits_per_element(self, bits):
        return jnp.float32(3.0)

    def traits(self):
        return formats.FormatTraits("thirds", "tensor")


THIRDS = cpt_jax.QuantConfig(weight=cpt_jax.TensorQuant(Thirds()),
                             activation=cpt_jax.TensorQuant(Thirds()),
                             error=cpt_jax.TensorQuant(Thirds(), "stochastic"))
cpt_jax.register_preset("thirds", THIRDS, "Seven levels, max|x| / 3 apart, everywhere.")


def build_every_other(ctx: ctl.ControllerContext) -> ctl.PrecisionController:
    """The base, raised by ``controller_lift`` bits every ``controller_every``-th step."""
    every, lift = ctx.config["controller_every"], ctx.config["controller_lift"]

    def update(state, stats, step):
        raise_by = jnp.where(step % every == 0, float(lift), 0.0)
        return ctl.Bits(ctl.adjust(ctx.base, step, raise_by=raise_by)[0],
                        ctl.error_bits(ctx.error_base, step)), state

    return ctl.PrecisionController(init=lambda: (), update=update)


cpt_jax.register_controller(
    "every_other", build_every_other,
    doc="The base, raised by controller_lift bits every controller_every-th step.",
    fields={"controller_every": ctl.ControllerField(2, "steps between raises", low=1),
            "controller_lift": ctl.ControllerField(2, "bits added on those steps", low=0)})


def unregister() -> None:
    """Remove what importing this module registered (tests)."""
    cpt_jax.quant_config.unregister_preset("thirds")
    ctl.unregister_controller("every_other")
