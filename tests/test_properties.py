"""Property tests (hypothesis) for the number formats and the precision schedules.

Every property is checked for every format on random arrays and bit-widths:
idempotence, error bounds (nearest: half a grid step, stochastic: one step, inside
the representable range), at most 2^bits levels per block, monotonicity of nearest
rounding on a shared grid, outputs inside `representable_range`; and schedules stay
integer-valued inside ``[min_bits, max_bits]`` for any step up to 10^9.

Float tolerance, found while writing these tests: `AffineInt` and `SymmetricInt`
compute ``q = code * s (+ min)`` with a scale ``s`` derived from the data, and XLA
on CPU evaluates a division by a broadcast scale as a multiplication by its
reciprocal (not correctly rounded). Re-quantizing ``q`` therefore recomputes a
scale that can differ from ``s`` in the last bit, so ``quantize(quantize(x))``
equals ``quantize(x)`` only up to 2 ulp of ``max|x|`` (seen per channel), with the
same integer codes. The other formats use power-of-two units and are exactly
idempotent. Bounds below add a few ulp of ``max|x|`` for the same reason.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from cpt_jax import formats as F
from cpt_jax import schedules as S
from cpt_jax.formats import AffineInt, BlockFloat, FixedPoint, Float, SymmetricInt

SETTINGS = settings(max_examples=40, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow])

FORMATS = [AffineInt(), AffineInt(channel_axis=0), AffineInt(channel_axis=-1),
           SymmetricInt(), SymmetricInt(channel_axis=-1), FixedPoint(frac_bits=2),
           BlockFloat(), BlockFloat(channel_axis=0), Float(3), Float(4), Float(5)]
IDS = [repr(f) for f in FORMATS]
SHAPE = (6, 5)  # one shape: one compilation per format

_Q = jax.jit(F.quantize, static_argnames=("fmt", "rounding"))
_STEP = jax.jit(F.grid_step, static_argnames=("fmt",))
_RANGE = jax.jit(F.representable_range, static_argnames=("fmt",))


def _element(v: float) -> np.float32:
    # Keep clear of float32 subnormals (flushed to zero on CPU) and of magnitudes whose
    # grid spacing would be subnormal: treat |v| < 1e-6 as an exact zero.
    return np.float32(0.0 if abs(v) < 1e-6 else v)


arrays = hnp.arrays(np.float32, SHAPE, elements=st.floats(
    -1000, 1000, width=32, allow_nan=False, allow_subnormal=False).map(_element))
# Many elements at a few scales exercise both wide and narrow ranges.
scaled = st.tuples(arrays, st.sampled_from([1e-3, 1.0, 1.0, 10.0])).map(
    lambda t: (t[0] * np.float32(t[1])).astype(np.float32))


def bits_for(fmt):
    if isinstance(fmt, Float):
        return st.integers(fmt.exp_bits + 1, fmt.exp_bits + 6)
    if isinstance(fmt, FixedPoint):
        return st.integers(1, 14)
    return st.integers(1, 10)


def quant(x, bits, fmt, rounding="nearest", key=None):
    return np.asarray(_Q(jnp.asarray(x), jnp.float32(bits), fmt, rounding=rounding, key=key))


def grid(x, bits, fmt):
    return np.broadcast_to(np.asarray(_STEP(jnp.asarray(x), jnp.float32(bits), fmt)), x.shape)


def range_of(x, bits, fmt):
    lo, hi = _RANGE(jnp.float32(bits), fmt, jnp.asarray(x))
    return (np.broadcast_to(np.asarray(lo), x.shape), np.broadcast_to(np.asarray(hi), x.shape))


def slop(x, fmt):
    """Float tolerance: a few ulp of max|x| for the data-scaled integer grids."""
    if isinstance(fmt, (AffineInt, SymmetricInt)):
        return 4 * np.spacing(np.float32(max(np.abs(x).max(), 1e-30)))
    return 0.0


def blocks(a, fmt):
    """The blocks sharing one grid: the whole tensor or each index of channel_axis."""
    axis = getattr(fmt, "channel_axis", None)
    if axis is None:
        return [a.ravel()]
    return [b.ravel() for b in np.moveaxis(a, axis, 0)]


def max_levels(bits, fmt):
    if isinstance(fmt, (SymmetricInt, BlockFloat, Float)):
        return 2 ** bits - 1  # symmetric: +-L .. 0 (and +-0 are one value)
    return 2 ** bits


def per_format(test):
    return pytest.mark.parametrize("fmt", FORMATS, ids=IDS)(test)


# --------------------------------------------------------------------------- formats

def check_idempotent(x, q, bits, fmt):
    qq = quant(q, bits, fmt)
    if isinstance(fmt, (AffineInt, SymmetricInt)):
        ulp = np.spacing(np.float32(max(np.abs(x).max(), 1e-30)))
        np.testing.assert_allclose(qq, q, rtol=0, atol=2 * ulp, err_msg="idempotence")
        # Same integer codes on the first pass's grid.
        step = grid(x, bits, fmt)
        lo = range_of(x, bits, fmt)[0] if isinstance(fmt, AffineInt) else 0.0
        np.testing.assert_array_equal(np.round((qq - lo) / step), np.round((q - lo) / step),
                                      err_msg="idempotence (codes)")
    else:
        np.testing.assert_array_equal(qq, q, err_msg="idempotence")


def check_error_bound(x, q, bits, fmt, steps_allowed):
    """|q - x| <= steps_allowed * grid step for x inside the representable range."""
    step = grid(x, bits, fmt)
    lo, hi = range_of(x, bits, fmt)
    inside = (x >= lo) & (x <= hi)
    err = np.abs(q.astype(np.float64) - x)
    bound = step * steps_allowed * (1 + 1e-6) + slop(x, fmt)
    assert np.all(err[inside] <= bound[inside]), (
        f"error bound ({steps_allowed} step): worst excess {(err - bound)[inside].max()}")
    return lo, hi


def check_levels(q, bits, fmt):
    for block in blocks(q, fmt):
        assert len(np.unique(block)) <= max_levels(bits, fmt), "too many levels"


def check_in_range(x, q, bits, fmt):
    lo, hi = range_of(x, bits, fmt)
    s = slop(x, fmt)
    assert np.all(q >= lo - s) and np.all(q <= hi + s), "outside representable_range"
    assert np.all(np.isfinite(q))


def check_monotone(x, q, fmt):
    for xb, qb in zip(blocks(x, fmt), blocks(q, fmt)):
        order = np.argsort(xb, kind="stable")
        assert np.all(np.diff(qb[order]) >= 0), "not monotone"


@per_format
@SETTINGS
@given(data=st.data())
def test_nearest_rounding_properties(fmt, data):
    """Idempotent; |q - x| <= step/2 inside the range, saturating outside it; at most
    2^bits levels per block; monotone on the shared grid; inside the range."""
    x = data.draw(scaled)
    bits = data.draw(bits_for(fmt))
    q = quant(x, bits, fmt)
    check_idempotent(x, q, bits, fmt)
    lo, hi = check_error_bound(x, q, bits, fmt, 0.5)
    if isinstance(fmt, (FixedPoint, BlockFloat, Float)):
        # Outside the range, nearest rounding saturates to the closest end.
        np.testing.assert_array_equal(q[x > hi], hi[x > hi].astype(np.float32))
        np.testing.assert_array_equal(q[x < lo], lo[x < lo].astype(np.float32))
    check_levels(q, bits, fmt)
    check_monotone(x, q, fmt)
    check_in_range(x, q, bits, fmt)


@per_format
@SETTINGS
@given(data=st.data())
def test_stochastic_rounding_properties(fmt, data):
    """|q - x| <= one step inside the range; at most 2^bits levels; inside the range."""
    x = data.draw(scaled)
    bits = data.draw(bits_for(fmt))
    key = jax.random.key(data.draw(st.integers(0, 2 ** 31 - 1)))
    q = quant(x, bits, fmt, rounding="stochastic", key=key)
    check_error_bound(x, q, bits, fmt, 1.0)
    check_levels(q, bits, fmt)
    check_in_range(x, q, bits, fmt)


@SETTINGS
@given(x=scaled, bits=st.integers(32, 64), fmt=st.sampled_from(FORMATS))
def test_32_bits_and_more_is_the_identity(x, bits, fmt):
    np.testing.assert_array_equal(quant(x, bits, fmt), x)


# --------------------------------------------------------------------------- schedules

@settings(max_examples=60, deadline=None, derandomize=True)
@given(name=st.sampled_from(S.SUITE), lo=st.integers(1, 16), span=st.integers(0, 16),
       cycles=st.integers(1, 64), extra=st.integers(0, 10 ** 6),
       steps=st.lists(st.integers(0, 10 ** 9), min_size=8, max_size=8))
def test_schedule_integer_and_within_bounds_for_any_step(name, lo, span, cycles, extra, steps):
    hi = lo + span
    total = cycles + extra
    s = S.cyclic(name, min_bits=lo, max_bits=hi, num_cycles=cycles, total_steps=total)
    values = np.asarray(s(jnp.asarray(steps, jnp.int32)))  # elementwise in the step
    assert values.dtype == np.float32
    np.testing.assert_array_equal(values, np.round(values))
    assert np.all(values >= lo) and np.all(values <= hi)
    # A Python int step gives the same value as an array of steps.
    assert float(s(steps[0])) == values[0]


@settings(max_examples=40, deadline=None, derandomize=True)
@given(bits=st.integers(1, 32), factor=st.floats(0.25, 4), delta=st.integers(-4, 4),
       step=st.integers(0, 10 ** 9))
def test_composed_schedules_stay_integer_and_clipped(bits, factor, delta, step):
    s = S.clip(S.offset(S.scale(S.constant(bits), factor), delta), 2, 16)
    v = float(s(step))
    assert v == round(v) and 2 <= v <= 16
