"""Schedules over formats (cpt_jax.format_schedule, cpt_jax.format_schedules,
cpt_jax.providers.format_switch; issue 25).

* Each step computes in the widest format whose element width <= the schedule's
  bits, through one compiled train step: a step of the switch equals a train step
  of a model quantized with that format alone (loss and updated parameters).
* The cost counts each step's format with its scale bits: against numbers written
  out here (NVFP4 4.5 / 16x16 weights 4 + 8/256, MXFP6 6.25, MXFP8 8.25).
* The main job's path: ``config.precision.formats`` -> builders -> the runner's cost.
"""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import cpt_jax
from cpt_jax import cost, training
from cpt_jax.format_schedules import (
    check_formats,
    format_schedule,
    format_steps,
    format_summary,
    format_switch,
)
from cpt_jax.formats import NVFP4
from cpt_jax.providers.format_switch import FORMAT_SWITCH
from cpt_jax.quant_config import PRESETS, FormatSwitch, TensorQuant, format_index
from cpt_jax.runner import builders
from cpt_jax.runner import job as runner
from experiments.configs import default

RNG = np.random.default_rng(0)
X = jnp.asarray(RNG.normal(size=(32, 48)), jnp.float32)
BATCH = {"inputs": X, "labels": jnp.arange(32) % 10}
# NVFP4's recipe with nearest errors: the comparison with a static run is exact (a
# switch's branches draw their rounding keys in another order than a lone format).
NVFP4_NEAREST = ("nvfp4_nearest", PRESETS["nvfp4_gemm"].replace(error=TensorQuant(NVFP4())))
FORMATS = (NVFP4_NEAREST, "mxfp6", "mxfp8_gemm")
T = 10
SCHEDULE = cpt_jax.cyclic("linear_growth", min_bits=4, max_bits=8, num_cycles=1, total_steps=T)
# linear_growth 4..8 over 10 steps: bits 4 4 5 5 6 6 6 7 7 8.
EXPECTED = ["nvfp4_nearest"] * 4 + ["mxfp6"] * 5 + ["mxfp8_gemm"]


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x, train=False):
        return nn.Dense(10, name="fc2")(nn.relu(nn.Dense(64, name="fc1")(x)))


def test_format_index_is_the_widest_format_not_above_the_bits():
    widths = (4.0, 6.0, 8.0)
    assert [int(format_index(widths, b)) for b in (1, 4, 5, 6, 7, 8, 12, 32)] == [
        0, 0, 0, 1, 1, 2, 2, 2]
    traced = jax.jit(lambda b: format_index(widths, b))
    assert [int(traced(jnp.float32(b))) for b in (5, 6, 8)] == [0, 1, 2]


@pytest.mark.slow
def test_a_step_of_the_switch_is_a_step_of_its_format_and_the_run_compiles_once():
    fs = format_schedule(FORMATS, SCHEDULE)
    assert [fs.config.names[int(fs.index(t))] for t in range(T)] == EXPECTED
    qmodel = cpt_jax.quantize_model(MLP(), config=fs.config)
    tx = optax.sgd(0.1)
    state = training.create_train_state(qmodel, tx, jax.random.key(0), X)
    step = training.make_train_step(qmodel, tx, fs, cpt_jax.constant(8), donate=False)
    statics = {}
    losses = []
    for t in range(T):
        at_t = state.replace(step=jnp.int32(t))
        new, metrics = step(at_t, BATCH)
        name = EXPECTED[t]
        if name not in statics:
            config = dict(zip(fs.config.names, fs.config.branches))[name]
            alone = cpt_jax.quantize_model(MLP(), config=config)
            statics[name] = training.make_train_step(alone, tx, SCHEDULE, cpt_jax.constant(8),
                                                     donate=False)
        ref, ref_metrics = statics[name](at_t, BATCH)
        assert float(metrics["loss"]) == float(ref_metrics["loss"])
        for a, b in zip(jax.tree.leaves(new.params), jax.tree.leaves(ref.params)):
            np.testing.assert_array_equal(a, b)
        losses.append(float(metrics["loss"]))
    assert step.num_compiles == 1
    assert len({losses[0], losses[5], losses[9]}) == 3          # three different formats


@pytest.mark.slow
def test_stochastic_formats_switch_too():
    fs = format_schedule(("nvfp4_gemm", "mxfp4_gemm", "mxfp6_gemm", "mxfp8_gemm")[::2], SCHEDULE)
    qmodel = cpt_jax.quantize_model(MLP(), config=fs.config)
    state = training.create_train_state(qmodel, optax.sgd(0.1), jax.random.key(0), X)
    step = training.make_train_step(qmodel, optax.sgd(0.1), fs, cpt_jax.constant(8))
    for _ in range(T):
        state, metrics = step(state, BATCH)
        assert np.isfinite(float(metrics["loss"]))
    assert step.num_compiles == 1


def test_the_cost_counts_each_steps_format_with_its_scale_bits():
    fs = format_schedule(("nvfp4_gemm", "mxfp6", "mxfp8_gemm"), SCHEDULE)
    qmodel = cpt_jax.quantize_model(nn.Dense(40), config=fs.config)
    variables = qmodel.init(jax.random.key(0), X)
    ops = cost.count_ops(qmodel, variables, X)
    macs = 32 * 48 * 40
    assert cost.total_macs(ops) == macs
    # (b_w, b_a, b_g) written out: NVFP4 16x16 weights 4 + 8/256, activations and
    # errors 4 + 8/16; MXFP6 6 + 8/32 (errors e3m2: 6.25); MXFP8 8 + 8/32 (errors e5m2).
    bits = {"nvfp4_gemm": (4 + 8 / 256, 4.5, 4.5), "mxfp6": (6.25,) * 3, "mxfp8_gemm": (8.25,) * 3}
    counts = {"nvfp4_gemm": 4, "mxfp6": 5, "mxfp8_gemm": 1}
    assert fs.format_steps(T) == counts
    expected = sum(n * macs * (bits[f][0] * bits[f][1] + bits[f][2] * (bits[f][0] + bits[f][1]))
                   for f, n in counts.items())
    result = fs.run_cost(cpt_jax.constant(8), T, ops)
    assert result["total_bitops"] == pytest.approx(expected, rel=1e-6)
    assert result["relative_cost_static8"] == pytest.approx(expected / (T * macs * 3 * 64),
                                                            rel=1e-6)


def test_main_job_config_builds_the_switch_and_counts_its_cost():
    config = default.get_config()
    config.precision.update(formats="nvfp4_gemm,mxfp6,mxfp8_gemm", schedule="linear_growth",
                            min_bits=4, max_bits=8, num_cycles=1)
    p = config.precision
    switch = builders.quant_config_from_config(p)
    assert isinstance(switch, FormatSwitch) and switch.names == ("nvfp4_gemm", "mxfp6", "mxfp8_gemm")
    from cpt_jax.quant_config import get_preset
    qmodel = cpt_jax.quantize_model(nn.Dense(40), config=switch)
    ops = cost.count_ops(qmodel, qmodel.init(jax.random.key(0), X), X)
    schedule = builders.precision_schedule_from_config(p, T)
    run_cost = runner.run_costs(ops, schedule, builders.grad_schedule_from_config(p), T,
                                quant_config=switch)
    # Step by step: the per-step cost is that step's format's own cost.
    for t in range(T):
        b = float(schedule(t))
        name = switch.names[int(format_index(switch.widths, b))]
        alone = float(cost.bitops_per_step(ops, b, 8.0, get_preset(name))) / \
            cost.fp32_bitops_per_step(ops)
        assert run_cost.per_step[t] == pytest.approx(alone, rel=1e-6)
    summary = format_summary(switch, schedule, T)
    assert summary == {"formats": list(switch.names),
                       "format_steps": format_steps(switch, schedule, T)}
    assert sum(summary["format_steps"].values()) == T
    assert format_summary(builders.quant_config_from_config(default.get_precision_config()),
                          schedule, T) == {}


@pytest.mark.parametrize("text,message", (
    ("mxfp8,mxfp4", "narrow to wide"),
    ("mxfp4,nope", r"formats\[1\]='nope' is not a preset"),
    ("cpt,mxfp8", "no fixed element width"),
    ("mxfp4,fp8_gemm_delayed", "cannot be one of several formats"),
    ("mxfp4,int8", "cannot be one of several formats"),
    ("mxfp6,mxfp6_gemm", "distinct element widths"),
))
def test_bad_format_schedules_are_refused_naming_the_field(text, message):
    with pytest.raises(ValueError, match=message) as info:
        check_formats(text)
    assert "config.precision.formats" in str(info.value)


@pytest.mark.slow
def test_format_schedule_api_errors_and_provider():
    with pytest.raises(ValueError, match="PrecisionSchedule"):
        format_schedule(("mxfp4", "mxfp8"), 8)
    with pytest.raises(ValueError, match="non-empty"):
        format_switch("mxfp4,mxfp8")
    assert cpt_jax.providers.default_provider(format_switch(["mxfp4", "mxfp8"])) is FORMAT_SWITCH
    # Static bits pick the branch without a switch; traced bits switch.
    fs = format_schedule(("mxfp4", "mxfp8"), SCHEDULE)
    qmodel = cpt_jax.quantize_model(nn.Dense(8), config=fs.config)
    params = qmodel.init(jax.random.key(0), X)

    def at(bits):
        with cpt_jax.precision(bits):
            return qmodel.apply(params, X)

    np.testing.assert_array_equal(jax.jit(at)(jnp.float32(4)), at(4))
    np.testing.assert_array_equal(jax.jit(at)(jnp.float32(8)), at(8))
    assert "cond" in str(jax.make_jaxpr(at)(jnp.float32(4)))
