"""Tests for cpt_jax.cost: exact MACs from traced shapes, BitOps, a run's relative cost.

Expected MACs come from the layer arithmetic (Dense: B*in*out; conv: output elements
times kh*kw*C_in/groups, output size from stride and padding), and the CPT cost from
the formula ``(b^2 + 2bg) / (3 * 32^2)`` with an independent numpy schedule.
"""
from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import cpt_jax
from cpt_jax import CPT_RULES, QuantConfig, count_ops, quantize_model

KEY = jax.random.key(0)


def ops_of(model, *inputs, **kwargs):
    """`count_ops` on abstract variables (nothing is initialized or computed)."""
    variables = jax.eval_shape(model.init, KEY, *inputs, **kwargs)
    return count_ops(model, variables, *inputs, **kwargs)


def spec(*shape):
    return jax.ShapeDtypeStruct(shape, jnp.float32)


# --------------------------------------------------------------------------- MACs

@pytest.mark.parametrize("batch,d_in,d_out", [(4, 6, 7), (1, 1, 1), (32, 128, 10)])
def test_dense_macs(batch, d_in, d_out):
    ops = ops_of(quantize_model(nn.Dense(d_out)), spec(batch, d_in))
    assert len(ops) == 1
    op = ops[0]
    assert op.kind == "dot_general"
    assert op.macs == batch * d_in * d_out
    assert op.reduction == d_in
    assert op.lhs_shape == (batch, d_in) and op.rhs_shape == (d_in, d_out)
    assert op.out_shape == (batch, d_out)
    assert op.quantized
    assert op.weight_reuse == batch and op.activation_reuse == d_out
    assert cpt_jax.cost.total_macs(ops) == batch * d_in * d_out


def test_dense_macs_with_extra_batch_dims():
    ops = ops_of(quantize_model(nn.Dense(5)), spec(2, 3, 4))
    assert ops[0].macs == 2 * 3 * 4 * 5 and ops[0].reduction == 4


def _out_size(size, k, stride, padding):
    if padding == "SAME":
        return math.ceil(size / stride)
    if padding == "VALID":
        return (size - k) // stride + 1
    lo, hi = padding
    return (size + lo + hi - k) // stride + 1


@pytest.mark.parametrize("kernel,strides,padding,groups", [
    ((3, 3), (1, 1), "SAME", 1),
    ((3, 3), (2, 2), "SAME", 1),
    ((3, 2), (2, 1), "VALID", 1),
    ((1, 1), (2, 2), "VALID", 1),        # a strided 1x1 shortcut
    ((3, 3), (1, 2), ((1, 0), (2, 1)), 2),
    ((3, 3), (1, 1), "SAME", 4),          # depthwise: C_in = groups = 4
])
def test_conv_macs(kernel, strides, padding, groups):
    batch, h, w, c_in, features = 2, 9, 8, 4, 8
    layer = nn.Conv(features, kernel, strides=strides, padding=padding,
                    feature_group_count=groups)
    ops = ops_of(quantize_model(layer), spec(batch, h, w, c_in))
    assert len(ops) == 1
    op = ops[0]
    pads = (padding, padding) if isinstance(padding, str) else padding
    h_out = _out_size(h, kernel[0], strides[0], pads[0])
    w_out = _out_size(w, kernel[1], strides[1], pads[1])
    assert op.kind == "conv"
    assert op.out_shape == (batch, h_out, w_out, features)
    k = kernel[0] * kernel[1] * c_in // groups
    assert op.reduction == k
    assert op.macs == batch * h_out * w_out * features * k
    assert op.rhs_shape == (*kernel, c_in // groups, features)


def test_einsum_macs():
    layer = nn.Einsum((4, 5, 6), "abc,cde->abde")
    ops = ops_of(quantize_model(layer), spec(2, 3, 4))
    assert len(ops) == 1 and ops[0].kind == "dot_general"   # an einsum is a dot_general
    assert ops[0].macs == 2 * 3 * 5 * 6 * 4 and ops[0].reduction == 4


class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Conv(4, (3, 3), name="conv")(x))
        x = nn.relu(nn.Conv(8, (3, 3), strides=2, name="conv2")(x))
        x = x.reshape((x.shape[0], -1))
        x = nn.relu(nn.Dense(16, name="fc")(x))
        return nn.Dense(10, name="classifier")(x)


def _net_ops(**kwargs):
    return ops_of(quantize_model(Net(), **kwargs), spec(2, 8, 8, 3))


def test_model_ops_names_and_full_precision_marking():
    ops = _net_ops(rules=CPT_RULES)
    by_name = {op.name.split("/")[-1]: op for op in ops}
    assert list(by_name) == ["conv", "conv2", "fc", "classifier"]
    assert [op.quantized for op in ops] == [True, True, True, False]
    want = {"conv": 2 * 8 * 8 * 4 * (9 * 3), "conv2": 2 * 4 * 4 * 8 * (9 * 4),
            "fc": 2 * 128 * 16, "classifier": 2 * 16 * 10}
    assert {k: op.macs for k, op in by_name.items()} == want


def test_bitops_per_step_counts_full_precision_ops_at_32_bits():
    ops = _net_ops(rules=CPT_RULES)
    b, g = 5.0, 8.0
    quantized = sum(op.macs for op in ops if op.quantized)
    full = sum(op.macs for op in ops if not op.quantized)
    want = quantized * (b * b + 2 * b * g) + full * (32 * 32 + 2 * 32 * 32)
    assert float(cpt_jax.bitops_per_step(ops, b, g)) == pytest.approx(want, rel=1e-6)
    assert cpt_jax.cost.fp32_bitops_per_step(ops) == (quantized + full) * 3 * 32 ** 2
    assert float(cpt_jax.cost.relative_cost_per_step(ops, b, g)) == pytest.approx(
        want / ((quantized + full) * 3 * 32 ** 2), rel=1e-6)
    # Without error quantization the backward products are at 32 bits.
    want_no_g = quantized * (b * b + 2 * b * 32) + full * 3 * 32 * 32
    assert float(cpt_jax.bitops_per_step(ops, b, None)) == pytest.approx(want_no_g, rel=1e-6)


def test_bitops_per_step_is_macs_times_b2_plus_2bg():
    ops = ops_of(quantize_model(nn.Dense(7)), spec(4, 6))
    for b, g in [(3, 8), (8, 8), (4, 6), (32, 32)]:
        assert float(cpt_jax.bitops_per_step(ops, b, g)) == 168 * (b * b + 2 * b * g)
    # Without ops: one MAC.
    assert float(cpt_jax.bitops_per_step(None, 3, 8)) == 9 + 48
    # Traceable: one compilation for every width.
    f = jax.jit(lambda b, g: cpt_jax.bitops_per_step(ops, b, g))
    for b in range(2, 9):
        assert float(f(jnp.float32(b), jnp.float32(8))) == 168 * (b * b + 16 * b)
    assert f._cache_size() == 1


def test_bits_offsets_enter_the_cost():
    ops = ops_of(quantize_model(nn.Dense(7), config=QuantConfig(bits_offset=2.0,
                                                                 grad_bits_offset=-1.0)),
                 spec(4, 6))
    assert ops[0].bits_offset == 2.0 and ops[0].grad_bits_offset == -1.0
    b, g = 4 + 2, 8 - 1
    assert float(cpt_jax.bitops_per_step(ops, 4, 8)) == 168 * (b * b + 2 * b * g)


# --------------------------------------------------------------------------- run cost

def _numpy_cpt(total, cycles, lo=3, hi=8):
    t = np.arange(total)
    period = total // cycles
    z = (t % period) / period
    return np.rint(lo + 0.5 * (hi - lo) * (1 - np.cos(np.pi * z)))


def test_run_cost_of_cpt_3_8_against_static_8():
    total, cycles = 64_000, 32
    schedule = cpt_jax.cyclic("cos_growth", min_bits=3, max_bits=8, num_cycles=cycles,
                              total_steps=total)
    result = cpt_jax.run_cost(schedule, cpt_jax.constant(8), total)
    b = _numpy_cpt(total, cycles)
    g = 8.0
    per_step = (b * b + 2 * b * g) / (3 * 32 ** 2)      # relative to fp32
    static8 = (8 * 8 + 2 * 8 * 8) / (3 * 32 ** 2)
    assert result["relative_cost_fp32"] == pytest.approx(per_step.mean(), rel=1e-6)
    assert result["relative_cost_static8"] == pytest.approx(per_step.mean() / static8, rel=1e-6)
    assert result["relative_cost_static8"] == pytest.approx(0.63, abs=0.01)  # CPT paper
    assert result["mean_bits"] == pytest.approx(b.mean(), abs=1e-9)
    assert result["mean_bits"] == pytest.approx(5.5, abs=0.01)
    assert result["mean_grad_bits"] == 8.0
    assert result["total_bitops"] == pytest.approx(float(np.sum(b * b + 2 * b * g)), rel=1e-6)


def test_run_cost_with_model_ops_and_full_precision_layers():
    ops = _net_ops(rules=CPT_RULES)
    total = 200
    schedule = cpt_jax.cyclic("linear_growth", min_bits=2, max_bits=6, num_cycles=4,
                              total_steps=total)
    result = cpt_jax.run_cost(schedule, cpt_jax.constant(8), total, ops=ops)
    b = cpt_jax.schedule_values(schedule, total).astype(np.float64)
    q = sum(op.macs for op in ops if op.quantized)
    f = sum(op.macs for op in ops if not op.quantized)
    step_cost = q * (b * b + 16 * b) + f * 3 * 32 ** 2
    assert result["total_bitops"] == pytest.approx(step_cost.sum(), rel=1e-6)
    assert result["relative_cost_fp32"] == pytest.approx(
        step_cost.sum() / ((q + f) * 3 * 32 ** 2 * total), rel=1e-6)
    static8 = q * 192 + f * 3 * 32 ** 2
    assert result["relative_cost_static8"] == pytest.approx(
        step_cost.sum() / (static8 * total), rel=1e-6)


def test_run_cost_without_error_quantization():
    result = cpt_jax.run_cost(cpt_jax.constant(8), None, 10)
    assert result["mean_grad_bits"] == 32.0
    assert result["relative_cost_fp32"] == pytest.approx((64 + 2 * 8 * 32) / 3072)


def test_trace_ops_counts_a_scanned_op_once_per_iteration():
    model = quantize_model(nn.Dense(3))
    variables = jax.eval_shape(model.init, KEY, spec(2, 4))

    def scanned(v, x):
        def body(carry, _):
            with cpt_jax.precision(4):
                return carry, model.apply(v, x)
        return jax.lax.scan(body, 0, None, length=5)[1]

    ops = cpt_jax.cost.trace_ops(scanned, variables, spec(2, 4))
    assert len(ops) == 1 and ops[0].calls == 5 and ops[0].macs == 5 * 2 * 4 * 3

    def nested(v, x):  # scan of a scan: trip counts multiply; a plain call counts once
        inner = lambda c, _: (c, model.apply(v, x))
        outer = lambda c, _: (c, jax.lax.scan(inner, 0, None, length=3)[1])
        return jax.lax.scan(outer, 0, None, length=2)[1], model.apply(v, x)

    ops = cpt_jax.cost.trace_ops(nested, variables, spec(2, 4))
    assert [op.calls for op in ops] == [6, 1]
    assert [op.macs for op in ops] == [6 * 24, 24]
