"""Per-layer bit allocation: factors computed by hand, policies, equal-cost solve."""
from __future__ import annotations

import dataclasses
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cpt_jax import allocation as P
from cpt_jax import cost as cost_lib
from cpt_jax import schedules as sched_lib
from cpt_jax.doors import quantize_model


class TwoLayerMLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(5, name="fc1")(x))
        return nn.Dense(2, name="fc2")(x)


class ConvNet(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Conv(4, (3, 3), padding="SAME", name="conv")(x))
        x = nn.Conv(6, (3, 3), strides=(2, 2), padding="VALID", name="conv_s2")(x)
        return nn.Dense(3, name="head")(x.reshape((x.shape[0], -1)))


class DeepMLP(nn.Module):
    widths: tuple = (64, 32, 128, 16, 96, 48, 24, 80)

    @nn.compact
    def __call__(self, x):
        for i, w in enumerate(self.widths):
            x = nn.relu(nn.Dense(w, name=f"d{i}")(x))
        return nn.Dense(10, name="out")(x)


def _ops(model, x, rules=None):
    qmodel = quantize_model(model, rules=rules)
    variables = jax.eval_shape(lambda k: qmodel.init(k, x), jax.random.key(0))
    return cost_lib.count_ops(qmodel, variables, x)


def test_factors_two_layer_mlp_by_hand():
    # x (4, 3) -> Dense 3->5 -> Dense 5->2.
    f1, f2 = P.layer_factors(_ops(TwoLayerMLP(), jnp.ones((4, 3))))
    assert (f1.name, f2.name) == ("fc1", "fc2")
    assert (f1.accumulation, f2.accumulation) == (3, 5)
    assert (f1.macs, f2.macs) == (4 * 3 * 5, 4 * 5 * 2)
    # each weight element is used once per batch row
    assert f1.weight_reuse == pytest.approx(4.0) and f2.weight_reuse == pytest.approx(4.0)
    # each input element is used once per output feature
    assert f1.activation_reuse == pytest.approx(5.0)
    assert f2.activation_reuse == pytest.approx(2.0)
    assert f1.reuse == pytest.approx(2 * 60 / (15 + 12))
    assert f2.reuse == pytest.approx(2 * 40 / (10 + 20))
    assert (f1.depth, f2.depth) == (0.0, 1.0)
    assert (f1.index, f2.index) == (0, 1)


def test_factors_conv_by_hand():
    # x (2, 6, 6, 3) -> conv 3x3 SAME, 4 ch -> conv 3x3 stride 2 VALID, 6 ch (out 2x2)
    # -> Dense 24 -> 3.
    f = P.layer_factors(_ops(ConvNet(), jnp.ones((2, 6, 6, 3))))
    assert [x.name for x in f] == ["conv", "conv_s2", "head"]
    c1, c2, head = f
    assert c1.accumulation == 3 * 3 * 3
    assert c1.macs == 2 * 6 * 6 * 4 * 27
    assert c1.weight_reuse == pytest.approx(2 * 6 * 6)          # batch x output positions
    assert c1.activation_reuse == pytest.approx(9 * 4)          # kh kw C_out (SAME, stride 1)
    assert c2.accumulation == 3 * 3 * 4
    assert c2.macs == 2 * 2 * 2 * 6 * 36
    assert c2.weight_reuse == pytest.approx(2 * 2 * 2)
    assert c2.activation_reuse == pytest.approx(c2.macs / (2 * 6 * 6 * 4))
    assert head.accumulation == 24 and head.weight_reuse == pytest.approx(2.0)
    assert [x.depth for x in f] == [0.0, 0.5, 1.0]


def test_full_precision_ops_get_no_factor():
    f = P.layer_factors(_ops(TwoLayerMLP(), jnp.ones((4, 3)), rules=[("fc2", None)]))
    assert [x.name for x in f] == ["fc1"]
    assert f[0].depth == 0.0


def test_policy_scores_follow_the_factor():
    f = P.layer_factors(_ops(ConvNet(), jnp.ones((2, 6, 6, 3))))
    k = np.array([x.accumulation for x in f])  # 27, 36, 24
    pos = P.policy_scores(f, "pos_accumulation")
    assert np.argsort(pos).tolist() == np.argsort(k).tolist()
    np.testing.assert_allclose(P.policy_scores(f, "neg_accumulation"), -pos)
    assert pos.min() == -0.5 and pos.max() == 0.5
    np.testing.assert_allclose(P.policy_scores(f, "uniform"), 0.0)
    depth = P.policy_scores(f, "pos_depth")
    np.testing.assert_allclose(depth, [-0.5, 0.0, 0.5])
    r1, r2 = P.policy_scores(f, "random", seed=3), P.policy_scores(f, "random", seed=3)
    np.testing.assert_allclose(r1, r2)
    assert sorted(r1.tolist()) == [-0.5, 0.0, 0.5]


def test_tied_factors_get_equal_scores_and_bits():
    # Both Dense layers see the same batch: equal weight reuse.
    ops = _ops(TwoLayerMLP(), jnp.ones((4, 3)))
    f = P.layer_factors(ops)
    np.testing.assert_allclose(P.policy_scores(f, "pos_weight_reuse"), 0.0)
    alloc = P.allocate(ops, "pos_weight_reuse", bits=4, grad_bits=8, spread=2)
    assert [o for _, o in alloc.offsets] == [0, 0]


def test_recommended_gives_fewer_bits_to_long_accumulation_and_low_reuse():
    f = [P.LayerFactors("a", 0, 0.0, 10, 1.0, 1.0, 100.0, 1, 1, 1),
         P.LayerFactors("b", 1, 0.5, 1000, 1.0, 1.0, 1.0, 1, 1, 1),
         P.LayerFactors("c", 2, 1.0, 100, 1.0, 1.0, 10.0, 1, 1, 1)]
    s = P.policy_scores(f, "recommended")
    assert s[0] > s[2] > s[1]


def test_allocation_cost_equals_cost_module_over_a_schedule():
    ops = _ops(ConvNet(), jnp.ones((2, 6, 6, 3)), rules=[("head", None)])
    schedule = sched_lib.cyclic("exp_decay_horizontal", min_bits=3, max_bits=8, num_cycles=3,
                                total_steps=90)
    offsets = {"conv": 2, "conv_s2": -1}
    shifted = [dataclasses.replace(op, bits_offset=float(offsets.get(op.name, 0))) for op in ops]
    expected = cost_lib.run_cost(schedule, sched_lib.constant(6), 90, shifted)["relative_cost_fp32"]
    values = sched_lib.schedule_values(schedule, 90)
    got = P.allocation_cost(ops, offsets, values, 6)
    assert got == pytest.approx(expected, rel=1e-6)
    # by hand for one static width: conv at 6, conv_s2 at 3, head fp32, errors at 6 bits
    m = {op.name: op.macs for op in ops}
    by_hand = (m["conv"] * (36 + 2 * 6 * 6) + m["conv_s2"] * (9 + 2 * 3 * 6)
               + m["head"] * 3 * 32 * 32) / (3 * 32 * 32 * sum(m.values()))
    assert P.allocation_cost(ops, offsets, 4, 6) == pytest.approx(by_hand, rel=1e-12)


@pytest.mark.parametrize("bits", ["static", "cyclic"])
def test_every_policy_meets_the_equal_cost_constraint(bits):
    ops = _ops(DeepMLP(), jnp.ones((8, 20)))
    if bits == "static":
        values, lo = 4.0, 2
    else:
        values = sched_lib.schedule_values(sched_lib.cyclic(
            "cos_growth", min_bits=4, max_bits=8, num_cycles=2, total_steps=40), 40)
        lo = 2
    factors = P.layer_factors(ops)
    for policy in P.POLICIES:
        alloc = P.allocate(ops, policy, bits=values, grad_bits=8, spread=2.0, min_bits=lo, seed=1)
        assert abs(alloc.cost_error) <= 0.02, (policy, alloc)
        assert alloc.target_cost == pytest.approx(P.allocation_cost(ops, {}, values, 8))
        assert alloc.relative_cost_fp32 == pytest.approx(
            P.allocation_cost(ops, alloc.offset_dict(), values, 8))
        o = np.array([v for _, v in alloc.offsets])
        assert np.min(values) + o.min() >= lo
        s = np.array(alloc.scores)
        # a higher score never gets fewer bits
        for i in range(len(o)):
            for j in range(len(o)):
                if s[i] < s[j]:
                    assert o[i] <= o[j], (policy, o, s)
        if policy != "uniform" and np.ptp(s) > 0:
            assert np.ptp(o) >= 1, (policy, o)
        # each layer within one bit of the continuous allocation spread * s + c
        assert np.ptp(o - 2.0 * s) <= 2.0 + 1e-9
    assert len(factors) == 9


def test_allocation_rules_and_bit_offsets_reach_the_ops():
    ops = _ops(DeepMLP(widths=(8, 16, 8)), jnp.ones((4, 6)))
    alloc = P.allocate(ops, "neg_activation_reuse", bits=4, grad_bits=8, spread=2)
    rules = alloc.rules()
    assert all(re.fullmatch(r"\^.*\$", pattern) for pattern, _ in rules)
    # exact match: "d1" must not match "d1x" or "a/d1"
    assert re.search(alloc.bit_offsets()[1][0], "d1") and not re.search(
        alloc.bit_offsets()[1][0], "d1x")
    new_ops = _ops(DeepMLP(widths=(8, 16, 8)), jnp.ones((4, 6)), rules=rules)
    got = {op.name: op.bits_offset for op in new_ops}
    assert got == {name: float(o) for name, o in alloc.offsets}


def test_bad_arguments_raise_clear_errors():
    ops = _ops(TwoLayerMLP(), jnp.ones((4, 3)))
    with pytest.raises(ValueError, match="policy"):
        P.allocate(ops, "by_magic", bits=4)
    with pytest.raises(ValueError, match="spread"):
        P.allocate(ops, "pos_depth", bits=4, spread=-1)
    with pytest.raises(ValueError, match="min_bits"):
        P.allocate(ops, "pos_depth", bits=4, min_bits=6, max_bits=5)
    with pytest.raises(ValueError, match="no room"):
        P.allocate(ops, "pos_depth", bits=1, min_bits=2)
    with pytest.raises(ValueError, match="factor"):
        P.layer_factors(ops)[0].factor("width")
    with pytest.raises(ValueError, match="quantized"):
        P.allocate(_ops(TwoLayerMLP(), jnp.ones((4, 3)), rules=[(".", None)]), "uniform", bits=4)


def test_allocate_counts_per_op_backward_offsets():
    ops = _ops(DeepMLP(widths=(8, 16, 8)), jnp.ones((4, 6)))
    ops = [dataclasses.replace(op, grad_bits_offset=float(i % 2)) for i, op in enumerate(ops)]
    alloc = P.allocate(ops, "pos_accumulation", bits=4, grad_bits=6, spread=2)
    assert alloc.relative_cost_fp32 == pytest.approx(
        P.allocation_cost(ops, alloc.offset_dict(), 4, 6), rel=1e-12)
    assert alloc.target_cost == pytest.approx(P.allocation_cost(ops, {}, 4, 6), rel=1e-12)
    shifted = [dataclasses.replace(op, bits_offset=float(alloc.offset_dict()[op.name]))
               for op in ops]
    expected = cost_lib.run_cost(sched_lib.constant(4), sched_lib.constant(6), 3,
                                 shifted)["relative_cost_fp32"]
    assert alloc.relative_cost_fp32 == pytest.approx(expected, rel=1e-6)
