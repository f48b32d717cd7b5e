"""cpt_jax.runner.builders: the objects a config names, checked against hand-written references."""
from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
import pytest

from cpt_jax.quant_config import CPT_CONFIG
from cpt_jax.runner import builders
from experiments.configs import default


def test_step_learning_rate_divides_by_ten_at_half_and_three_quarters():
    o = default.get_optimizer_config(learning_rate=0.2, lr_schedule="step")
    lr = builders.learning_rate_from_config(o, 100)
    expected = [0.2 if t < 50 else 0.02 if t < 75 else 0.002 for t in range(100)]
    np.testing.assert_allclose([float(lr(t)) for t in range(100)], expected, rtol=1e-6)


def test_cosine_with_warmup_follows_the_formula():
    o = default.get_optimizer_config(learning_rate=1.0, lr_schedule="cosine", warmup_steps=10)
    lr = builders.learning_rate_from_config(o, 110)
    for t in (0, 5, 10, 60, 109):
        ref = t / 10 if t < 10 else 0.5 * (1 + math.cos(math.pi * (t - 10) / 100))
        assert float(lr(t)) == pytest.approx(ref, abs=1e-6)


def test_sgd_matches_pytorch_semantics_by_hand():
    """PyTorch SGD: d = g + wd w; m = mu m + d; w -= lr m (momentum on the decayed grad)."""
    o = default.get_optimizer_config(learning_rate=0.1, momentum=0.9, weight_decay=0.01,
                                     lr_schedule="constant")
    tx = builders.optimizer_from_config(o, 10)
    w = {"w": jnp.array([1.0, -2.0])}
    g = {"w": jnp.array([0.5, 0.25])}
    state = tx.init(w)
    w_ref, m_ref = np.array([1.0, -2.0]), np.zeros(2)
    for _ in range(3):
        updates, state = tx.update(g, state, w)
        w = {"w": w["w"] + updates["w"]}
        d = np.array([0.5, 0.25]) + 0.01 * w_ref
        m_ref = 0.9 * m_ref + d
        w_ref = w_ref - 0.1 * m_ref
    np.testing.assert_allclose(np.asarray(w["w"]), w_ref, rtol=1e-6)


def test_grad_clip_bounds_the_global_norm():
    o = default.get_optimizer_config(name="sgd", learning_rate=1.0, momentum=0.0,
                                     weight_decay=0.0, lr_schedule="constant", grad_clip=1.0)
    tx = builders.optimizer_from_config(o, 10)
    g = {"a": jnp.array([3.0, 4.0])}                   # norm 5 -> clipped to 1
    updates, _ = tx.update(g, tx.init(g), g)
    np.testing.assert_allclose(np.asarray(updates["a"]), [-0.6, -0.8], rtol=1e-6)


def test_schedules_from_config():
    p = default.get_precision_config(schedule="constant", max_bits=6)
    assert float(builders.precision_schedule_from_config(p, 100)(37)) == 6.0
    p = default.get_precision_config(schedule="critical_period", min_bits=2, max_bits=8,
                                     deficit_steps=10)
    s = builders.precision_schedule_from_config(p, 100)
    assert [float(s(t)) for t in (0, 9, 10, 99)] == [2.0, 2.0, 8.0, 8.0]
    assert builders.precision_schedule_from_config(
        default.get_precision_config(schedule="none"), 100) is None
    assert builders.grad_schedule_from_config(default.get_precision_config(grad_bits=32)) is None
    assert float(builders.grad_schedule_from_config(
        default.get_precision_config(grad_bits=6))(5)) == 6.0


def test_rules_and_eval_bits():
    p = default.get_precision_config(keep_full_precision=("head",),
                                     bit_offsets=(("conv1", 2), ("conv2", -1)))
    rules = builders.rules_from_config(p)
    assert [r[0] for r in rules] == ["head", "conv1", "conv2"]
    assert rules[0][1] is None
    assert rules[1][1] == CPT_CONFIG.replace(bits_offset=2.0)
    assert rules[2][1].bits_offset == -1.0
    assert builders.eval_bits_from_config(default.get_precision_config(eval_bits=5)) == 5.0
    assert builders.eval_bits_from_config(default.get_precision_config(max_bits=7)) == 7.0
    assert builders.eval_bits_from_config(default.get_precision_config(schedule="none")) == 32.0


@pytest.mark.parametrize("field,value,build,message", [
    ("schedule", "cos_grow", lambda p: builders.precision_schedule_from_config(p, 10),
     "config.precision.schedule='cos_grow' is unknown"),
    ("quantizer", "fp4", builders.quant_config_from_config,
     "config.precision.quantizer='fp4' is unknown"),
])
def test_unknown_names_are_one_line_errors(field, value, build, message):
    with pytest.raises(ValueError, match=message) as info:
        build(default.get_precision_config(**{field: value}))
    assert "\n" not in str(info.value)


def test_run_costs_count_block_scale_bits_of_the_quantizer_preset():
    """MXFP8 stores 8 + 8/32 bits per element: every product costs (8.25 / 8)^2 of int8's."""
    import flax.linen as nn
    import jax
    import jax.numpy as jnp

    import cpt_jax
    from cpt_jax.runner import job as runner

    model = cpt_jax.quantize_model(nn.Dense(64))
    x = jnp.ones((4, 64))
    ops = cpt_jax.count_ops(model, model.init(jax.random.key(0), x), x)
    fwd, grad = cpt_jax.constant(8), cpt_jax.constant(8)
    plain = runner.run_costs(ops, fwd, grad, 10).totals
    mx = runner.run_costs(ops, fwd, grad, 10,
                          quant_config=builders.quant_config_from_config(
                              default.get_precision_config(quantizer="mxfp8"))).totals
    assert plain["relative_cost_static8"] == pytest.approx(1.0)
    assert mx["relative_cost_static8"] == pytest.approx((8.25 / 8) ** 2, rel=1e-6)
    cpt = runner.run_costs(ops, fwd, grad, 10, quant_config=cpt_jax.CPT_CONFIG).totals
    assert cpt["relative_cost_static8"] == pytest.approx(1.0)
