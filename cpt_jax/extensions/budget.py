"""``budget``: a precision controller that keeps the run's cost within a fraction of static 8/8.

Written only through the public controller idiom (`cpt_jax.controllers.PrecisionController`,
`adjust`, `error_bits`) and registered with `cpt_jax.register_controller`, as a user's
own module would be (``--config.precision.controller=budget``).

With ``c(b, g)`` a step's BitOps at forward bits ``b`` and error bits ``g`` (the run's
cost table, the bits actually used) over ``C_8`` those of static 8/8 (integer, the
``relative_cost_static8`` baseline), ``S_t`` the cumulative relative cost of the steps
``0 .. t-1`` and ``r`` the offset (in levels: bits, or formats over a schedule over
formats) of the previous step from the base, step ``t`` takes the highest level

    l_t = max { l : low <= l <= min(high, base(t) + r + 1),
                    S_t + c(bits(l), g_t) / C_8 <= target * (t + 1) }

(the lowest, ``low``, when none fits), so the bits rise at most one level a step
and fall as far as the budget needs, around the schedule: while the floor fits, the
cost of the steps done never passes ``target`` times as many static 8/8 steps.
``low`` / ``high`` are the schedule's range (``min_bits`` / ``max_bits``, or the
formats). The errors keep their schedule (their bits are in ``c``).
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from cpt_jax import controllers as ctl
from cpt_jax import cost as cost_lib

Array = jax.Array
OFFSETS = np.arange(-32.0, 33.0, dtype=np.float32)
"""The offsets (levels) from the base a step may take."""


class BudgetState(NamedTuple):
    """`budget`'s state: the cumulative relative cost `spent` of the steps done (in
    static 8/8 steps) and the last step's `offset` from the base (levels)."""

    spent: Array
    offset: Array


def budget(base, *, target: float, table, baseline: float, low: float, high: float,
           error_base=None) -> ctl.PrecisionController:
    """Keep the run's cumulative cost within `target` times static 8/8 (module docstring).

    Args:
      base: a `PrecisionSchedule` or a ``cpt_jax.format_schedule`` (levels are formats).
      target: the budget, a fraction of static 8/8's cost (> 0).
      table: BitOps of one step at each ``(forward, error)`` bits, ``(33, 33)``
        (`cpt_jax.controllers.cost_table`).
      baseline: BitOps of one static 8/8 step (``cpt_jax.cost.bitops_per_step(ops, 8, 8)``).
      low, high: the levels it may use (bits, or format indices).
      error_base: the error bits' schedule (None: fp32 errors).

    Returns:
      A `PrecisionController`.

    Example:
      >>> c = budget(cpt_jax.constant(6), target=0.6, table=cpt_jax.controllers.cost_table(),
      ...            baseline=192.0, low=3, high=8, error_base=cpt_jax.constant(8))
      >>> state, seen = c.init(), []
      >>> for t in range(6):
      ...     bits, state = c.update(state, None, t)
      ...     seen.append(int(bits.forward))
      >>> seen
      [5, 5, 6, 5, 5, 6]
    """
    ctl.check_base(base)
    target = float(target)
    if not np.isfinite(target) or target <= 0:
        raise ValueError(f"target={target!r} must be a number > 0")
    if float(low) > float(high):
        raise ValueError(f"low={low!r} must be <= high={high!r}")
    relative = jnp.asarray(np.asarray(table, np.float64) / float(baseline), jnp.float32)
    offsets = jnp.asarray(OFFSETS)

    def init():
        return BudgetState(spent=jnp.float32(0.0), offset=jnp.float32(0.0))

    def update(state, stats, step):
        del stats
        g = ctl.error_bits(error_base, step)
        cost_of = lambda bits: relative[ctl.bits_level(bits), ctl.bits_level(g)]  # noqa: E731
        base_level = ctl.adjust(base, step)[1]
        bits_k, level_k = jax.vmap(lambda k: ctl.adjust(base, step, raise_by=k))(offsets)
        cap = jnp.minimum(float(high), base_level + state.offset + 1.0)
        allowed = (level_k >= low) & (level_k <= cap) & (level_k - base_level == offsets)
        allowance = target * (jnp.asarray(step, jnp.float32) + 1.0)
        fits = allowed & (state.spent + jax.vmap(cost_of)(bits_k) <= allowance)
        best = jnp.max(jnp.where(fits, offsets, -jnp.inf))
        k = jnp.where(jnp.any(fits), best, float(low) - base_level)
        bits, level = ctl.adjust(base, step, raise_by=k)
        return ctl.Bits(bits, g), BudgetState(spent=state.spent + cost_of(bits),
                                              offset=level - base_level)

    return ctl.PrecisionController(init=init, update=update)


def build_budget(ctx: ctl.ControllerContext) -> ctl.PrecisionController:
    """`budget` from the main job's context: ``controller_budget``, its cost table and ops."""
    table = ctx.cost_table if ctx.cost_table is not None else ctl.cost_table(ctx.ops)
    return budget(ctx.base, target=ctx.config["controller_budget"], table=table,
                  baseline=float(cost_lib.bitops_per_step(ctx.ops, 8.0, 8.0)), low=ctx.low,
                  high=ctx.high, error_base=ctx.error_base)


ctl.register_controller(
    "budget", build_budget,
    doc="Keep the run's cumulative cost within controller_budget times static 8/8: each "
        "step the highest bits (rising one level a step, from min_bits to max_bits) whose "
        "cost keeps the steps done within the budget.",
    fields={"controller_budget": ctl.ControllerField(
        0.5, "the run's cumulative cost <= this fraction of static 8/8", low=0.0,
        low_open=True)})

__all__ = ["BudgetState", "budget", "build_budget"]
