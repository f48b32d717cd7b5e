"""The jitted train steps: learning, the schedule on device, one compile, non-finite policy."""
from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import cpt_jax
from cpt_jax import data as image_data
from cpt_jax.models import MLP
from cpt_jax.training import (
    create_train_state,
    make_train_step,
    make_train_step_with_bits,
    nonfinite_layers,
)

STEPS = 24
SCHEDULE = cpt_jax.cyclic("cos_growth", min_bits=3, max_bits=8, num_cycles=3,
                          total_steps=STEPS)


@functools.cache
def _digits():
    return image_data.to_device(image_data.load_image_dataset("digits"))


def _batch(step):
    x, y = image_data.batch_at_step(_digits(), jnp.int32(step), jax.random.key(0),
                                    batch_size=64, augment=False)
    return {"inputs": x, "labels": y}


def _setup():
    model = cpt_jax.quantize_model(MLP(hidden=(32,), num_classes=10), rules=cpt_jax.CPT_RULES)
    tx = optax.sgd(0.1, momentum=0.9)
    init = jax.jit(lambda key: create_train_state(model, tx, key, jnp.zeros((1, 8, 8, 1))))
    return model, tx, init(jax.random.key(0))


@functools.cache
def _scheduled_run():
    """STEPS steps of a cyclic run: (step fn, states' params, per-step metrics)."""
    model, tx, state = _setup()
    step_fn = make_train_step(model, tx, SCHEDULE, cpt_jax.constant(8), donate=False)
    metrics = []
    for t in range(STEPS):
        state, m = step_fn(state, _batch(t))
        metrics.append(jax.device_get(m))
    return step_fn, state, metrics


def test_loss_decreases_on_digits():
    _, state, metrics = _scheduled_run()
    losses = [float(m["loss"]) for m in metrics]
    assert np.mean(losses[-4:]) < 0.6 * np.mean(losses[:4])
    assert int(state.step) == STEPS and int(state.skipped_steps) == 0


def test_schedule_is_evaluated_on_device_every_step():
    _, _, metrics = _scheduled_run()
    bits = [float(m["bits"]) for m in metrics]
    assert bits == [float(SCHEDULE(t)) for t in range(STEPS)]
    assert len(set(bits)) >= 4  # it really cycles: 3 ... 8, three times
    assert all(float(m["grad_bits"]) == 8.0 for m in metrics)


def test_one_compile_over_a_cyclic_run():
    step_fn, _, _ = _scheduled_run()
    assert step_fn.num_compiles == 1


def test_make_train_step_with_bits_matches_the_scheduled_step():
    model, tx, state = _setup()
    step_fn = make_train_step_with_bits(model, tx, donate=False)
    for t in range(STEPS):
        state, m = step_fn(state, _batch(t), jnp.float32(SCHEDULE(t)), jnp.float32(8))
        assert float(m["bits"]) == float(SCHEDULE(t))
    assert step_fn.num_compiles == 1
    # Same bits, same batches: the same training (up to XLA fusing the two programs
    # differently: float rounding only).
    _, scheduled_state, _ = _scheduled_run()
    for a, b in zip(jax.tree_util.tree_leaves(state.params),
                    jax.tree_util.tree_leaves(scheduled_state.params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-3, atol=1e-4)


# --------------------------------------------------------------------------- non-finite

class SqrtAtZero(nn.Module):
    """Finite loss, but d sqrt(s)/ds = inf at s = 0: only `offset/s` has a bad gradient."""

    @nn.compact
    def __call__(self, x, train: bool = False):
        y = nn.Dense(3, name="dense")(x.reshape((x.shape[0], -1)))
        s = self.param("s", nn.initializers.zeros, ())
        return nn.Dense(3, name="offset")(y) + jnp.sqrt(s)


def _nonfinite_step(policy):
    model, tx = SqrtAtZero(), optax.sgd(0.1)
    state = jax.jit(lambda key: create_train_state(model, tx, key, jnp.zeros((2, 4))))(
        jax.random.key(0))
    step = make_train_step(model, tx, nonfinite=policy, donate=False)
    batch = {"inputs": jnp.ones((2, 4)), "labels": jnp.array([0, 1])}
    new_state, metrics = step(state, batch)
    return state, new_state, jax.device_get(metrics)


@pytest.mark.parametrize("policy", ["skip", "stop"])
def test_skip_and_stop_leave_the_state_and_count_the_step(policy):
    state, new_state, metrics = _nonfinite_step(policy)
    assert np.isfinite(metrics["loss"]) and not metrics["finite"]
    assert int(new_state.step) == 1 and int(new_state.skipped_steps) == 1
    for a, b in zip(jax.tree_util.tree_leaves(state.params),
                    jax.tree_util.tree_leaves(new_state.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    if policy == "stop":
        assert nonfinite_layers(new_state.params, metrics["grads_finite"]) == ["s"]
    else:
        assert "grads_finite" not in metrics


def test_ignore_applies_the_non_finite_update():
    _, new_state, metrics = _nonfinite_step("ignore")
    assert not metrics["finite"] and int(new_state.skipped_steps) == 1
    assert not np.isfinite(float(new_state.params["s"]))


def test_unknown_policy_is_rejected():
    with pytest.raises(ValueError, match="nonfinite must be one of"):
        make_train_step(SqrtAtZero(), optax.sgd(0.1), nonfinite="panic")
