"""Tests for cpt_jax.formats: each number format against its definition.

Expected values are worked out by hand (in the comments) or computed independently
in numpy / ml_dtypes; most examples use power-of-two scales so results are exact.
"""
from __future__ import annotations

import dataclasses
import itertools
import pathlib
import re

import chex
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from cpt_jax import formats as F
from cpt_jax.formats import AffineInt, BlockFloat, FixedPoint, Float, SymmetricInt, quantize

ALL_FORMATS = [AffineInt(), AffineInt(channel_axis=-1), SymmetricInt(),
               SymmetricInt(channel_axis=0), FixedPoint(frac_bits=3),
               BlockFloat(channel_axis=-1), Float(4), Float(5)]
FMT_IDS = [repr(f) for f in ALL_FORMATS]

# One compilation per (format, rounding, shape): much cheaper on 2 shared cores than
# eager dispatch, which compiles every primitive of `quantize` for each new shape.
_JQ = jax.jit(quantize, static_argnames=("fmt", "rounding"))
_JSTEP = jax.jit(F.grid_step, static_argnames=("fmt",))
_JRANGE = jax.jit(F.representable_range, static_argnames=("fmt",))


def q_np(x, bits, fmt, dtype=jnp.float32, **kw) -> np.ndarray:
    """``quantize`` (jitted, traced bits) as a numpy array."""
    out = _JQ(jnp.asarray(x, dtype), jnp.float32(bits), fmt, **kw)
    return np.asarray(out.astype(jnp.float32)) if dtype != jnp.float32 else np.asarray(out)


def f32(*values) -> np.ndarray:
    return np.array(values, np.float32)


def min_bits(fmt) -> int:
    return fmt.exp_bits + 1 if isinstance(fmt, Float) else 1


# --------------------------------------------------------------------------- AffineInt

def test_affine_per_tensor_cpt_formula():
    # lo = -1, hi = 2, b = 2: s = 3/3 = 1; codes round(x + 1) half to even:
    # [0, .5, .8, 1.5, 2.5, 3] -> [0, 0, 1, 2, 2, 3]; q = codes - 1.
    x = f32(-1.0, -0.5, -0.2, 0.5, 1.5, 2.0)
    np.testing.assert_array_equal(q_np(x, 2, AffineInt()), f32(-1, -1, 0, 1, 1, 2))
    # [0, 7], b = 3: s = 1; 0.5 -> 0, 1.5 -> 2, 2.5 -> 2, 3.49 -> 3, 6.6 -> 7.
    x = f32(0.0, 0.5, 1.5, 2.5, 3.49, 6.6, 7.0)
    np.testing.assert_array_equal(q_np(x, 3, AffineInt()), f32(0, 0, 2, 2, 3, 7, 7))
    # Non-dyadic scale: [0, 0.3, 1] at 2 bits, s = 1/3, codes [0, 1, 3].
    np.testing.assert_allclose(q_np(f32(0, 0.3, 1), 2, AffineInt()), [0, 1 / 3, 1], rtol=1e-6)


def test_affine_scale_is_clamped_at_1e_8():
    # Range 5e-8 at 8 bits: (max-min)/255 ~ 2e-10 < 1e-8, so s = 1e-8 and the codes
    # are round(x / 1e-8) = [0, 2, 5] (without the clamp q would be ~x).
    x = f32(0.0, 2.4e-8, 5e-8)
    np.testing.assert_allclose(q_np(x, 8, AffineInt()), [0.0, 2e-8, 5e-8], rtol=1e-5)
    assert F.MIN_SCALE == 1e-8


def test_affine_per_channel():
    w = np.array([[0.0, -2.0],
                  [1.0, 0.9],
                  [3.0, 4.0]], np.float32)
    # column 0: [0, 3], s = 1 -> [0, 1, 3]; column 1: [-2, 4], s = 2,
    # (x + 2)/2 = [0, 1.45, 3] -> codes [0, 1, 3] -> [-2, 0, 4].
    want = np.array([[0, -2], [1, 0], [3, 4]], np.float32)
    np.testing.assert_array_equal(q_np(w, 2, AffineInt(channel_axis=-1)), want)
    np.testing.assert_array_equal(q_np(w, 2, AffineInt(channel_axis=1)), want)
    np.testing.assert_array_equal(q_np(w.T, 2, AffineInt(channel_axis=0)), want.T)
    # One range for the whole tensor: [-2, 4], s = 2; column 0 (x+2)/2 = [1, 1.5, 2.5]
    # -> codes [1, 2, 2] -> [0, 2, 2].
    np.testing.assert_array_equal(q_np(w, 2, AffineInt())[:, 0], f32(0, 2, 2))


def test_affine_channel_axis_out_of_range():
    with pytest.raises(ValueError, match="channel_axis"):
        quantize(jnp.ones((2, 3)), 4, AffineInt(channel_axis=2))


# --------------------------------------------------------------------------- SymmetricInt

def test_symmetric_levels():
    # b = 3: L = 3, amax = 3 -> s = 1; ties -1.5 -> -2, 0.5 -> 0, 2.5 -> 2.
    x = f32(-3.0, -1.5, -0.4, 0.5, 1.2, 2.5, 3.0)
    np.testing.assert_array_equal(q_np(x, 3, SymmetricInt()), f32(-3, -2, 0, 0, 1, 2, 3))
    # b = 2: L = 1, s = amax: three levels {-1, 0, 1}.
    np.testing.assert_array_equal(q_np(f32(-1, -0.6, 0.1, 0.9), 2, SymmetricInt()),
                                  f32(-1, -1, 0, 1))
    # b = 1: no nonzero level.
    np.testing.assert_array_equal(q_np(f32(-1, 0.5, 2), 1, SymmetricInt()), f32(0, 0, 0))
    # At b bits there are at most 2^b - 1 levels, symmetric about 0.
    x = np.linspace(-1, 1, 1001, dtype=np.float32)
    for b in range(2, 9):
        levels = np.unique(q_np(x, b, SymmetricInt()))
        assert len(levels) == 2 ** b - 1
        np.testing.assert_allclose(levels, -levels[::-1], rtol=1e-6)


def test_symmetric_per_channel():
    w = np.array([[-4.0, 0.5],
                  [1.0, -0.25],
                  [3.1, 1.0]], np.float32)
    # b = 3, L = 3: column 0 amax 4 -> s = 4/3; column 1 amax 1 -> s = 1/3.
    want = np.stack([np.round(w[:, 0] / (4 / 3)) * (4 / 3),
                     np.round(w[:, 1] * 3) / 3], axis=1)
    np.testing.assert_allclose(q_np(w, 3, SymmetricInt(channel_axis=-1)), want, rtol=1e-6)


# --------------------------------------------------------------------------- FixedPoint

def test_fixed_point_range_rounding_and_saturation():
    fmt = FixedPoint(frac_bits=2)  # unit 0.25, b = 4: range [-2, 1.75]
    x = f32(0.3, 0.375, 0.125, -0.625, 5.0, -5.0, 1.75, -2.0, 1.9, -2.1)
    # 1.2 -> 1, 1.5 -> 2, 0.5 -> 0, -2.5 -> -2 (half to even); saturate to [-2, 1.75].
    want = f32(0.25, 0.5, 0.0, -0.5, 1.75, -2.0, 1.75, -2.0, 1.75, -2.0)
    np.testing.assert_array_equal(q_np(x, 4, fmt), want)
    lo, hi = F.representable_range(4, fmt)
    assert (float(lo), float(hi)) == (-2.0, 1.75)
    # b = 6, f = 2: range [-8, 7.75].
    np.testing.assert_array_equal(q_np(f32(100, -100, 7.8, 3.125), 6, fmt),
                                  f32(7.75, -8, 7.75, 3.0))
    lo, hi = F.representable_range(6, fmt)
    assert (float(lo), float(hi)) == (-8.0, 7.75)
    # Integers (f = 0) at 8 bits: [-128, 127].
    np.testing.assert_array_equal(q_np(f32(-300, -128.5, 126.5, 300), 8, FixedPoint(0)),
                                  f32(-128, -128, 126, 127))


def test_fixed_point_rejects_bad_frac_bits():
    with pytest.raises(ValueError, match="frac_bits"):
        FixedPoint(frac_bits=-1)


# --------------------------------------------------------------------------- BlockFloat

def test_block_float_shared_exponent():
    # amax 3.9 -> e = 1, b = 4: unit 2^(1+2-4) = 0.5, codes clipped to [-7, 7]:
    # 7.8 -> 8 -> 7 (saturates), 1.5 -> 2, 2.5 -> 2 (half to even), 0.4 -> 0.
    x = f32(3.9, -3.9, 0.75, 1.25, 0.2)
    np.testing.assert_array_equal(q_np(x, 4, BlockFloat()), f32(3.5, -3.5, 1.0, 1.0, 0.0))
    # Docstring example: amax 1 -> e = 0, unit 0.25.
    np.testing.assert_array_equal(q_np(f32(1.0, 0.3, -0.05), 4, BlockFloat()),
                                  f32(1.0, 0.25, 0.0))
    # b = 8, amax 3 (e = 1): unit 2^-5.
    x = f32(3.0, 0.1, -1.0)
    np.testing.assert_array_equal(q_np(x, 8, BlockFloat()),
                                  np.round(x * 32) / 32)


def test_block_float_per_channel():
    x = np.array([[3.9, 0.75, 1.25],
                  [0.1, 0.03, -0.06]], np.float32)
    # Row 1: amax 0.1 = 1.6 * 2^-4 -> e = -4, b = 4: unit 2^-6 = 0.015625;
    # 6.4 -> 6, 1.92 -> 2, -3.84 -> -4.
    want = np.array([[3.5, 1.0, 1.0],
                     [0.09375, 0.03125, -0.0625]], np.float32)
    np.testing.assert_array_equal(q_np(x, 4, BlockFloat(channel_axis=0)), want)
    np.testing.assert_array_equal(q_np(x.T, 4, BlockFloat(channel_axis=-1)), want.T)
    # One exponent for the whole tensor (unit 0.5): the small row vanishes.
    np.testing.assert_array_equal(q_np(x, 4, BlockFloat())[1], f32(0, 0, 0))


# --------------------------------------------------------------------------- Float

def float_grid(exp_bits: int, man_bits: int) -> np.ndarray:
    """All non-negative values of a QPyTorch small float (no Inf/NaN codes), float64."""
    bias = 2 ** (exp_bits - 1) - 1
    emin, emax = 1 - bias, 2 ** (exp_bits - 1)
    sub = [k * 2.0 ** (emin - man_bits) for k in range(2 ** man_bits)]
    normal = [(1 + m / 2 ** man_bits) * 2.0 ** e
              for e in range(emin, emax + 1) for m in range(2 ** man_bits)]
    return np.array(sorted(set(sub + normal)))


@pytest.mark.parametrize("exp_bits,max_value,min_sub", [(4, 480.0, 2.0 ** -9),
                                                        (5, 114688.0, 2.0 ** -16)])
def test_float8_extremes(exp_bits, max_value, min_sub):
    fmt = Float(exp_bits)
    grid = float_grid(exp_bits, 8 - 1 - exp_bits)
    assert grid.max() == max_value and grid[1] == min_sub
    lo, hi = F.representable_range(8, fmt)
    assert (float(lo), float(hi)) == (-max_value, max_value)
    x = f32(1e9, -1e9, max_value, 1.01 * max_value, min_sub, -min_sub, 0.75 * min_sub,
            0.5 * min_sub, 1.5 * min_sub, 0.25 * min_sub)
    want = f32(max_value, -max_value, max_value, max_value, min_sub, -min_sub, min_sub,
               0.0, 2 * min_sub, 0.0)  # 0.5 -> 0 and 1.5 -> 2 (half to even)
    np.testing.assert_array_equal(q_np(x, 8, fmt), want)


@pytest.mark.parametrize("exp_bits,bits", [(4, 8), (5, 8), (3, 6), (2, 4)])
def test_float_grid_points_and_midpoints(exp_bits, bits):
    man = bits - 1 - exp_bits
    grid = float_grid(exp_bits, man)
    fmt = Float(exp_bits)
    # Every grid value (and its negative) is a fixed point.
    np.testing.assert_array_equal(q_np(grid, bits, fmt), grid.astype(np.float32))
    np.testing.assert_array_equal(q_np(-grid, bits, fmt), -grid.astype(np.float32))
    # Midpoints go to the neighbour with an even significand (half to even).
    a, b = grid[:-1], grid[1:]
    spacing = b - a
    k = np.round(a / spacing).astype(np.int64)  # a = k * spacing exactly
    np.testing.assert_array_equal(k * spacing, a)
    want = np.where(k % 2 == 0, a, b)
    np.testing.assert_array_equal(q_np((a + b) / 2, bits, fmt), want.astype(np.float32))
    # Just off the midpoint: the nearer neighbour.
    np.testing.assert_array_equal(q_np(a + 0.4 * spacing, bits, fmt), a.astype(np.float32))
    np.testing.assert_array_equal(q_np(a + 0.6 * spacing, bits, fmt), b.astype(np.float32))


def test_float_known_values():
    # e4m3 at the top binade (e = 8, spacing 32): 464 = 14.5 * 32 -> 448, 470 -> 480.
    np.testing.assert_array_equal(q_np(f32(464, 470, 500, 0.1, 1000), 8, Float(4)),
                                  f32(448, 480, 480, 0.1015625, 480))


@pytest.mark.parametrize("exp_bits,dtype,limit", [
    (4, ml_dtypes.float8_e4m3fn, 448.0),  # e4m3fn spends its top code on NaN: max 448
    (5, ml_dtypes.float8_e5m2, 57344.0),  # IEEE e5m2: top exponent is Inf/NaN
])
def test_float8_matches_ml_dtypes_inside_their_range(exp_bits, dtype, limit):
    rng = np.random.default_rng(0)
    mags = np.exp2(rng.uniform(-20, np.log2(limit), 4000))
    x = (mags * rng.choice([-1, 1], mags.shape)).astype(np.float32)
    x = np.clip(x, -limit, limit)
    want = x.astype(dtype).astype(np.float32)
    np.testing.assert_array_equal(q_np(x, 8, Float(exp_bits)), want)


def test_float8_exp8_matches_bfloat16_down_to_the_smallest_normal():
    # Float(8) at 16 bits is bfloat16 (no Inf code); check normal float32 inputs over
    # the whole exponent range, including the lowest binades (2^-126 .. 2^-100).
    rng = np.random.default_rng(1)
    mags = np.exp2(rng.uniform(-126, 127.9, 4000))
    mags = np.concatenate([mags, np.exp2(rng.uniform(-126, -100, 1000))])
    x = (mags * rng.choice([-1, 1], mags.shape)).astype(np.float32)
    x = x[np.abs(x) >= np.finfo(np.float32).tiny]
    want = x.astype(ml_dtypes.bfloat16).astype(np.float32)
    np.testing.assert_array_equal(q_np(x, 16, Float(8)), want)


def test_float_rejects_bad_exp_bits():
    for e in (0, 9, 2.5):
        with pytest.raises(ValueError, match="exp_bits"):
            Float(exp_bits=e)


# --------------------------------------------------------------------------- contract

@pytest.mark.parametrize("fmt", ALL_FORMATS, ids=FMT_IDS)
def test_bits_traced_in_jit_compiles_once(fmt):
    traces = []

    @jax.jit
    def f(x, bits):
        traces.append(1)
        return quantize(x, bits, fmt)

    x = jnp.asarray(np.random.default_rng(0).normal(size=(4, 6)), jnp.float32)
    widths = list(range(max(2, min_bits(fmt)), 9))
    outs = []
    for b in widths:
        got = np.asarray(f(x, jnp.float32(b)))
        with jax.disable_jit():  # op by op, static Python bits: another code path
            want = np.asarray(quantize(x, b, fmt))
        if isinstance(fmt, (AffineInt, SymmetricInt)):
            # XLA fuses `codes * s + min` differently under jit and eagerly (and turns a
            # division by a broadcast scale into a reciprocal multiply): allow 2 ulp.
            ulp = np.spacing(np.abs(np.asarray(x)).max())
            np.testing.assert_allclose(got, want, rtol=0, atol=2 * ulp)
            # Same grid point: the integer codes agree exactly.
            step = np.asarray(_JSTEP(x, b, fmt))
            lo = np.asarray(_JRANGE(b, fmt, x)[0]) if isinstance(
                fmt, AffineInt) else 0.0
            np.testing.assert_array_equal(np.round((got - lo) / step),
                                          np.round((want - lo) / step))
        else:
            np.testing.assert_array_equal(got, want)
        outs.append(got)
    # Traced 32 bits is full precision too.
    np.testing.assert_array_equal(np.asarray(f(x, jnp.float32(32))), np.asarray(x))
    assert len(traces) == 1
    assert f._cache_size() == 1
    # The width really changes the result: more bits, smaller error (non-increasing).
    errors = [np.abs(o - np.asarray(x)).max() for o in outs]
    assert errors[-1] < errors[0]


@pytest.mark.parametrize("fmt", ALL_FORMATS, ids=FMT_IDS)
def test_full_precision_at_32_bits(fmt):
    x = jnp.asarray(f32(0.1234567, -3.3, np.nan, np.inf, 1e-30, 7e5))
    for b in (32, 33, 64):
        out = quantize(x, b, fmt)
        np.testing.assert_array_equal(np.asarray(out), np.asarray(x))


@pytest.mark.parametrize("fmt", ALL_FORMATS, ids=FMT_IDS)
def test_all_zero_and_constant_tensors(fmt):
    for b in sorted({min_bits(fmt), 4 if min_bits(fmt) <= 4 else min_bits(fmt), 8}):
        zeros = np.zeros((3, 4), np.float32)
        np.testing.assert_array_equal(q_np(zeros, b, fmt), zeros)
        for c in (0.3, -2.7, 1.0):
            x = np.full((3, 4), c, np.float32)
            q = q_np(x, b, fmt)
            assert np.all(np.isfinite(q))
            assert np.all(q == q.flat[0])  # a constant stays constant
            if isinstance(fmt, AffineInt):
                np.testing.assert_array_equal(q, x)  # zero range: exact
            elif isinstance(fmt, SymmetricInt) and b >= 2:
                np.testing.assert_allclose(q, x, rtol=1e-6)  # the top level is max|x|


def test_stochastic_constant_and_zero_tensors_are_exact():
    key = jax.random.key(0)
    for fmt in (AffineInt(), AffineInt(channel_axis=0), SymmetricInt()):
        x = np.full((5,), -1.7, np.float32)
        np.testing.assert_array_equal(q_np(x, 4, fmt, rounding="stochastic", key=key), x)
    for fmt in (AffineInt(), SymmetricInt(channel_axis=0), BlockFloat(), Float(4)):
        z = np.zeros((5,), np.float32)
        np.testing.assert_array_equal(
            q_np(z, 8, fmt, rounding="stochastic", key=key), z)


@pytest.mark.parametrize("fmt", ALL_FORMATS, ids=FMT_IDS)
def test_non_finite_pass_through_without_poisoning(fmt):
    x = np.array([[0.5, -0.25, 1.0, 3.0],
                  [-1.5, 2.0, 0.125, -0.75],
                  [0.3, -2.2, 1.7, 0.9]], np.float32)
    x[0, 0], x[1, 1], x[2, 2] = np.nan, np.inf, -np.inf
    mask = ~np.isfinite(x)
    bits = 4 if min_bits(fmt) <= 4 else 8
    q = q_np(x, bits, fmt)
    assert np.isnan(q[0, 0]) and q[1, 1] == np.inf and q[2, 2] == -np.inf
    assert np.all(np.isfinite(q[~mask]))
    # The finite elements are quantized as if the non-finite ones were not there.
    ref = _finite_only_reference(x, fmt, bits)
    np.testing.assert_array_equal(q[~mask], ref[~mask])


def _finite_only_reference(x, fmt, bits):
    """Quantize each block after replacing its non-finite entries by a finite entry of
    the same block (which changes neither its min, max nor max-abs)."""
    x = x.copy()
    axis = getattr(fmt, "channel_axis", None)
    if axis is None:
        x[~np.isfinite(x)] = x[np.isfinite(x)][0]
    else:
        moved = np.moveaxis(x, axis, 0)
        for block in moved:
            block[~np.isfinite(block)] = block[np.isfinite(block)][0]
        x = np.moveaxis(moved, 0, axis)
    return q_np(x, bits, fmt)


@pytest.mark.parametrize("fmt", [AffineInt(), AffineInt(channel_axis=-1), SymmetricInt(),
                                 BlockFloat(channel_axis=0)], ids=repr)
def test_non_finite_in_a_large_tensor(fmt):
    # Large tensors may take a different (CPU fast-path) reduction: same contract.
    x = np.random.default_rng(3).normal(size=(128, 130)).astype(np.float32)
    clean = q_np(x, 4, fmt)
    x[5, 7], x[100, 3], x[64, 129] = np.nan, np.inf, -np.inf
    mask = ~np.isfinite(x)
    q = q_np(x, 4, fmt)
    assert np.isnan(q[5, 7]) and q[100, 3] == np.inf and q[64, 129] == -np.inf
    ref = _finite_only_reference(x, fmt, 4)
    np.testing.assert_array_equal(q[~mask], ref[~mask])
    # Away from the poisoned blocks nothing changed at all.
    assert np.all(np.isfinite(q[~mask]))
    if getattr(fmt, "channel_axis", None) is not None:
        axis = fmt.channel_axis % 2
        untouched = np.all(np.isfinite(x), axis=1 - axis)
        idx = [slice(None), slice(None)]
        idx[axis] = untouched
        np.testing.assert_array_equal(q[tuple(idx)], clean[tuple(idx)])


def test_affine_range_overflowing_float32_stays_finite():
    # max - min = 6e38 overflows float32; the grid is built on the range halved
    # (exactly, a power of two): step 6e38 / 15 = 4e37 at 4 bits, points -3e38 + c 4e37.
    x = f32(-3e38, 0.0, 3e38, 1.1e38)
    q = q_np(x, 4, AffineInt())
    assert np.all(np.isfinite(q))
    step = np.float64(6e38) / 15
    codes = (q.astype(np.float64) + 3e38) / step
    np.testing.assert_allclose(codes, [0, 8, 15, 10], atol=1e-5)  # 7.5 -> 8 (half even)
    assert np.asarray(_JSTEP(x, 4, AffineInt())).item() == pytest.approx(step, rel=1e-6)
    # 2 bits: step 2e38, whose reciprocal (5e-39) is subnormal: still the nearest point.
    np.testing.assert_allclose(q_np(f32(-3e38, 0.0, 3e38), 2, AffineInt()),
                               [-3e38, 1e38, 3e38], rtol=1e-6)
    # Per channel: only the overflowing column is built on the halved range.
    w = np.array([[-3e38, 0.0], [3e38, 1.0]], np.float32)
    np.testing.assert_allclose(q_np(w, 4, AffineInt(channel_axis=-1)), w, rtol=1e-6)


EXTREME_FORMATS = ALL_FORMATS + [
    AffineInt(channel_axis=0), Float(8), F.OCPFloat("e4m3"), F.OCPFloat("e2m1"),
    F.MX("e4m3"), F.MX("int8"), F.MX("int"), F.MX("float"), F.NVFP4(),
    F.ScaledFloat("e4m3"), F.ScaledFloat("e5m2", granularity="row"),
    F.ScaledFloat("e4m3", granularity="tile"), F.ScaledFloat("e4m3", granularity="block")]
_FMAX, _TINY = np.finfo(np.float32).max, np.finfo(np.float32).tiny
EXTREME_INPUTS = {
    "+-3e38": np.tile(f32(-3e38, 0.0, 3e38, 1.0), (4, 1)),
    "+-max": np.tile(f32(-_FMAX, 0.0, _FMAX, -_FMAX), (4, 1)),
    "max": np.full((4, 4), _FMAX, np.float32),
    "max and tiny": np.tile(f32(_FMAX, -_FMAX, 1e-30, _TINY), (4, 1)),
    "near the smallest normal": np.tile(f32(_TINY, 2 * _TINY, 0.0, -_TINY), (4, 1)),
}


@pytest.mark.parametrize("name", sorted(EXTREME_INPUTS))
@pytest.mark.parametrize("fmt", EXTREME_FORMATS, ids=[repr(f) for f in EXTREME_FORMATS])
def test_every_format_is_finite_on_extreme_finite_inputs(fmt, name):
    # Each case once failed: AffineInt's +-3e38 (max - min = inf, NaN everywhere),
    # SymmetricInt's max (the top code times the scale rounds to inf) and the scaled FP
    # formats near the smallest normal (amax / 448 flushed to 0, 0 / 0 = NaN).
    x = jnp.asarray(EXTREME_INPUTS[name])
    q = jax.jit(lambda x, b, k: jnp.stack([
        quantize(x, b, fmt), quantize(x, b, fmt, rounding="stochastic", key=k)]))
    for bits in (2, 4, 8, 16):
        if bits < min_bits(fmt) or (isinstance(fmt, F.MX) and fmt.element == "float"
                                    and bits < 4):
            continue
        out = np.asarray(q(x, jnp.float32(bits), jax.random.key(bits)))
        assert np.all(np.isfinite(out)), (bits, out[0, 0])


def test_non_finite_only_tensor():
    x = f32(np.nan, np.inf, -np.inf)
    for fmt in ALL_FORMATS:
        q = q_np(x, 8, fmt)
        assert np.isnan(q[0]) and q[1] == np.inf and q[2] == -np.inf


@pytest.mark.parametrize("fmt", ALL_FORMATS, ids=FMT_IDS)
def test_stochastic_rounding_is_unbiased_and_within_one_step(fmt):
    bits = 4 if min_bits(fmt) <= 4 else 6
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.uniform(-0.9, 0.9, size=(5, 5)), jnp.float32)
    if isinstance(fmt, FixedPoint):  # keep inside [-1, 0.875] at 4 bits, f = 3
        x = jnp.clip(x, -0.95, 0.8)
    n = 2000
    keys = jax.random.split(jax.random.key(42), n)
    samples = np.asarray(jax.jit(jax.vmap(
        lambda k: quantize(x, bits, fmt, rounding="stochastic", key=k)))(keys))
    step = np.broadcast_to(np.asarray(_JSTEP(x, bits, fmt)), x.shape)
    xn = np.asarray(x)
    # Within one grid step of x: the value just below or just above.
    assert np.all(np.abs(samples - xn) <= step * (1 + 1e-5))
    nearest = q_np(xn, bits, fmt)
    assert np.all(np.abs(samples - nearest) <= step * (1 + 1e-5))
    # Unbiased inside the representable range (BlockFloat's top code is
    # (2^(b-1)-1) u, which can be below max|x|: those elements saturate): the mean
    # over keys is within 4 standard errors (<= step/2/sqrt(n)).
    lo, hi = (np.asarray(v) for v in _JRANGE(bits, fmt, x))
    inside = (xn >= lo) & (xn <= hi)
    assert inside.mean() > 0.8
    err = np.abs(samples.mean(0) - xn)
    assert np.all(err[inside] <= (4 * 0.5 * step / np.sqrt(n) + 1e-6)[inside]), \
        (err / step).max()
    # And it is not nearest rounding in disguise.
    assert np.mean(samples != nearest[None]) > 0.1


def test_stochastic_rounding_depends_on_the_key_only():
    x = jnp.linspace(-1, 1, 64)
    a = _JQ(x, 3.0, AffineInt(), rounding="stochastic", key=jax.random.key(1))
    b = _JQ(x, 3.0, AffineInt(), rounding="stochastic", key=jax.random.key(1))
    c = _JQ(x, 3.0, AffineInt(), rounding="stochastic", key=jax.random.key(2))
    chex.assert_trees_all_equal(a, b)
    assert not np.array_equal(np.asarray(a), np.asarray(c))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("fmt", ALL_FORMATS, ids=FMT_IDS)
def test_dtype_and_shape_preserved(fmt, dtype):
    x = jnp.asarray(np.random.default_rng(0).normal(size=(3, 4)), dtype)
    bits = 8
    out = _JQ(x, jnp.float32(bits), fmt)
    chex.assert_type(out, dtype)
    chex.assert_shape(out, (3, 4))
    # Computed in float32, cast back once.
    want = q_np(np.asarray(x, np.float32), bits, fmt)
    np.testing.assert_array_equal(np.asarray(out, np.float32),
                                  np.asarray(jnp.asarray(want).astype(dtype), np.float32))


def test_dtype_preserved_eagerly_and_with_stochastic_rounding():
    x = jnp.asarray([0.3, -1.2, 2.5], jnp.bfloat16)
    chex.assert_type(quantize(x, 4, AffineInt()), jnp.bfloat16)
    chex.assert_type(_JQ(x, 4.0, AffineInt(), rounding="stochastic",
                         key=jax.random.key(0)), jnp.bfloat16)
    chex.assert_type(quantize(x, 32, AffineInt()), jnp.bfloat16)


def test_scalar_input():
    out = _JQ(jnp.float32(0.3), 4.0, FixedPoint(2))
    chex.assert_shape(out, ())
    assert float(out) == 0.25


# --------------------------------------------------------------------------- errors

def test_unknown_rounding():
    with pytest.raises(ValueError, match="rounding"):
        quantize(jnp.ones(3), 4, AffineInt(), rounding="up")


def test_stochastic_without_key():
    with pytest.raises(ValueError, match="key"):
        quantize(jnp.ones(3), 4, AffineInt(), rounding="stochastic")


@pytest.mark.parametrize("bits", [0, -3, 0.5, np.float32(0.0), float("nan")])
def test_bits_below_one(bits):
    with pytest.raises(ValueError, match="bits"):
        quantize(jnp.ones(3), bits, AffineInt())


@pytest.mark.parametrize("fmt", ["affine", AffineInt, None, 8])
def test_not_a_format(fmt):
    with pytest.raises(ValueError, match="fmt"):
        quantize(jnp.ones(3), 4, fmt)


def test_float_bits_below_exp_bits_plus_one():
    with pytest.raises(ValueError, match="exp_bits"):
        quantize(jnp.ones(3), 4, Float(4))
    with pytest.raises(ValueError, match="exp_bits"):
        quantize(jnp.ones(3), 5, Float(5))
    # m = 0: powers of two only; 3 = 1.5 * 2 ties to significand 2 -> 4, 5 -> 4.
    np.testing.assert_array_equal(q_np(f32(1, 3, 5, 6.5), 5, Float(4)), f32(1, 4, 4, 8))


def test_integer_input_rejected():
    with pytest.raises(ValueError, match="x must be a floating-point"):
        quantize(jnp.arange(3), 4, AffineInt())


def test_pow2_and_floor_log2_exact():
    e = np.arange(-126, 128)
    np.testing.assert_array_equal(np.asarray(F.pow2(jnp.asarray(e))),
                                  np.ldexp(np.float32(1), e).astype(np.float32))
    a = f32(1.0, 1.5, 2.0, 0.75, 3.9, 1e-30, 3e38, 0.1)
    np.testing.assert_array_equal(np.asarray(F.floor_log2(jnp.asarray(a))),
                                  np.floor(np.log2(a.astype(np.float64))))


def test_round_half_to_even_everywhere():
    # One tie per format with a power-of-two unit: 0.5 -> 0, 1.5 -> 2, 2.5 -> 2.
    for fmt, bits, x in [
        (AffineInt(), 3, f32(0, 0.5, 1.5, 2.5, 7)),       # s = 1
        (SymmetricInt(), 4, f32(-7, 0.5, 1.5, 2.5, 7)),   # s = 1
        (FixedPoint(0), 8, f32(0.5, 1.5, 2.5, -0.5, -1.5)),
        (BlockFloat(), 5, f32(4, 0.25, 0.75, 1.25, 0)),   # e = 2, unit 2^(2+2-5) = .5
        (Float(4), 8, f32(1 + 1 / 16, 1 + 3 / 16, 1 + 5 / 16, 0.5, 0)),  # spacing 1/8
    ]:
        q = q_np(x, bits, fmt)
        if isinstance(fmt, BlockFloat):
            np.testing.assert_array_equal(q, f32(4, 0, 1, 1, 0))
        elif isinstance(fmt, Float):
            np.testing.assert_array_equal(q, f32(1, 1.25, 1.25, 0.5, 0))
        elif isinstance(fmt, FixedPoint):
            np.testing.assert_array_equal(q, f32(0, 2, 2, 0, -2))
        else:
            np.testing.assert_array_equal(q[1:4], f32(0, 2, 2))


def test_grid_step_and_range_helpers():
    x = f32(-1.0, 0.5, 2.0)
    step = lambda *a: np.unique(np.asarray(F.grid_step(*a))).item()
    assert step(x, 2, AffineInt()) == 1.0
    assert step(x, 3, SymmetricInt()) == pytest.approx(2 / 3)
    assert step(x, 4, FixedPoint(2)) == 0.25
    assert step(x, 4, BlockFloat()) == 0.5  # amax 2: e = 1, 2^(1+2-4)
    np.testing.assert_array_equal(np.asarray(F.grid_step(f32(1.0, 3.0, 0.001), 8, Float(4))),
                                  f32(1 / 8, 2 / 8, 2.0 ** -9))
    lo, hi = F.representable_range(2, AffineInt(), x)
    assert (np.asarray(lo).item(), np.asarray(hi).item()) == (-1.0, 2.0)
    lo, hi = F.representable_range(3, SymmetricInt(), x)
    assert np.asarray(hi).item() == pytest.approx(2.0)
    assert np.asarray(lo).item() == pytest.approx(-2.0)
    with pytest.raises(ValueError, match="x"):
        F.representable_range(3, SymmetricInt())


def test_every_format_is_frozen_and_hashable():
    for fmt in ALL_FORMATS:
        hash(fmt)
        field = dataclasses.fields(fmt)[0].name
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(fmt, field, 3)
    assert len({f for f in itertools.chain(ALL_FORMATS, ALL_FORMATS)}) == len(ALL_FORMATS)


# --------------------------------------------------------------------------- format traits

_FORMAT_TYPES = ("AffineInt", "SymmetricInt", "FixedPoint", "BlockFloat", "Float", "OCPFloat",
                 "MX", "NVFP4", "ScaledFloat", "HARDWARE_FORMATS", "FORMATS", "BLOCKED")
# `isinstance(x, T)` or `isinstance(x, (T, ...))` whose second argument names a format type.
_ISINSTANCE_FORMAT = re.compile(
    r"isinstance\([^,()]+(?:\([^()]*\))?[^,()]*,\s*\(?[^)]*\b(?:formats\.)?(?:"
    + "|".join(_FORMAT_TYPES) + r")\b")


def _isinstance_format_sites() -> list[str]:
    root = pathlib.Path(F.__file__).parent.parent
    sites = []
    for path in sorted(root.rglob("*.py")):
        if path.is_relative_to(root / "formats"):
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            sites += [f"{path.relative_to(root)}:{n}"] * len(_ISINSTANCE_FORMAT.findall(line))
    return sites


def test_isinstance_format_regex_finds_what_it_looks_for():
    found = [bool(_ISINSTANCE_FORMAT.search(s)) for s in (
        "if isinstance(fmt, MX):", "isinstance(tq.fmt, (OCPFloat, ScaledFloat))",
        "not isinstance(f, formats.BLOCKED)", "isinstance(getattr(tq, 'fmt'), SymmetricInt)",
        "isinstance(x, (int, np.integer))", "isinstance(self.block_2d, (bool, np.bool_))",
        "isinstance(qmodel, QuantizedModel)")]
    assert found == [True, True, True, True, False, False, False]


def test_code_outside_formats_asks_traits_not_types():
    """At most 5 ``isinstance`` tests on format classes outside `cpt_jax.formats`
    (issue 32: 26 before `format_traits`); ask `F.format_traits(fmt)` instead."""
    sites = _isinstance_format_sites()
    assert len(sites) <= 5, sites


@pytest.mark.parametrize("fmt,family,scale", [
    (AffineInt(), "affine_int", "tensor"), (SymmetricInt(channel_axis=0), "symmetric_int", "channel"),
    (SymmetricInt(scale_axes=(-1,)), "symmetric_int", "axes"),
    (AffineInt(scale_axes=(-1,), tile=4), "affine_int", "tile"),
    (FixedPoint(), "fixed_point", "none"), (BlockFloat(), "block_float", "tensor"),
    (Float(4), "float", "none"), (F.OCPFloat("e5m2"), "ocp_float", "none"),
    (F.MX("int8"), "mx", "tile"), (F.NVFP4(), "nvfp4", "two_level"),
    (F.ScaledFloat(granularity="row"), "scaled_float", "row"),
    (F.ScaledFloat(granularity="block"), "scaled_float", "block")])
def test_format_traits_family_and_scale(fmt, family, scale):
    t = F.format_traits(fmt)
    assert (t.family, t.scale) == (family, scale)
    assert t.family in F.FAMILIES and t.scale in F.SCALES
    assert t.blocked == isinstance(fmt, (F.MX, F.NVFP4, F.ScaledFloat)) == F.is_blocked(fmt)


def test_format_traits_blocks_elements_and_grids():
    t = F.format_traits(F.ScaledFloat("e5m2", granularity="block", axis=0, tile=64))
    assert (t.axis, t.block_size, t.two_d, t.element) == (0, 64, True, "e5m2")
    assert F.format_traits(F.ScaledFloat(granularity="row")).block_size is None
    assert F.format_traits(F.NVFP4(block_2d=True)).two_d
    assert (F.format_traits(F.NVFP4()).element, F.format_traits(F.NVFP4()).two_d) == ("e2m1", False)
    assert [F.format_traits(f).range_grid for f in (AffineInt(), SymmetricInt(), Float(5),
                                                   BlockFloat(), F.OCPFloat())] == [
        "affine", "symmetric", "float", None, None]
    for not_a_format in (None, "MX", 3, jnp.float32):
        assert F.format_traits(not_a_format) is F.NOT_A_FORMAT
        assert not (F.is_blocked(not_a_format) or F.has_fp8_codes(not_a_format)
                    or F.is_per_tensor_scaled(not_a_format))
    with pytest.raises(dataclasses.FrozenInstanceError):
        t.family = "mx"


def test_has_fp8_codes_and_per_tensor_scaled():
    yes = [F.OCPFloat("e4m3"), F.OCPFloat("e5m2"), F.ScaledFloat("e4m3"),
           F.ScaledFloat("e5m2", granularity="row")]
    no = [F.OCPFloat("e2m1"), F.ScaledFloat(granularity="tile"), F.ScaledFloat("e3m2"),
          F.MX("e4m3"), F.NVFP4(), Float(4), SymmetricInt()]
    assert [F.has_fp8_codes(f) for f in yes + no] == [True] * len(yes) + [False] * len(no)
    assert [F.is_per_tensor_scaled(f) for f in (F.ScaledFloat(), F.ScaledFloat(granularity="row"),
                                                F.OCPFloat())] == [True, False, False]
