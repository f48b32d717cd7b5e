"""Tests for cpt_jax.schedules against an independent numpy implementation.

The reference below re-implements the formulas of REFERENCE.md (Wolfe & Kyrillidis
2024; CPT, Fu et al. 2021) in float64 numpy, without looking at the jnp code:
``z = (t mod P)/P``, ``P = total_steps // num_cycles``, ``*_decay`` triangular
(even cycles decay curve, odd cycles the matching growth curve), ``np.rint``.

Exact ties: where the exact value of a curve is a half-integer (e.g. linear 3..8
at z = 0.7 gives 6.5), float32 (the library) and float64 (this reference, and
CPT's own numpy code) may land on either side of the tie, so at steps whose
reference value lies within 1e-4 of a half-integer either neighbour is accepted;
everywhere else the values must be equal. Half-to-even itself is checked on
exactly representable ties (`test_rint_is_round_half_to_even`).
"""
from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from cpt_jax import schedules as S
from cpt_jax.schedules import SUITE

# --------------------------------------------------------------------------- reference

_GROWTH_OF = {
    "cos_decay": "cos_growth",
    "linear_decay": "linear_growth",
    "exp_decay_vertical": "exp_growth",
    "exp_decay_horizontal": "exp_growth",
    "demon_decay_vertical": "demon_growth",
    "demon_decay_horizontal": "demon_growth",
}


def ref_curve(name: str, z: np.ndarray, lo: float, hi: float) -> np.ndarray:
    """The curves of REFERENCE.md's table (float64)."""
    d = hi - lo
    u = 1.0 - z
    table = {
        "cos_growth": lambda: lo + d / 2 * (1 - np.cos(np.pi * z)),
        "cos_decay": lambda: hi - d / 2 * (1 - np.cos(np.pi * z)),
        "linear_growth": lambda: lo + d * z,
        "linear_decay": lambda: hi - d * z,
        "exp_growth": lambda: hi - d * np.exp(-4 * z),
        "exp_decay_vertical": lambda: lo + d * np.exp(-4 * z),
        "exp_decay_horizontal": lambda: hi - d * np.exp(-4 * (1 - z)),
        "demon_growth": lambda: hi - d * u / (0.1 + 0.9 * u),
        "demon_decay_vertical": lambda: lo + d * u / (0.1 + 0.9 * u),
        "demon_decay_horizontal": lambda: hi - d * z / (0.1 + 0.9 * z),
    }
    return table[name]()


def ref_unrounded(name, lo, hi, cycles, total, steps) -> np.ndarray:
    t = np.asarray(steps, np.int64)
    period = total // cycles
    z = (t % period) / period
    odd = (t // period) % 2 == 1
    growth = _GROWTH_OF.get(name, name)
    return np.where(odd, ref_curve(growth, z, lo, hi), ref_curve(name, z, lo, hi))


def ref_schedule(name, lo, hi, cycles, total, steps) -> np.ndarray:
    return np.rint(ref_unrounded(name, lo, hi, cycles, total, steps))


def assert_matches_reference(got, name, lo, hi, cycles, total, steps, tie_tol=1e-4):
    """Equal to the reference, except at (near-)exact half-integer ties (see module doc)."""
    raw = ref_unrounded(name, lo, hi, cycles, total, steps)
    want = np.rint(raw)
    got = np.asarray(got, np.float64)
    tie = np.abs(np.abs(raw - np.floor(raw)) - 0.5) < tie_tol
    bad = (got != want) & ~(tie & ((got == np.floor(raw)) | (got == np.ceil(raw))))
    assert not bad.any(), (
        f"{name} {lo}..{hi}, {cycles} cycles, {total} steps: mismatch at steps "
        f"{np.asarray(steps)[bad][:10]}: got {got[bad][:10]}, want {want[bad][:10]}")
    # Ties are isolated points of the curve (a few per cycle), never a whole stretch.
    assert len(tie) < 100 or tie.mean() < 0.1


SETTINGS = [  # (min_bits, max_bits, num_cycles, total_steps)
    (3, 8, 32, 64_000),   # CPT's CIFAR recipe, P = 2000
    (3, 8, 8, 800),       # 8 cycles as in the suite's cost table
    (2, 8, 3, 1000),      # P = 333, the last step is past the last full cycle
    (4, 6, 5, 997),       # total not a multiple of cycles
    (1, 16, 2, 50),
]


def _make(name, lo, hi, cycles, total):
    return S.cyclic(name, min_bits=lo, max_bits=hi, num_cycles=cycles, total_steps=total)


# --------------------------------------------------------------------------- suite

@pytest.mark.parametrize("setting", SETTINGS, ids=lambda s: "-".join(map(str, s)))
def test_suite_matches_numpy_reference_at_every_step(setting):
    lo, hi, cycles, total = setting
    steps = np.arange(total)
    for name in SUITE:
        values = S.schedule_values(_make(name, lo, hi, cycles, total), total)
        assert values.dtype == np.float32
        assert values.shape == (total,)
        np.testing.assert_array_equal(values, np.round(values))  # integer-valued
        assert values.min() >= lo and values.max() <= hi
        assert_matches_reference(values, name, lo, hi, cycles, total, steps)


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
        assert mean == pytest.approx(ref, abs=2e-4)  # only exact ties may differ
        assert mean == pytest.approx(expected, abs=0.06), name


def test_cpt_mean_bits_is_5_5():
    mean = S.mean_bits(S.cpt(3, 8, num_cycles=32, total_steps=64_000), 64_000)
    ref = ref_schedule("cos_growth", 3, 8, 32, 64_000, np.arange(64_000)).mean()
    assert mean == pytest.approx(ref, abs=1e-9)   # 5.499: no ties on this schedule
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
    S.plot_schedule(S.cpt(num_cycles=2, total_steps=100), 100, str(single))
    assert single.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_period_helper():
    assert S.cycle_period(64_000, 32) == 2000
    assert S.cycle_period(1000, 3) == 333
    assert S.cycle_period(10, 10) == 1
