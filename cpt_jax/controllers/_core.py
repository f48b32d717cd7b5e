"""The precision controllers themselves: the optax idiom, the built-ins, the carry.

`PrecisionController` (``init`` / ``update``), the statistics a step measures
(`StepStats`), the built-ins (`on_instability`, `on_plateau`, `online_range_test`,
`final_phase`, `scheduled`), the per-product error provider (`measure_products`) and
the carry that counts the bits used and costs them (`realized_cost`). The package's
docstring (`cpt_jax.controllers`) has the formulas.
"""
from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.extend.core import get_opaque_trace_state

from cpt_jax import cost as cost_lib
from cpt_jax.providers import default_provider
from cpt_jax.schedules import PrecisionSchedule, Step, constant, join

Array = jax.Array
NUM_LEVELS = 33
"""Bits counted per step: ``0..32`` (32: full precision; None error bits count 32)."""

STATISTICS = ("loss", "grad_norm", "quant_effect", "quant_error")
"""The `StepStats` fields a built-in can watch."""


class Bits(NamedTuple):
    """The widths of one step: `forward` (weights and activations) and `error`
    (backward; None keeps errors in fp32)."""

    forward: Array
    error: Array | None = None


class StepStats(NamedTuple):
    """What a train step measures for its controller (float32 / int32 / bool scalars).

    Attributes:
      loss: the step's training loss.
      grad_norm: ``sqrt(sum_leaves sum g^2)`` of the raw gradients (before clipping).
      nonfinite: non-finite gradient elements, plus one for a non-finite loss.
      quant_effect: ``(L_q - L_32) / |L_32|`` on the step's batch (NaN: not measured).
      observed: False before the first step (`no_stats`).
      quant_error: the largest relative quantization error of a product,
        ``max_p |y_q - y|_2 / |y|_2`` (NaN: not measured, see `measure_products`).
    """

    loss: Array
    grad_norm: Array
    nonfinite: Array
    quant_effect: Array
    observed: Array
    quant_error: Array


def no_stats() -> StepStats:
    """The statistics before the first step (``observed`` False, NaN values).

    Example:
      >>> bool(no_stats().observed)
      False
    """
    nan = jnp.float32(jnp.nan)
    return StepStats(loss=nan, grad_norm=nan, nonfinite=jnp.int32(0), quant_effect=nan,
                     observed=jnp.bool_(False), quant_error=nan)


def stats_of(loss, grads, quant_effect=None, quant_errors=None) -> StepStats:
    """`StepStats` of a step from its loss and raw gradients (traceable).

    ``grad_norm = sqrt(sum g^2)`` over every leaf; ``nonfinite = #{g not finite} +
    [loss not finite]``; ``quant_error = max`` of `quant_errors` (``{path: error}``).

    Example:
      >>> s = stats_of(jnp.float32(1.0), {"w": jnp.array([3.0, 4.0, jnp.inf])})
      >>> int(s.nonfinite), bool(s.observed)
      (1, True)
    """
    leaves = jax.tree_util.tree_leaves(grads)
    sq = sum((jnp.sum(jnp.square(g.astype(jnp.float32))) for g in leaves), jnp.float32(0.0))
    bad = sum((jnp.sum(~jnp.isfinite(g)).astype(jnp.int32) for g in leaves), jnp.int32(0))
    loss = jnp.asarray(loss, jnp.float32)
    effect = jnp.float32(jnp.nan) if quant_effect is None else quant_effect
    errors = list((quant_errors or {}).values())
    worst = jnp.max(jnp.stack(errors)) if errors else jnp.float32(jnp.nan)
    return StepStats(loss=loss, grad_norm=jnp.sqrt(sq),
                     nonfinite=bad + (~jnp.isfinite(loss)).astype(jnp.int32),
                     quant_effect=jnp.asarray(effect, jnp.float32), observed=jnp.bool_(True),
                     quant_error=jnp.asarray(worst, jnp.float32))


class PrecisionController(NamedTuple):
    """A precision controller (optax idiom): ``init() -> state``, ``update(state,
    stats, step) -> (Bits, state)``, both pure and jittable.

    Attributes:
      init: the initial state (a pytree).
      update: the bits of `step` given the statistics of the step before it.
      measure_every: measure ``quant_effect`` every this many steps (0: never; it
        costs one extra full-precision forward pass per measured step).
    """

    init: Callable[[], Any]
    update: Callable[[Any, StepStats, Step], tuple[Bits, Any]]
    measure_every: int = 0


# --------------------------------------------------------------------------- per product

class _Collectors(threading.local):
    def __init__(self):
        self.stack: list = []


_COLLECTORS = _Collectors()


@contextlib.contextmanager
def product_errors() -> Iterator[dict[str, Array]]:
    """Collect, in the block, each product's relative quantization error as computed
    by a `measure_products` provider: ``{product path: |y_q - y|_2 / |y|_2}``.

    Enter it where the model is applied (inside the traced function: the values are
    its tracers); a product traced inside a loop body (``nn.scan``) is not collected.
    """
    errors: dict[str, Array] = {}
    _COLLECTORS.stack.append((errors, get_opaque_trace_state(convention="cpt_jax")))
    try:
        yield errors
    finally:
        _COLLECTORS.stack.pop()


class MeasuredProvider:
    """A provider that computes each product as `inner` does (None: the provider its
    config asks for, `cpt_jax.providers.default_provider`) and, inside
    `product_errors`, also records ``|y_q - y|_2 / |y_2|`` against the fp32 product
    (an extra float product, no gradient)."""

    def __init__(self, inner=None):
        self.inner = inner

    def _inner(self, product):
        return self.inner if self.inner is not None else default_provider(product.config)

    def prepare(self, product, lhs, rhs) -> None:
        prepare = getattr(self._inner(product), "prepare", None)
        if prepare is not None:
            prepare(product, lhs, rhs)

    def compute(self, product, lhs, rhs, state, apply):
        out = self._inner(product).compute(product, lhs, rhs, state, apply)
        if _COLLECTORS.stack:
            errors, trace = _COLLECTORS.stack[-1]
            if trace == get_opaque_trace_state(convention="cpt_jax"):
                exact = jax.lax.stop_gradient(apply(lhs, rhs)).astype(jnp.float32)
                diff = jax.lax.stop_gradient(out).astype(jnp.float32) - exact
                norm = jnp.sqrt(jnp.sum(exact * exact))
                errors[product.path] = jnp.sqrt(jnp.sum(diff * diff)) / jnp.maximum(
                    norm, jnp.finfo(jnp.float32).tiny)
        return out


def measure_products(inner=None) -> MeasuredProvider:
    """A provider reporting every product's relative quantization error to the step.

    Pass it to `cpt_jax.quantize_model` (``provider=measure_products()``): a train
    step with statistics then holds ``metrics["quant_error"]`` (``{path: |y_q -
    y|_2 / |y|_2}``, each product's output against its fp32 product on the same
    operands) and `StepStats.quant_error` (the largest). Costs one extra fp32 forward
    product per product and step.

    Example:
      >>> qmodel = cpt_jax.quantize_model(nn.Dense(4), provider=measure_products())
      >>> params = qmodel.init(jax.random.key(0), jnp.ones((2, 3)))
      >>> with product_errors() as errors, cpt_jax.precision(2):
      ...     _ = qmodel.apply(params, jnp.arange(6.0).reshape(2, 3))
      >>> list(errors), bool(errors["Dense"] > 0)
      (['Dense'], True)
    """
    return MeasuredProvider(inner)


# --------------------------------------------------------------------------- the base

def is_format_schedule(base) -> bool:
    """Whether `base` is a schedule over formats (`cpt_jax.format_schedule`): it has
    ``index(step)`` and a config with ``widths``."""
    return callable(getattr(base, "index", None)) and hasattr(getattr(base, "config", None),
                                                               "widths")


def check_base(base, name: str = "base") -> None:
    """ValueError unless `base` is a `PrecisionSchedule` or a schedule over formats."""
    if not callable(base):
        raise ValueError(f"{name} must be a PrecisionSchedule (step -> bits) or a "
                         f"cpt_jax.format_schedule, got {base!r}")


def adjust(base, step: Step, raise_by=0, floor=None) -> tuple[Array, Array]:
    """``(bits, level)`` of `step` under a raise and a floor (traceable).

    Schedule base: ``b = clip(max(base(t) + r, f), 1, 32)``, level ``b``. Format base
    (`is_format_schedule`): ``i = clip(max(index(t) + r, f), 0, n - 1)``, ``b = w_i``,
    level ``i``. ``floor=None``: no floor.

    Example:
      >>> b, level = adjust(cpt_jax.constant(4), 0, raise_by=2)
      >>> float(b)
      6.0
      >>> fs = cpt_jax.format_schedule(("nvfp4_gemm", "mxfp6", "mxfp8_gemm"),
      ...                              cpt_jax.constant(4))
      >>> [float(adjust(fs, 0, raise_by=r)[0]) for r in (0, 1, 5)]
      [4.0, 6.0, 8.0]
    """
    raise_by = jnp.asarray(raise_by, jnp.float32)
    if is_format_schedule(base):
        widths = jnp.asarray(base.config.widths, jnp.float32)
        index = jnp.asarray(base.index(step), jnp.float32) + raise_by
        if floor is not None:
            index = jnp.maximum(index, jnp.asarray(floor, jnp.float32))
        index = jnp.clip(index, 0, len(base.config.widths) - 1).astype(jnp.int32)
        return widths[index], index.astype(jnp.float32)
    bits = jnp.asarray(base(step), jnp.float32) + raise_by
    if floor is not None:
        bits = jnp.maximum(bits, jnp.asarray(floor, jnp.float32))
    bits = jnp.clip(bits, 1.0, 32.0)
    return bits, bits


def error_bits(error_base: PrecisionSchedule | None, step: Step, raise_by=0) -> Array | None:
    """``clip(error_base(t) + r, 1, 32)``, or None (fp32 errors) without an error base.

    Example:
      >>> float(error_bits(cpt_jax.constant(8), 3, raise_by=2)), error_bits(None, 3)
      (10.0, None)
    """
    if error_base is None:
        return None
    value = jnp.asarray(error_base(step), jnp.float32) + jnp.asarray(raise_by, jnp.float32)
    return jnp.clip(value, 1.0, 32.0)


def _statistic(stats: StepStats, name: str) -> Array:
    return jnp.asarray(getattr(stats, name), jnp.float32)


def _check_statistic(statistic: str) -> None:
    if statistic not in STATISTICS:
        raise ValueError(f"statistic={statistic!r} is unknown; choose one of {list(STATISTICS)}")


def _check_number(name: str, value, low: float, *, strict: bool = False) -> float:
    value = float(value)
    if not np.isfinite(value) or value < low or (strict and value == low):
        raise ValueError(f"{name}={value!r} must be a number {'>' if strict else '>='} {low:g}")
    return value


def _check_int(name: str, value, low: int) -> int:
    if isinstance(value, bool) or int(value) != value or int(value) < low:
        raise ValueError(f"{name}={value!r} must be an integer >= {low}")
    return int(value)


# --------------------------------------------------------------------------- built-ins

def scheduled(base, error_base: PrecisionSchedule | None = None) -> PrecisionController:
    """The base itself as a controller (no statistic read): ``b_t = base(t)``.

    Example:
      >>> c = scheduled(cpt_jax.constant(6), error_base=cpt_jax.constant(8))
      >>> bits, _ = c.update(c.init(), no_stats(), 0)
      >>> float(bits.forward), float(bits.error)
      (6.0, 8.0)
    """
    check_base(base)

    def update(state, stats, step):
        del stats
        return Bits(adjust(base, step)[0], error_bits(error_base, step)), state

    return PrecisionController(init=lambda: (), update=update)


class InstabilityState(NamedTuple):
    """`on_instability`'s state: the statistic's running `mean`, its finite
    observations `seen`, and the boosted steps `left` (this one included)."""

    mean: Array
    seen: Array
    left: Array


def on_instability(base, *, statistic: str = "grad_norm", ratio: float = 2.0, boost: float = 2,
                   hold: int = 10, decay: float = 0.9,
                   error_base: PrecisionSchedule | None = None,
                   error_boost: float = 0) -> PrecisionController:
    """Raise the bits (or the format) for `hold` steps when the run turns unstable.

    With ``s`` the statistic of the step before, ``m`` its running mean (an EMA over
    the finite observations, ``m = s`` at the first):

        trigger = nonfinite > 0  or  s not finite  or  (m exists and s > ratio * m)
        m      <- decay * m + (1 - decay) * s          (finite s; after the test)
        left   <- hold if trigger else max(left - 1, 0)
        bits    = base(t) + boost * [left > 0]         (errors: error_base + error_boost)

    so the steps ``t .. t + hold - 1`` after a spike seen at step ``t - 1`` are boosted
    (a new spike restarts the count). Like GNMR's switch back to higher precision
    when the gradient-norm ratio signals risk. The mean follows the statistic during a
    boost too: a statistic that depends on the bits (the gradient norm is lower with
    8-bit than with 4-bit errors) can trigger again when the boost ends
    (docs/adaptive.md, the study).

    Args:
      base: a `PrecisionSchedule`, or a `cpt_jax.format_schedule` (then `boost`
        counts formats: 1 is the next wider one).
      statistic: the `StepStats` field watched (`STATISTICS`).
      ratio: the spike threshold (> 0) on ``s / m``.
      boost: bits (or formats) added while boosted.
      hold: boosted steps after a trigger (>= 1).
      decay: the running mean's EMA decay, in [0, 1).
      error_base: the error bits' schedule (None: fp32 errors).
      error_boost: bits added to the errors while boosted.

    Returns:
      A `PrecisionController`.

    Example:
      >>> c = on_instability(cpt_jax.constant(4), ratio=2.0, boost=4, hold=2, decay=0.5)
      >>> state, seen = c.init(), []
      >>> for t, g in enumerate([None, 1.0, 1.0, 5.0, 1.0, 1.0, 1.0]):
      ...     stats = no_stats() if g is None else stats_of(0.0, {"w": jnp.float32(g)})
      ...     bits, state = c.update(state, stats, t)
      ...     seen.append(int(bits.forward))
      >>> seen
      [4, 4, 4, 8, 8, 4, 4]
    """
    check_base(base)
    _check_statistic(statistic)
    ratio = _check_number("ratio", ratio, 0.0, strict=True)
    hold = _check_int("hold", hold, 1)
    decay = _check_number("decay", decay, 0.0)
    if decay >= 1.0:
        raise ValueError(f"decay={decay!r} must be < 1")

    def init():
        return InstabilityState(mean=jnp.float32(0.0), seen=jnp.int32(0), left=jnp.int32(0))

    def update(state, stats, step):
        s = _statistic(stats, statistic)
        finite = stats.observed & jnp.isfinite(s)
        bad = stats.observed & ((stats.nonfinite > 0) | ~jnp.isfinite(s))
        trigger = bad | (finite & (state.seen > 0) & (s > ratio * state.mean))
        mean = jnp.where(state.seen > 0, decay * state.mean + (1.0 - decay) * s, s)
        new = InstabilityState(mean=jnp.where(finite, mean, state.mean).astype(jnp.float32),
                               seen=state.seen + finite.astype(jnp.int32),
                               left=jnp.where(trigger, hold, jnp.maximum(state.left - 1, 0)
                                              ).astype(jnp.int32))
        on = (new.left > 0).astype(jnp.float32)
        bits = Bits(adjust(base, step, raise_by=on * boost)[0],
                    error_bits(error_base, step, raise_by=on * error_boost))
        return bits, new

    return PrecisionController(init=init, update=update)


class PlateauState(NamedTuple):
    """`on_plateau`'s state: optax's ``ReduceLROnPlateauState`` and the raises so far."""

    plateau: Any
    raises: Array


def on_plateau(base, *, floor: float, max_floor: float, increment: float = 1,
               statistic: str = "loss", patience: int = 10, cooldown: int = 0,
               rtol: float = 1e-4, atol: float = 0.0, accumulation_size: int = 1,
               error_base: PrecisionSchedule | None = None) -> PrecisionController:
    """Raise the floor of the bits (or formats) each time the statistic plateaus.

    optax ``contrib.reduce_on_plateau`` watches the statistic (its semantics exactly:
    `patience`, `cooldown`, `rtol`, `atol`, `accumulation_size`; the transformation
    itself runs with factor 1/2); each of its reductions raises the floor:

        f = min(floor + k * increment, max_floor)     after k reductions
        bits = max(base(t), f)

    Steps before the first and steps whose statistic is not finite are not fed to it.

    Args:
      base: a `PrecisionSchedule` or a `cpt_jax.format_schedule` (then `floor`,
        `max_floor` and `increment` count formats).
      floor: the initial floor (bits, or a format index).
      max_floor: the highest floor.
      increment: the raise per plateau (> 0).
      statistic: the `StepStats` field watched (lower is better).
      patience, cooldown, rtol, atol, accumulation_size: as optax's.
      error_base: the error bits' schedule (None: fp32 errors).

    Returns:
      A `PrecisionController`.

    Example:
      >>> c = on_plateau(cpt_jax.constant(3), floor=3, max_floor=8, increment=2, patience=2)
      >>> state, seen = c.init(), []
      >>> for t, loss in enumerate([None, 5.0, 4.0, 4.0, 4.0, 4.0, 4.0]):
      ...     stats = no_stats() if loss is None else stats_of(loss, {})
      ...     bits, state = c.update(state, stats, t)
      ...     seen.append(int(bits.forward))
      >>> seen
      [3, 3, 3, 3, 5, 5, 7]
    """
    check_base(base)
    _check_statistic(statistic)
    increment = _check_number("increment", increment, 0.0, strict=True)
    if float(max_floor) < float(floor):
        raise ValueError(f"max_floor={max_floor!r} must be >= floor={floor!r}")
    max_raises = int(np.ceil((float(max_floor) - float(floor)) / increment))
    plateau = optax.contrib.reduce_on_plateau(
        factor=0.5, patience=_check_int("patience", patience, 1), rtol=float(rtol),
        atol=float(atol), cooldown=_check_int("cooldown", cooldown, 0),
        accumulation_size=_check_int("accumulation_size", accumulation_size, 1),
        min_scale=0.5 ** max_raises)

    def init():
        return PlateauState(plateau=plateau.init(jnp.zeros((), jnp.float32)),
                            raises=jnp.int32(0))

    def update(state, stats, step):
        s = _statistic(stats, statistic)
        _, inner = plateau.update(jnp.zeros((), jnp.float32), state.plateau, value=s)
        use = stats.observed & jnp.isfinite(s)
        inner = jax.tree_util.tree_map(lambda n, o: jnp.where(use, n, o), inner, state.plateau)
        lowered = use & (inner.scale < state.plateau.scale)
        raises = state.raises + lowered.astype(jnp.int32)
        level = jnp.minimum(float(floor) + raises.astype(jnp.float32) * increment,
                            float(max_floor))
        bits = Bits(adjust(base, step, floor=level)[0], error_bits(error_base, step))
        return bits, PlateauState(plateau=inner, raises=raises)

    return PrecisionController(init=init, update=update)


class RangeTestState(NamedTuple):
    """`online_range_test`'s state: the `floor` (bits or format index), the window's
    `total` over `seen` observations, whether the test is `done`, and whether the
    last bits given were the floor (`at_floor`)."""

    floor: Array
    total: Array
    seen: Array
    done: Array
    at_floor: Array


def online_range_test(base, *, start: float, min_floor: float, threshold: float,
                      window: int = 20, statistic: str = "quant_effect",
                      measure_every: int = 1,
                      error_base: PrecisionSchedule | None = None) -> PrecisionController:
    """CPT's precision range test, online: lower the floor while the quantization's
    effect on the loss stays under `threshold`.

    The floor starts at `start` (the bits are ``max(base(t), f)``). Each step computed
    at the floor adds its statistic (by default ``quant_effect``, ``(L_q - L_32) /
    |L_32|``, measured every `measure_every` steps) to a window; when `window`
    observations are in, with ``mu`` their mean:

        mu <= threshold and f > min_floor:   f <- f - 1          (probe one lower)
        mu <= threshold and f == min_floor:  done                (the lowest is fine)
        mu >  threshold:                     f <- f + 1, done    (back to the last good)

    A non-finite step at the floor counts as above the threshold at once. After
    ``done`` the floor stays: the range test's lower bound, found by the training.

    Args:
      base: a `PrecisionSchedule` or a `cpt_jax.format_schedule` (then `start` and
        `min_floor` are format indices).
      start: the first floor (e.g. the base's max bits).
      min_floor: the lowest floor probed.
      threshold: the largest acceptable mean statistic.
      window: observations per decision (>= 1).
      statistic: the `StepStats` field watched.
      measure_every: steps between ``quant_effect`` measurements (>= 1).
      error_base: the error bits' schedule (None: fp32 errors).

    Returns:
      A `PrecisionController` (``measure_every`` set when it watches ``quant_effect``).

    Example:
      >>> c = online_range_test(cpt_jax.constant(2), start=6, min_floor=3, threshold=0.1,
      ...                       window=2)
      >>> state, seen = c.init(), []
      >>> for t, e in enumerate([None, 0.0, 0.0, 0.05, 0.05, 0.3, 0.3, 0.0, 0.0]):
      ...     stats = no_stats() if e is None else stats_of(1.0, {}, quant_effect=e)
      ...     bits, state = c.update(state, stats, t)
      ...     seen.append(int(bits.forward))
      >>> seen, bool(state.done)
      ([6, 6, 5, 5, 4, 4, 5, 5, 5], True)
    """
    check_base(base)
    _check_statistic(statistic)
    window = _check_int("window", window, 1)
    threshold = float(threshold)
    if float(min_floor) > float(start):
        raise ValueError(f"min_floor={min_floor!r} must be <= start={start!r}")
    every = _check_int("measure_every", measure_every, 1) if statistic == "quant_effect" else 0

    def init():
        return RangeTestState(floor=jnp.float32(start), total=jnp.float32(0.0),
                              seen=jnp.int32(0), done=jnp.bool_(False),
                              at_floor=jnp.bool_(False))

    def update(state, stats, step):
        s = _statistic(stats, statistic)
        probing = stats.observed & state.at_floor & ~state.done
        seen = probing & jnp.isfinite(s) & (stats.nonfinite == 0)
        bad = probing & ~seen & ((stats.nonfinite > 0) | ~jnp.isfinite(stats.loss))
        total = state.total + jnp.where(seen, s, 0.0)
        count = state.seen + seen.astype(jnp.int32)
        full = count >= window
        ok = total / jnp.maximum(count, 1).astype(jnp.float32) <= threshold
        lower = full & ok & (state.floor > min_floor)
        back = bad | (full & ~ok)
        floor = state.floor - lower.astype(jnp.float32) + back.astype(jnp.float32)
        done = state.done | back | (full & ok & ~lower)
        reset = full | bad
        bits, level = adjust(base, step, floor=floor)
        new = RangeTestState(floor=floor, total=jnp.where(reset, 0.0, total),
                             seen=jnp.where(reset, 0, count).astype(jnp.int32), done=done,
                             at_floor=level == floor)
        return Bits(bits, error_bits(error_base, step)), new

    return PrecisionController(init=init, update=update, measure_every=every)


def final_phase(base, fraction: float, bits: float, *, total_steps: int):
    """The last `fraction` of a run at `bits` (sugar over `cpt_jax.join`).

    ``b(t) = base(t)`` for ``t < B``, ``bits`` after, ``B = T - round(fraction T)``;
    for a `cpt_jax.format_schedule` base the same on its bits (the format of `bits`
    at the end). Returns a schedule of the base's kind (no state to carry), as the
    NVFP4 pretraining recipe keeps its last phase in higher precision.

    Example:
      >>> s = final_phase(cpt_jax.constant(4), 0.25, 8, total_steps=8)
      >>> [int(s(t)) for t in range(8)]
      [4, 4, 4, 4, 4, 4, 8, 8]
    """
    check_base(base)
    fraction = float(fraction)
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"fraction={fraction!r} must be in [0, 1]")
    steps = _check_int("total_steps", total_steps, 1)
    boundary = steps - int(round(fraction * steps))
    if is_format_schedule(base):
        return dataclasses.replace(base, schedule=join([base.schedule, constant(bits)],
                                                       [boundary]))
    return join([base, constant(bits)], [boundary])


# --------------------------------------------------------------------------- the carry

class ControllerCarry(NamedTuple):
    """What `cpt_jax.training.TrainState.controller` holds for a controlled run.

    Attributes:
      state: the controller's state.
      stats: the `StepStats` of the last step (`no_stats` before the first).
      counts: int32 ``(33, 33)``: steps computed at each (forward, error) bits
        (rounded to integers; fp32 errors count as 32).
    """

    state: Any
    stats: StepStats
    counts: Array


def init_carry(controller: PrecisionController) -> ControllerCarry:
    """The carry of a run's first step.

    Example:
      >>> init_carry(scheduled(cpt_jax.constant(4))).counts.shape
      (33, 33)
    """
    return ControllerCarry(state=controller.init(), stats=no_stats(),
                           counts=jnp.zeros((NUM_LEVELS, NUM_LEVELS), jnp.int32))


def bits_level(bits) -> Array:
    """The count index of `bits`: ``clip(rint(bits), 0, 32)`` (None: 32)."""
    if bits is None:
        return jnp.int32(NUM_LEVELS - 1)
    return jnp.clip(jnp.rint(jnp.asarray(bits, jnp.float32)), 0, NUM_LEVELS - 1).astype(jnp.int32)


def advance_carry(carry: ControllerCarry, state, stats: StepStats, bits: Bits) -> ControllerCarry:
    """The carry after a step computed at `bits` that measured `stats`."""
    counts = carry.counts.at[bits_level(bits.forward), bits_level(bits.error)].add(1)
    return ControllerCarry(state=state, stats=stats, counts=counts)


def bits_histogram(counts) -> dict[str, dict[str, int]]:
    """``{"forward": {bits: steps}, "error": {bits: steps}}`` of a count table (keys as
    strings, for JSON; only bits that were used).

    Example:
      >>> c = np.zeros((33, 33), int); c[4, 8] = 3; c[6, 8] = 1
      >>> bits_histogram(c)
      {'forward': {'4': 3, '6': 1}, 'error': {'8': 4}}
    """
    c = np.asarray(counts, np.int64)
    fwd, err = c.sum(axis=1), c.sum(axis=0)
    return {"forward": {str(b): int(n) for b, n in enumerate(fwd) if n},
            "error": {str(b): int(n) for b, n in enumerate(err) if n}}


def cost_table(ops=None, config=None) -> np.ndarray:
    """BitOps of one step at each ``(forward, error)`` bits ``(b, g)``, ``b, g`` in
    ``0..32`` (``cpt_jax.cost.bitops_per_step``; 0 counts as 1), float64 ``(33, 33)``.

    Example:
      >>> float(cost_table()[4, 8])    # 4 * 4 + 2 * 4 * 8
      80.0
    """
    levels = jnp.maximum(jnp.arange(NUM_LEVELS, dtype=jnp.float32), 1.0)
    b, g = jnp.meshgrid(levels, levels, indexing="ij")
    per = jax.jit(jax.vmap(jax.vmap(lambda x, y: cost_lib.bitops_per_step(ops, x, y, config))))
    return np.asarray(per(b, g), np.float64)


def measured_steps(measure_every: int, steps: int) -> int:
    """How many of the first `steps` steps measured ``quant_effect``: those with
    ``t % measure_every == 0`` (0 when it is 0).

    Example:
      >>> measured_steps(4, 10), measured_steps(0, 10)
      (3, 0)
    """
    return 0 if measure_every <= 0 or steps <= 0 else -(-int(steps) // int(measure_every))


def realized_cost(counts, ops=None, config=None, baseline_bits: int = 8,
                  table: np.ndarray | None = None, measured: int = 0,
                  measured_products: int = 0) -> dict[str, float]:
    """The cost of the bits actually used: ``sum_{b,g} n_{b,g} BitOps(b, g)``, plus
    ``measured * MACs * 32^2`` for the fp32 forward passes of ``quant_effect`` and
    ``measured_products * MACs_q * 32^2`` for the fp32 products of ``quant_error``
    (``MACs_q``: the quantized ops' MACs).

    Returns `cpt_jax.cost.run_cost`'s keys for the counted steps:
    ``relative_cost_fp32``, ``relative_cost_static8`` (against `baseline_bits`),
    ``mean_bits``, ``mean_grad_bits`` (a run without steps: zeros). `table`: the
    `cost_table` of `ops` and `config`, if already computed; `measured`: the steps
    that measured ``quant_effect`` (`measured_steps`); `measured_products`: the steps
    that measured ``quant_error`` (`measure_products`).

    Example:
      >>> c = np.zeros((33, 33), int); c[4, 8] = 1; c[8, 8] = 1
      >>> round(realized_cost(c)["relative_cost_static8"], 4)   # (80 + 192) / (2 * 192)
      0.7083
    """
    c = np.asarray(counts, np.float64)
    steps = float(c.sum())
    if steps == 0:
        return {"relative_cost_fp32": 0.0, "relative_cost_static8": 0.0, "mean_bits": 0.0,
                "mean_grad_bits": 0.0}
    table = cost_table(ops, config) if table is None else table
    quantized = sum(op.macs for op in ops if op.quantized) if ops else 1
    total = (float(np.sum(c * table)) + measured * cost_lib.fp32_bitops_per_step(ops) / 3.0
             + measured_products * float(quantized) * cost_lib.FP_BITS ** 2)
    base = float(cost_lib.bitops_per_step(ops, float(baseline_bits), float(baseline_bits)))
    values = np.arange(NUM_LEVELS, dtype=np.float64)
    return {"relative_cost_fp32": total / (cost_lib.fp32_bitops_per_step(ops) * steps),
            "relative_cost_static8": total / (base * steps),
            "mean_bits": float(c.sum(axis=1) @ values / steps),
            "mean_grad_bits": float(c.sum(axis=0) @ values / steps)}


__all__ = ["Bits", "ControllerCarry", "InstabilityState", "NUM_LEVELS", "PlateauState",
           "MeasuredProvider", "PrecisionController", "RangeTestState", "STATISTICS", "StepStats", "adjust",
           "advance_carry", "bits_histogram", "bits_level", "check_base", "cost_table", "error_bits",
           "final_phase", "init_carry", "is_format_schedule", "measure_products", "measured_steps", "no_stats",
           "product_errors", "on_instability",
           "on_plateau", "online_range_test", "realized_cost", "scheduled", "stats_of"]
