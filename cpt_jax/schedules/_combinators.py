"""Combinators (optax semantics): `join`, `switch`, `offset`, `scale`, `clip`; and a
schedule's values over a run (`schedule_values`, `mean_bits`)."""
from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from cpt_jax.schedules._schedules import (
    PrecisionSchedule,
    Step,
    as_step,
    check_bits_range,
    check_int,
)

Array = jax.Array


def join(schedules: Sequence[PrecisionSchedule], boundaries: Sequence[int]) -> PrecisionSchedule:
    """Piecewise schedule with `optax.join_schedules` semantics.

    ``b(t) = schedules[i](t - boundaries[i-1])`` for ``boundaries[i-1] <= t < boundaries[i]``
    (with ``boundaries[-1] = 0``): each segment sees its own step count from 0.

    Example:
      >>> from cpt_jax.schedules import constant, cyclic
      >>> s = join([constant(8), cyclic("cos_growth", min_bits=3, max_bits=8,
      ...           num_cycles=1, total_steps=10)], boundaries=[5])
      >>> [int(s(t)) for t in (4, 5)]
      [8, 3]
    """
    schedules, boundaries = _check_segments("join", schedules, boundaries)

    def schedule(step: Step) -> Array:
        t = as_step(step)
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
      >>> from cpt_jax.schedules import cyclic
      >>> first = cyclic("linear_growth", min_bits=2, max_bits=6, num_cycles=1, total_steps=4)
      >>> longer = cyclic("linear_growth", min_bits=2, max_bits=6, num_cycles=1, total_steps=8)
      >>> s = switch([first, longer], boundaries=[4])
      >>> [int(s(t)) for t in range(8)]
      [2, 3, 4, 5, 4, 4, 5, 6]
    """
    schedules, boundaries = _check_segments("switch", schedules, boundaries)

    def schedule(step: Step) -> Array:
        t = as_step(step)
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
    lo, hi = check_bits_range(min_bits, max_bits)
    return lambda step: jnp.clip(schedule(step), float(lo), float(hi)).astype(jnp.float32)


def schedule_values(schedule: PrecisionSchedule, total_steps: int) -> np.ndarray:
    """The schedule evaluated at steps ``0..total_steps-1`` (one vectorized call)."""
    total = check_int("total_steps", total_steps, 1)
    steps = jnp.arange(total, dtype=jnp.int32)
    values = jax.jit(jax.vmap(lambda t: jnp.asarray(schedule(t), jnp.float32)))(steps)
    return np.asarray(values)


def mean_bits(schedule: PrecisionSchedule, total_steps: int) -> float:
    """Mean bit-width over a run: ``(1/T) sum_{t<T} b(t)``.

    Example:
      >>> from cpt_jax.schedules import cpt
      >>> round(mean_bits(cpt(3, 8, num_cycles=32, total_steps=64_000), 64_000), 2)
      5.5
    """
    return float(np.mean(schedule_values(schedule, total_steps), dtype=np.float64))
