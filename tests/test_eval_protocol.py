"""The main job's evaluation protocol: eval bits (max | current), activation ranges
(batch | running), best and final test metrics, period convention, critical period.

Tiny runs (digits, MLP, a dozen steps). Expected bits come from the schedules'
formulas evaluated here in numpy, not from the runner.
"""
from __future__ import annotations

import json
import math
import os

import numpy as np
import pytest

from cpt_jax.runner import job as runner
from experiments.configs import default


def _config(**changes):
    config = default.get_config()
    config.update(model="mlp", num_steps=12, log_every=4, eval_every=3, plots=False,
                  tensorboard=False, eval_batch_size=500)
    config.precision.num_cycles = 2
    for key, value in changes.items():
        node = config
        *parents, leaf = key.split(".")
        for parent in parents:
            node = node[parent]
        node[leaf] = value
    return config


def _evals(workdir):
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [json.loads(line)["eval"] for line in f if '"eval"' in line]


def _cos_bits(t, lo, hi, total, cycles):
    period = math.ceil(total / cycles)
    z = (t % period) / period
    return float(np.rint(lo + (hi - lo) / 2 * (1 - np.cos(np.pi * z))))


@pytest.mark.slow
def test_default_protocol_max_bits_batch_ranges_and_best_accuracy(tmp_path):
    workdir = str(tmp_path)
    summary = runner.train_and_evaluate(_config(), workdir, progress=False)
    assert summary["eval_protocol"] == "max-bits/batch-ranges"
    assert summary["eval_bits"] == 8.0 and summary["convention"] == "ceil"
    evals = _evals(workdir)
    assert [e["step"] for e in evals] == [3, 6, 9]
    assert all(e["eval_bits"] == 8.0 for e in evals)
    seen = [e["test_accuracy"] for e in evals] + [summary["final_test_accuracy"]]
    assert summary["best_test_accuracy"] == max(seen)
    with open(os.path.join(workdir, "summary.json")) as f:
        written = json.load(f)
    assert written["best_test_accuracy"] == summary["best_test_accuracy"]
    assert written["eval_protocol"] == "max-bits/batch-ranges"


@pytest.mark.slow
def test_cpt_protocol_current_bits_running_ranges(tmp_path):
    workdir = str(tmp_path / "a")
    config = _config(**{"precision.eval_bits_mode": "current",
                        "precision.activation_range": "running"})
    summary = runner.train_and_evaluate(config, workdir, progress=False)
    assert summary["eval_protocol"] == "current-bits/running-ranges"
    for e in _evals(workdir):   # bits of the last step trained (0-based step - 1)
        assert e["eval_bits"] == _cos_bits(e["step"] - 1, 3, 8, 12, 2), e
    assert summary["eval_bits"] == _cos_bits(11, 3, 8, 12, 2)
    # Running ranges: the same trained model evaluated in batches of 7 gives the same
    # result (training is unchanged by eval_batch_size).
    other = runner.train_and_evaluate(_config(**{
        "precision.eval_bits_mode": "current", "precision.activation_range": "running",
        "eval_batch_size": 7}), str(tmp_path / "b"), progress=False)
    assert other["params_sha256"] == summary["params_sha256"]
    assert other["final_test_loss"] == pytest.approx(summary["final_test_loss"], rel=2e-6)
    assert other["final_test_accuracy"] == summary["final_test_accuracy"]


@pytest.mark.slow
def test_batch_ranges_depend_on_the_eval_batch_size(tmp_path):
    # The counterpart of the test above: without running ranges, batching moves the
    # loss (evaluated at 3 bits, where the grid is coarse).
    a = runner.train_and_evaluate(_config(**{"eval_every": 0, "precision.eval_bits": 3}),
                                  str(tmp_path / "a"), progress=False)
    b = runner.train_and_evaluate(_config(**{"eval_every": 0, "precision.eval_bits": 3,
                                             "eval_batch_size": 7}),
                                  str(tmp_path / "b"), progress=False)
    assert a["params_sha256"] == b["params_sha256"] and a["eval_bits"] == 3.0
    assert abs(a["final_test_loss"] - b["final_test_loss"]) > 1e-4   # 50x the running tolerance


@pytest.mark.slow
@pytest.mark.parametrize("convention,period", [("ceil", 188), ("floor", 187), ("wolfe", 188)])
def test_precision_convention_sets_the_period(convention, period):
    p = default.get_precision_config(convention=convention)
    schedule = runner.precision_schedule_from_config(p, 1500)
    values = [float(schedule(t)) for t in range(1500)]
    want = [float(np.rint(3 + 2.5 * (1 - np.cos(np.pi * (t % period) / period))))
            for t in range(1500)]
    assert values == want


def test_deficit_inclusive_holds_low_bits_one_more_step():
    for inclusive, last_low in ((False, 9), (True, 10)):
        p = default.get_precision_config(schedule="critical_period", deficit_steps=10,
                                         deficit_inclusive=inclusive)
        schedule = runner.precision_schedule_from_config(p, 30)
        assert float(schedule(last_low)) == 3.0 and float(schedule(last_low + 1)) == 8.0


def test_best_metrics_picks_max_or_min():
    class T:
        metric, eval_splits = "perplexity", ("test",)
    records = [{"eval": {"test_perplexity": 9.0}}, {"step": 3}, {"eval": {"test_perplexity": 7.0}}]
    assert runner.best_metrics(T, records, {"final_test_perplexity": 8.0}) == {
        "best_test_perplexity": 7.0}
    T.metric = "accuracy"
    records = [{"eval": {"test_accuracy": 0.5}}, {"eval": {"test_accuracy": 0.7}}]
    assert runner.best_metrics(T, records, {"final_test_accuracy": 0.6}) == {
        "best_test_accuracy": 0.7}


@pytest.mark.parametrize("changes,field", [
    ({"precision.eval_bits_mode": "last"}, "eval_bits_mode"),
    ({"precision.activation_range": "ema"}, "activation_range"),
    ({"precision.activation_range": "running", "precision.quantizer": "int8"},
     "activation_range"),
    ({"precision.convention": "round"}, "convention"),
])
def test_protocol_fields_are_validated(changes, field):
    with pytest.raises(ValueError, match=field):
        runner.validate_config(_config(**changes))


def test_cifar_recipe_cpt_selects_cpts_protocol():
    from experiments.configs import cifar10_resnet
    plain, cpt = cifar10_resnet.get_config(), cifar10_resnet.get_config("cpt")
    for config in (plain, cpt):
        runner.validate_config(config)
    assert runner.eval_protocol_name(plain.precision) == "max-bits/batch-ranges"
    assert runner.eval_protocol_name(cpt.precision) == "current-bits/running-ranges"
    assert cpt.recipe == "cpt" and cpt.eval_every == 390 and cpt.precision.convention == "floor"
    assert cpt.optimizer.weight_decay == 1e-4 and cpt.precision.num_cycles == 32
    with pytest.raises(ValueError, match="recipe"):
        cifar10_resnet.get_config("wolfe")
