"""Precision controllers (`cpt_jax.controllers`): each built-in against a hand-computed
trace of its rule on a synthetic statistic sequence; the train step's statistics and
plumbing (one compile, the base schedule reproduced bit for bit, the bits counted);
the main job (summary, records, plot, resume with the controller state bit-identical,
a controller over formats)."""
from __future__ import annotations

import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import cpt_jax
from cpt_jax import controllers as ctl
from cpt_jax.models import MLP
from cpt_jax.runner import checkpoint as ckpt_lib
from cpt_jax.runner import job as runner
from cpt_jax.runner import realized
from cpt_jax.training import (
    classification_loss,
    create_train_state,
    make_train_step,
    make_train_step_with_bits,
)
from experiments.configs import default

FORMATS = ("nvfp4_gemm", "mxfp6", "mxfp8_gemm")  # widths 4, 6, 8


def _trace(controller, stats_seq):
    """Feed `stats_seq` (None: no statistics yet) to `controller` step by step, jitted.

    Returns ``(forward bits, error bits, final state)``.
    """
    update = jax.jit(controller.update)
    state, fwd, err = controller.init(), [], []
    for t, stats in enumerate(stats_seq):
        bits, state = update(state, ctl.no_stats() if stats is None else stats, t)
        fwd.append(float(bits.forward))
        err.append(None if bits.error is None else float(bits.error))
    return fwd, err, state


def _grad_norms(values):
    return [None if v is None else ctl.stats_of(1.0, {"w": jnp.float32(v)}) for v in values]


def _losses(values):
    return [None if v is None else ctl.stats_of(v, {}) for v in values]


def _effects(values):
    out = []
    for v in values:
        if v is None:
            out.append(None)
        elif v == "nonfinite":
            out.append(ctl.stats_of(jnp.nan, {}))
        else:
            out.append(ctl.stats_of(1.0, {}, quant_effect=v))
    return out


# --------------------------------------------------------------------------- on_instability

def test_on_instability_follows_its_rule_step_by_step():
    # ratio 2, decay 0.5: mean 2, 2, spike 10 (> 4) -> boost t=3,4; mean 6, 4; spike 20
    # (> 8) at t=5 restarts the hold (t=5,6); NaN at t=8 triggers (t=8,9), mean kept.
    c = ctl.on_instability(cpt_jax.constant(5), ratio=2.0, boost=3, hold=2, decay=0.5,
                           error_base=cpt_jax.constant(8), error_boost=4)
    fwd, err, state = _trace(c, _grad_norms([None, 2, 2, 10, 2, 20, 1, 1, np.nan, 1, 1]))
    assert fwd == [5, 5, 5, 8, 8, 8, 8, 5, 8, 8, 5]
    assert err == [8, 8, 8, 12, 12, 12, 12, 8, 12, 12, 8]
    # mean after 20: 0.5*4 + 0.5*20 = 12, then 6.5, 3.75; NaN skipped; then 2.375, 1.6875
    assert float(state.mean) == pytest.approx(1.6875)
    assert int(state.seen) == 9 and int(state.left) == 0


def test_on_instability_watches_the_loss_and_moves_formats():
    fs = cpt_jax.format_schedule(FORMATS, cpt_jax.constant(4))
    c = ctl.on_instability(fs, statistic="loss", ratio=1.5, boost=1, hold=1)
    fwd, err, _ = _trace(c, _losses([None, 2.0, 2.0, 3.5, 2.0]))
    assert fwd == [4, 4, 4, 6, 4]            # nvfp4 -> mxfp6 for one step
    assert err == [None] * 5                  # no error base: errors stay fp32
    c = ctl.on_instability(fs, statistic="loss", ratio=1.5, boost=5, hold=1)
    assert _trace(c, _losses([None, 2.0, 9.0]))[0] == [4, 4, 8]   # clipped to the widest


def test_builtins_reject_bad_arguments():
    base = cpt_jax.constant(4)
    with pytest.raises(ValueError, match="statistic='accuracy'"):
        ctl.on_instability(base, statistic="accuracy")
    with pytest.raises(ValueError, match="hold=0"):
        ctl.on_instability(base, hold=0)
    with pytest.raises(ValueError, match="decay=1.0"):
        ctl.on_instability(base, decay=1.0)
    with pytest.raises(ValueError, match="max_floor=2"):
        ctl.on_plateau(base, floor=3, max_floor=2)
    with pytest.raises(ValueError, match="min_floor=6"):
        ctl.online_range_test(base, start=5, min_floor=6, threshold=0.1)
    with pytest.raises(ValueError, match="fraction=1.5"):
        ctl.final_phase(base, 1.5, 8, total_steps=10)
    with pytest.raises(ValueError, match="PrecisionSchedule"):
        ctl.scheduled(4)


# --------------------------------------------------------------------------- on_plateau

def test_on_plateau_raises_the_floor_with_optax_semantics():
    # optax reduce_on_plateau, patience 2, cooldown 1, accumulation 2, rtol 0.1 on the
    # loss; the NaN at t=4 is not fed. Windows (pairs of observations) end at t=2: 10
    # (best); t=5: 9 (not < 0.9*10: plateau 1); t=7: plateau 2 -> reduce, floor 3 -> 4,
    # cooldown 1; t=9: cooldown; t=11: plateau 1; t=13: plateau 2 -> floor 5.
    c = ctl.on_plateau(cpt_jax.constant(2), floor=3, max_floor=6, patience=2, cooldown=1,
                       accumulation_size=2, rtol=0.1)
    losses = [None, 10, 10, 9, np.nan, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9]
    fwd, _, state = _trace(c, _losses(losses))
    assert fwd == [3] * 7 + [4] * 6 + [5] * 3
    assert int(state.raises) == 2
    capped = ctl.on_plateau(cpt_jax.constant(2), floor=3, max_floor=4, patience=2,
                            cooldown=1, accumulation_size=2, rtol=0.1)
    fwd, _, state = _trace(capped, _losses(losses))
    assert fwd == [3] * 7 + [4] * 9 and int(state.raises) == 1


def test_on_plateau_floor_leaves_higher_base_bits_alone():
    base = cpt_jax.cyclic("linear_growth", min_bits=4, max_bits=8, num_cycles=1,
                          total_steps=4)  # 4 5 6 7
    c = ctl.on_plateau(base, floor=5, max_floor=8, patience=100)
    assert _trace(c, _losses([None, 1, 1, 1]))[0] == [5, 5, 6, 7]


# --------------------------------------------------------------------------- range test

def test_online_range_test_lowers_the_floor_then_stops_over_formats():
    # Format base (always nvfp4, index 0); floor from 2 (mxfp8), window 2, threshold 0.05:
    # mean 0.02 at the floor -> floor 1 (mxfp6); a non-finite step there -> back to 2, done.
    fs = cpt_jax.format_schedule(FORMATS, cpt_jax.constant(4))
    c = ctl.online_range_test(fs, start=2, min_floor=0, threshold=0.05, window=2)
    assert c.measure_every == 1
    fwd, _, state = _trace(c, _effects([None, 0.01, 0.03, "nonfinite", 0.0, 0.0]))
    assert fwd == [8, 8, 6, 8, 8, 8]
    assert bool(state.done) and float(state.floor) == 2


def test_online_range_test_counts_only_steps_at_the_floor():
    # Reaching min_floor with every window fine ends the test there.
    c = ctl.online_range_test(cpt_jax.constant(2), start=5, min_floor=4, threshold=1.0,
                              window=1)
    fwd, _, state = _trace(c, _effects([None, 0.0, 0.0, 0.0]))
    assert fwd == [5, 4, 4, 4] and bool(state.done)
    # Unmeasured steps (NaN effect, finite loss) are not observations.
    c = ctl.online_range_test(cpt_jax.constant(2), start=5, min_floor=3, threshold=1.0,
                              window=2, measure_every=3)
    assert c.measure_every == 3
    fwd, _, state = _trace(c, _effects([None, np.nan, 0.0, np.nan, 0.0, np.nan]))
    assert fwd == [5, 5, 5, 5, 4, 4] and not bool(state.done)
    # A base above the floor never computes at the floor: nothing is probed.
    c = ctl.online_range_test(cpt_jax.constant(6), start=5, min_floor=3, threshold=1.0,
                              window=1)
    fwd, _, state = _trace(c, _effects([None, 0.0, 0.0, 0.0]))
    assert fwd == [6, 6, 6, 6] and float(state.floor) == 5 and int(state.seen) == 0


# --------------------------------------------------------------------------- final_phase

def test_final_phase_is_join_and_keeps_a_format_schedule():
    base = cpt_jax.cyclic("linear_growth", min_bits=3, max_bits=6, num_cycles=2,
                          total_steps=8)
    s = ctl.final_phase(base, 0.25, 8, total_steps=8)
    assert [int(s(t)) for t in range(8)] == [3, 4, 4, 5, 3, 4, 8, 8]   # rint(3 + 3t/4)
    assert [int(ctl.final_phase(base, 0.0, 8, total_steps=8)(t)) for t in range(8)] == \
        [int(base(t)) for t in range(8)]
    fs = ctl.final_phase(cpt_jax.format_schedule(FORMATS, cpt_jax.constant(4)), 0.5, 8,
                         total_steps=4)
    assert [fs.config.names[int(fs.index(t))] for t in range(4)] == \
        ["nvfp4_gemm", "nvfp4_gemm", "mxfp8_gemm", "mxfp8_gemm"]


# --------------------------------------------------------------------------- the carry

def test_bits_are_counted_and_costed_as_run_cost_counts_them():
    counts = np.zeros((33, 33), np.int64)
    carry = ctl.init_carry(ctl.scheduled(cpt_jax.constant(4)))
    for b, g in [(4, 8), (4, 8), (6, None)]:
        carry = ctl.advance_carry(carry, (), ctl.no_stats(),
                                  ctl.Bits(jnp.float32(b), None if g is None else jnp.float32(g)))
        counts[b, 32 if g is None else g] += 1
    np.testing.assert_array_equal(np.asarray(carry.counts), counts)
    assert ctl.bits_histogram(carry.counts) == {"forward": {"4": 2, "6": 1},
                                                "error": {"8": 2, "32": 1}}
    schedule = cpt_jax.cyclic("cos_growth", min_bits=3, max_bits=8, num_cycles=2,
                              total_steps=10)
    counts = np.zeros((33, 33), np.int64)
    for t in range(10):
        counts[int(schedule(t)), 8] += 1
    got = ctl.realized_cost(counts)
    want = cpt_jax.run_cost(schedule, cpt_jax.constant(8), 10)
    for key in ("relative_cost_fp32", "relative_cost_static8", "mean_bits", "mean_grad_bits"):
        assert got[key] == pytest.approx(want[key], rel=1e-12)
    # Two fp32 forward passes that measured quant_effect: 2 * 32^2 BitOps more.
    measured = ctl.realized_cost(counts, measured=ctl.measured_steps(5, 10))
    assert measured["relative_cost_static8"] * 10 * 192 == pytest.approx(
        want["relative_cost_static8"] * 10 * 192 + 2 * 1024)
    # Per-product measurement on 10 steps: the quantized ops' MACs at 32^2 each step.
    ops = [cpt_jax.cost.OpRecord("a", "dot_general", macs=100, reduction=4, lhs_shape=(1,),
                            rhs_shape=(1,), out_shape=(1,)),
           cpt_jax.cost.OpRecord("head", "dot_general", macs=10, reduction=4, lhs_shape=(1,),
                            rhs_shape=(1,), out_shape=(1,), quantized=False)]
    plain = ctl.realized_cost(counts, ops)["relative_cost_fp32"]
    extra = ctl.realized_cost(counts, ops, measured_products=10)["relative_cost_fp32"]
    assert (extra - plain) * 110 * 3 * 1024 * 10 == pytest.approx(10 * 100 * 1024)


# --------------------------------------------------------------------------- the train step

def _mlp_setup(controller=None):
    qmodel = cpt_jax.quantize_model(MLP(hidden=(16,), num_classes=3))
    x = jax.random.normal(jax.random.key(1), (16, 5))
    y = jnp.arange(16) % 3
    state = create_train_state(qmodel, optax.adam(0.05), jax.random.key(0), x,
                               controller=controller)
    return qmodel, state, {"inputs": x, "labels": y}


def test_a_scheduled_controller_reproduces_the_schedule_bit_for_bit():
    schedule = cpt_jax.cyclic("cos_growth", min_bits=3, max_bits=8, num_cycles=2,
                              total_steps=6)
    qmodel, plain, batch = _mlp_setup()
    step = make_train_step(qmodel, optax.adam(0.05), schedule, cpt_jax.constant(8))
    controller = ctl.scheduled(schedule, error_base=cpt_jax.constant(8))
    _, controlled, _ = _mlp_setup(controller)
    cstep = make_train_step(qmodel, optax.adam(0.05), controller=controller)
    for _ in range(6):
        plain, m1 = step(plain, batch)
        controlled, m2 = cstep(controlled, batch)
        assert float(m1["bits"]) == float(m2["bits"])
    for a, b in zip(jax.tree_util.tree_leaves(plain.params),
                    jax.tree_util.tree_leaves(controlled.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert int(controlled.controller.counts.sum()) == 6
    with pytest.raises(ValueError, match="controller or schedules"):
        make_train_step(qmodel, optax.adam(0.05), schedule, controller=controller)


def test_a_controller_changes_the_bits_and_compiles_once():
    base = cpt_jax.cyclic("cos_growth", min_bits=3, max_bits=6, num_cycles=2, total_steps=10)
    # ratio 0.5: every step's gradient norm is above half its running mean: boosted.
    controller = ctl.on_instability(base, ratio=0.5, boost=2, hold=2,
                                    error_base=cpt_jax.constant(8))
    qmodel, state, batch = _mlp_setup(controller)
    step = make_train_step(qmodel, optax.adam(0.05), controller=controller)
    bits = []
    for _ in range(10):
        state, metrics = step(state, batch)
        bits.append(float(metrics["bits"]))
        assert bool(metrics["stats"].observed)
    assert step.num_compiles == 1
    base_bits = [float(base(t)) for t in range(10)]
    # Step 0 has no statistics, step 1 only the first (which starts the mean); every
    # later gradient norm is above half its running mean: boosted from step 2 on.
    assert bits[:2] == base_bits[:2]
    assert bits[2:] == [b + 2 for b in base_bits[2:]]
    forward = np.asarray(state.controller.counts).sum(axis=1)
    assert {b: int(forward[b]) for b in range(33) if forward[b]} == \
        {int(b): bits.count(b) for b in set(bits)}


@pytest.mark.slow
def test_the_step_measures_its_statistics():
    qmodel, state, batch = _mlp_setup()
    step = make_train_step_with_bits(qmodel, optax.sgd(0.1), stats=True, measure_every=2,
                                     donate=False)

    def loss_of(params):
        logits = qmodel.apply({"params": params}, batch["inputs"], train=True)
        return classification_loss(logits, batch)[0]

    grads = jax.grad(loss_of)(state.params)
    new, m = step(state, batch, jnp.float32(32), jnp.float32(32))   # full precision
    s = m["stats"]
    norm = float(jnp.sqrt(sum(jnp.sum(g * g) for g in jax.tree_util.tree_leaves(grads))))
    assert float(s.grad_norm) == pytest.approx(norm, rel=1e-5)
    assert float(s.loss) == pytest.approx(float(loss_of(state.params)), rel=1e-6)
    assert int(s.nonfinite) == 0 and bool(s.observed)
    assert float(s.quant_effect) == 0.0                 # 32 bits: the quantized loss is fp32's
    _, m = step(new, batch, jnp.float32(2), jnp.float32(8))
    assert np.isnan(float(m["stats"].quant_effect))      # step 1: not measured
    _, m = step(new.replace(step=jnp.int32(2)), batch, jnp.float32(2), jnp.float32(8))
    assert float(m["stats"].quant_effect) != 0.0         # 2 bits change the loss
    bad = state.replace(params=jax.tree_util.tree_map(lambda p: p * jnp.inf, state.params))
    _, m = step(bad, batch, jnp.float32(8), jnp.float32(8))
    assert int(m["stats"].nonfinite) > 0


# --------------------------------------------------------------------------- the main job

def _job_config(**changes):
    config = default.get_config()
    config.update(model="mlp", num_steps=12, log_every=3, eval_every=0, plots=False,
                  tensorboard=False)
    config.precision.num_cycles = 2
    for key, value in changes.items():
        node = config
        *parents, leaf = key.split(".")
        for parent in parents:
            node = node[parent]
        node[leaf] = value
    return config


def _lines(workdir):
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.mark.slow
def test_the_main_job_reports_the_bits_used_and_resumes_the_controller_exactly(tmp_path):
    config = _job_config(**{"precision.controller": "on_instability",
                            "precision.controller_ratio": 0.9, "precision.controller_hold": 2,
                            "checkpoint_every": 6, "keep_checkpoints": 5, "plots": True})
    first = str(tmp_path / "first")
    summary = runner.train_and_evaluate(config, first, progress=False)
    assert summary["num_compiles"] == 1 and summary["controller"] == "on_instability"
    records = [r for r in _lines(first) if "step" in r]
    per_step = sum((r["bits_per_step"] for r in records), [])
    assert len(per_step) == 12 and [r["bits"] for r in records] == \
        [r["bits_per_step"][-1] for r in records]
    hist = summary["realized_bits_histogram"]
    assert hist["forward"] == {str(int(b)): per_step.count(b) for b in set(per_step)}
    assert hist["error"] == {"8": 12}
    base = runner.precision_schedule_from_config(config.precision, 12)
    assert per_step != [float(base(t)) for t in range(12)]       # the controller acted
    assert summary["relative_cost_fp32"] == pytest.approx(
        ctl.realized_cost(_counts(per_step), runner.build_run(config)[0].ops)[
            "relative_cost_fp32"])
    assert summary["relative_cost_fp32"] != summary["base_relative_cost_fp32"]
    assert records[-1]["cumulative_relative_cost"] == pytest.approx(summary["relative_cost_fp32"])
    assert os.path.isfile(os.path.join(first, "bits.png"))
    # Resume from the checkpoint of step 6: the controller's state (its running mean,
    # boost countdown and the bit counts) comes back, so everything ends identical.
    second = str(tmp_path / "second")
    shutil.copytree(first, second)
    for name in ("summary.json", "metrics.jsonl"):
        os.remove(os.path.join(second, name))
    shutil.rmtree(os.path.join(second, "checkpoints", "12"))
    restored = ckpt_lib.CheckpointManager(os.path.join(second, "checkpoints")).restore(
        6, runner.build_run(config)[1])
    assert int(restored.state.controller.state.seen) == 5   # stats of steps 0..4 absorbed
    assert int(np.asarray(restored.state.controller.counts).sum()) == 6
    resumed = runner.train_and_evaluate(config, second, progress=False)
    assert resumed["resumed_from_step"] == 6
    for key in ("params_sha256", "realized_bits_histogram", "relative_cost_fp32"):
        assert resumed[key] == summary[key], key
    assert [r for r in _lines(second) if "step" in r] == records


@pytest.mark.slow
def test_a_controller_over_formats_moves_the_format_and_compiles_once(tmp_path):
    config = _job_config(**{"precision.formats": ",".join(FORMATS),
                            "precision.schedule": "constant", "precision.min_bits": 4,
                            "precision.max_bits": 4, "precision.controller": "on_instability",
                            "precision.controller_ratio": 0.9, "precision.controller_boost": 1,
                            "precision.controller_hold": 1})
    summary = runner.train_and_evaluate(config, str(tmp_path), progress=False)
    assert summary["num_compiles"] == 1
    steps = summary["format_steps"]
    assert sum(steps.values()) == 12 and steps["mxfp8_gemm"] == 0
    assert steps["nvfp4_gemm"] > 0 and steps["mxfp6"] > 0
    assert set(summary["realized_bits_histogram"]["forward"]) == {"4", "6"}


@pytest.mark.slow
@pytest.mark.parametrize("statistic", ["quant_effect", "quant_error"])
def test_online_range_test_in_the_main_job_lowers_the_floor_and_counts_its_measurements(
        tmp_path, statistic):
    config = _job_config(**{"precision.controller": "online_range_test",
                            "precision.controller_statistic": statistic,
                            "precision.controller_window": 2,
                            "precision.controller_threshold": 10.0})
    summary = runner.train_and_evaluate(config, str(tmp_path), progress=False)
    passes = 12 if statistic == "quant_effect" else 0
    assert summary["num_compiles"] == 1 and summary["measured_steps"] == passes
    records = [r for r in _lines(str(tmp_path)) if "step" in r]
    per_step = sum((r["bits_per_step"] for r in records), [])
    # The floor starts at max_bits (8) and drops one bit per window of 2 steps at it
    # (every measure is far under the threshold) until the cycle's own bits rise
    # above it.
    assert per_step[:4] == [8.0, 8.0, 7.0, 7.0]
    assert all(statistic in r for r in records)
    ops = runner.build_run(config)[0].ops
    bits_only = ctl.realized_cost(_counts(per_step), ops)["relative_cost_fp32"]
    with_passes = ctl.realized_cost(_counts(per_step), ops, measured=passes,
                                    measured_products=12 - passes)["relative_cost_fp32"]
    assert summary["relative_cost_fp32"] == pytest.approx(with_passes)
    assert with_passes > bits_only


def _counts(per_step, grad_bits=8):
    counts = np.zeros((33, 33))
    for b in per_step:
        counts[int(b), grad_bits] += 1
    return counts


def test_the_config_names_a_bad_controller_field():
    config = _job_config(**{"precision.controller": "on_instabilty"})
    with pytest.raises(ValueError, match="config.precision.controller='on_instabilty'"):
        runner.validate_config(config)
    config = _job_config(**{"precision.controller": "on_instability",
                            "precision.controller_hold": 0})
    with pytest.raises(ValueError, match="config.precision.controller_hold=0"):
        runner.validate_config(config)
    config = _job_config(**{"precision.controller": "final_phase",
                            "precision.schedule": "none"})
    with pytest.raises(ValueError, match="needs a quantized run"):
        runner.validate_config(config)


def test_final_phase_in_the_main_job_is_a_schedule():
    p = default.get_precision_config(controller="final_phase", controller_fraction=0.25,
                                     min_bits=3, max_bits=8, num_cycles=1)
    schedule = runner.precision_schedule_from_config(p, 8)
    assert [int(schedule(t)) for t in range(6, 8)] == [8, 8]
    assert int(schedule(0)) == 3
    assert runner.controller_from_config(p, schedule, None) is None
    low = default.get_precision_config(controller="final_phase", min_bits=3, max_bits=3,
                                       controller_bits=8)
    assert runner.eval_bits_from_config(low) == 8.0   # the schedule's max: its last phase
    run_realized = realized.realized_steps([{"step": 4, "bits_per_step": [3.0, 4.0]},
                                            {"step": 6, "bits_per_step": [5.0, 6.0]}])
    assert run_realized == ([3, 4, 5, 6], [3.0, 4.0, 5.0, 6.0])


@pytest.mark.slow
def test_measured_products_report_their_relative_quantization_error():
    qmodel = cpt_jax.quantize_model(MLP(hidden=(16,), num_classes=3),
                                    provider=ctl.measure_products())
    plain = cpt_jax.quantize_model(MLP(hidden=(16,), num_classes=3))
    x = jax.random.normal(jax.random.key(1), (16, 5))
    batch = {"inputs": x, "labels": jnp.arange(16) % 3}
    state = create_train_state(qmodel, optax.sgd(0.1), jax.random.key(0), x)
    step = make_train_step_with_bits(qmodel, optax.sgd(0.1), stats=True, donate=False)
    _, m = step(state, batch, jnp.float32(3), jnp.float32(8))
    errors = {k: float(v) for k, v in m["quant_error"].items()}
    assert set(errors) == {"dense1", "classifier"}
    # dense1 by hand: its 3-bit product against the fp32 one, on the same operands.
    params = state.params["dense1"]
    with cpt_jax.precision(3):
        y_q = plain.apply({"params": state.params}, x, train=True,
                          capture_intermediates=True)[1]["intermediates"]["dense1"]["__call__"][0]
    y = x @ params["kernel"] + params["bias"]
    assert errors["dense1"] == pytest.approx(float(jnp.linalg.norm(y_q - y) / jnp.linalg.norm(y)),
                                             rel=1e-4)
    assert float(m["stats"].quant_error) == pytest.approx(max(errors.values()))
    # At 32 bits every product is exact; the plain provider computes the same step.
    _, m32 = step(state, batch, jnp.float32(32), jnp.float32(32))
    assert all(float(v) == 0.0 for v in m32["quant_error"].values())
    new_plain, _ = make_train_step_with_bits(plain, optax.sgd(0.1), donate=False)(
        state, batch, jnp.float32(3), jnp.float32(8))
    new_measured, _ = step(state, batch, jnp.float32(3), jnp.float32(8))
    for a, b in zip(jax.tree_util.tree_leaves(new_plain.params),
                    jax.tree_util.tree_leaves(new_measured.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
