"""Scales from history (delayed, Autoflex) and the fused fast paths of the quantizers."""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import cpt_jax
from cpt_jax import formats
from cpt_jax.formats import AffineInt, BlockFloat, Float, SymmetricInt, quantize
from cpt_jax.ops import quantize_with_range
from cpt_jax.ops.scale_history import predicted_range, update_history
from cpt_jax.providers.delayed_scaling import ScaleHistory, delayed_scale_quantize, init_history
from cpt_jax.training import create_train_state, make_eval_step, make_train_step

RNG = np.random.default_rng(0)
X = jnp.asarray(RNG.normal(size=(4, 5)), jnp.float32)


def history_of(maxima, length=16, symmetric=True, extra=0.0):
    hi = np.zeros(length, np.float32)
    hi[:len(maxima)] = maxima
    lo = -hi if symmetric else np.zeros(length, np.float32)
    return ScaleHistory(lo=jnp.asarray(lo), hi=jnp.asarray(hi),
                        count=jnp.int32(len(maxima)), extra_bits=jnp.float32(extra))


# --------------------------------------------------------------------------- validation

def test_bad_arguments():
    with pytest.raises(ValueError, match="length"):
        init_history(0)
    with pytest.raises(ValueError, match="method"):
        delayed_scale_quantize(X, 8, init_history(), method="median")
    with pytest.raises(ValueError, match="fmt"):
        delayed_scale_quantize(X, 8, init_history(), BlockFloat())
    with pytest.raises(ValueError, match="channel_axis"):
        delayed_scale_quantize(X, 8, init_history(), SymmetricInt(channel_axis=0))
    with pytest.raises(ValueError, match="autoflex"):
        delayed_scale_quantize(X, 8, init_history(), AffineInt(), method="autoflex")
    with pytest.raises(ValueError, match="bits"):
        delayed_scale_quantize(X, 0, init_history())


# --------------------------------------------------------------------------- pure functions

@pytest.mark.parametrize("fmt", [AffineInt(), SymmetricInt()])
def test_first_step_is_dynamic(fmt):
    q, h, overflow = delayed_scale_quantize(X, 4, init_history(8), fmt)
    np.testing.assert_allclose(q, quantize(X, 4, fmt), rtol=1e-6, atol=1e-6)
    assert int(h.count) == 1 and not bool(overflow)
    if isinstance(fmt, AffineInt):
        assert float(h.hi[0]) == float(X.max()) and float(h.lo[0]) == float(X.min())
    else:
        assert float(h.hi[0]) == float(jnp.abs(X).max())


def test_delayed_uses_the_max_of_the_history_and_flags_overflow():
    h = history_of([1.0, 3.0, 2.0], length=4)
    lo, hi = predicted_range(h, SymmetricInt())
    assert (float(lo), float(hi)) == (-3.0, 3.0)
    x = jnp.array([-5.0, 0.4, 2.9])
    q, new, overflow = delayed_scale_quantize(x, 3, h, SymmetricInt())
    # 3 bits: levels -3..3 of scale 1 (range 3): -5 saturates at -3.
    np.testing.assert_allclose(q, [-3.0, 0.0, 3.0])
    assert bool(overflow)
    np.testing.assert_allclose(new.hi, [5.0, 1.0, 3.0, 2.0])   # newest first
    assert int(new.count) == 4
    newer = update_history(new, -1.0, 1.0, False)
    assert int(newer.count) == 4 and float(newer.hi[-1]) == 3.0  # oldest dropped


def test_delayed_affine_keeps_min_and_max():
    h = history_of([], length=4, symmetric=False)
    h = update_history(h, -1.0, 4.0, False)
    h = update_history(h, 0.5, 2.0, False)
    lo, hi = predicted_range(h, AffineInt())
    assert (float(lo), float(hi)) == (-1.0, 4.0)
    x = jnp.array([0.0, 1.0, 3.9])
    q, _, overflow = delayed_scale_quantize(x, 8, h, AffineInt())
    np.testing.assert_allclose(q, quantize_with_range(x, -1.0, 4.0, 8, AffineInt()),
                               rtol=1e-6, atol=1e-6)
    assert not bool(overflow)


def test_margin_scales_the_range():
    h = history_of([2.0], length=4)
    assert float(predicted_range(h, SymmetricInt(), margin=1.0)[1]) == 4.0


def test_autoflex_prediction_and_overflow_reset():
    f = np.array([1.0, 1.5, 1.2, 0.9], np.float32)
    h = history_of(list(f), length=16)
    _, r = predicted_range(h, SymmetricInt(), method="autoflex")
    p = f.max() + 3 * f.std() + 100 * 2.0 / 2 ** 15
    assert float(r) == 2.0 ** np.ceil(np.log2(p))    # a power of two covering p
    assert float(r) >= p
    x = jnp.array([3.0 * float(r), 0.1])             # overflows the predicted range
    q, new, overflow = delayed_scale_quantize(x, 8, h, SymmetricInt(), method="autoflex")
    assert bool(overflow)
    assert float(q[0]) == pytest.approx(float(r), rel=1e-6)        # saturated
    assert int(new.count) == 1 and float(new.hi[0]) == pytest.approx(float(x[0]))
    assert float(jnp.abs(new.hi[1:]).max()) == 0.0                 # history cleared
    assert float(new.extra_bits) == 1.0                            # one bit of headroom
    _, r1 = predicted_range(new, SymmetricInt(), method="autoflex")
    _, r0 = predicted_range(new.replace(extra_bits=jnp.float32(0)), SymmetricInt(),
                            method="autoflex")
    assert float(r1) == 2 * float(r0)
    # The headroom goes once the history is full again.
    full = new
    for _ in range(16):
        full = update_history(full, -1.0, 1.0, False, method="autoflex")
    assert int(full.count) == 16 and float(full.extra_bits) == 0.0


def test_float_grid_fp8_style():
    h = history_of([448.0 * 2], length=4)            # range 896 -> scale 2 for e4m3
    x = jnp.array([100.0, -900.0, 1e-9])
    q, _, overflow = delayed_scale_quantize(x, 8, h, Float(4))
    want = quantize(x / (896 / 480), 8, Float(4)) * (896 / 480)
    np.testing.assert_allclose(q[0], want[0], rtol=1e-6)
    assert float(q[1]) == pytest.approx(-896.0, rel=1e-6) and bool(overflow)


def test_non_finite_pass_through_and_ste_gradient():
    h = history_of([2.0], length=4)
    x = jnp.array([jnp.nan, jnp.inf, 0.5, -1.0])
    q, new, _ = delayed_scale_quantize(x, 4, h, SymmetricInt())
    assert np.isnan(q[0]) and q[1] == np.inf
    assert float(new.hi[0]) == 1.0                   # the observed range ignores them
    g = jax.grad(lambda x: delayed_scale_quantize(x, 3, h, SymmetricInt())[0].sum())(X)
    np.testing.assert_array_equal(g, jnp.ones_like(X))


def test_full_precision_and_traced_bits_compile_once():
    h = update_history(init_history(4), -2.0, 2.0, False)
    f = jax.jit(lambda x, b: delayed_scale_quantize(x, b, h, SymmetricInt())[0])
    np.testing.assert_array_equal(f(X, 32.0), X)
    for b in (2.0, 5.0, 8.0):
        f(X, b)
    assert f._cache_size() == 1


# --------------------------------------------------------------------------- Flax

def test_dense_module_reads_and_writes_its_history():
    layer = nn.Dense(3, dot_general_cls=cpt_jax.doors.DelayedQuantDotGeneral)
    v = layer.init(jax.random.key(0), X)
    hist = v["batch_stats"]["DelayedQuantDotGeneral_0"]["input_history"]
    assert int(hist.count) == 0
    # Outside a precision context: exact fp32, history untouched.
    np.testing.assert_allclose(layer.apply(v, X), X @ v["params"]["kernel"] + v["params"]["bias"],
                               rtol=1e-6)
    with cpt_jax.precision(8):
        _, upd = layer.apply(v, X, mutable=["batch_stats"])
        hist = upd["batch_stats"]["DelayedQuantDotGeneral_0"]["input_history"]
        assert int(hist.count) == 1 and float(hist.hi[0]) == float(X.max())
        y_eval = layer.apply(v, X)   # collection not mutable: read-only, no error
    assert y_eval.shape == (4, 3)


@pytest.mark.slow
def test_delayed_scaling_model_trains_with_make_train_step():
    class Net(nn.Module):
        @nn.compact
        def __call__(self, x, train: bool = False):
            x = nn.relu(nn.Conv(4, (3, 3), name="conv")(x))
            x = nn.relu(nn.Dense(8, name="hidden")(x.reshape(x.shape[0], -1)))
            return nn.Dense(3, name="classifier")(x)

    x = jnp.asarray(RNG.normal(size=(4, 6, 6, 1)), jnp.float32)
    batch = {"inputs": x, "labels": jnp.array([0, 1, 2, 0])}
    model = cpt_jax.doors.delayed_scaling_model(Net(), rules=cpt_jax.CPT_RULES)
    opt = optax.sgd(0.05)
    state = create_train_state(model, opt, jax.random.key(0), x, train=False)
    assert set(state.batch_stats) == {"conv", "hidden"}        # not the fp32 classifier
    # Same params tree as the float model.
    plain = Net().init(jax.random.key(0), x)["params"]
    assert jax.tree_util.tree_structure(plain) == jax.tree_util.tree_structure(state.params)
    sched = cpt_jax.cyclic("cos_growth", min_bits=3, max_bits=8, num_cycles=1, total_steps=6)
    step = make_train_step(model, opt, sched, cpt_jax.constant(8))
    losses = []
    for _ in range(6):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    hist = state.batch_stats["conv"]["delayed_quant"]["input_history"]
    assert int(hist.count) == 6 and step.num_compiles == 1
    assert losses[-1] < losses[0]
    ev = make_eval_step(model)(state, batch, jnp.float32(8.0))
    assert float(ev["count"]) == 4.0


# --------------------------------------------------------------------------- fast paths

BIG = (64, 32, 16)   # above formats._FAST_REDUCTION_MIN_SIZE: the CPU fast path


def _masked_reference(x, bits, fmt):
    xn = np.asarray(x, np.float64)
    fin = np.isfinite(xn)
    if isinstance(fmt, AffineInt):
        lo, hi = xn[fin].min(), xn[fin].max()
        s = max((hi - lo) / (2 ** bits - 1), 1e-8)
        q = np.clip(np.round((xn - lo) / s), 0, 2 ** bits - 1) * s + lo
    else:
        s = max(np.abs(xn[fin]).max() / (2 ** (bits - 1) - 1), 1e-8)
        top = 2 ** (bits - 1) - 1
        q = np.clip(np.round(xn / s), -top, top) * s
    return np.where(fin, q, xn)


@pytest.mark.parametrize("fmt", [AffineInt(), SymmetricInt()])
def test_large_tensor_with_non_finite_uses_only_finite_range(fmt):
    assert np.prod(BIG) >= formats._FAST_REDUCTION_MIN_SIZE
    x = np.asarray(RNG.normal(size=BIG), np.float32)
    x[3, 4, 5], x[10, 0, 1], x[20, 2, 2] = np.nan, np.inf, -np.inf
    x[40, 1, 1] = 7.5      # the true max must not be lost behind the NaN
    q = np.asarray(jax.jit(lambda x: quantize(x, 6, fmt))(jnp.asarray(x)))
    ref = _masked_reference(x, 6, fmt)
    fin = np.isfinite(x)
    np.testing.assert_allclose(q[fin], ref[fin], rtol=1e-5, atol=1e-5)
    assert np.isnan(q[3, 4, 5]) and q[10, 0, 1] == np.inf and q[20, 2, 2] == -np.inf
    # All finite: the fast path equals the masked path exactly.
    clean = jnp.asarray(np.where(fin, x, 0.0))
    np.testing.assert_allclose(jax.jit(lambda x: quantize(x, 6, fmt))(clean),
                               _masked_reference(np.asarray(clean), 6, fmt),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fmt", [AffineInt(), AffineInt(channel_axis=-1), SymmetricInt()])
@pytest.mark.parametrize("finite", [True, False])
def test_stochastic_quantizer_under_its_finiteness_cond_equals_the_masked_path(fmt, finite):
    # On CPU a large stochastically rounded tensor is quantized whole inside one
    # lax.cond (plain ranges replayed, or masked ranges): the same values as the
    # masked path, which GPU/TPU run, for finite and for non-finite inputs.
    from cpt_jax.formats import _cpu_guard
    x = np.asarray(RNG.normal(size=BIG), np.float32)
    if not finite:
        x[3, 4, 5], x[10, 0, 1], x[20, 2, 2] = np.nan, np.inf, -np.inf
    key = jax.random.key(3)

    def q(x):
        return quantize(x, 5, fmt, rounding="stochastic", key=key)

    def masked(x):
        with _cpu_guard._range_mode("masked"):
            return q(x)
    text = jax.jit(q).lower(jnp.asarray(x)).compile().as_text()
    assert text.count("conditional(") == 1
    got, want = jax.jit(q)(jnp.asarray(x)), jax.jit(masked)(jnp.asarray(x))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    fin = np.isfinite(x)
    assert np.all(np.isfinite(np.asarray(got)[fin]))
    assert finite or (np.isnan(got[3, 4, 5]) and got[10, 0, 1] == np.inf)


@pytest.mark.parametrize("shape", [(), (7,), (3, 5, 2), BIG])
def test_uniform_noise_is_bit_exact_with_jax_random(shape):
    for key in (jax.random.key(0), jax.random.fold_in(jax.random.key(5), 3),
                jax.random.PRNGKey(9)):
        a = jax.random.uniform(key, shape)
        b = jax.jit(lambda k: formats.uniform_noise(k, shape))(key)
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_uniform_noise_falls_back_for_other_prngs():
    key = jax.random.key(0, impl="rbg")
    np.testing.assert_array_equal(formats.uniform_noise(key, (4, 3)),
                                  jax.random.uniform(key, (4, 3)))


def test_stochastic_rounding_matches_the_dither_formula():
    x = jnp.asarray(RNG.normal(size=BIG), jnp.float32)
    key = jax.random.key(11)
    q = jax.jit(lambda x: quantize(x, 5, AffineInt(), rounding="stochastic", key=key))(x)
    lo, hi = float(x.min()), float(x.max())
    s = jnp.maximum((hi - lo) / 31.0, 1e-8)
    v = (x - lo) / s + formats.dither_noise(key, BIG)
    want = jnp.clip(jnp.floor(v), 0, 31) * s + lo
    # Equal, except where v is within float32 rounding of an integer: the jitted
    # computation may round across it (one step s). The draws depend on the shared
    # RNG's state, so on which tests ran before this one (e.g. the fast tier alone).
    diff = np.abs(np.asarray(q) - np.asarray(want))
    boundary = np.abs(np.asarray(v) - np.round(np.asarray(v))) < 1e-4
    assert np.all((diff <= 1e-5) | (boundary & (np.abs(diff - float(s)) < 1e-4))), diff.max()
    assert boundary.mean() < 1e-3
