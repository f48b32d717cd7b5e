"""Running activation ranges (CPT's QuantMeasure) against independent references.

References: the moving average of a layer's input range is computed here in float64
numpy from the input batches themselves (the first layer's input does not depend on
the parameters); the evaluation grid is CPT's affine formula written out in numpy.
"""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import cpt_jax
from cpt_jax.formats import AffineInt, Float, SymmetricInt
from cpt_jax.providers import running_ranges as AR
from cpt_jax.quant_config import CPT_CONFIG, QuantConfig, TensorQuant
from cpt_jax.training import create_train_state, make_eval_step, make_train_step

RUNNING = CPT_CONFIG.replace(activation_range="running")


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = False):
        x = nn.relu(nn.Dense(16, name="hidden")(x))
        return nn.Dense(4, name="head")(x)


def _data(n=64, d=6, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, d)).astype(np.float32) * np.linspace(0.5, 3.0, d, dtype=np.float32)
    y = (x[:, 0] + x[:, 1] > 0).astype(np.int32) + 2 * (x[:, 2] > 0).astype(np.int32)
    return x, y


def _trained_state(config=RUNNING, steps=12, batch=16, seed=0):
    x, y = _data()
    qmodel = cpt_jax.quantize_model(MLP(), config=config)
    state = create_train_state(qmodel, optax.sgd(0.1), jax.random.key(seed), x[:2])
    step = make_train_step(qmodel, optax.sgd(0.1), cpt_jax.constant(4), cpt_jax.constant(8),
                           donate=False)
    batches = []
    for t in range(steps):
        idx = np.arange(t * batch, (t + 1) * batch) % len(x)
        batches.append(x[idx])
        state, _ = step(state, {"inputs": jnp.asarray(x[idx]), "labels": jnp.asarray(y[idx])})
    return qmodel, state, batches


def _ema_reference(batches, momentum=0.1):
    zero_point, width = 0.0, 0.0
    for b in batches:
        b = np.asarray(b, np.float64)
        zero_point = (1 - momentum) * zero_point + momentum * b.min()
        width = (1 - momentum) * width + momentum * (b.max() - b.min())
    return zero_point, width


def _affine_reference(x, lo, hi, bits):
    """CPT's UniformQuantize with given (zero_point, range), numpy float64."""
    levels = 2.0 ** bits - 1
    scale = max((hi - lo) / levels, 1e-8)
    return np.clip(np.round((np.asarray(x, np.float64) - lo) / scale), 0, levels) * scale + lo


# --------------------------------------------------------------------------- state

def test_init_creates_zero_ranges_only_for_running_configs():
    x, _ = _data()
    v = cpt_jax.quantize_model(MLP(), config=RUNNING).init(jax.random.key(0), x[:2])
    ranges = v[AR.COLLECTION]
    assert set(ranges) == {"hidden", "head"}
    for layer in ranges.values():
        assert float(layer["lhs"].zero_point) == 0.0 and float(layer["lhs"].range) == 0.0
        assert "rhs" not in layer   # the kernel is a weight: no running range
    plain = cpt_jax.quantize_model(MLP(), config=CPT_CONFIG).init(jax.random.key(0), x[:2])
    assert AR.COLLECTION not in plain


def test_train_step_updates_the_moving_average_of_the_input_range():
    _, state, batches = _trained_state()
    got = state.activation_ranges["hidden"]["lhs"]
    zero_point, width = _ema_reference(batches)
    assert float(got.zero_point) == pytest.approx(zero_point, rel=1e-5)
    assert float(got.range) == pytest.approx(width, rel=1e-5)
    # The hidden layer's input is the ReLU output: its running minimum stays >= 0.
    head = state.activation_ranges["head"]["lhs"]
    assert float(head.zero_point) >= 0.0 and float(head.range) > 0.0


def test_update_range_formula():
    r = AR.init_range()
    for lo, hi in [(-1.0, 3.0), (0.5, 2.0), (-4.0, -1.0)]:
        old_zp, old_range = float(r.zero_point), float(r.range)
        r = AR.update_range(r, lo, hi, momentum=0.25)
        assert float(r.zero_point) == pytest.approx(0.75 * old_zp + 0.25 * lo, rel=1e-6)
        assert float(r.range) == pytest.approx(0.75 * old_range + 0.25 * (hi - lo), rel=1e-6)
    lo, hi = AR.observed_range(jnp.array([1.0, jnp.nan, -2.0, jnp.inf]))
    assert (float(lo), float(hi)) == (-2.0, 1.0)


# --------------------------------------------------------------------------- evaluation

@pytest.mark.slow
def test_evaluation_quantizes_on_the_running_grid():
    qmodel, state, _ = _trained_state()
    x, _ = _data(seed=1)
    lo_h, hi_h = (float(v) for v in state.activation_ranges["hidden"]["lhs"].bounds)
    lo_o, hi_o = (float(v) for v in state.activation_ranges["head"]["lhs"].bounds)
    p = jax.device_get(state.params)
    wq = lambda w: np.asarray(cpt_jax.quantize(jnp.asarray(w), 4, AffineInt(channel_axis=-1)),
                              np.float64)
    h = _affine_reference(x, lo_h, hi_h, 4) @ wq(p["hidden"]["kernel"]) + p["hidden"]["bias"]
    h = np.maximum(h, 0.0)
    want = _affine_reference(h, lo_o, hi_o, 4) @ wq(p["head"]["kernel"]) + p["head"]["bias"]
    with cpt_jax.precision(4):
        got = qmodel.apply(state.variables(), jnp.asarray(x))
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-4)


def _eval_logits(qmodel, state, x, batch_size, bits=4):
    outs = []
    for i in range(0, len(x), batch_size):
        with cpt_jax.precision(bits):
            outs.append(np.asarray(qmodel.apply(state.variables(), jnp.asarray(x[i:i + batch_size]))))
    return np.concatenate(outs)


@pytest.mark.slow
def test_running_ranges_make_evaluation_independent_of_the_batch_size():
    qmodel, state, _ = _trained_state()
    x, _ = _data(n=60, seed=2)
    full = _eval_logits(qmodel, state, x, 60)
    for size in (1, 7, 20):
        # Equal up to the float rounding of differently shaped matmuls (1e-7 here;
        # batch ranges move the logits by > 1e-3, next test).
        np.testing.assert_allclose(_eval_logits(qmodel, state, x, size), full, atol=2e-6)


@pytest.mark.slow
def test_batch_ranges_depend_on_the_batch_size_and_differ_from_running():
    qmodel, state, _ = _trained_state()
    x, _ = _data(n=60, seed=2)
    batch_model = cpt_jax.quantize_model(MLP(), config=CPT_CONFIG)
    batch_state = state.replace(activation_ranges={})
    by_batch = {s: _eval_logits(batch_model, batch_state, x, s) for s in (1, 60)}
    assert np.abs(by_batch[1] - by_batch[60]).max() > 1e-3
    running = _eval_logits(qmodel, state, x, 60)
    assert np.abs(running - by_batch[60]).max() > 1e-3


def test_training_forward_is_the_batch_range_forward():
    # In training the operand is quantized with its own range, exactly as "batch".
    x, _ = _data()
    running = cpt_jax.quantize_model(MLP(), config=RUNNING)
    batch = cpt_jax.quantize_model(MLP(), config=CPT_CONFIG)
    v = running.init(jax.random.key(0), x[:2])
    with cpt_jax.precision(3):
        y_run, _ = running.apply(v, jnp.asarray(x), mutable=[AR.COLLECTION])
        y_batch = batch.apply({"params": v["params"]}, jnp.asarray(x))
    np.testing.assert_array_equal(np.asarray(y_run), np.asarray(y_batch))


@pytest.mark.slow
def test_eval_step_uses_running_ranges_and_full_precision_ignores_them():
    qmodel, state, _ = _trained_state()
    x, y = _data(n=40, seed=3)
    eval_step = make_eval_step(qmodel)
    batch = {"inputs": jnp.asarray(x), "labels": jnp.asarray(y)}
    halves = [eval_step(state, {k: v[i:i + 20] for k, v in batch.items()}, jnp.float32(4))
              for i in (0, 20)]
    whole = eval_step(state, batch, jnp.float32(4))
    assert float(halves[0]["loss_sum"] + halves[1]["loss_sum"]) == pytest.approx(
        float(whole["loss_sum"]), rel=1e-5)
    fp32 = eval_step(state, batch, jnp.float32(32))
    plain = make_eval_step(cpt_jax.quantize_model(MLP(), config=CPT_CONFIG))(
        state.replace(activation_ranges={}), batch, jnp.float32(32))
    assert float(fp32["loss_sum"]) == pytest.approx(float(plain["loss_sum"]), rel=1e-6)


@pytest.mark.slow
def test_symmetric_running_ranges():
    cfg = QuantConfig(activation=TensorQuant(SymmetricInt()), activation_range="running")
    qmodel, state, _ = _trained_state(config=cfg)
    x, _ = _data(n=30, seed=4)
    np.testing.assert_allclose(_eval_logits(qmodel, state, x, 1), _eval_logits(qmodel, state, x, 30),
                               atol=2e-6)


# --------------------------------------------------------------------------- validation

@pytest.mark.parametrize("kwargs", [
    {"activation_range": "ema"},
    {"activation_range": "running", "activation": TensorQuant(AffineInt(channel_axis=-1))},
    {"activation_range": "running", "activation": TensorQuant(Float(4))},
    {"activation_range": "running", "activation": None},
    {"activation_range": "running", "weight": TensorQuant(SymmetricInt(channel_axis=-1)),
     "activation": TensorQuant(SymmetricInt()), "compute": "int"},
])
def test_quant_config_rejects_unsupported_running_ranges(kwargs):
    with pytest.raises(ValueError, match="activation_range"):
        QuantConfig(**kwargs)


def test_running_ranges_need_a_module():
    door = cpt_jax.doors.QuantDotGeneral(config=RUNNING, provider=AR.RUNNING_RANGES)
    with cpt_jax.precision(4), pytest.raises(ValueError, match="Linen or NNX"):
        door(jnp.ones((2, 3)), jnp.ones((3, 4)), (((1,), (0,)), ((), ())))


class NNXNet(nnx.Module):
    """A layer's product and a raw product of the root module."""

    def __init__(self, rngs):
        self.hidden = nnx.Linear(4, 6, rngs=rngs)
        self.w = nnx.Param(jax.random.normal(rngs.params(), (6, 3)))

    def __call__(self, x):
        return jnp.tanh(self.hidden(x)) @ self.w[...]


@pytest.mark.slow
def test_nnx_running_ranges_are_variables_updated_in_train_and_used_in_eval():
    model = cpt_jax.quantize_model(NNXNet(nnx.Rngs(0)), config=RUNNING)
    x = jnp.asarray(np.random.default_rng(0).normal(size=(8, 4)), jnp.float32)

    @nnx.jit
    def run(model, x, bits):
        with cpt_jax.precision(bits):
            return model(x)

    run(model, x, 8.0)
    ranges = nnx.state(model, nnx.variable_type_from_name(AR.COLLECTION))
    names = sorted("/".join(map(str, path)) for path, _ in nnx.to_flat_state(ranges))
    assert names == ["activation_ranges__matmul_0_lhs", "hidden/activation_ranges__lhs"]
    lo, hi = AR.observed_range(x)                      # 0.9 * 0 + 0.1 * (hi - lo)
    np.testing.assert_allclose(float(model.hidden.activation_ranges__lhs.get_value().range),
                               0.1 * float(hi - lo), rtol=1e-6)
    model.eval()
    first = run(model, x, 3.0)
    frozen = float(model.hidden.activation_ranges__lhs.get_value().range)
    single = run(model, x[:1], 3.0)                    # batch-size independent in eval
    np.testing.assert_allclose(np.asarray(single), np.asarray(first[:1]), rtol=1e-6)
    assert float(model.hidden.activation_ranges__lhs.get_value().range) == frozen


def test_running_ranges_survive_a_checkpoint(tmp_path):
    from cpt_jax.runner import checkpoint as ckpt_lib
    qmodel, state, _ = _trained_state(steps=3)
    manager = ckpt_lib.CheckpointManager(str(tmp_path), keep=1)
    manager.save(3, state, {})
    manager.close()
    x, _ = _data()
    fresh = create_train_state(qmodel, optax.sgd(0.1), jax.random.key(1), x[:2])
    restored = ckpt_lib.CheckpointManager(str(tmp_path), keep=1).restore_latest(fresh)
    want = state.activation_ranges["hidden"]["lhs"]
    got = restored.state.activation_ranges["hidden"]["lhs"]
    assert float(got.range) == float(want.range) > 0.0
    assert float(got.zero_point) == float(want.zero_point)
