"""The precision schedules: Wolfe et al.'s suite of cyclic curves, CPT's cosine, constant
and critical-period schedules, as pure functions of the step (see `cpt_jax.schedules`)."""
from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array
Step = int | Array
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
_CURVES: dict[str, tuple] = {
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
    """The rounded value of curve `name` at ``r = 0..P-1`` (``z = r/P``), exactly.

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


def _steps_of(levels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Run-length form of `levels`: first index of each run and the run's value."""
    starts = np.concatenate([[0], np.flatnonzero(np.diff(levels)) + 1])
    return starts.astype(np.int32), levels[starts].astype(np.float32)


def _lookup(starts: np.ndarray, values: np.ndarray, r: Array) -> Array:
    """``values[i]`` for the last run ``i`` with ``starts[i] <= r`` (traced ``r``, any shape)."""
    index = jnp.sum(r[..., None] >= jnp.asarray(starts), axis=-1) - 1
    return jnp.asarray(values)[index]


# --------------------------------------------------------------------------- validation

def check_int(name: str, value, minimum: int) -> int:
    """`value` as an int ``>= minimum``, else ValueError naming `name`."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer, float, np.floating)):
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    if float(value) != int(value) or int(value) < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def check_bits_range(min_bits, max_bits) -> tuple[int, int]:
    """``(min_bits, max_bits)`` as ints with ``1 <= min_bits <= max_bits``, else ValueError."""
    lo = check_int("min_bits", min_bits, 1)
    hi = check_int("max_bits", max_bits, 1)
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
    cycles = check_int("num_cycles", num_cycles, 1)
    total = check_int("total_steps", total_steps, 1)
    if total < cycles:
        raise ValueError(
            f"total_steps must be >= num_cycles so each cycle has a step, got "
            f"total_steps={total} < num_cycles={cycles}")
    if convention == "ceil":
        return -(-total // cycles)
    return total // cycles + (1 if convention == "wolfe" else 0)


def as_step(step: Step) -> Array:
    """The step as an int32 array (traced steps stay traced)."""
    return jnp.asarray(step, dtype=jnp.int32)


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
    lo, hi = check_bits_range(min_bits, max_bits)
    period = cycle_period(total_steps, num_cycles, convention)
    even_name, odd_name = _CURVES[name]
    even = _steps_of(curve_levels(even_name, period, lo, hi))
    odd = _steps_of(curve_levels(odd_name, period, lo, hi))

    def schedule(step: Step) -> Array:
        t = as_step(step)
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
    value = float(check_int("bits", bits, 1))

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
    lo = check_int("low_bits", low_bits, 1)
    hi = check_int("high_bits", high_bits, 1)
    d = check_int("deficit_steps", deficit_steps, 0)
    last_low_step = d if inclusive else d - 1

    def schedule(step: Step) -> Array:
        return jnp.where(as_step(step) <= last_low_step, float(lo), float(hi)).astype(jnp.float32)

    return schedule


# --------------------------------------------------------------------------- helpers
