"""Tests for cpt_jax.schedules against independent references.

The reference below re-implements the formulas of REFERENCE.md (Wolfe & Kyrillidis
2024; CPT, Fu et al. 2021) in float64 numpy, without looking at the library code:
``z = (t mod P)/P`` with ``P`` from the convention (``ceil(T/n)``, ``floor(T/n)``,
``floor(T/n) + 1``), ``*_decay`` triangular (even cycles decay curve, odd cycles the
matching growth curve), ``np.rint`` (half to even).

Exact ties: where the float64 value lies within 1e-9 of a half-integer, the reference
re-evaluates that step with 60-digit arithmetic (`fractions` / `decimal`, a Taylor
series for cos) and treats a value within 1e-40 of a half-integer as an exact tie,
rounded to even. The library must match this reference at every step.
"""
from __future__ import annotations

import decimal
import math
from fractions import Fraction

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from cpt_jax import schedules as S
from cpt_jax.schedules import CONVENTIONS, SUITE

# --------------------------------------------------------------------------- reference

_GROWTH_OF = {
    "cos_decay": "cos_growth",
    "linear_decay": "linear_growth",
    "exp_decay_vertical": "exp_growth",
    "exp_decay_horizontal": "exp_growth",
    "demon_decay_vertical": "demon_growth",
    "demon_decay_horizontal": "demon_growth",
}

_PI_60 = decimal.Decimal(
    "3.14159265358979323846264338327950288419716939937510582097494459")


def ref_period(total: int, cycles: int, convention: str) -> int:
    if convention == "ceil":
        return math.ceil(Fraction(total, cycles))
    if convention == "floor":
        return math.floor(Fraction(total, cycles))
    assert convention == "wolfe"
    return int(total / cycles) + 1   # as written in the Wolfe et al. scripts


def ref_curve(name: str, z, lo, hi, cos=np.cos, exp=np.exp, pi=np.pi):
    """The curves of REFERENCE.md's table (float64 by default)."""
    d = hi - lo
    u = 1 - z
    table = {
        "cos_growth": lambda: lo + d / 2 * (1 - cos(pi * z)),
        "cos_decay": lambda: hi - d / 2 * (1 - cos(pi * z)),
        "linear_growth": lambda: lo + d * z,
        "linear_decay": lambda: hi - d * z,
        "exp_growth": lambda: hi - d * exp(-4 * z),
        "exp_decay_vertical": lambda: lo + d * exp(-4 * z),
        "exp_decay_horizontal": lambda: hi - d * exp(-4 * (1 - z)),
        "demon_growth": lambda: hi - d * u / (Fraction(1, 10) + Fraction(9, 10) * u)
        if isinstance(u, Fraction) else hi - d * u / (0.1 + 0.9 * u),
        "demon_decay_vertical": lambda: lo + d * u / (Fraction(1, 10) + Fraction(9, 10) * u)
        if isinstance(u, Fraction) else lo + d * u / (0.1 + 0.9 * u),
        "demon_decay_horizontal": lambda: hi - d * z / (Fraction(1, 10) + Fraction(9, 10) * z)
        if isinstance(z, Fraction) else hi - d * z / (0.1 + 0.9 * z),
    }
    return table[name]()


def _decimal_cos(x: decimal.Decimal) -> decimal.Decimal:
    total, term, k = decimal.Decimal(1), decimal.Decimal(1), 0
    while abs(term) > decimal.Decimal("1e-70"):
        k += 2
        term = -term * x * x / (k * (k - 1))
        total += term
    return total


def _precise_rint(name: str, r: int, period: int, lo: int, hi: int) -> float:
    """rint of the curve at z = r/P in exact (linear, demon) or 60-digit arithmetic."""
    if name.startswith(("linear", "demon")):
        value = ref_curve(name, Fraction(r, period), lo, hi)
        return float(round(value))   # Python's round is half to even, exact on Fraction
    with decimal.localcontext() as ctx:
        ctx.prec = 60
        z = decimal.Decimal(r) / decimal.Decimal(period)
        value = ref_curve(name, z, decimal.Decimal(lo), decimal.Decimal(hi),
                          cos=_decimal_cos, exp=lambda x: x.exp(), pi=_PI_60)
        nearest_half = value.to_integral_value(decimal.ROUND_FLOOR) + decimal.Decimal("0.5")
        if abs(value - nearest_half) < decimal.Decimal("1e-40"):
            value = nearest_half
        return float(value.to_integral_value(decimal.ROUND_HALF_EVEN))


def ref_schedule(name, lo, hi, cycles, total, steps, convention="ceil") -> np.ndarray:
    t = np.asarray(steps, np.int64)
    period = ref_period(total, cycles, convention)
    r = t % period
    odd = (t // period) % 2 == 1
    curve_of_step = np.where(odd, _GROWTH_OF.get(name, name), name)
    raw = np.where(odd, ref_curve(_GROWTH_OF.get(name, name), r / period, lo, hi),
                   ref_curve(name, r / period, lo, hi))
    out = np.rint(raw)
    near_tie = np.abs(np.abs(raw - np.floor(raw)) - 0.5) < 1e-9
    for i in np.flatnonzero(near_tie):
        out[i] = _precise_rint(str(curve_of_step[i]), int(r[i]), period, lo, hi)
    return out


SETTINGS = [  # (min_bits, max_bits, num_cycles, total_steps)
    (3, 8, 32, 64_000),   # CPT's CIFAR recipe, P = 2000
    (3, 8, 8, 1500),      # the default config: 187.5 steps a cycle
    (2, 8, 3, 1000),      # P = 333 / 334
    (4, 6, 5, 997),       # total not a multiple of cycles
    (3, 8, 10, 1000),     # linear 3..8 lands on .5 every other step of a 100-step cycle
    (2, 6, 7, 49),        # demon 2..6 lands exactly on 3.5 (float64 of 1 - 0.9 + 0.9u does not)
    (3, 5, 4, 24),        # cos 3..5 at z = 1/3 is 3.5 (float64 1 - cos(pi/3) < 0.5)
    (1, 16, 2, 50),
]


def _make(name, lo, hi, cycles, total, convention="ceil"):
    return S.cyclic(name, min_bits=lo, max_bits=hi, num_cycles=cycles, total_steps=total,
                    convention=convention)


def assert_matches_reference(got, name, lo, hi, cycles, total, steps, convention="ceil"):
    want = ref_schedule(name, lo, hi, cycles, total, steps, convention)
    got = np.asarray(got, np.float64)
    bad = got != want
    assert not bad.any(), (
        f"{name} {lo}..{hi}, {cycles} cycles, {total} steps, {convention}: mismatch at "
        f"steps {np.asarray(steps)[bad][:10]}: got {got[bad][:10]}, want {want[bad][:10]}")


# --------------------------------------------------------------------------- suite

@pytest.mark.parametrize("convention", CONVENTIONS)
@pytest.mark.parametrize("setting", SETTINGS, ids=lambda s: "-".join(map(str, s)))
def test_suite_matches_reference_at_every_step(setting, convention):
    lo, hi, cycles, total = setting
    steps = np.arange(total)
    for name in SUITE:
        values = S.schedule_values(_make(name, lo, hi, cycles, total, convention), total)
        assert values.dtype == np.float32
        assert values.shape == (total,)
        assert values.min() >= lo and values.max() <= hi
        assert_matches_reference(values, name, lo, hi, cycles, total, steps, convention)


def test_reference_has_exact_ties_where_float64_misses_them():
    # The settings above do exercise the exact path: float64 of the authors' expressions
    # lands an ulp below these exact .5 values, rint of the exact value goes up to even.
    assert 1 - math.cos(math.pi / 3) < 0.5                      # cos 3..5 at z = 1/3: 3.5
    assert float(_make("cos_growth", 3, 5, 4, 24)(2)) == 4.0     # P = 6, r = 2
    u = 1 / 7                                                    # demon 2..6, P = 7, r = 6
    assert 6 - 4 * (u / (1 - 0.9 + 0.9 * u)) < 3.5               # Wolfe's float64 form
    assert float(_make("demon_growth", 2, 6, 7, 49)(6)) == 4.0   # exact 3.5 -> 4
    assert float(_make("linear_growth", 3, 8, 1, 100)(90)) == 8.0  # 7.5 -> 8 (issue 15)


def test_periods_of_the_conventions():
    # 1500 steps, 8 cycles (the default config): floor starts a 9th cycle at min bits
    # for the last 4 steps; ceil and wolfe end the run inside the 8th cycle.
    total, cycles = 1500, 8
    for convention, period in (("ceil", 188), ("floor", 187), ("wolfe", 188)):
        assert S.cycle_period(total, cycles, convention) == period
        v = S.schedule_values(_make("cos_growth", 3, 8, cycles, total, convention), total)
        starts = np.flatnonzero(np.diff(v) < 0) + 1   # where a new cycle drops to min bits
        assert len(starts) == (8 if convention == "floor" else 7), convention
    floor = S.schedule_values(_make("cos_growth", 3, 8, cycles, total, "floor"), total)
    np.testing.assert_array_equal(floor[-4:], 3.0)
    # 78,200 steps, 32 cycles: floor trains its last 24 steps in a partial cycle.
    assert 78_200 - 32 * S.cycle_period(78_200, 32, "floor") == 24
    assert S.cycle_period(78_200, 32, "ceil") * 32 >= 78_200
    # Divisible: ceil and floor agree, wolfe is one longer.
    assert S.cycle_period(64_000, 32, "ceil") == S.cycle_period(64_000, 32, "floor") == 2000
    assert S.cycle_period(64_000, 32, "wolfe") == 2001


def test_matches_the_authors_float64_code_away_from_ties():
    # CPT's cyclic_adjust_precision: rint(lo + 0.5 D (1 + cos(pi z + pi))), P = int(T/n).
    total, cycles, lo, hi = 64_000, 32, 3, 8
    period = int(total / cycles)
    t = np.arange(total)
    z = (t % period) / period
    theirs = np.rint(lo + 0.5 * (hi - lo) * (1 + np.cos(np.pi * z + np.pi)))
    ours = S.schedule_values(S.cpt(lo, hi, num_cycles=cycles, total_steps=total,
                                   convention="floor"), total)
    np.testing.assert_array_equal(ours, theirs)


def test_suite_has_every_reference_schedule():
    assert set(SUITE) == {
        "cos_growth", "cos_decay", "linear_growth", "linear_decay", "exp_growth",
        "exp_decay_vertical", "exp_decay_horizontal", "demon_growth",
        "demon_decay_vertical", "demon_decay_horizontal"}


@pytest.mark.parametrize("name", SUITE)
def test_python_int_jit_and_vmap_agree(name):
    lo, hi, cycles, total = 3, 8, 4, 400
    s = _make(name, lo, hi, cycles, total)
    steps = np.array([0, 1, 37, 99, 100, 101, 250, 399, 400, 12_345], np.int32)
    eager = np.array([float(s(int(t))) for t in steps], np.float32)
    jitted = jax.jit(s)
    under_jit = np.array([float(jitted(jnp.int32(t))) for t in steps], np.float32)
    under_vmap = np.asarray(jax.jit(jax.vmap(s))(jnp.asarray(steps)))
    np.testing.assert_array_equal(eager, under_jit)
    np.testing.assert_array_equal(eager, under_vmap)
    np.testing.assert_array_equal(eager, np.asarray(s(jnp.asarray(steps))))  # elementwise
    assert_matches_reference(eager, name, lo, hi, cycles, total, steps)
    out = jitted(jnp.int32(5))
    chex.assert_shape(out, ())
    assert out.dtype == jnp.float32


def test_traced_step_compiles_once():
    traces = []
    s = _make("cos_growth", 3, 8, 2, 40)

    @jax.jit
    def f(t):
        traces.append(1)
        return s(t)

    values = [int(f(jnp.int32(t))) for t in range(40)]
    assert len(traces) == 1
    assert sorted(set(values)) == [3, 4, 5, 6, 7, 8]


def test_rint_is_round_half_to_even():
    # P = 2 and z = 1/2: the linear value is lo + D/2, an exact float32 tie.
    half = lambda lo, hi: int(_make("linear_growth", lo, hi, 1, 2)(1))
    assert half(2, 3) == 2   # 2.5 -> 2
    assert half(3, 4) == 4   # 3.5 -> 4
    assert half(5, 6) == 6   # 5.5 -> 6
    assert half(6, 7) == 6   # 6.5 -> 6


def test_cpt_examples():
    s = S.cyclic("cos_growth", min_bits=3, max_bits=8, num_cycles=32, total_steps=64_000)
    assert float(s(0)) == 3.0
    assert float(s(1999)) == 8.0
    assert float(s(2000)) == 3.0
    assert float(s(1000)) == 6.0  # 3 + 2.5 (1 - cos(pi/2)) = 5.5 -> 6 (half to even)
    np.testing.assert_array_equal(S.schedule_values(S.cpt(), 64_000),
                                  S.schedule_values(s, 64_000))


def test_decay_schedules_are_triangular():
    # Even cycles decay from q_max, odd cycles grow back: the run starts at q_max and
    # the value is continuous across the boundary between cycle 0 and cycle 1.
    lo, hi, cycles, total = 3, 8, 4, 400
    for name in SUITE:
        v = S.schedule_values(_make(name, lo, hi, cycles, total), total)
        if name.endswith("_decay") or "_decay_" in name:
            assert v[0] == hi
            assert v[99] <= lo + 1 and v[100] == lo   # end of decay, start of growth
            assert v[199] >= hi - 1 and v[200] == hi   # end of growth, next decay
        else:
            assert v[0] == lo and v[100] == lo and v[99] >= hi - 1


@pytest.mark.parametrize("names,expected", [
    (("cos_growth", "cos_decay", "linear_growth", "linear_decay", "exp_decay_vertical"), 5.5),
    (("demon_growth", "demon_decay_horizontal"), 3.8),
    (("exp_growth", "exp_decay_horizontal"), 6.8),
])
def test_mean_bits_of_the_suite(names, expected):
    total = 64_000  # 3..8 bits, 8 cycles (REFERENCE.md)
    for name in names:
        s = _make(name, 3, 8, 8, total)
        mean = S.mean_bits(s, total)
        ref = ref_schedule(name, 3, 8, 8, total, np.arange(total)).mean()
        assert mean == pytest.approx(ref, abs=1e-12)
        assert mean == pytest.approx(expected, abs=0.06), name


def test_cpt_mean_bits_is_5_5():
    mean = S.mean_bits(S.cpt(3, 8, num_cycles=32, total_steps=64_000), 64_000)
    ref = ref_schedule("cos_growth", 3, 8, 32, 64_000, np.arange(64_000)).mean()
    assert mean == pytest.approx(ref, abs=1e-12)
    assert mean == pytest.approx(5.5, abs=0.01)


# --------------------------------------------------------------------------- others

def test_constant():
    s = S.constant(6)
    for t in (0, 1, 10**6, jnp.int32(7)):
        out = s(t)
        assert out.dtype == jnp.float32 and float(out) == 6.0
    np.testing.assert_array_equal(S.schedule_values(s, 5), np.full(5, 6.0, np.float32))
    assert float(S.constant(32)(3)) == 32.0


def test_critical_period():
    s = S.critical_period(3, 8, deficit_steps=100)
    v = S.schedule_values(s, 300)
    np.testing.assert_array_equal(v, np.where(np.arange(300) < 100, 3.0, 8.0))
    assert float(jax.jit(s)(jnp.int32(99))) == 3.0
    assert float(jax.jit(s)(jnp.int32(100))) == 8.0
    np.testing.assert_array_equal(S.schedule_values(S.critical_period(3, 8, 0), 10),
                                  np.full(10, 8.0))


def test_critical_period_inclusive_is_cpts_cifar_convention():
    # crit_learn.py (CIFAR): low bits while t <= D, i.e. D + 1 steps.
    for d in (0, 1, 7, 100):
        v = S.schedule_values(S.critical_period(4, 8, d, inclusive=True), 120)
        np.testing.assert_array_equal(v, np.where(np.arange(120) <= d, 4.0, 8.0))
        assert int((v == 4.0).sum()) == d + 1
        exclusive = S.schedule_values(S.critical_period(4, 8, d), 120)
        assert int((exclusive == 4.0).sum()) == d


def test_rint_fraction_matches_python_round_on_fractions():
    rng = np.random.default_rng(0)
    num = rng.integers(-10_000, 10_000, size=2000)
    den = rng.integers(1, 40, size=2000)
    want = [round(Fraction(int(n), int(d))) for n, d in zip(num, den)]
    np.testing.assert_array_equal(S.rint_fraction(num, den), want)
    with pytest.raises(ValueError, match="positive"):
        S.rint_fraction(np.array([1]), np.array([0]))


def test_join_has_optax_semantics():
    cyc = _make("linear_growth", 2, 6, 1, 20)
    pieces = [S.constant(8), cyc, S.critical_period(4, 5, 3)]
    boundaries = [5, 25]
    joined = S.join(pieces, boundaries)
    steps = np.arange(40)
    got = S.schedule_values(joined, 40)
    # Each segment sees its own step count from 0.
    want = np.concatenate([
        np.full(5, 8.0),
        ref_schedule("linear_growth", 2, 6, 1, 20, np.arange(20)),
        np.where(np.arange(15) < 3, 4.0, 5.0)])
    np.testing.assert_array_equal(got, want)
    # The same as optax.join_schedules on the same pieces.
    via_optax = optax.join_schedules(pieces, boundaries)
    np.testing.assert_array_equal(
        got, np.asarray(jax.vmap(via_optax)(jnp.asarray(steps, jnp.int32)), np.float32))


def test_join_validation():
    with pytest.raises(ValueError, match="boundaries"):
        S.join([S.constant(8), S.constant(4)], [])
    with pytest.raises(ValueError, match="boundaries"):
        S.join([S.constant(8), S.constant(4), S.constant(2)], [10, 5])
    with pytest.raises(ValueError, match="boundaries"):
        S.join([S.constant(8), S.constant(4)], [-1])


def test_offset_scale_clip():
    base = _make("cos_growth", 3, 8, 2, 40)
    b = S.schedule_values(base, 40)
    np.testing.assert_array_equal(S.schedule_values(S.offset(base, 2), 40), b + 2)
    np.testing.assert_array_equal(S.schedule_values(S.offset(base, -1), 40), b - 1)
    np.testing.assert_array_equal(S.schedule_values(S.scale(base, 1.5), 40), np.rint(b * 1.5))
    np.testing.assert_array_equal(S.schedule_values(S.scale(base, 2), 40), b * 2)
    np.testing.assert_array_equal(S.schedule_values(S.clip(base, 4, 6), 40), np.clip(b, 4, 6))
    composed = S.clip(S.offset(S.scale(base, 2), 1), 1, 16)
    np.testing.assert_array_equal(S.schedule_values(composed, 40), np.clip(2 * b + 1, 1, 16))
    for sched in (S.offset(base, 2), S.scale(base, 1.5), S.clip(base, 4, 6)):
        assert sched(3).dtype == jnp.float32


# --------------------------------------------------------------------------- validation

@pytest.mark.parametrize("call,arg", [
    (lambda: S.constant(0), "bits"),
    (lambda: S.constant(2.5), "bits"),
    (lambda: S.cyclic("cos_growth", min_bits=0, max_bits=8, num_cycles=2, total_steps=10),
     "min_bits"),
    (lambda: S.cyclic("cos_growth", min_bits=3, max_bits=0, num_cycles=2, total_steps=10),
     "max_bits"),
    (lambda: S.cyclic("cos_growth", min_bits=8, max_bits=3, num_cycles=2, total_steps=10),
     "min_bits"),
    (lambda: S.cyclic("cos_growth", min_bits=3, max_bits=8, num_cycles=0, total_steps=10),
     "num_cycles"),
    (lambda: S.cyclic("cos_growth", min_bits=3, max_bits=8, num_cycles=11, total_steps=10),
     "total_steps"),
    (lambda: S.cyclic("cos_growth", min_bits=3, max_bits=8, num_cycles=2, total_steps=0),
     "total_steps"),
    (lambda: S.cpt(3, 8, num_cycles=-1), "num_cycles"),
    (lambda: S.critical_period(0, 8, 10), "low_bits"),
    (lambda: S.critical_period(3, 8, -1), "deficit_steps"),
    (lambda: S.clip(S.constant(8), 9, 4), "min_bits"),
    (lambda: S.schedule_values(S.constant(8), 0), "total_steps"),
])
def test_validation_errors_name_the_argument(call, arg):
    with pytest.raises(ValueError, match=arg):
        call()


def test_min_bits_greater_than_max_bits_message():
    with pytest.raises(ValueError, match=r"min_bits must be <= max_bits.*8.*3"):
        S.cyclic("linear_growth", min_bits=8, max_bits=3, num_cycles=1, total_steps=10)


def test_unknown_name_lists_suite():
    with pytest.raises(ValueError) as info:
        S.cyclic("cosine", min_bits=3, max_bits=8, num_cycles=1, total_steps=10)
    message = str(info.value)
    assert "cosine" in message
    for name in SUITE:
        assert name in message


# --------------------------------------------------------------------------- plotting

def test_plot_schedules_writes_png(tmp_path):
    path = tmp_path / "suite.png"
    named = {n: _make(n, 3, 8, 2, 100) for n in SUITE[:3]}
    fig = S.plot_schedules(named, 100, str(path), title="suite", grid=True)
    assert fig is not None
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1000
    single = tmp_path / "one.png"
    S.plot_schedules(S.cpt(num_cycles=2, total_steps=100), 100, str(single))
    assert single.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_period_helper():
    assert S.cycle_period(64_000, 32) == 2000
    assert S.cycle_period(1000, 3) == 334
    assert S.cycle_period(1000, 3, "floor") == 333
    assert S.cycle_period(1000, 3, "wolfe") == 334
    assert S.cycle_period(10, 10) == 1
    with pytest.raises(ValueError, match="convention"):
        S.cycle_period(10, 2, "round")
