"""The real-int8 path: int8 x int8 -> int32 products equal SymmetricInt fake quantization."""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax

import cpt_jax
from cpt_jax import QuantConfig, TensorQuant, get_preset, precision, quantize, quantize_model
from cpt_jax.formats import AffineInt, SymmetricInt
from cpt_jax.ops import int8_conv, int8_dot_general
from cpt_jax.training import create_train_state, make_train_step

INT8_CONFIG = get_preset("int8")
RNG = np.random.default_rng(0)
X_VEC = jnp.asarray(RNG.normal(size=(6, 12)), jnp.float32)
X_IMG = jnp.asarray(RNG.normal(size=(2, 7, 7, 3)), jnp.float32)
DN_IMG = ("NHWC", "HWIO", "NHWC")
# The same grids as INT8_CONFIG, through fake quantization and float products.
FAKE = QuantConfig(weight=TensorQuant(SymmetricInt(channel_axis=-1)),
                   activation=TensorQuant(SymmetricInt()),
                   error=TensorQuant(AffineInt(), "stochastic"))
WIDTHS = list(range(2, 9))


def _runner(model):
    @jax.jit
    def run(variables, x, bits):
        with precision(bits):
            return model.apply(variables, x)
    return run


def _close(a, b, scale):
    # Equal up to the float rounding of the rescale: relative to the output scale.
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0,
                               atol=2e-6 * max(1.0, float(scale)))


@pytest.mark.slow
def test_dense_equals_symmetric_fake_quant_at_every_width():
    model = quantize_model(nn.Dense(5), config=INT8_CONFIG)
    variables = model.init(jax.random.key(0), X_VEC)
    p = variables["params"]
    run = _runner(model)
    for bits in WIDTHS:
        y = run(variables, X_VEC, jnp.float32(bits))
        want = lax.dot(quantize(X_VEC, bits, SymmetricInt()),
                       quantize(p["kernel"], bits, SymmetricInt(channel_axis=-1))) + p["bias"]
        _close(y, want, jnp.abs(want).max())
    assert run._cache_size() == 1  # one compilation for all seven widths


def test_conv_equals_symmetric_fake_quant_at_every_width():
    model = quantize_model(nn.Conv(4, (3, 3), use_bias=False), config=INT8_CONFIG)
    variables = model.init(jax.random.key(1), X_IMG)
    k = variables["params"]["kernel"]
    run = _runner(model)
    for bits in WIDTHS:
        y = run(variables, X_IMG, jnp.float32(bits))
        want = lax.conv_general_dilated(
            quantize(X_IMG, bits, SymmetricInt()),
            quantize(k, bits, SymmetricInt(channel_axis=-1)), (1, 1), "SAME",
            dimension_numbers=DN_IMG)
        _close(y, want, jnp.abs(want).max())
    assert run._cache_size() == 1


@pytest.mark.slow
def test_strided_grouped_conv_and_nchw_layout():
    x = jnp.asarray(RNG.normal(size=(2, 4, 9, 9)), jnp.float32)   # NCHW
    w = jnp.asarray(RNG.normal(size=(6, 2, 3, 3)), jnp.float32)   # OIHW, 2 groups
    dn = ("NCHW", "OIHW", "NCHW")
    for bits in (3, 8):
        y = int8_conv(x, w, (2, 2), ((1, 1), (1, 1)), dimension_numbers=dn,
                      feature_group_count=2, bits=bits)
        want = lax.conv_general_dilated(
            quantize(x, bits, SymmetricInt()), quantize(w, bits, SymmetricInt(channel_axis=0)),
            (2, 2), ((1, 1), (1, 1)), dimension_numbers=dn, feature_group_count=2)
        _close(y, want, jnp.abs(want).max())


def test_products_really_are_int8_with_int32_accumulation():
    for layer, x in ((nn.Dense(3), X_VEC), (nn.Conv(2, (3, 3)), X_IMG)):
        model = quantize_model(layer, config=INT8_CONFIG)
        variables = model.init(jax.random.key(0), x)
        def apply(v, model=model, x=x):
            with precision(4):  # inside the traced function: no StalePrecisionWarning
                return model.apply(v, x)

        jaxpr = str(jax.make_jaxpr(apply)(variables))
        assert "i8[" in jaxpr and "preferred_element_type=int32" in jaxpr


@pytest.mark.slow
@pytest.mark.parametrize("bits", [2, 8])
@pytest.mark.parametrize("kind", ["dense", "conv"])
def test_gradients_finite_and_equal_to_ste(kind, bits):
    layer, x = (nn.Dense(5), X_VEC) if kind == "dense" else (nn.Conv(4, (3, 3)), X_IMG)
    int8_model = quantize_model(layer, config=INT8_CONFIG)
    fake_model = quantize_model(layer, config=FAKE)
    variables = int8_model.init(jax.random.key(2), x)
    target = jax.random.normal(jax.random.key(3), int8_model.apply(variables, x).shape)

    def grads(model):
        def loss(v, x):
            with precision(bits):  # no grad_bits: errors stay fp32, no noise
                return jnp.sum((model.apply(v, x) - target) ** 2)
        return jax.jit(jax.grad(loss, argnums=(0, 1)))(variables, x)

    (gv8, gx8), (gvf, gxf) = grads(int8_model), grads(fake_model)
    for a, b in zip(jax.tree_util.tree_leaves((gv8, gx8)), jax.tree_util.tree_leaves((gvf, gxf))):
        assert np.all(np.isfinite(np.asarray(a)))
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4,
                                   atol=1e-4 * float(jnp.abs(b).max()))
    assert float(jnp.abs(gv8["params"]["kernel"]).sum()) > 0


@pytest.mark.slow
def test_ste_gradient_of_the_bare_product():
    w = jnp.asarray(RNG.normal(size=(12, 4)), jnp.float32)
    dn = (((1,), (0,)), ((), ()))
    ga, gb = jax.grad(lambda a, b: int8_dot_general(a, b, dn, 6).sum(), argnums=(0, 1))(X_VEC, w)
    xq, wq = quantize(X_VEC, 6, SymmetricInt()), quantize(w, 6, SymmetricInt(channel_axis=-1))
    ones = jnp.ones((X_VEC.shape[0], 4))
    np.testing.assert_allclose(ga, ones @ wq.T, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(gb, xq.T @ ones, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_wider_than_8_bits_uses_the_float_product():
    model = quantize_model(nn.Dense(5), config=INT8_CONFIG)
    variables = model.init(jax.random.key(0), X_VEC)
    p = variables["params"]
    y = _runner(model)(variables, X_VEC, jnp.float32(12))
    want = lax.dot(quantize(X_VEC, 12, SymmetricInt()),
                   quantize(p["kernel"], 12, SymmetricInt(channel_axis=-1))) + p["bias"]
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5)


def test_non_finite_activation_stays_visible():
    model = quantize_model(nn.Dense(3), config=INT8_CONFIG)
    variables = model.init(jax.random.key(0), X_VEC)
    x = X_VEC.at[0, 0].set(jnp.nan)
    y = _runner(model)(variables, x, jnp.float32(8))
    assert not np.all(np.isfinite(np.asarray(y)))


def test_per_channel_activation_falls_back_to_fake_quant_with_a_warning():
    """A scale along the contraction (per input channel) has no integer GEMM: the
    product runs fake quantization, and says so."""
    cfg = QuantConfig(weight=TensorQuant(SymmetricInt(-1)),
                      activation=TensorQuant(SymmetricInt(channel_axis=-1)), compute="int")
    model = quantize_model(nn.Dense(3), config=cfg)
    variables = model.init(jax.random.key(0), X_VEC)
    with pytest.warns(cpt_jax.providers.integer.IntegerFallbackWarning, match="Dense"):
        with precision(8):
            y = model.apply(variables, X_VEC)
    with precision(8):
        want = quantize_model(nn.Dense(3), config=cfg.replace(compute="fake")).apply(variables,
                                                                                     X_VEC)
    np.testing.assert_array_equal(y, want)


def test_one_compilation_for_a_whole_cyclic_int8_run():
    class Net(nn.Module):
        @nn.compact
        def __call__(self, x, train: bool = False):
            x = nn.relu(nn.Conv(4, (3, 3), name="conv")(x))
            return nn.Dense(3, name="classifier")(x.reshape(x.shape[0], -1))

    model = quantize_model(Net(), rules=cpt_jax.CPT_RULES, config=INT8_CONFIG)
    opt = optax.sgd(0.05)
    steps = 14
    sched = cpt_jax.cyclic("cos_growth", min_bits=2, max_bits=8, num_cycles=2,
                           total_steps=steps)
    step = make_train_step(model, opt, sched, cpt_jax.constant(8))
    state = create_train_state(model, opt, jax.random.key(0), X_IMG, train=False)
    batch = {"inputs": X_IMG, "labels": jnp.array([0, 2])}
    bits = []
    for _ in range(steps):
        state, metrics = step(state, batch)
        bits.append(float(metrics["bits"]))
        assert bool(metrics["finite"])
    assert len(set(bits)) >= 5          # the run visits many widths ...
    assert step.num_compiles == 1       # ... with one compilation
