"""Tests for cpt_jax.optim: LP-SGD (OptimLP), SWA/SWALP, BN recompute, SVRG/HALP."""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from cpt_jax import optim
from cpt_jax.formats import AffineInt, BlockFloat, FixedPoint, SymmetricInt, quantize

KEY = jax.random.key(0, impl="unsafe_rbg")  # compiles faster than threefry on CPU
# The stochastic-rounding tests also run on the default PRNG (threefry2x32): the path a
# training takes, where formats.dither_noise draws its seed words from the key.
IMPLS = pytest.mark.parametrize("impl", ["threefry2x32", "unsafe_rbg"])


def _key(seed, impl):
    return jax.random.key(seed, impl=impl)


def _randn(shape, seed=0, scale=1.0):
    return jnp.asarray(scale * np.random.default_rng(seed).standard_normal(shape), jnp.float32)


def _params():
    return {"w": _randn((6, 5), 1), "b": _randn((5,), 2, 0.1)}


def _grads(seed):
    return {"w": _randn((6, 5), 10 + seed), "b": _randn((5,), 20 + seed)}


def _levels(x) -> int:
    return len(np.unique(np.asarray(x)))


def _on_grid(x, bits, fmt) -> bool:
    """x lies on the grid of fmt at `bits` (checked per format)."""
    x = np.asarray(x, np.float64)
    if isinstance(fmt, FixedPoint):
        codes = x * 2.0 ** fmt.frac_bits
        top = 2.0 ** (bits - 1)
        return bool(np.all(codes == np.round(codes)) and codes.min() >= -top
                    and codes.max() <= top - 1)
    if isinstance(fmt, BlockFloat):  # idempotent under nearest rounding
        return bool(np.array_equal(np.asarray(quantize(jnp.asarray(x, jnp.float32), bits, fmt)),
                                   x.astype(np.float32)))
    return _levels(x) <= 2 ** bits  # integer formats


def _grid_params(bits, fmt):
    return optim.quantize_tree(_params(), bits, fmt, rounding="nearest")


def _run(opt, steps=3, params=None):
    params = _params() if params is None else params
    state = opt.init(params)
    update = jax.jit(opt.update)
    for t in range(steps):
        updates, state = update(_grads(t), state, params)
        params = optax.apply_updates(params, updates)
    return params, state


# ---------------------------------------------------------------- quantized states ---

@pytest.mark.slow
@pytest.mark.parametrize("fmt,bits", [(SymmetricInt(), 3), (AffineInt(), 3),
                                      (FixedPoint(frac_bits=4), 6), (BlockFloat(), 5)])
@IMPLS
def test_quantize_gradients_representable(fmt, bits, impl):
    opt = optim.quantize_gradients(bits, fmt, seed=_key(0, impl))
    g, _ = opt.update(_grads(0), opt.init(_params()))
    for leaf in jax.tree_util.tree_leaves(g):
        assert _on_grid(leaf, bits, fmt)
        if not isinstance(fmt, FixedPoint):
            assert _levels(leaf) <= 2 ** bits
    # stochastic rounding really rounds: results differ from the input
    assert not np.allclose(np.asarray(g["w"]), np.asarray(_grads(0)["w"]))


@pytest.mark.slow
@pytest.mark.parametrize("fmt,bits", [(BlockFloat(), 6), (FixedPoint(frac_bits=4), 8),
                                      (SymmetricInt(), 4), (AffineInt(), 3)])
@IMPLS
def test_lp_sgd_weights_and_momentum_on_grid(fmt, bits, impl):
    opt = optim.lp_sgd(0.1, 0.9, weight_decay=1e-2, weight_bits=bits, grad_bits=bits,
                       momentum_bits=bits, weight_fmt=fmt, grad_fmt=fmt, momentum_fmt=fmt,
                       seed=_key(0, impl))
    params, state = _run(opt, steps=3, params=_grid_params(bits, fmt))
    trace = state.inner_state[1].trace
    for leaf in jax.tree_util.tree_leaves(params) + jax.tree_util.tree_leaves(trace):
        assert _on_grid(leaf, bits, fmt)
    assert np.abs(np.asarray(trace["w"])).max() > 0


@IMPLS
def test_first_step_from_off_grid_params(impl):
    """From fp32 (off-grid) params the first step lands within one float32 ulp of the
    grid (w' - w need not be a float32 number); from then on params + update == Q(.)."""
    fmt = BlockFloat()
    opt = optim.quantize_weights(8, fmt, seed=_key(0, impl))
    params = _params()
    state = opt.init(params)
    raw = jax.tree_util.tree_map(lambda g: -0.05 * g, _grads(0))
    updates, state = opt.update(raw, state, params)
    new = optax.apply_updates(params, updates)
    for leaf in jax.tree_util.tree_leaves(new):
        q = np.asarray(quantize(leaf, 8, fmt))
        assert np.all(np.abs(np.asarray(leaf) - q) <= np.spacing(np.abs(np.asarray(leaf))))
    # stochastic rounding: each weight is within one grid unit of w + raw
    target = np.asarray(params["w"] + raw["w"])
    unit = 2.0 ** (np.floor(np.log2(np.abs(target).max())) - 6)
    assert np.all(np.abs(np.asarray(new["w"]) - target) < unit)
    updates, state = opt.update(raw, state, new)
    for leaf in jax.tree_util.tree_leaves(optax.apply_updates(new, updates)):
        assert _on_grid(leaf, 8, fmt)


def test_accumulator_semantics():
    """acc' = acc - lr g in fp32; w' = Q_w(acc') (nearest) on a 3-bit fixed grid."""
    fmt = FixedPoint(frac_bits=2)
    opt = optim.lp_sgd(0.1, 0.0, weight_bits=4, weight_fmt=fmt, grad_bits=None,
                       momentum_bits=None, acc_bits=32, rounding="nearest")
    params = _params()
    acc = params
    state = opt.init(params)
    for t in range(3):
        updates, state = opt.update(_grads(t), state, params)
        params = optax.apply_updates(params, updates)
        acc = jax.tree_util.tree_map(lambda a, g: a - 0.1 * g, acc, _grads(t))
        for k in acc:
            np.testing.assert_allclose(state.acc[k], acc[k], rtol=1e-6, atol=1e-6)
            np.testing.assert_array_equal(params[k], quantize(acc[k], 4, fmt))


def test_lp_sgd_full_precision_equals_optax_sgd():
    opt = optim.lp_sgd(0.1, 0.9, nesterov=True, weight_decay=1e-2, weight_bits=32,
                       grad_bits=32, momentum_bits=32, seed=KEY)
    ref = optax.chain(optax.add_decayed_weights(1e-2), optax.sgd(0.1, 0.9, nesterov=True))
    p1, _ = _run(opt, steps=4)
    p2, _ = _run(ref, steps=4)
    for k in p1:
        np.testing.assert_allclose(p1[k], p2[k], rtol=1e-6, atol=1e-7)


def test_optim_lp_adam_moments_quantized():
    fmt = FixedPoint(frac_bits=6)
    opt = optim.optim_lp(optax.adam(1e-2), momentum_quant=optim.LPQuant(8, fmt, "nearest"),
                         seed=KEY)
    _, state = _run(opt, steps=2)
    adam_state = state.inner_state[0]
    for leaf in jax.tree_util.tree_leaves((adam_state.mu, adam_state.nu)):
        assert _on_grid(leaf, 8, fmt)
    assert int(adam_state.count) == 2  # integer leaves are left alone


@IMPLS
def test_deterministic_keys_from_state(impl):
    opt = optim.lp_sgd(0.1, 0.9, seed=_key(3, impl))
    a, _ = _run(opt)
    b, _ = _run(opt)
    c, _ = _run(optim.lp_sgd(0.1, 0.9, seed=_key(4, impl)))
    np.testing.assert_array_equal(a["w"], b["w"])
    assert not np.array_equal(np.asarray(a["w"]), np.asarray(c["w"]))


# ---------------------------------------------------------------- traced bits ---

def test_jit_with_traced_bits_compiles_once():
    traces = []
    params = _params()

    @jax.jit
    def step(params, grads, bits):
        traces.append(1)
        opt = optim.lp_sgd(0.5, weight_bits=bits, grad_bits=bits, weight_fmt=SymmetricInt(),
                           grad_fmt=SymmetricInt(), seed=KEY)
        updates, _ = opt.update(grads, opt.init(params), params)
        return optax.apply_updates(params, updates)

    for bits in (2, 3, 5):
        new = step(params, _grads(0), jnp.asarray(bits, jnp.float32))
        assert _levels(new["w"]) <= 2 ** bits
    assert _levels(step(params, _grads(0), jnp.asarray(5, jnp.float32))["w"]) > 4
    assert len(traces) == 1


def test_inject_hyperparams_and_schedule_bits():
    opt = optax.inject_hyperparams(optim.lp_sgd, static_args=("seed",))(
        learning_rate=0.5, weight_bits=2, weight_fmt=SymmetricInt(), seed=KEY)
    params = _params()
    state = opt.init(params)
    update = jax.jit(opt.update)
    updates, state = update(_grads(0), state, params)
    p = optax.apply_updates(params, updates)
    assert _levels(p["w"]) <= 4
    state.hyperparams["weight_bits"] = jnp.asarray(6)
    updates, state = update(_grads(1), state, p)
    p = optax.apply_updates(p, updates)
    assert 4 < _levels(p["w"]) <= 64
    # a schedule of the step count: 2 bits at step 0, 6 bits afterwards
    sched = optim.lp_sgd(0.5, weight_bits=lambda c: jnp.where(c < 1, 2, 6),
                         weight_fmt=SymmetricInt(), seed=KEY)
    p1, _ = _run(sched, steps=1)
    p2, _ = _run(sched, steps=2)
    assert _levels(p1["w"]) <= 4 < _levels(p2["w"])


# ---------------------------------------------------------------- SWA / SWALP ---

def test_swa_average_is_mean_of_iterates():
    opt = optim.swa(optax.sgd(0.1, 0.5), swa_start=2, swa_freq=3)
    params = _params()
    state = opt.init(params)
    iterates = []
    for t in range(1, 11):
        updates, state = opt.update(_grads(t), state, params)
        params = optax.apply_updates(params, updates)
        if t >= 2 and (t - 2) % 3 == 0:
            iterates.append(params)
    assert int(optim.swa_count(state)) == len(iterates) == 3
    avg = optim.swa_params(state)
    for k in params:
        np.testing.assert_allclose(avg[k], np.mean([np.asarray(p[k]) for p in iterates], 0),
                                   rtol=1e-6, atol=1e-7)


def test_swalp_averages_low_precision_iterates():
    opt = optim.swalp(0.1, 0.9, swa_start=2, swa_freq=2, swa_lr=0.01, bits=8, seed=KEY)
    params = _grid_params(8, BlockFloat())
    state = opt.init(params)
    iterates = []
    for t in range(1, 7):
        updates, state = opt.update(_grads(t), state, params)
        params = optax.apply_updates(params, updates)
        assert _on_grid(params["w"], 8, BlockFloat())
        if t in (2, 4, 6):
            iterates.append(np.asarray(params["w"]))
    np.testing.assert_allclose(optim.swa_params(state)["w"], np.mean(iterates, 0), rtol=1e-6,
                               atol=1e-7)
    # the average of grid points is (generally) not itself on the grid: kept in fp32
    assert not _on_grid(optim.swa_params(state)["w"], 8, BlockFloat())


def test_recompute_batch_stats_matches_weighted_batch_averages():
    class Net(nn.Module):
        @nn.compact
        def __call__(self, x, train):
            return nn.BatchNorm(use_running_average=not train, momentum=0.8)(x)

    model = Net()
    batches = [_randn((8, 3), 1, 2.0) + 1.0, _randn((8, 3), 2), _randn((4, 3), 3, 0.5)]
    variables = model.init(KEY, batches[0], train=False)

    def apply(v, x):
        return model.apply(v, x, train=True, mutable=["batch_stats"])[1]["batch_stats"]

    stats = optim.recompute_batch_stats(apply, variables, batches)
    sizes = np.array([len(b) for b in batches], np.float64)
    means = np.stack([np.asarray(b).mean(0) for b in batches])
    vars_ = np.stack([np.asarray(b).var(0) for b in batches])
    bn = stats["BatchNorm_0"]
    np.testing.assert_allclose(bn["mean"], (sizes[:, None] * means).sum(0) / sizes.sum(),
                               rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(bn["var"], (sizes[:, None] * vars_).sum(0) / sizes.sum(),
                               rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------- HALP ---

@pytest.mark.slow
def test_halp_recenter_formula_and_code_range():
    params = {"w": _randn((4, 3), 1), "b": _randn((3,), 2)}
    state = optim.halp_init(params, bits=8)
    assert state.codes["w"].dtype == jnp.int8
    state = state.replace(codes=jax.tree_util.tree_map(lambda c: c + 5, state.codes),
                          scale=jnp.asarray(0.01))
    before = state.params
    g = {"w": _randn((4, 3), 3), "b": _randn((3,), 4)}
    state = state.recenter(g, mu=0.5)
    norm = np.sqrt(sum(np.sum(np.asarray(x, np.float64) ** 2) for x in g.values()))
    np.testing.assert_allclose(state.scale, norm / (0.5 * 127), rtol=1e-6)
    for k in params:
        np.testing.assert_array_equal(state.codes[k], 0)
        np.testing.assert_allclose(state.anchor[k], before[k], rtol=1e-7)
        np.testing.assert_allclose(before[k], params[k] + 0.05, rtol=1e-6)
    # a huge step saturates the codes at [-2^(b-1), 2^(b-1) - 1]
    big = jax.tree_util.tree_map(lambda x: 1e6 * jnp.sign(x) + 1e6 * (x == 0), g)
    zero = jax.tree_util.tree_map(jnp.zeros_like, g)
    neg = state.inner_step(big, zero, 1.0, KEY)
    pos = state.inner_step(jax.tree_util.tree_map(lambda x: -x, big), zero, 1.0, KEY)
    assert int(jnp.min(neg.codes["w"])) == -128 and int(jnp.max(pos.codes["w"])) == 127
    for s in (neg, pos):
        for c in jax.tree_util.tree_leaves(s.codes):
            assert c.dtype == jnp.int8 and -128 <= int(c.min()) and int(c.max()) <= 127


def test_halp_traced_bits_clamp_under_jit():
    params = {"w": jnp.zeros(64)}
    g = {"w": jnp.ones(64)}

    @jax.jit
    def codes_after_step(bits):
        state = optim.halp_init(params, bits=bits, dtype=jnp.int8).recenter(g, mu=1.0)
        return state.inner_step(g, {"w": jnp.zeros(64)}, 1e3, KEY).codes["w"], state.scale

    for bits in (3, 5):
        codes, scale = codes_after_step(jnp.asarray(bits))
        assert int(codes.min()) == -(2 ** (bits - 1))
        np.testing.assert_allclose(scale, 8.0 / (2 ** (bits - 1) - 1), rtol=1e-6)


@IMPLS
def test_quantize_to_codes_unbiased_and_clamped(impl):
    KEY = _key(0, impl)  # noqa: N806 - shadows the module's key
    u = jnp.full((20000,), 0.237)
    codes = optim.quantize_to_codes(u, 0.1, 8, key=KEY, dtype=jnp.int8)
    assert set(np.unique(np.asarray(codes))) == {2, 3}
    np.testing.assert_allclose(0.1 * np.asarray(codes, np.float64).mean(), 0.237, atol=2e-3)
    assert int(optim.quantize_to_codes(jnp.array([-50.0]), 0.1, 8, key=KEY)[0]) == -128
    np.testing.assert_array_equal(optim.quantize_to_codes(u[:3], 0.0, 8, key=KEY), 0)


def _least_squares():
    x = _randn((128, 6), 5)
    y = x @ jnp.arange(1.0, 7.0) + 0.1 * _randn((128,), 6)
    data = (x, y)

    def loss_fn(w, batch):
        xb, yb = batch
        return 0.5 * jnp.mean((xb @ w - yb) ** 2) + 0.5e-2 * jnp.sum(w ** 2)

    return loss_fn, data


def test_full_gradient_chunked_equals_full():
    loss_fn, data = _least_squares()
    w = jnp.ones(6)
    full = optim.full_gradient(loss_fn, w, data)
    chunked = optim.full_gradient(loss_fn, w, data, batch_size=50)  # 50 + 50 + 28
    np.testing.assert_allclose(chunked, full, rtol=1e-5, atol=1e-5)


def test_variance_reduced_methods_reduce_loss():
    loss_fn, data = _least_squares()
    w0 = jnp.zeros(6)
    f0 = float(loss_fn(w0, data))
    epochs = {
        "svrg": optim.svrg(loss_fn, learning_rate=0.1, batch_size=8),
        "lp_svrg": optim.lp_svrg(loss_fn, learning_rate=0.1, batch_size=8, scale=2.0 ** -4),
        "halp": optim.halp(loss_fn, learning_rate=0.1, batch_size=8, mu=1.0, bits=8),
    }
    final = {}
    for name, epoch in epochs.items():
        w = w0
        for e in range(6):
            w = epoch(w, data, jax.random.fold_in(KEY, e))
        final[name] = float(loss_fn(w, data))
        assert final[name] < 0.05 * f0, name
    # lp_svrg's iterates stay on its fixed grid
    w = epochs["lp_svrg"](w0, data, KEY)
    assert np.all(np.asarray(w) * 16 == np.round(np.asarray(w) * 16))
    # HALP reaches the optimum far more precisely than the fixed-grid LP-SVRG
    w_star = jnp.linalg.solve(data[0].T @ data[0] / 128 + 1e-2 * jnp.eye(6),
                              data[0].T @ data[1] / 128)
    f_star = float(loss_fn(w_star, data))
    assert final["halp"] - f_star < 1e-2 * (final["lp_svrg"] - f_star)


def test_lp_sgd_and_swalp_reduce_loss():
    loss_fn, (x, y) = _least_squares()
    grad_fn = jax.jit(jax.grad(loss_fn))
    f0 = float(loss_fn(jnp.zeros(6), (x, y)))
    for opt in (optim.lp_sgd(0.05, 0.9, seed=KEY),
                optim.swalp(0.05, 0.9, swa_start=40, swa_freq=8, swa_lr=0.02, seed=KEY)):
        w = jnp.zeros(6)
        state = opt.init(w)
        update = jax.jit(opt.update)
        for t in range(80):
            i = (t * 8) % 128
            updates, state = update(grad_fn(w, (x[i:i + 8], y[i:i + 8])), state, w)
            w = optax.apply_updates(w, updates)
        assert float(loss_fn(w, (x, y))) < 0.05 * f0
    assert float(loss_fn(optim.swa_params(state), (x, y))) < 0.05 * f0


# ---------------------------------------------------------------- validation ---

def test_bad_arguments_raise_value_errors():
    with pytest.raises(ValueError, match="momentum"):
        optim.lp_sgd(0.1, momentum=1.5)
    with pytest.raises(ValueError, match="weight_bits"):
        optim.lp_sgd(0.1, weight_bits=0)
    with pytest.raises(ValueError, match="rounding"):
        optim.LPQuant(8, BlockFloat(), "up")
    with pytest.raises(ValueError, match="swa_freq"):
        optim.swa(optax.sgd(0.1), swa_start=0, swa_freq=0)
    with pytest.raises(ValueError, match="mu"):
        optim.halp(lambda w, b: 0.0, learning_rate=0.1, batch_size=1, mu=0.0)
    with pytest.raises(ValueError, match="bits"):
        optim.halp_init({"w": jnp.zeros(2)}, bits=1)
    with pytest.raises(ValueError, match="bits"):
        optim.halp_init({"w": jnp.zeros(2)}, bits=12, dtype=jnp.int8)
    assert optim.halp_init({"w": jnp.zeros(2)}, bits=12).codes["w"].dtype == jnp.int16
    opt = optim.quantize_weights(8)
    with pytest.raises(ValueError, match="params"):
        opt.update(_grads(0), opt.init(_params()))
    with pytest.raises(ValueError, match="batch_size"):
        optim.svrg_epoch(lambda w, b: jnp.sum(w), jnp.zeros(2), (jnp.zeros((4, 2)),), KEY,
                         learning_rate=0.1, batch_size=5)
    with pytest.raises(ValueError, match="SWAState"):
        optim.swa_params(optax.sgd(0.1).init(_params()))
