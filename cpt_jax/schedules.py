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
from __future__ import annotations

from typing import Callable, Dict, Mapping, Optional, Sequence, Tuple, Union

import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array
Step = Union[int, Array]
PrecisionSchedule = Callable[[Step], Array]

CONVENTIONS: tuple = ("ceil", "floor", "wolfe")
"""Cycle-period conventions of `cyclic` (see the module docstring)."""

# --------------------------------------------------------------------------- curves (float64)
# Each curve maps z in [0, 1) (float64 numpy) to its unrounded value.


def _cos_growth(z, lo, hi):
    return lo + 0.5 * (hi - lo) * (1.0 - np.cos(np.pi * z))


def _cos_decay(z, lo, hi):
    return hi - 0.5 * (hi - lo) * (1.0 - np.cos(np.pi * z))


def _linear_growth(z, lo, hi):
    return lo + (hi - lo) * z


def _linear_decay(z, lo, hi):
    return hi - (hi - lo) * z


def _exp_growth(z, lo, hi):
    return hi - (hi - lo) * np.exp(-4.0 * z)


def _exp_decay_vertical(z, lo, hi):
    return lo + (hi - lo) * np.exp(-4.0 * z)


def _exp_decay_horizontal(z, lo, hi):
    return hi - (hi - lo) * np.exp(-4.0 * (1.0 - z))


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
    "cos_growth": ("cos_growth", "cos_growth"),
    "cos_decay": ("cos_decay", "cos_growth"),
    "linear_growth": ("linear_growth", "linear_growth"),
    "linear_decay": ("linear_decay", "linear_growth"),
    "exp_growth": ("exp_growth", "exp_growth"),
    "exp_decay_vertical": ("exp_decay_vertical", "exp_growth"),
    "exp_decay_horizontal": ("exp_decay_horizontal", "exp_growth"),
    "demon_growth": ("demon_growth", "demon_growth"),
    "demon_decay_vertical": ("demon_decay_vertical", "demon_growth"),
    "demon_decay_horizontal": ("demon_decay_horizontal", "demon_growth"),
}

_FLOAT_CURVE = {
    "cos_growth": _cos_growth, "cos_decay": _cos_decay,
    "linear_growth": _linear_growth, "linear_decay": _linear_decay,
    "exp_growth": _exp_growth, "exp_decay_vertical": _exp_decay_vertical,
    "exp_decay_horizontal": _exp_decay_horizontal, "demon_growth": _demon_growth,
    "demon_decay_vertical": _demon_decay_vertical,
    "demon_decay_horizontal": _demon_decay_horizontal,
}

SUITE: tuple = tuple(_CURVES)
"""Names of every cyclic schedule of the Wolfe et al. suite (CPT is `cos_growth`)."""


# --------------------------------------------------------------------------- exact values

def _rational_value(name: str, r: np.ndarray, period: int, lo: int, hi: int):
    """``(numerator, denominator, exact)`` int64 arrays: the curve's value is
    ``numerator / denominator`` wherever ``exact`` (a rational value), else unknown.

    With ``z = r/P`` and ``u = 1 - z``: ``D z = D r / P``; ``u / (0.1 + 0.9u) =
    10 (P - r) / (10P - 9r)``; ``z / (0.1 + 0.9z) = 10 r / (P + 9r)``; ``1 - cos(pi z)``
    is 0, 1/2, 1, 3/2 at ``z`` = 0, 1/3, 1/2, 2/3 (its only rational values, Niven).
    """
    d, p = hi - lo, period
    all_exact = np.ones_like(r, dtype=bool)
    if name in ("linear_growth", "linear_decay"):
        sign, base = (1, lo) if name == "linear_growth" else (-1, hi)
        return base * p + sign * d * r, np.full_like(r, p), all_exact
    if name in ("demon_growth", "demon_decay_vertical"):
        den = 10 * p - 9 * r
        sign, base = (-1, hi) if name == "demon_growth" else (1, lo)
        return base * den + sign * 10 * d * (p - r), den, all_exact
    if name == "demon_decay_horizontal":
        den = p + 9 * r
        return hi * den - 10 * d * r, den, all_exact
    if name in ("cos_growth", "cos_decay"):
        # 4 (1 - cos(pi z)) / 2 = 2 (1 - cos(pi z)) at z = 0, 1/3, 1/2, 2/3
        quarters = np.select([r == 0, 3 * r == p, 2 * r == p, 3 * r == 2 * p], [0, 1, 2, 3], -1)
        sign, base = (1, lo) if name == "cos_growth" else (-1, hi)
        return 4 * base + sign * d * quarters, np.full_like(r, 4), quarters >= 0
    return np.zeros_like(r), np.ones_like(r), np.zeros_like(r, dtype=bool)


def rint_fraction(numerator: np.ndarray, denominator: np.ndarray) -> np.ndarray:
    """``rint(numerator / denominator)`` (round half to even) exactly, in integers.

    Args:
      numerator: integer array.
      denominator: positive integer array (broadcastable with `numerator`).

    Returns:
      int64 array: ``q + 1`` if the remainder is past half of the denominator, or
      exactly half and ``q = floor(numerator / denominator)`` is odd; else ``q``.

    Example:
      >>> rint_fraction(np.array([5, 7, -5, 8]), np.array([2, 2, 2, 3])).tolist()
      [2, 4, -2, 3]
    """
    num = np.asarray(numerator, np.int64)
    den = np.asarray(denominator, np.int64)
    if np.any(den <= 0):
        raise ValueError("rint_fraction needs positive denominators")
    q = num // den
    twice_rem = 2 * (num - q * den)
    up = (twice_rem > den) | ((twice_rem == den) & (q % 2 == 1))
    return q + up.astype(np.int64)


def curve_levels(name: str, period: int, min_bits: int, max_bits: int) -> np.ndarray:
    """The rounded value of curve `name` at ``r = 0 .. P-1`` (``z = r/P``), exactly.

    ``b(r) = rint(curve(r/P))``: exact integer arithmetic where the value is rational
    (see `_rational_value`), float64 elsewhere.

    Args:
      name: a curve of the suite's table (module docstring).
      period: ``P >= 1``.
      min_bits, max_bits: ``q_min <= q_max``.

    Returns:
      int64 array of length ``P``.

    Example:
      >>> curve_levels("linear_growth", 10, 3, 8).tolist()   # 3 + 0.5 r, ties to even
      [3, 4, 4, 4, 5, 6, 6, 6, 7, 8]
    """
    if name not in _FLOAT_CURVE:
        raise ValueError(f"unknown curve {name!r}; choose one of {tuple(_FLOAT_CURVE)}")
    r = np.arange(int(period), dtype=np.int64)
    approx = np.rint(_FLOAT_CURVE[name](r / period, float(min_bits), float(max_bits)))
    num, den, exact = _rational_value(name, r, int(period), int(min_bits), int(max_bits))
    exact_levels = rint_fraction(np.where(exact, num, 0), np.where(exact, den, 1))
    return np.where(exact, exact_levels, approx.astype(np.int64))


def _steps_of(levels: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """Run-length form of `levels`: first index of each run and the run's value."""
    starts = np.concatenate([[0], np.flatnonzero(np.diff(levels)) + 1])
    return starts.astype(np.int32), levels[starts].astype(np.float32)


def _lookup(starts: np.ndarray, values: np.ndarray, r: Array) -> Array:
    """``values[i]`` for the last run ``i`` with ``starts[i] <= r`` (traced ``r``, any shape)."""
    index = jnp.sum(r[..., None] >= jnp.asarray(starts), axis=-1) - 1
    return jnp.asarray(values)[index]


# --------------------------------------------------------------------------- validation

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


def cycle_period(total_steps: int, num_cycles: int, convention: str = "ceil") -> int:
    """The cycle length ``P`` of `cyclic`, validated (`num_cycles >= 1`, `total_steps >= num_cycles`).

    ``ceil``: ``P = ceil(T/n)``; ``floor``: ``P = floor(T/n)`` (CPT's code); ``wolfe``:
    ``P = floor(T/n) + 1`` (Wolfe et al.'s scripts).

    Args:
      total_steps: ``T``, the run's length in steps.
      num_cycles: ``n``, the number of cycles.
      convention: one of `CONVENTIONS`.

    Returns:
      ``P`` as a Python int.

    Example:
      >>> [cycle_period(1500, 8, c) for c in CONVENTIONS]
      [188, 187, 188]
    """
    if convention not in CONVENTIONS:
        raise ValueError(f"unknown period convention {convention!r}; choose one of {CONVENTIONS}")
    cycles = _check_int("num_cycles", num_cycles, 1)
    total = _check_int("total_steps", total_steps, 1)
    if total < cycles:
        raise ValueError(
            f"total_steps must be >= num_cycles so each cycle has a step, got "
            f"total_steps={total} < num_cycles={cycles}")
    if convention == "ceil":
        return -(-total // cycles)
    return total // cycles + (1 if convention == "wolfe" else 0)


def _as_step(step: Step) -> Array:
    return jnp.asarray(step, dtype=jnp.int32)


# --------------------------------------------------------------------------- factories

def cyclic(name: str, *, min_bits: int, max_bits: int, num_cycles: int,
           total_steps: int, convention: str = "ceil") -> PrecisionSchedule:
    """Cyclic precision: curve `name` of `SUITE`, repeated every ``P`` steps.

    ``b(t) = rint(curve(z))``, ``z = (t mod P)/P``, ``P = cycle_period(T, n, convention)``
    (``ceil(T/n)`` by default); ``*_decay`` curves alternate with their growth curve
    (see module docstring). Values are exact (module docstring), traced on device.

    Args:
      name: one of `SUITE`.
      min_bits, max_bits: ``q_min <= q_max``.
      num_cycles: ``n``.
      total_steps: ``T``.
      convention: the period convention, one of `CONVENTIONS`.

    Returns:
      A `PrecisionSchedule` (float32 scalar bits of an int step).

    Example:
      >>> s = cyclic("cos_growth", min_bits=3, max_bits=8, num_cycles=32,
      ...            total_steps=64_000)
      >>> [int(s(t)) for t in (0, 1000, 1999, 2000)]
      [3, 6, 8, 3]
      >>> [int(cyclic("cos_growth", min_bits=3, max_bits=8, num_cycles=8,
      ...             total_steps=1500, convention=c)(1499)) for c in CONVENTIONS]
      [8, 3, 8]
    """
    if name not in _CURVES:
        raise ValueError(f"unknown schedule name {name!r}; choose one of {SUITE}")
    lo, hi = _check_bits_range(min_bits, max_bits)
    period = cycle_period(total_steps, num_cycles, convention)
    even_name, odd_name = _CURVES[name]
    even = _steps_of(curve_levels(even_name, period, lo, hi))
    odd = _steps_of(curve_levels(odd_name, period, lo, hi))

    def schedule(step: Step) -> Array:
        t = _as_step(step)
        r = t % period
        if even_name == odd_name:
            return _lookup(*even, r)
        is_odd = (t // period) % 2 == 1
        return jnp.where(is_odd, _lookup(*odd, r), _lookup(*even, r))

    return schedule


def cpt(min_bits: int = 3, max_bits: int = 8, *, num_cycles: int = 32,
        total_steps: int = 64_000, convention: str = "ceil") -> PrecisionSchedule:
    """CPT's schedule (Fu et al. 2021): ``cyclic("cos_growth", ...)`` with its defaults.

    ``b_t = rint(q_min + (q_max - q_min)/2 (1 - cos(pi (t mod P)/P)))``; CPT's own code
    uses ``convention="floor"`` (the same ``P`` when `num_cycles` divides `total_steps`).
    """
    return cyclic("cos_growth", min_bits=min_bits, max_bits=max_bits,
                  num_cycles=num_cycles, total_steps=total_steps, convention=convention)


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


def critical_period(low_bits: int, high_bits: int, deficit_steps: int, *,
                    inclusive: bool = False) -> PrecisionSchedule:
    """A precision deficit early in training: ``b(t) = low_bits if t < D else high_bits``.

    The critical-learning-period study holds the forward bits at `low_bits` for
    ``D = deficit_steps`` steps, then trains at `high_bits` (Wolfe & Kyrillidis).
    ``inclusive=True`` uses ``t <= D`` (``D + 1`` low steps), as CPT's CIFAR
    ``crit_learn.py``; their ImageNet, GNN and PTB scripts use ``t < D``.

    Args:
      low_bits: bits during the deficit.
      high_bits: bits after it.
      deficit_steps: ``D >= 0``.
      inclusive: compare with ``<=`` instead of ``<``.

    Returns:
      A `PrecisionSchedule`.

    Example:
      >>> s = critical_period(3, 8, deficit_steps=100)
      >>> int(s(99)), int(s(100))
      (3, 8)
      >>> int(critical_period(3, 8, deficit_steps=100, inclusive=True)(100))
      3
    """
    lo = _check_int("low_bits", low_bits, 1)
    hi = _check_int("high_bits", high_bits, 1)
    d = _check_int("deficit_steps", deficit_steps, 0)
    last_low_step = d if inclusive else d - 1

    def schedule(step: Step) -> Array:
        return jnp.where(_as_step(step) <= last_low_step, float(lo), float(hi)).astype(jnp.float32)

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
    schedules, boundaries = _check_segments("join", schedules, boundaries)

    def schedule(step: Step) -> Array:
        t = _as_step(step)
        out = schedules[0](t)
        for boundary, segment in zip(boundaries, schedules[1:]):
            out = jnp.where(t < boundary, out, segment(t - boundary))
        return jnp.asarray(out, jnp.float32)

    return schedule


def _check_segments(name: str, schedules, boundaries) -> tuple[list, list]:
    schedules = list(schedules)
    boundaries = [int(b) for b in boundaries]
    if len(schedules) != len(boundaries) + 1:
        raise ValueError(
            f"{name} needs len(schedules) == len(boundaries) + 1, got {len(schedules)} "
            f"schedules and {len(boundaries)} boundaries")
    if any(b2 < b1 for b1, b2 in zip(boundaries, boundaries[1:])) or any(b < 0 for b in boundaries):
        raise ValueError(f"boundaries must be non-negative and non-decreasing, got {boundaries}")
    return schedules, boundaries


def switch(schedules: Sequence[PrecisionSchedule], boundaries: Sequence[int]) -> PrecisionSchedule:
    """Piecewise schedule at the run's own step: a run whose plan changed at `boundaries`.

    ``b(t) = schedules[i](t)`` for ``boundaries[i-1] <= t < boundaries[i]`` (with
    ``boundaries[-1] = 0``). Unlike `join`, a segment is not restarted at 0: an
    extended run (``experiments.train --extend``) trains steps ``[0, s)`` on the
    schedule built for its first length and the rest on the one rebuilt for the new
    length, both read at the absolute step.

    Example:
      >>> first = cyclic("linear_growth", min_bits=2, max_bits=6, num_cycles=1, total_steps=4)
      >>> longer = cyclic("linear_growth", min_bits=2, max_bits=6, num_cycles=1, total_steps=8)
      >>> s = switch([first, longer], boundaries=[4])
      >>> [int(s(t)) for t in range(8)]
      [2, 3, 4, 5, 4, 4, 5, 6]
    """
    schedules, boundaries = _check_segments("switch", schedules, boundaries)

    def schedule(step: Step) -> Array:
        t = _as_step(step)
        out = schedules[0](t)
        for boundary, segment in zip(boundaries, schedules[1:]):
            out = jnp.where(t < boundary, out, segment(t))
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
