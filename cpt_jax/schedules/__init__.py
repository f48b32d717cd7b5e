"""Precision schedules: pure functions of the training step, like `optax.Schedule`.

A `PrecisionSchedule` maps a step (a Python int or a traced int32 scalar inside
`jit`) to a bit-width, returned as a float32 scalar holding an integer value.
Factories build them and they compose (`join`, `offset`, `scale`, `clip`), so the
whole precision plan of a run is one function evaluated on device from the step.

The cyclic suite of Wolfe & Kyrillidis (2024) follows, with ``z = (t mod P) / P``,
``D = max_bits - min_bits`` and ``rint`` (round half to even) applied to every value:

========================  =========================================
cos_growth (= CPT)        ``q_min + D/2 (1 - cos(pi z))``
cos_decay                 ``q_max - D/2 (1 - cos(pi z))``
linear_growth             ``q_min + D z``
linear_decay              ``q_max - D z``
exp_growth                ``q_max - D e^(-4z)``
exp_decay_vertical        ``q_min + D e^(-4z)``
exp_decay_horizontal      ``q_max - D e^(-4(1-z))``
demon_growth              ``q_max - D u / (0.1 + 0.9u)``, ``u = 1 - z``
demon_decay_vertical      ``q_min + D u / (0.1 + 0.9u)``
demon_decay_horizontal    ``q_max - D z / (0.1 + 0.9z)``
========================  =========================================

``*_growth`` repeat their curve every cycle (a sawtooth). ``*_decay`` are triangular:
even cycles (0, 2, ...) use the decay curve, odd cycles the matching growth curve, so
the run starts at ``q_max``.

Period conventions (``T`` total steps, ``n`` cycles), `CONVENTIONS`:

* ``"ceil"`` (default): ``P = ceil(T/n)``; equal to ``T/n`` when ``n`` divides ``T``,
  otherwise the last cycle is cut short instead of an extra partial cycle starting
  at ``q_min`` at the end of the run.
* ``"floor"``: ``P = floor(T/n)``, CPT's code (``int(iters / num_cyclic_period)``).
* ``"wolfe"``: ``P = floor(T/n) + 1``, the Wolfe et al. scripts (CIFAR, GNN, PTB,
  VOC, XNLI).

Exactness: a cycle's values are computed once, when the schedule is built, from
the integers ``t mod P`` and ``P``: exactly (integer arithmetic) where the curve's
value is rational (linear and demon curves everywhere, cos at ``z`` in {0, 1/3,
1/2, 2/3}), in float64 elsewhere (cos, exp: their other values are irrational, so
never a tie). Every value is therefore ``rint`` of the exact value of the formula,
ties at .5 included (round half to even): the float64 evaluation of the formulas
above, except where float64 itself lands an ulp off an exact tie (e.g. ``1 -
cos(pi/3)`` is ``0.4999999999999999`` in float64). On device the schedule is a
lookup of the step's level among the few points where the rounded value changes:
traced, one compile, no float32 rounding.
"""
from cpt_jax.schedules._combinators import (
    clip,
    join,
    mean_bits,
    offset,
    scale,
    schedule_values,
    switch,
)
from cpt_jax.schedules._schedules import (
    CONVENTIONS,
    SUITE,
    PrecisionSchedule,
    Step,
    constant,
    cpt,
    critical_period,
    curve_levels,
    cycle_period,
    cyclic,
    rint_fraction,
)
from cpt_jax.schedules.plots import plot_schedules

__all__ = (
    "CONVENTIONS",
    "PrecisionSchedule",
    "SUITE",
    "Step",
    "clip",
    "constant",
    "cpt",
    "critical_period",
    "curve_levels",
    "cycle_period",
    "cyclic",
    "join",
    "mean_bits",
    "offset",
    "plot_schedules",
    "rint_fraction",
    "scale",
    "schedule_values",
    "switch",
)
