"""Tests for the hardware formats: OCPFloat, MX, NVFP4 and ScaledFloat.

References are written here from the specs, independently of cpt_jax.formats: in
numpy float64 with explicit loops over blocks, and elements cast with ml_dtypes
(OCP MX v1.0 section 6.3: ``X = 2^(floor(log2 amax) - emax_elem)``, elements
``cast(x / X)``; NVIDIA's NVFP4: ``s_t = 448*6/amax``, ``s_b = e4m3(amax_b/6 s_t)``).
"""
from __future__ import annotations

import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest

import cpt_jax
from cpt_jax import formats as F
from cpt_jax import training
from cpt_jax.formats import MX, NVFP4, OCPFloat, ScaledFloat, quantize

DTYPES = {"e4m3": ml_dtypes.float8_e4m3fn, "e5m2": ml_dtypes.float8_e5m2,
          "e3m2": ml_dtypes.float6_e3m2fn, "e2m3": ml_dtypes.float6_e2m3fn,
          "e2m1": ml_dtypes.float4_e2m1fn}
WIDTH = {"e4m3": 8, "e5m2": 8, "e3m2": 6, "e2m3": 6, "e2m1": 4}
# Spec values, typed in from the OCP tables (not read from the implementation).
MAX = {"e4m3": 448.0, "e5m2": 57344.0, "e3m2": 28.0, "e2m3": 7.5, "e2m1": 6.0}
EMAX = {"e4m3": 8, "e5m2": 15, "e3m2": 4, "e2m3": 2, "e2m1": 2}

# Scales that are not powers of two: fp32 rescaling vs the float64 reference
# (one rounding, 2^-24 relative); a wrong element would be off by a grid step.
RESCALE_RTOL = 2.0 ** -22

_JQ = jax.jit(quantize, static_argnames=("fmt", "rounding"))


def q_np(x, bits, fmt, **kw) -> np.ndarray:
    return np.asarray(_JQ(jnp.asarray(x, jnp.float32), jnp.float32(bits), fmt, **kw))


def cast(values, element) -> np.ndarray:
    """The ml_dtypes cast of ``clip(v, -max, max)``, back in float64."""
    v = np.clip(np.asarray(values, np.float64), -MAX[element], MAX[element])
    return v.astype(np.float32).astype(DTYPES[element]).astype(np.float64)


def spread(rng, shape, low=-12, high=12) -> np.ndarray:
    """Values spread over many binades, with both signs and exact zeros."""
    mag = 2.0 ** rng.uniform(low, high, size=shape)
    x = np.where(rng.random(shape) < 0.5, -mag, mag)
    x[rng.random(shape) < 0.05] = 0.0
    return x.astype(np.float32)


# --------------------------------------------------------------------------- references

def mx_reference(x, element, block_size, axis, bits=8) -> np.ndarray:
    """OCP MX v1.0 quantization, one block at a time (float64)."""
    x = np.moveaxis(np.asarray(x, np.float64), axis, -1)
    out = np.zeros_like(x)
    for index in np.ndindex(*x.shape[:-1]):
        row = x[index]
        for start in range(0, row.shape[0], block_size):
            block = row[start:start + block_size]
            finite = np.isfinite(block)
            amax = np.max(np.abs(block[finite]), initial=0.0)
            emax = 0 if element in ("int", "int8") else EMAX[element]
            shared = 0 if amax == 0 else min(max(math.floor(math.log2(amax)) - emax, -127), 127)
            scale = 2.0 ** shared
            v = block / scale
            if element in ("int", "int8"):
                b = 8 if element == "int8" else bits
                top = 2 ** (b - 1) - 1
                elem = np.clip(np.rint(v * 2 ** (b - 2)), -top, top) / 2 ** (b - 2)
            else:
                elem = cast(v, element)
            out[index][start:start + block_size] = np.where(finite, elem * scale, block)
    return np.moveaxis(out, -1, axis)


def nvfp4_reference(x, axis=-1) -> np.ndarray:
    """NVFP4 as NVIDIA describes it: fp32 tensor scale, E4M3 scale per 16 elements."""
    x = np.moveaxis(np.asarray(x, np.float64), axis, -1)
    amax_t = np.max(np.abs(x))
    s_t = 448.0 * 6.0 / amax_t if amax_t > 0 else 1.0
    out = np.zeros_like(x)
    for index in np.ndindex(*x.shape[:-1]):
        for start in range(0, x.shape[-1], 16):
            block = x[index][start:start + 16]
            s_b = cast(np.max(np.abs(block)) / 6.0 * s_t, "e4m3")
            scale = s_b / s_t
            elem = cast(block / scale, "e2m1") if scale > 0 else np.zeros_like(block)
            out[index][start:start + 16] = elem * scale
    return np.moveaxis(out, -1, axis)


def scaled_reference(x, element, groups) -> np.ndarray:
    """``amax/max`` scale per group (a list of index arrays), elements cast.

    The scale and ``x / scale`` in float32 (as the recipes compute them), so a
    value near a rounding boundary is decided the same way.
    """
    x = np.asarray(x, np.float32)
    out = np.zeros(x.shape, np.float64)
    for g in groups:
        amax = np.max(np.abs(x[g]))
        scale = amax / np.float32(MAX[element]) if amax > 0 else np.float32(1.0)
        out[g] = cast(x[g] / scale, element) * scale
    return out


# --------------------------------------------------------------------------- OCPFloat

@pytest.mark.parametrize("element", list(DTYPES))
def test_ocp_float_equals_ml_dtypes_saturating_cast(element):
    rng = np.random.default_rng(0)
    x = spread(rng, (4000,), -14, 18)
    np.testing.assert_array_equal(q_np(x, WIDTH[element], OCPFloat(element)), cast(x, element))


@pytest.mark.parametrize("element", list(DTYPES))
def test_ocp_float_ties_round_half_to_even_like_ml_dtypes(element):
    # Every midpoint between two neighbouring finite values of the element.
    grid = np.unique(np.abs(np.arange(256, dtype=np.uint8).view(DTYPES[element])
                            .astype(np.float64)))
    grid = grid[np.isfinite(grid)][: 2 ** (WIDTH[element] - 1)]
    mids = (grid[1:] + grid[:-1]) / 2
    x = np.concatenate([mids, -mids]).astype(np.float32)
    np.testing.assert_array_equal(q_np(x, WIDTH[element], OCPFloat(element)), cast(x, element))


def test_ocp_float_known_values_and_non_finite():
    x = np.array([448.0, 464.0, 1e9, -1e9, np.nan, np.inf, 2.0 ** -9, 2.0 ** -11], np.float32)
    # 464 is the tie between 448 and the NaN code 480: saturates to 448; 2^-11 -> 0.
    want = np.array([448, 448, 448, -448, np.nan, np.inf, 2.0 ** -9, 0.0])
    np.testing.assert_array_equal(q_np(x, 8, OCPFloat("e4m3")), want)
    np.testing.assert_array_equal(q_np(x, 32, OCPFloat("e4m3")), x)


@pytest.mark.parametrize("element", ["e4m3", "e2m1"])
def test_ocp_float_stochastic_rounding_is_unbiased_between_neighbours(element):
    x = np.full((20000,), 0.3, np.float32) if element == "e4m3" else np.full((20000,), 2.4, np.float32)
    q = q_np(x, WIDTH[element], OCPFloat(element), rounding="stochastic", key=jax.random.key(1))
    lo, hi = (0.28125, 0.3125) if element == "e4m3" else (2.0, 3.0)  # spacing 2^-5 / 1
    assert set(np.unique(q).tolist()) == {lo, hi}
    assert abs(q.mean() - x[0]) < 4 * (hi - lo) / math.sqrt(len(x))


# --------------------------------------------------------------------------- MX

@pytest.mark.parametrize("element", list(DTYPES) + ["int8"])
def test_mx_matches_spec_reference(element):
    rng = np.random.default_rng(1)
    x = spread(rng, (3, 70), -10, 10)  # 70 = two full blocks + one padded block of 6
    got = q_np(x, 8, MX(element))
    np.testing.assert_array_equal(got, mx_reference(x, element, 32, -1))


@pytest.mark.parametrize("axis,block_size", [(0, 32), (1, 8), (-2, 16)])
def test_mx_blocks_follow_axis(axis, block_size):
    rng = np.random.default_rng(2)
    # Rows of very different magnitudes: blocks along axis 0 mix them, along 1 not.
    x = spread(rng, (40, 5, 3), -3, 3) * (4.0 ** np.arange(3))[None, None, :]
    got = q_np(x, 8, MX("e2m1", block_size=block_size, axis=axis))
    np.testing.assert_array_equal(got, mx_reference(x, "e2m1", block_size, axis))


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 7, 8])
def test_mx_int_traced_width_matches_reference(bits):
    rng = np.random.default_rng(3)
    x = spread(rng, (4, 64), -6, 6)
    np.testing.assert_array_equal(q_np(x, bits, MX("int")), mx_reference(x, "int", 32, -1, bits))


def test_mx_int_at_8_is_mxint8_and_float_at_4_6_8_is_the_element():
    rng = np.random.default_rng(4)
    x = spread(rng, (2, 96))
    np.testing.assert_array_equal(q_np(x, 8, MX("int")), q_np(x, 8, MX("int8")))
    for bits, element in [(4, "e2m1"), (5, "e2m1"), (6, "e2m3"), (7, "e2m3"), (8, "e4m3")]:
        np.testing.assert_array_equal(q_np(x, bits, MX("float")), q_np(x, 8, MX(element)))


def test_mx_shared_exponent_clamps_and_zero_blocks():
    # amax 2^-130 is below float32's normal range: flushed to 0 on CPU, an all-zero
    # block stays zero; amax 2^120 with e2m1 gives X = 2^118 (no clamp needed).
    x = np.zeros((2, 32), np.float32)
    x[1, :3] = [2.0 ** 120, 2.0 ** 119, -(2.0 ** 117)]
    got = q_np(x, 8, MX("e2m1"))
    np.testing.assert_array_equal(got, mx_reference(x, "e2m1", 32, -1))
    assert np.all(got[0] == 0)


def test_mx_non_finite_does_not_poison_its_block():
    x = np.linspace(-1, 1, 32).astype(np.float32)
    x[3], x[7] = np.nan, np.inf
    got = q_np(x, 8, MX("e4m3"))
    assert np.isnan(got[3]) and got[7] == np.inf
    np.testing.assert_array_equal(got, mx_reference(x, "e4m3", 32, -1))


def test_mx_stochastic_rounding_is_unbiased():
    x = np.tile(np.array([1.0, 0.3], np.float32), 16)  # one block, amax 1: X = 2^-2 for e2m1
    keys = jax.random.split(jax.random.key(0), 2000)
    qs = jax.vmap(lambda k: quantize(jnp.asarray(x), 4, MX("e2m1"), rounding="stochastic",
                                     key=k))(keys)
    mean = np.asarray(qs).mean(axis=0)
    # 0.3 / 0.25 = 1.2 lies between elements 1 and 1.5: q in {0.25, 0.375}.
    assert set(np.unique(np.asarray(qs)[:, 1]).tolist()) <= {0.25, 0.375}
    np.testing.assert_allclose(mean[1::2], 0.3, atol=0.01)
    np.testing.assert_array_equal(mean[0::2], 1.0)


def test_mx_rejects_bad_fields_and_bits():
    with pytest.raises(ValueError, match="MX.element"):
        MX("e3m3")
    with pytest.raises(ValueError, match="block_size"):
        MX("e4m3", block_size=0)
    with pytest.raises(ValueError, match=">= 2"):
        quantize(jnp.ones(4), 1, MX("int"))
    with pytest.raises(ValueError, match=">= 4"):
        quantize(jnp.ones(4), 3, MX("float"))
    with pytest.raises(ValueError, match="MX.axis"):
        quantize(jnp.ones(4), 8, MX("e4m3", axis=2))


# --------------------------------------------------------------------------- NVFP4

@pytest.mark.parametrize("shape,axis", [((4, 48), -1), ((33, 3), 0)])
def test_nvfp4_matches_nvidia_description(shape, axis):
    rng = np.random.default_rng(5)
    x = spread(rng, shape, -8, 4)
    # Same elements; the fp32 rescale ``elem * s_b / s_t`` rounds once (float64 here).
    np.testing.assert_allclose(q_np(x, 4, NVFP4(axis=axis)), nvfp4_reference(x, axis),
                               rtol=RESCALE_RTOL)


def test_nvfp4_tiny_block_scale_rounds_to_zero():
    # amax_b / 6 * s_t = 1e-4 * 448 / 1e3 < 2^-10: the E4M3 scale is 0, so is the block.
    x = np.concatenate([[1000.0], np.zeros(15), np.full(16, 1e-4)]).astype(np.float32)
    got = q_np(x, 4, NVFP4())
    assert got[0] == 1000.0 and np.all(got[16:] == 0)


# --------------------------------------------------------------------------- ScaledFloat

def test_scaled_float_granularities_match_reference():
    check = functools.partial(np.testing.assert_allclose, rtol=RESCALE_RTOL)
    rng = np.random.default_rng(6)
    x = spread(rng, (6, 300), -6, 6)
    rows, cols = x.shape
    tensor = [np.s_[:, :]]
    row = [np.s_[i, :] for i in range(rows)]
    tile = [np.s_[i, j:j + 128] for i in range(rows) for j in range(0, cols, 128)]
    for element in ("e4m3", "e5m2"):
        check(q_np(x, 8, ScaledFloat(element)), scaled_reference(x, element, tensor))
    check(q_np(x, 8, ScaledFloat("e4m3", "row")), scaled_reference(x, "e4m3", row))
    check(q_np(x, 8, ScaledFloat("e4m3", "tile")), scaled_reference(x, "e4m3", tile))
    w = spread(rng, (260, 130), -6, 6)
    blocks = [np.s_[i:i + 128, j:j + 128] for i in range(0, 260, 128) for j in range(0, 130, 128)]
    check(q_np(w, 8, ScaledFloat("e4m3", "block", axis=0)), scaled_reference(w, "e4m3", blocks))


# --------------------------------------------------------------------------- cost and compiles

def test_bits_per_element_counts_scale_bits():
    assert float(F.bits_per_element(MX("e4m3"), 8)) == 8.25     # 8 per 32 elements
    assert float(F.bits_per_element(MX("e2m1"), 8)) == 4.25
    assert float(F.bits_per_element(MX("int"), 5)) == 5.25
    assert float(F.bits_per_element(MX("float"), 7)) == 6.25
    assert float(F.bits_per_element(NVFP4(), 4)) == 4.5         # E4M3 per 16
    assert float(F.bits_per_element(ScaledFloat("e4m3", "tile"), 8)) == 8.25
    assert float(F.bits_per_element(ScaledFloat("e4m3", "block"), 8)) == 8 + 32 / 128 ** 2
    assert float(F.bits_per_element(OCPFloat("e2m3"), 8)) == 6.0
    assert float(F.bits_per_element(F.AffineInt(), 5)) == 5.0
    assert float(F.bits_per_element(MX("e4m3"), 32)) == 32.0


class TwoLayerNet(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = False):
        return nn.Dense(3)(nn.relu(nn.Dense(40)(x)))


@pytest.mark.parametrize("element", ["int", "float"])
def test_traced_mx_width_compiles_once_in_a_train_step(element):
    config = cpt_jax.QuantConfig(
        weight=cpt_jax.TensorQuant(MX(element, axis=-2)),
        activation=cpt_jax.TensorQuant(MX(element)),
        error=cpt_jax.TensorQuant(MX(element), "stochastic"))
    model = cpt_jax.quantize_model(TwoLayerNet(), config=config)
    x = jnp.asarray(spread(np.random.default_rng(7), (8, 64), -2, 2))
    batch = {"inputs": x, "labels": jnp.arange(8) % 3}
    state = training.create_train_state(model, optax.sgd(0.1), jax.random.key(0), x)
    step = training.make_train_step_with_bits(model, optax.sgd(0.1), donate=False)
    losses = {}
    for bits in (4, 5, 6, 7, 8):
        _, metrics = step(state, batch, jnp.float32(bits), jnp.float32(bits))
        losses[bits] = float(metrics["loss"])
    assert step.num_compiles == 1
    # Different widths are different grids: the losses are not all equal.
    assert len(set(losses.values())) > 1


# --------------------------------------------------------------------------- presets and cost

def test_presets_table_holds_every_recipe_and_the_old_names():
    from cpt_jax import quant_config as Q
    assert Q.CPT_CONFIG is Q.PRESETS["cpt"] and Q.INT8_CONFIG is Q.PRESETS["int8"]
    assert Q.PRESETS["cpt"] == Q.QuantConfig()
    fp8 = Q.get_preset("fp8_tensor")
    assert (fp8.activation.fmt.element, fp8.error.fmt.element) == ("e4m3", "e5m2")
    blockwise = Q.get_preset("fp8_blockwise")
    assert (blockwise.activation.fmt.granularity, blockwise.weight.fmt.granularity) == ("tile", "block")
    assert blockwise.activation.fmt.tile == blockwise.weight.fmt.tile == 128
    assert Q.get_preset("mxfp4").weight.fmt == MX("e2m1", axis=-2)
    with pytest.raises(ValueError, match="unknown quantizer preset"):
        Q.get_preset("fp7")


def test_cost_counts_stored_bits_with_scales():
    from cpt_jax import cost
    from cpt_jax import quant_config as Q
    op = cost.OpRecord("dense", "dot_general", macs=1000, reduction=10, lhs_shape=(10, 10),
                       rhs_shape=(10, 100), out_shape=(10, 100))
    # MXFP8 forward, E5M2 errors in MX blocks: every tensor 8 + 8/32 bits.
    w = a = g = 8.25
    assert float(cost.bitops_per_step([op], 8, 8, Q.get_preset("mxfp8"))) == 1000 * (w * a + g * (w + a))
    # MX("int") at 5 forward bits, 8 error bits: 5.25 and 8.25.
    got = float(cost.bitops_per_step([op], 5, 8, Q.get_preset("mx_int")))
    assert got == pytest.approx(1000 * (5.25 ** 2 + 8.25 * 2 * 5.25))
    # Without a config: the papers' b^2 + 2 b g.
    assert float(cost.bitops_per_step([op], 5, 8)) == 1000 * (25 + 80)
    run = cost.run_cost(cpt_jax.constant(8), cpt_jax.constant(8), 10, [op],
                        config=Q.get_preset("nvfp4"))
    assert run["relative_cost_static8"] == pytest.approx(3 * 4.5 ** 2 / (3 * 64))
