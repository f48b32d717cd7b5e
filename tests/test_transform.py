"""Tests for cpt_jax.doors: quantizing Flax models, the precision context, int8."""
from __future__ import annotations

import functools

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax

import cpt_jax
from cpt_jax import (
    CPT_RULES,
    INT8_CONFIG,
    AffineInt,
    QuantConfig,
    QuantConvGeneralDilated,
    QuantDotGeneral,
    SymmetricInt,
    TensorQuant,
    context,
    precision,
    quantize,
    quantize_model,
)

KEY = jax.random.key(0)
RNG = np.random.default_rng(0)


class Net(nn.Module):
    """A small float model: conv, batch norm, dense and a `classifier` head."""

    @nn.compact
    def __call__(self, x, train: bool = False):
        x = nn.Conv(4, (3, 3), name="conv")(x)
        x = nn.BatchNorm(use_running_average=not train, name="bn")(x)
        x = nn.relu(x)
        x = x.reshape((x.shape[0], -1))
        x = nn.relu(nn.Dense(8, name="fc")(x))
        return nn.Dense(3, name="classifier")(x)


class TwoHeads(nn.Module):
    """Two Dense layers on the same input: one quantized, one kept full precision."""

    @nn.compact
    def __call__(self, x):
        return nn.Dense(4, name="fc")(x), nn.Dense(4, name="classifier")(x)


def normal(*shape, seed=0):
    return jnp.asarray(np.random.default_rng(seed).normal(size=shape), jnp.float32)


X_IMG = normal(2, 5, 5, 3)
X_VEC = normal(4, 6, seed=1)


def make_variables(model, *inputs, seed=0):
    """Random variables with the model's tree (from `eval_shape`, nothing compiled).

    Cheaper on 2 shared cores than `init`, whose random initializers take seconds to
    compile; `test_quantize_model_keeps_the_variable_tree` checks real `init`.
    """
    rng = np.random.default_rng(seed)
    shapes = jax.eval_shape(model.init, KEY, *inputs)

    def fill(path, leaf):
        value = rng.normal(size=leaf.shape) * 0.5
        if any(getattr(k, "key", None) == "var" for k in path):
            value = np.abs(value) + 0.5  # batch-norm variances are positive
        return jnp.asarray(value, leaf.dtype)

    return jax.tree_util.tree_map_with_path(fill, shapes)


def dense_reference(x, kernel, bias, bits):
    """CPT's quantized Dense: Q_b(x) per tensor, Q_b(W) per output channel."""
    return lax.dot(quantize(x, bits, AffineInt()),
                   quantize(kernel, bits, AffineInt(channel_axis=-1))) + bias


# --------------------------------------------------------------------------- structure

def test_quantize_model_keeps_the_variable_tree():
    float_tree = jax.eval_shape(Net().init, KEY, X_IMG)
    q_tree = jax.eval_shape(quantize_model(Net(), rules=CPT_RULES).init, KEY, X_IMG)
    chex.assert_trees_all_equal_structs(float_tree, q_tree)
    chex.assert_trees_all_equal_shapes_and_dtypes(float_tree, q_tree)
    assert set(q_tree) == {"params", "batch_stats"}
    assert set(q_tree["params"]) == {"conv", "bn", "fc", "classifier"}
    # Real init: the same values too (the wrapper shares the model's scope and rngs).
    key = jax.random.key(0, impl="rbg")  # cheap to compile on CPU
    chex.assert_trees_all_equal(jax.jit(TwoHeads().init)(key, X_VEC),
                                jax.jit(quantize_model(TwoHeads(), rules=CPT_RULES).init)(
                                    key, X_VEC))


def test_outside_a_precision_context_the_model_is_the_float_model():
    model, qmodel = Net(), quantize_model(Net(), rules=CPT_RULES)
    variables = make_variables(model, X_IMG)
    chex.assert_trees_all_equal(model.apply(variables, X_IMG), qmodel.apply(variables, X_IMG))
    # Training mode with mutable batch statistics: same output, same new statistics.
    y_f, s_f = model.apply(variables, X_IMG, train=True, mutable=["batch_stats"])
    y_q, s_q = qmodel.apply(variables, X_IMG, train=True, mutable=["batch_stats"])
    chex.assert_trees_all_equal((y_f, s_f), (y_q, s_q))
    with cpt_jax.full_precision():  # explicitly full precision inside an outer context
        chex.assert_trees_all_equal(model.apply(variables, X_IMG),
                                    qmodel.apply(variables, X_IMG))


@pytest.mark.slow
def test_dense_inside_precision_is_exactly_the_cpt_formula():
    model = quantize_model(nn.Dense(5))
    variables = make_variables(model, X_VEC)
    p = variables["params"]
    # Eagerly (op by op, no fusion): bit-for-bit the formula.
    with precision(3):
        y = model.apply(variables, X_VEC)
    chex.assert_trees_all_equal(y, dense_reference(X_VEC, p["kernel"], p["bias"], 3))
    assert not np.allclose(np.asarray(y), np.asarray(nn.Dense(5).apply(variables, X_VEC)))

    # Under jit with traced bits, model and formula in the same program.
    @jax.jit
    def both(variables, x, bits):
        with precision(bits):
            y = model.apply(variables, x)
        p = variables["params"]
        return y, dense_reference(x, p["kernel"], p["bias"], bits)

    for bits in (2, 5, 8):
        y, want = both(variables, X_VEC, jnp.float32(bits))
        chex.assert_trees_all_equal(y, want)


def test_bits_32_is_full_precision():
    model = quantize_model(nn.Dense(5))
    variables = make_variables(model, X_VEC)
    with precision(32):
        y = model.apply(variables, X_VEC)
    chex.assert_trees_all_equal(y, nn.Dense(5).apply(variables, X_VEC))


@pytest.mark.slow
def test_rules_keep_the_classifier_in_full_precision():
    qmodel = quantize_model(TwoHeads(), rules=CPT_RULES)
    variables = make_variables(qmodel, X_VEC)
    float_fc, float_cls = TwoHeads().apply(variables, X_VEC)
    with precision(3):
        q_fc, q_cls = qmodel.apply(variables, X_VEC)
    chex.assert_trees_all_equal(q_cls, float_cls)  # same input, full precision
    p = variables["params"]["fc"]
    chex.assert_trees_all_equal(q_fc, dense_reference(X_VEC, p["kernel"], p["bias"], 3))
    assert not np.allclose(np.asarray(q_fc), np.asarray(float_fc))
    # "full_precision" as a rule target and a dict of rules do the same.
    for rules in ({"classifier": "full_precision"}, [("class", None)]):
        with precision(3):
            _, q_cls2 = quantize_model(TwoHeads(), rules=rules).apply(variables, X_VEC)
        chex.assert_trees_all_equal(q_cls2, float_cls)


def test_rules_with_a_config_and_first_match_wins():
    sym = QuantConfig(weight=TensorQuant(SymmetricInt(channel_axis=-1)),
                      activation=TensorQuant(SymmetricInt()), error=None)
    qmodel = quantize_model(TwoHeads(), rules=[("fc", sym), ("fc|classifier", None)])
    variables = make_variables(qmodel, X_VEC)
    with precision(4):
        q_fc, q_cls = qmodel.apply(variables, X_VEC)
    p = variables["params"]["fc"]
    want = lax.dot(quantize(X_VEC, 4, SymmetricInt()),
                   quantize(p["kernel"], 4, SymmetricInt(channel_axis=-1))) + p["bias"]
    chex.assert_trees_all_equal(q_fc, want)
    chex.assert_trees_all_equal(q_cls, TwoHeads().apply(variables, X_VEC)[1])


def test_bits_offset_per_layer():
    qmodel = quantize_model(nn.Dense(5), config=QuantConfig(bits_offset=2.0))
    variables = make_variables(qmodel, X_VEC)
    with precision(3):
        y = qmodel.apply(variables, X_VEC)
    p = variables["params"]
    chex.assert_trees_all_equal(y, dense_reference(X_VEC, p["kernel"], p["bias"], 5))


def test_invalid_rules():
    with pytest.raises(ValueError, match="rules"):
        quantize_model(nn.Dense(3), rules=[("fc",)])
    with pytest.raises(ValueError, match="regex"):
        quantize_model(nn.Dense(3), rules=[("(", None)])
    with pytest.raises(ValueError, match="target"):
        quantize_model(nn.Dense(3), rules=[("fc", 8)])
    with pytest.raises(ValueError, match="Module"):
        quantize_model(lambda x: x)


# --------------------------------------------------------------------------- Linen idiom

def test_dot_general_cls_on_dense():
    layer = nn.Dense(5, dot_general_cls=QuantDotGeneral)
    variables = make_variables(layer, X_VEC)
    p = variables["params"]
    chex.assert_trees_all_equal(layer.apply(variables, X_VEC),
                                nn.Dense(5).apply(variables, X_VEC))
    with precision(4):
        y = layer.apply(variables, X_VEC)
    chex.assert_trees_all_equal(y, dense_reference(X_VEC, p["kernel"], p["bias"], 4))


@pytest.mark.parametrize("kwargs", [
    dict(),
    dict(padding=((1, 0), (2, 1)), feature_group_count=3, strides=(1, 2)),
], ids=["same", "stride-padding-groups"])
def test_conv_general_dilated_cls_on_conv(kwargs):
    layer = nn.Conv(6, (3, 3), conv_general_dilated_cls=QuantConvGeneralDilated, **kwargs)
    plain = nn.Conv(6, (3, 3), **kwargs)
    variables = jax.jit(layer.init)(KEY, X_IMG)

    @jax.jit
    def run(variables, x):
        y_fp = layer.apply(variables, x)
        with precision(4):
            y = layer.apply(variables, x)
        # The quantized conv is the float conv applied to the quantized input and
        # kernel (kernel HWIO: one range per output feature, the last axis).
        k = variables["params"]["kernel"]
        q_vars = {"params": {"kernel": quantize(k, 4, AffineInt(channel_axis=-1)),
                             "bias": variables["params"]["bias"]}}
        return y_fp, plain.apply(variables, x), y, plain.apply(q_vars, quantize(x, 4, AffineInt()))

    y_fp, want_fp, y, want = run(variables, X_IMG)
    chex.assert_trees_all_equal(y_fp, want_fp)
    chex.assert_trees_all_equal(y, want)
    assert not np.allclose(np.asarray(y), np.asarray(y_fp))


def test_quantize_model_conv_matches_the_linen_idiom():
    qmodel = quantize_model(nn.Conv(4, (3, 3)))
    idiom = nn.Conv(4, (3, 3), conv_general_dilated_cls=QuantConvGeneralDilated)
    variables = jax.jit(qmodel.init)(KEY, X_IMG)

    @jax.jit
    def run(variables, x):
        with precision(3):
            return qmodel.apply(variables, x), idiom.apply(variables, x)

    chex.assert_trees_all_equal(*run(variables, X_IMG))


def test_quant_dot_general_accepts_out_sharding():
    op = QuantDotGeneral()
    dims = (((1,), (0,)), ((), ()))
    kernel = normal(6, 5, seed=3)
    chex.assert_trees_all_equal(op(X_VEC, kernel, dims, out_sharding=None),
                                lax.dot_general(X_VEC, kernel, dims))
    with precision(4):
        y = op(X_VEC, kernel, dims, None, None, out_sharding=None)
    chex.assert_trees_all_equal(y, lax.dot(quantize(X_VEC, 4, AffineInt()),
                                           quantize(kernel, 4, AffineInt(channel_axis=-1))))
    # As the quantized_dot_general function too.
    chex.assert_trees_all_equal(
        cpt_jax.doors.quantized_dot_general(X_VEC, kernel, dims, out_sharding=None),
        lax.dot_general(X_VEC, kernel, dims))


# --------------------------------------------------------------------------- errors

def test_error_quantization_gradient_of_dense():
    bits, grad_bits = 4, 5
    model = quantize_model(nn.Dense(5))
    variables = make_variables(model, X_VEC)
    c = normal(4, 5, seed=7)  # dL/dy for L = sum(c * y)
    rng = jax.random.key(42)

    def loss(params, x):
        with precision(bits, grad_bits=grad_bits, rng=rng):
            y = model.apply({"params": params}, x)
        return jnp.sum(c * y)

    @jax.jit
    def run(params, x):
        grads = jax.grad(loss, argnums=(0, 1))(params, x)
        x_q = quantize(x, bits, AffineInt())
        w_q = quantize(params["kernel"], bits, AffineInt(channel_axis=-1))
        # The only stochastic tensor of this op is its error: key fold_in(rng, 0).
        e_q = quantize(c, grad_bits, AffineInt(), rounding="stochastic",
                       key=jax.random.fold_in(rng, 0))
        return grads, x_q, w_q, e_q

    (g_params, g_x), x_q, w_q, e_q = run(variables["params"], X_VEC)
    assert not np.allclose(np.asarray(e_q), np.asarray(c))
    # One quantized error feeds both products; the operands pass straight through.
    chex.assert_trees_all_close(g_params["kernel"], x_q.T @ e_q, rtol=1e-6, atol=1e-6)
    chex.assert_trees_all_close(g_x, e_q @ w_q.T, rtol=1e-6, atol=1e-6)
    # The bias is added after the quantized product: its gradient is the fp32 error.
    chex.assert_trees_all_close(g_params["bias"], c.sum(0), rtol=1e-6)
    # The error lies on the affine grid of its own range: (e_q - min c) / s are
    # integers in [0, 2^g - 1], s = (max c - min c) / (2^g - 1).
    lo, s = float(c.min()), (float(c.max()) - float(c.min())) / (2 ** grad_bits - 1)
    codes = (np.asarray(e_q) - lo) / s
    np.testing.assert_allclose(codes, np.round(codes), atol=1e-4)
    assert codes.min() > -1e-4 and codes.max() < 2 ** grad_bits - 1 + 1e-4


def test_error_keys_are_fold_in_of_rng_in_op_order():
    model = quantize_model(TwoHeads())
    variables = make_variables(model, X_VEC)
    rng = jax.random.key(5)
    c1, c2 = normal(4, 4, seed=8), normal(4, 4, seed=9)

    def loss(params):
        with precision(6, grad_bits=3, rng=rng):
            a, b = model.apply({"params": params}, X_VEC)
        return jnp.sum(c1 * a) + jnp.sum(c2 * b)

    @jax.jit
    def run(params):
        errors = [quantize(c, 3, AffineInt(), rounding="stochastic",
                           key=jax.random.fold_in(rng, i)) for i, c in enumerate((c1, c2))]
        return jax.grad(loss)(params), quantize(X_VEC, 6, AffineInt()), errors

    g, x_q, (e1, e2) = run(variables["params"])
    chex.assert_trees_all_close(g["fc"]["kernel"], x_q.T @ e1, rtol=1e-6, atol=1e-6)
    chex.assert_trees_all_close(g["classifier"]["kernel"], x_q.T @ e2, rtol=1e-6, atol=1e-6)
    # Swapping the keys would not match: the order matters.
    assert not np.allclose(np.asarray(g["fc"]["kernel"]), np.asarray(x_q.T @ quantize(
        c1, 3, AffineInt(), rounding="stochastic", key=jax.random.fold_in(rng, 1))))


def test_without_grad_bits_errors_stay_fp32():
    model = quantize_model(nn.Dense(5))
    variables = make_variables(model, X_VEC)
    c = normal(4, 5, seed=7)

    def loss(params):
        with precision(4):
            return jnp.sum(c * model.apply({"params": params}, X_VEC))

    g = jax.grad(loss)(variables["params"])
    chex.assert_trees_all_close(g["kernel"], quantize(X_VEC, 4, AffineInt()).T @ c,
                                rtol=1e-6, atol=1e-6)


def test_stochastic_rounding_without_rng_raises():
    model = quantize_model(nn.Dense(5))
    variables = make_variables(model, X_VEC)
    with pytest.raises(ValueError, match="rng"):
        with precision(4, grad_bits=8):
            model.apply(variables, X_VEC)
    stochastic_weights = QuantConfig(weight=TensorQuant(AffineInt(-1), "stochastic"))
    with pytest.raises(ValueError, match="rng"):
        with precision(4):
            quantize_model(nn.Dense(5), config=stochastic_weights).apply(variables, X_VEC)


def test_precision_validation():
    with pytest.raises(ValueError, match="bits"):
        with precision(0):
            pass
    with pytest.raises(ValueError, match="grad_bits"):
        with precision(4, grad_bits=0):
            pass
    assert context.current_precision() is None


# --------------------------------------------------------------------------- one compile

def test_cyclic_training_compiles_once():
    model = quantize_model(Net(), rules=CPT_RULES)
    variables = make_variables(model, X_IMG)
    params, batch_stats = variables["params"], variables["batch_stats"]
    labels = jnp.array([0, 2])
    tx = optax.sgd(0.05, momentum=0.9)
    opt_state = tx.init(params)
    total = 24
    schedule = cpt_jax.cyclic("cos_growth", min_bits=3, max_bits=8, num_cycles=2,
                              total_steps=total)  # P = 12: 3 .. 8, then back to 3
    traces = []

    @jax.jit
    def train_step(params, batch_stats, opt_state, step, rng):
        traces.append(1)
        bits = schedule(step)

        def loss_fn(p):
            with precision(bits, grad_bits=8, rng=jax.random.fold_in(rng, step)):
                logits, new_state = model.apply(
                    {"params": p, "batch_stats": batch_stats}, X_IMG, train=True,
                    mutable=["batch_stats"])
            loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
            return loss, new_state["batch_stats"]

        (loss, new_stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), new_stats, opt_state, loss, bits

    rng = jax.random.key(1)
    seen, losses = [], []
    for step in range(total + 1):
        params, batch_stats, opt_state, loss, bits = train_step(
            params, batch_stats, opt_state, jnp.int32(step), rng)
        seen.append(int(bits))
        losses.append(float(loss))
    assert sorted(set(seen)) == [3, 4, 5, 6, 7, 8]
    assert seen[0] == 3 and seen[11] == 8 and seen[12] == 3 and seen[24] == 3
    assert np.all(np.isfinite(losses))
    assert len(traces) == 1
    assert train_step._cache_size() == 1

    # The width is data: the same compiled forward gives different outputs per width.
    @jax.jit
    def forward(variables, bits):
        with precision(bits):
            return model.apply(variables, X_IMG)

    outs = [forward({"params": params, "batch_stats": batch_stats}, jnp.float32(b))
            for b in (3, 8, 32)]
    assert forward._cache_size() == 1
    assert not np.allclose(np.asarray(outs[0]), np.asarray(outs[1]))
    chex.assert_trees_all_close(outs[2], jax.jit(Net().apply)(
        {"params": params, "batch_stats": batch_stats}, X_IMG), rtol=1e-6, atol=1e-6)


# --------------------------------------------------------------------------- int8

def test_int8_path_matches_symmetric_fake_quant():
    qmodel = quantize_model(nn.Dense(5), config=INT8_CONFIG)
    variables = make_variables(qmodel, X_VEC)
    p = variables["params"]

    @jax.jit
    def run(variables, x, bits):
        with precision(bits):
            return qmodel.apply(variables, x)

    for bits in range(2, 9):
        y = run(variables, X_VEC, jnp.float32(bits))
        want = lax.dot(quantize(X_VEC, bits, SymmetricInt()),
                       quantize(p["kernel"], bits, SymmetricInt(channel_axis=-1))) + p["bias"]
        chex.assert_trees_all_close(y, want, rtol=1e-5, atol=1e-5)
    assert run._cache_size() == 1
    # The forward product really is int8 x int8 -> int32.
    jaxpr = str(jax.make_jaxpr(lambda v: run(v, X_VEC, jnp.float32(4)))(variables))
    assert "i8[" in jaxpr and "preferred_element_type=int32" in jaxpr
    # Gradients flow (straight-through).
    g = jax.grad(lambda v: jnp.sum(run(v, X_VEC, jnp.float32(6))))(variables)
    assert np.all(np.isfinite(np.asarray(g["params"]["kernel"])))
    assert np.abs(np.asarray(g["params"]["kernel"])).sum() > 0


def test_int_compute_requires_integer_operands():
    with pytest.raises(ValueError, match="compute='int'"):
        QuantConfig(weight=TensorQuant(cpt_jax.formats.BlockFloat()), compute="int")
    assert isinstance(INT8_CONFIG.weight.fmt, SymmetricInt) and INT8_CONFIG.compute == "int"


def test_functools_partial_config_for_the_linen_idiom():
    sym = QuantConfig(weight=TensorQuant(SymmetricInt(channel_axis=-1)),
                      activation=TensorQuant(SymmetricInt()), error=None)
    layer = nn.Dense(5, dot_general_cls=functools.partial(QuantDotGeneral, config=sym))
    variables = make_variables(layer, X_VEC)
    p = variables["params"]
    with precision(3):
        y = layer.apply(variables, X_VEC)
    want = lax.dot(quantize(X_VEC, 3, SymmetricInt()),
                   quantize(p["kernel"], 3, SymmetricInt(channel_axis=-1))) + p["bias"]
    chex.assert_trees_all_equal(y, want)
