"""Flax NNX through the one door: `quantize_model` of an NNX model matches the Linen
model on the same weights, forward and backward; rules, LAST_PRODUCT, one compile."""
from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import cpt_jax
from cpt_jax import count_ops, quantize_model, quantized_layers
from cpt_jax.doors import QuantEinsum


class LinenNet(nn.Module):
    @nn.compact
    def __call__(self, x):
        y = nn.relu(nn.Conv(4, (3, 3), name="conv")(x))
        y = y.reshape((y.shape[0], -1))
        y = nn.relu(nn.Dense(16, name="hidden")(y))
        return nn.Dense(3, name="classifier")(y)


class NNXNet(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.conv = nnx.Conv(1, 4, (3, 3), rngs=rngs)
        self.hidden = nnx.Linear(4 * 36, 16, rngs=rngs)
        self.classifier = nnx.Linear(16, 3, rngs=rngs)

    def __call__(self, x):
        y = nnx.relu(self.conv(x))
        y = y.reshape((y.shape[0], -1))
        return self.classifier(nnx.relu(self.hidden(y)))


RULES = [("classifier", None)]


@functools.cache
def _linen():
    x = jax.random.normal(jax.random.key(1), (5, 6, 6, 1))
    linen = cpt_jax.quantize_model(LinenNet(), rules=RULES)
    variables = jax.jit(linen.init)(jax.random.key(0), x)
    return linen, variables, x


def _pair():
    """The quantized Linen model and an NNX twin holding the same weights."""
    linen, variables, x = _linen()
    model = nnx.eval_shape(lambda: NNXNet(nnx.Rngs(0)))  # no eager init
    p = variables["params"]
    for name in ("conv", "hidden", "classifier"):
        getattr(model, name).kernel = nnx.Param(p[name]["kernel"])
        getattr(model, name).bias = nnx.Param(p[name]["bias"])
    return linen, variables, quantize_model(model, rules=RULES), x


@pytest.mark.slow
def test_nnx_matches_linen_forward_and_gradients_at_several_bits():
    linen, variables, model, x = _pair()
    labels = jnp.array([0, 1, 2, 0, 1])
    key = jax.random.key(7)
    loss_of = lambda logits: optax.softmax_cross_entropy_with_integer_labels(  # noqa: E731
        logits, labels).mean()

    @jax.jit
    def linen_grads(params, bits):
        def loss(params):
            with cpt_jax.precision(bits, grad_bits=6, rng=key):
                logits = linen.apply({"params": params}, x)
            return loss_of(logits), logits
        return jax.value_and_grad(loss, has_aux=True)(params)

    @nnx.jit
    def nnx_grads(model, bits):
        def loss(m):
            with cpt_jax.precision(bits, grad_bits=6, rng=key):
                logits = m(x)
            return loss_of(logits), logits
        return nnx.value_and_grad(loss, has_aux=True)(model)

    fp32 = np.asarray(nnx.jit(lambda m, x: m(x))(model, x))
    for bits in (2.0, 3.0, 4.0, 6.0, 8.0):
        (_, l_logits), l_grads = linen_grads(variables["params"], jnp.float32(bits))
        (_, n_logits), n_grads = nnx_grads(model, jnp.float32(bits))
        np.testing.assert_array_equal(np.asarray(n_logits), np.asarray(l_logits))
        for name in ("conv", "hidden", "classifier"):
            np.testing.assert_array_equal(np.asarray(n_grads[name]["kernel"][...]),
                                          np.asarray(l_grads[name]["kernel"]))
        if bits <= 4:  # quantization is really on: the output moves away from fp32
            assert not np.allclose(fp32, np.asarray(n_logits), atol=1e-4)


def test_rules_and_cost_records():
    _, _, model, x = _pair()
    layers = {layer.path: layer.config for layer in quantized_layers(model, x)}
    assert list(layers) == ["conv", "hidden", "classifier"]
    assert layers["classifier"] is None and layers["hidden"] is cpt_jax.CPT_CONFIG
    ops = count_ops(model, x)
    assert [(op.name, op.kind, op.quantized) for op in ops] == [
        ("conv", "conv", True), ("hidden", "dot_general", True),
        ("classifier", "dot_general", False)]
    assert ops[1].macs == 5 * 16 * 4 * 36


def test_jitted_nnx_train_step_compiles_once_over_a_cyclic_schedule():
    _, _, model, x = _pair()
    labels = jnp.array([0, 1, 2, 0, 1])
    optimizer = nnx.Optimizer(model, optax.sgd(0.05), wrt=nnx.Param)
    schedule = cpt_jax.cyclic("cos_growth", min_bits=3, max_bits=8, num_cycles=2,
                              total_steps=12)
    traces = []

    @nnx.jit
    def train_step(model, optimizer, x, y, step, key):
        traces.append(1)

        def loss_fn(m):
            with cpt_jax.precision(schedule(step), grad_bits=8, rng=key):
                logits = m(x)
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return loss, schedule(step)

    losses, bits = [], []
    for step in range(12):
        loss, b = train_step(model, optimizer, x, labels, jnp.int32(step),
                             jax.random.fold_in(jax.random.key(0), step))
        losses.append(float(loss))
        bits.append(float(b))
    assert len(traces) == 1
    assert bits == [float(schedule(s)) for s in range(12)] and len(set(bits)) > 2
    assert losses[-1] < losses[0]


def test_einsum_layer_matches_linear():
    def build():
        rngs = nnx.Rngs(0)
        return (nnx.Linear(3, 4, dot_general=cpt_jax.doors.QuantDotGeneral(), rngs=rngs),
                nnx.Einsum("bd,df->bf", (3, 4), (4,), einsum_op=QuantEinsum(), rngs=rngs))

    linear, einsum = nnx.eval_shape(build)
    linear.kernel = nnx.Param(jax.random.normal(jax.random.key(3), (3, 4)))
    linear.bias = nnx.Param(jnp.arange(4.0))
    einsum.kernel = nnx.Param(linear.kernel[...])
    einsum.bias = nnx.Param(linear.bias[...])
    x = jax.random.normal(jax.random.key(2), (2, 3))

    @nnx.jit
    def both(linear, einsum, x):
        with cpt_jax.precision(3.0):
            return linear(x), einsum(x), einsum.einsum_op.__class__ is QuantEinsum

    a, b, _ = both(linear, einsum, x)
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=1e-6)
    assert not np.allclose(np.asarray(a), np.asarray(x @ linear.kernel[...] + linear.bias[...]),
                           atol=1e-3)


def test_last_product_rule_and_state_untouched():
    _, _, model, x = _pair()
    state = jax.tree_util.tree_map(np.asarray, nnx.state(model))
    model = quantize_model(model, rules=cpt_jax.CPT_RULES)   # re-quantize with new rules
    assert [(layer.path, layer.config is None) for layer in quantized_layers(model, x)] == [
        ("conv", False), ("hidden", False), ("classifier", True)]
    jax.tree_util.tree_map(np.testing.assert_array_equal, nnx.state(model), state)
    assert isinstance(model, NNXNet)


@pytest.mark.slow
def test_other_methods_are_intercepted_and_bad_models_rejected():
    class Twin(nnx.Module):
        def __init__(self, rngs):
            self.a, self.b = nnx.Linear(6, 6, rngs=rngs), nnx.Linear(6, 2, rngs=rngs)

        def features(self, x):
            return self.a(x)

        def __call__(self, x):
            return self.b(self.features(x))

    model = quantize_model(Twin(nnx.Rngs(0)), rules=[])
    x = jax.random.normal(jax.random.key(0), (3, 6))
    assert [op.name for op in count_ops(model, x, method="features")] == ["a"]
    float_features = x @ model.a.kernel[...] + model.a.bias[...]
    np.testing.assert_allclose(np.asarray(model.features(x)), np.asarray(float_features),
                               rtol=1e-6)          # fp32 outside a precision context
    with cpt_jax.precision(2):
        assert not np.allclose(np.asarray(model.features(x)), np.asarray(float_features),
                               atol=1e-2)
    with pytest.raises(ValueError, match="flax.linen or flax.nnx Module"):
        quantize_model(object())
