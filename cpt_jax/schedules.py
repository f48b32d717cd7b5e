"""Precision schedules: pure functions of the training step, like `optax.Schedule`.

A `PrecisionSchedule` maps a step (a Python int or a traced int32 scalar inside
`jit`) to a bit-width, returned as a float32 scalar holding an integer value.
Factories build them and they compose (`join`, `offset`, `scale`, `clip`), so the
whole precision plan of a run is one function evaluated on device from the step.

The cyclic suite of Wolfe & Kyrillidis (2024) follows, with ``z = (t mod P) / P``,
``P = total_steps // num_cycles``, ``D = max_bits - min_bits`` and ``rint`` (round half
to even) applied to every value:

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
the run starts at ``q_max``. (The Wolfe code uses ``P = int(T/n) + 1``; we use
``T // n`` so that exactly ``n`` cycles fit in ``T`` steps, as CPT's code does.)
"""
from __future__ import annotations

from typing import Callable, Dict, Mapping, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array
Step = Union[int, Array]
PrecisionSchedule = Callable[[Step], Array]

_Curve = Callable[[Array, float, float], Array]


def _cos_growth(z, lo, hi):
    return lo + 0.5 * (hi - lo) * (1.0 - jnp.cos(jnp.pi * z))


def _cos_decay(z, lo, hi):
    return hi - 0.5 * (hi - lo) * (1.0 - jnp.cos(jnp.pi * z))


def _linear_growth(z, lo, hi):
    return lo + (hi - lo) * z


def _linear_decay(z, lo, hi):
    return hi - (hi - lo) * z


def _exp_growth(z, lo, hi):
    return hi - (hi - lo) * jnp.exp(-4.0 * z)


def _exp_decay_vertical(z, lo, hi):
    return lo + (hi - lo) * jnp.exp(-4.0 * z)


def _exp_decay_horizontal(z, lo, hi):
    return hi - (hi - lo) * jnp.exp(-4.0 * (1.0 - z))


def _demon(u):
    return u / (0.1 + 0.9 * u)


def _demon_growth(z, lo, hi):
    return hi - (hi - lo) * _demon(1.0 - z)


def _demon_decay_vertical(z, lo, hi):
    return lo + (hi - lo) * _demon(1.0 - z)


def _demon_decay_horizontal(z, lo, hi):
    return hi - (hi - lo) * _demon(z)


# name -> (curve of even cycles, curve of odd cycles)
_CURVES: Dict[str, tuple] = {
    "cos_growth": (_cos_growth, _cos_growth),
    "cos_decay": (_cos_decay, _cos_growth),
    "linear_growth": (_linear_growth, _linear_growth),
    "linear_decay": (_linear_decay, _linear_growth),
    "exp_growth": (_exp_growth, _exp_growth),
    "exp_decay_vertical": (_exp_decay_vertical, _exp_growth),
    "exp_decay_horizontal": (_exp_decay_horizontal, _exp_growth),
    "demon_growth": (_demon_growth, _demon_growth),
    "demon_decay_vertical": (_demon_decay_vertical, _demon_growth),
    "demon_decay_horizontal": (_demon_decay_horizontal, _demon_growth),
}

SUITE: tuple = tuple(_CURVES)
"""Names of every cyclic schedule of the Wolfe et al. suite (CPT is `cos_growth`)."""


# --------------------------------------------------------------------------- validation

def _is_static(value) -> bool:
    return not isinstance(value, jax.core.Tracer)


def _check_int(name: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer, float, np.floating)):
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    if float(value) != int(value) or int(value) < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def _check_bits_range(min_bits, max_bits) -> tuple[int, int]:
    lo = _check_int("min_bits", min_bits, 1)
    hi = _check_int("max_bits", max_bits, 1)
    if lo > hi:
        raise ValueError(f"min_bits must be <= max_bits, got min_bits={lo} > max_bits={hi}")
    return lo, hi


def cycle_period(total_steps: int, num_cycles: int) -> int:
    """``P = total_steps // num_cycles``, validated (`num_cycles >= 1`, `P >= 1`)."""
    cycles = _check_int("num_cycles", num_cycles, 1)
    total = _check_int("total_steps", total_steps, 1)
    if total < cycles:
        raise ValueError(
            f"total_steps must be >= num_cycles so each cycle has a step, got "
            f"total_steps={total} < num_cycles={cycles}")
    return total // cycles


def _as_step(step: Step) -> Array:
    return jnp.asarray(step, dtype=jnp.int32)


# --------------------------------------------------------------------------- factories

def cyclic(name: str, *, min_bits: int, max_bits: int, num_cycles: int,
           total_steps: int) -> PrecisionSchedule:
    """Cyclic precision: curve `name` of `SUITE`, repeated every ``P`` steps.

    ``b(t) = rint(curve(z))``, ``z = (t mod P)/P``, ``P = total_steps // num_cycles``;
    ``*_decay`` curves alternate with their growth curve (see module docstring).

    Example:
      >>> s = cyclic("cos_growth", min_bits=3, max_bits=8, num_cycles=32,
      ...            total_steps=64_000)
      >>> [int(s(t)) for t in (0, 1000, 1999, 2000)]
      [3, 6, 8, 3]
    """
    if name not in _CURVES:
        raise ValueError(f"unknown schedule name {name!r}; choose one of {SUITE}")
    lo, hi = _check_bits_range(min_bits, max_bits)
    period = cycle_period(total_steps, num_cycles)
    even_curve, odd_curve = _CURVES[name]

    def schedule(step: Step) -> Array:
        t = _as_step(step)
        z = (t % period).astype(jnp.float32) / period
        odd = (t // period) % 2 == 1
        value = jnp.where(odd, odd_curve(z, float(lo), float(hi)), even_curve(z, float(lo), float(hi)))
        return jnp.round(value).astype(jnp.float32)

    return schedule


def cpt(min_bits: int = 3, max_bits: int = 8, *, num_cycles: int = 32,
        total_steps: int = 64_000) -> PrecisionSchedule:
    """CPT's schedule (Fu et al. 2021): ``cyclic("cos_growth", ...)`` with its defaults.

    ``b_t = rint(q_min + (q_max - q_min)/2 (1 - cos(pi (t mod P)/P)))``.
    """
    return cyclic("cos_growth", min_bits=min_bits, max_bits=max_bits,
                  num_cycles=num_cycles, total_steps=total_steps)


def constant(bits: float) -> PrecisionSchedule:
    """``b(t) = bits`` for every step (static precision; ``bits >= 32`` is full precision).

    Example:
      >>> int(constant(8)(12345))
      8
    """
    value = float(_check_int("bits", bits, 1))

    def schedule(step: Step) -> Array:
        del step
        return jnp.asarray(value, jnp.float32)

    return schedule


def critical_period(low_bits: int, high_bits: int, deficit_steps: int) -> PrecisionSchedule:
    """A precision deficit early in training: ``b(t) = low_bits if t < D else high_bits``.

    The critical-learning-period study holds the forward bits at `low_bits` for
    ``D = deficit_steps`` steps, then trains at `high_bits` (Wolfe & Kyrillidis).

    Example:
      >>> s = critical_period(3, 8, deficit_steps=100)
      >>> int(s(99)), int(s(100))
      (3, 8)
    """
    lo = _check_int("low_bits", low_bits, 1)
    hi = _check_int("high_bits", high_bits, 1)
    d = _check_int("deficit_steps", deficit_steps, 0)

    def schedule(step: Step) -> Array:
        return jnp.where(_as_step(step) < d, float(lo), float(hi)).astype(jnp.float32)

    return schedule


def join(schedules: Sequence[PrecisionSchedule], boundaries: Sequence[int]) -> PrecisionSchedule:
    """Piecewise schedule with `optax.join_schedules` semantics.

    ``b(t) = schedules[i](t - boundaries[i-1])`` for ``boundaries[i-1] <= t < boundaries[i]``
    (with ``boundaries[-1] = 0``): each segment sees its own step count from 0.

    Example:
      >>> s = join([constant(8), cyclic("cos_growth", min_bits=3, max_bits=8,
      ...           num_cycles=1, total_steps=10)], boundaries=[5])
      >>> [int(s(t)) for t in (4, 5)]
      [8, 3]
    """
    schedules = list(schedules)
    boundaries = [int(b) for b in boundaries]
    if len(schedules) != len(boundaries) + 1:
        raise ValueError(
            f"join needs len(schedules) == len(boundaries) + 1, got {len(schedules)} "
            f"schedules and {len(boundaries)} boundaries")
    if any(b2 < b1 for b1, b2 in zip(boundaries, boundaries[1:])) or any(b < 0 for b in boundaries):
        raise ValueError(f"boundaries must be non-negative and non-decreasing, got {boundaries}")

    def schedule(step: Step) -> Array:
        t = _as_step(step)
        out = schedules[0](t)
        for boundary, segment in zip(boundaries, schedules[1:]):
            out = jnp.where(t < boundary, out, segment(t - boundary))
        return jnp.asarray(out, jnp.float32)

    return schedule


def offset(schedule: PrecisionSchedule, delta: float) -> PrecisionSchedule:
    """``b'(t) = b(t) + delta`` (e.g. backward bits a fixed amount above forward bits)."""
    return lambda step: (schedule(step) + float(delta)).astype(jnp.float32)


def scale(schedule: PrecisionSchedule, factor: float) -> PrecisionSchedule:
    """``b'(t) = rint(factor * b(t))`` (e.g. backward bits as a multiple of forward bits)."""
    return lambda step: jnp.round(schedule(step) * float(factor)).astype(jnp.float32)


def clip(schedule: PrecisionSchedule, min_bits: float = 1, max_bits: float = 32) -> PrecisionSchedule:
    """``b'(t) = clip(b(t), min_bits, max_bits)``."""
    lo, hi = _check_bits_range(min_bits, max_bits)
    return lambda step: jnp.clip(schedule(step), float(lo), float(hi)).astype(jnp.float32)


# --------------------------------------------------------------------------- helpers

def schedule_values(schedule: PrecisionSchedule, total_steps: int) -> np.ndarray:
    """The schedule evaluated at steps ``0 .. total_steps-1`` (one vectorized call)."""
    total = _check_int("total_steps", total_steps, 1)
    steps = jnp.arange(total, dtype=jnp.int32)
    values = jax.jit(jax.vmap(lambda t: jnp.asarray(schedule(t), jnp.float32)))(steps)
    return np.asarray(values)


def mean_bits(schedule: PrecisionSchedule, total_steps: int) -> float:
    """Mean bit-width over a run: ``(1/T) sum_{t<T} b(t)``.

    Example:
      >>> round(mean_bits(cpt(3, 8, num_cycles=32, total_steps=64_000), 64_000), 2)
      5.5
    """
    return float(np.mean(schedule_values(schedule, total_steps), dtype=np.float64))


def plot_schedules(schedules: Union[PrecisionSchedule, Mapping[str, PrecisionSchedule]],
                   total_steps: int, path: Optional[str] = None, *, title: str = "",
                   grid: bool = False):
    """Plot one schedule or a dict of named schedules (bits vs step); save a PNG to `path`.

    `grid=True` draws each named schedule in its own panel (the suite's shapes).
    Returns the matplotlib figure.
    """
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    named = schedules if isinstance(schedules, Mapping) else {"bits": schedules}
    steps = np.arange(_check_int("total_steps", total_steps, 1))
    if grid and len(named) > 1:
        cols = min(5, len(named))
        rows = -(-len(named) // cols)
        fig, axes = plt.subplots(rows, cols, figsize=(3.2 * cols, 2.4 * rows),
                                 sharex=True, sharey=True, squeeze=False)
        for ax, (name, sched) in zip(axes.flat, named.items()):
            ax.step(steps, schedule_values(sched, total_steps), where="post", lw=1)
            ax.set_title(name, fontsize=9)
        for ax in list(axes.flat)[len(named):]:
            ax.axis("off")
        fig.supxlabel("step")
        fig.supylabel("bits")
    else:
        fig, ax = plt.subplots(figsize=(7, 3))
        for name, sched in named.items():
            ax.step(steps, schedule_values(sched, total_steps), where="post", lw=1, label=name)
        ax.set_xlabel("step")
        ax.set_ylabel("bits")
        if len(named) > 1:
            ax.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    if path:
        fig.savefig(path, dpi=120)
    plt.close(fig)
    return fig


plot_schedule = plot_schedules
