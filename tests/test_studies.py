"""The study scripts at tiny settings: their CSV columns, exact costs, resumability.

Real (tiny) trainings on digits with a 1-hidden-layer MLP, 2 runs per study.
"""
from __future__ import annotations

import os
import tempfile

import numpy as np
import pytest

from cpt_jax import schedules as sched_lib
from cpt_jax.runner import builders
from cpt_jax.runner import job as runner
from experiments import allocation, critical_period, range_test, schedule_suite
from experiments import study_utils as su

HIDDEN = 16
STEPS = 20


_CACHE_OPTIONS = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs")


def _reset_compile_cache() -> None:
    # jax opens its persistent cache once; a changed directory takes effect after a reset.
    from jax._src import compilation_cache

    reset = getattr(compilation_cache, "reset_cache", None)
    if reset is not None:
        reset()


@pytest.fixture(scope="module", autouse=True)
def _compile_cache():
    """This module's runs share a persistent compile cache (the same programs, so the same
    results, faster); the global jax options are restored for the worker's next tests."""
    import jax

    before = {name: getattr(jax.config, name) for name in _CACHE_OPTIONS}
    su.enable_compile_cache(os.path.join(tempfile.gettempdir(), "cpt_jax_test_jax_cache"))
    _reset_compile_cache()
    yield
    for name, value in before.items():
        jax.config.update(name, value)
    _reset_compile_cache()


def tiny_config(**overrides):
    config = su.load_config()
    return su.with_overrides(config, {"model": "mlp", "model_kwargs": {"hidden": (HIDDEN,)},
                                      "num_steps": STEPS, "log_every": 5, "eval_every": 0,
                                      "batch_size": 32, **overrides})


def _columns(path):
    rows = su.read_csv(path)
    assert rows, path
    return rows, set(rows[0])


@pytest.mark.slow
def test_schedule_suite_columns_and_costs_match_the_formula(tmp_path, monkeypatch):
    config = tiny_config()
    result = schedule_suite.run_suite(config, str(tmp_path), seeds=[0],
                                      schedules=["exp_decay_horizontal"], static_bits=[8],
                                      include_fp32=False)
    rows, cols = _columns(tmp_path / "suite.csv")
    assert {"schedule", "metric_mean", "metric_std", "relative_cost_fp32",
            "relative_cost_static", "mean_bits"} <= cols
    assert [r["schedule"] for r in rows] == ["exp_decay_horizontal", "static_8"]
    for name in ("suite.md", "suite_runs.csv", "correlation.json", "schedules.png",
                 "tradeoff.png"):
        assert (tmp_path / name).is_file(), name

    # Independent cost: MLP digits (8x8 -> 64) -> Dense(16) quantized, classifier
    # Dense(10) in fp32; BitOps = MACs (b^2 + 2 b g), fp32 = MACs * 3 * 32^2.
    batch = int(config.batch_size)
    m1, m2 = batch * 64 * HIDDEN, batch * HIDDEN * 10
    b = sched_lib.schedule_values(sched_lib.cyclic(
        "exp_decay_horizontal", min_bits=3, max_bits=8, num_cycles=8, total_steps=STEPS),
        STEPS).astype(np.float64)
    g = 8.0
    fp32 = (m1 + m2) * 3 * 32 * 32

    def cost(bits):
        return np.mean((m1 * (bits * bits + 2 * bits * g) + m2 * 3 * 32 * 32) / fp32)

    expected = cost(b)
    static8 = cost(np.full(STEPS, 8.0))
    row = rows[0]
    assert float(row["relative_cost_fp32"]) == pytest.approx(expected, rel=1e-6)
    assert float(row["relative_cost_static"]) == pytest.approx(expected / static8, rel=1e-6)
    assert float(row["mean_bits"]) == pytest.approx(b.mean(), rel=1e-9)
    assert float(rows[1]["relative_cost_static"]) == pytest.approx(1.0)
    assert 0.0 <= float(row["metric_mean"]) <= 1.0 and float(row["metric_std"]) == 0.0
    # Pareto: a row is on the front unless the other is as cheap and as good, and better
    # in one (two rows: worked out directly from their cost and metric).
    (c0, m0), (c1, m1) = ((r["relative_cost_fp32"], r["metric_mean"]) for r in result["rows"])
    dominated = [c1 <= c0 and m1 >= m0 and (c1 < c0 or m1 > m0),
                 c0 <= c1 and m0 >= m1 and (c0 < c1 or m0 > m1)]
    assert [r["pareto"] for r in result["rows"]] == [not d for d in dominated]
    assert result["rows"][0]["pareto"]  # the cheaper schedule: no row is cheaper

    # Resumable: a second call loads every run instead of training.
    def boom(*args, **kwargs):
        raise AssertionError("a finished run was trained again")
    monkeypatch.setattr(runner, "train_and_evaluate", boom)
    again = schedule_suite.run_suite(config, str(tmp_path), seeds=[0],
                                     schedules=["exp_decay_horizontal"], static_bits=[8],
                                     include_fp32=False)
    assert again["rows"][0]["metric_mean"] == result["rows"][0]["metric_mean"]
    # ... and a different config in the same run directory is refused.
    with pytest.raises(ValueError, match="another config"):
        schedule_suite.run_suite(tiny_config(batch_size=16), str(tmp_path), seeds=[0],
                                 schedules=["exp_decay_horizontal"], static_bits=[8],
                                 include_fp32=False)


@pytest.mark.slow
def test_critical_period_columns(tmp_path):
    out = critical_period.run_critical_period(tiny_config(), str(tmp_path), deficits=[0, 10],
                                              budget=10, low_bits=2, high_bits=8, seeds=[0],
                                              control=True)
    rows, cols = _columns(tmp_path / "critical_period.csv")
    assert {"deficit_steps", "metric_mean", "metric_std", "control_mean", "effect_mean"} <= cols
    # D = 0 is its own control; D = 10 has a separate 20-step run at 8 bits throughout
    assert float(rows[0]["effect_mean"]) == 0.0
    control = out["controls"][1]
    assert control["total_steps"] == 20 and control["mean_bits"] == 8.0
    assert float(rows[1]["effect_mean"]) == pytest.approx(
        out["runs"][1]["value"] - control["value"])
    assert [int(r["deficit_steps"]) for r in rows] == [0, 10]
    assert [int(r["total_steps"]) for r in rows] == [10, 20]
    # mean forward bits: D steps at 2, the budget at 8
    assert float(rows[1]["mean_bits"]) == pytest.approx((10 * 2 + 10 * 8) / 20)
    assert (tmp_path / "critical_period.png").is_file()
    assert len(out["runs"]) == 2


def test_lr_held_constant_then_schedule_over_the_budget():
    o = tiny_config().optimizer  # step schedule, lr 0.05
    hold, total = 40, 100
    original = builders.learning_rate_from_config
    with su.lr_held_constant(hold):
        lr = builders.learning_rate_from_config(o, total)
    assert builders.learning_rate_from_config is original  # restored on exit
    lr0 = float(o.learning_rate)
    assert float(lr(0)) == pytest.approx(lr0) and float(lr(39)) == pytest.approx(lr0)
    # the step decay happens at 50% / 75% of the 60 post-deficit steps
    assert float(lr(40 + 29)) == pytest.approx(lr0)
    assert float(lr(40 + 31)) == pytest.approx(lr0 * 0.1)
    assert float(lr(40 + 46)) == pytest.approx(lr0 * 0.01)
    # restored afterwards: the plain schedule decays at 50 of 100
    assert float(builders.learning_rate_from_config(o, total)(51)) == pytest.approx(lr0 * 0.1)


def test_recommend_min_bits_rule():
    assert range_test.recommend_min_bits([2, 3, 4, 8], [0.2, 0.85, 0.9, 0.91],
                                         tolerance=0.1) == 3
    # a dip at 5 bits blocks everything below it
    assert range_test.recommend_min_bits([3, 4, 5, 6], [0.9, 0.9, 0.5, 0.9],
                                         tolerance=0.05) == 6
    # loss: relative tolerance, lower is better
    assert range_test.recommend_min_bits([2, 4, 8], [3.0, 1.05, 1.0], tolerance=0.1,
                                         higher_is_better=False) == 4


@pytest.mark.slow
def test_range_test_columns(tmp_path):
    out = range_test.run_range_test(tiny_config(), str(tmp_path), bits=[2, 8], steps=10,
                                    seeds=[0], include_fp32=False)
    rows, cols = _columns(tmp_path / "range_test.csv")
    assert {"bits", "progress_mean", "progress_std", "metric_mean", "within_tolerance"} <= cols
    rec = out["recommendation"]
    # The rule on the measured rows: 2 bits if its early progress is within the
    # tolerance (0.02) of 8 bits' (absolute for accuracy, relative for loss), else 8.
    p2, p8 = (float(r["progress_mean"]) for r in rows)
    if rows[0]["measure"] == "accuracy":
        within = p2 >= p8 - 0.02
    else:
        within = p2 <= p8 * 1.02
    assert rec["max_bits"] == 8 and rec["min_bits"] == (2 if within else 8)
    assert [r["within_tolerance"] for r in rows] == [str(within), "True"]
    assert (tmp_path / "recommendation.json").is_file()
    assert (tmp_path / "range_test.png").is_file()


@pytest.mark.slow
def test_allocation_columns_and_runner_cost_agree(tmp_path):
    config = tiny_config(**{"precision.schedule": "constant", "precision.max_bits": 4,
                            "precision.keep_full_precision": ()})
    out = allocation.run_allocation(config, str(tmp_path),
                                    policies=["uniform", "neg_accumulation"], seeds=[0],
                                    spread=2.0)
    rows, cols = _columns(tmp_path / "allocation.csv")
    assert {"policy", "metric_mean", "metric_std", "relative_cost_fp32"} <= cols
    assert [r["policy"] for r in rows] == ["uniform", "neg_accumulation"]
    # dense1 (K=64) gets more bits than the classifier (K=16): fewer bits for long K
    offsets = dict(item.rsplit(":", 1) for item in rows[1]["offsets"].split())
    assert int(offsets["dense1"]) < int(offsets["classifier"])
    # equal cost within the tolerance of a 2-layer net, and the runner counted the
    # allocation's own cost (run_allocation checks it to 1e-5)
    assert abs(out["rows"][1]["cost_error"]) < 0.1
    assert (tmp_path / "factors.csv").is_file() and (tmp_path / "allocation.png").is_file()
    # One seed, two layers: the mean alone and why a correlation is undefined, no
    # "+- 0.0000" and no "Spearman +nan" (issue 43).
    md = (tmp_path / "allocation.md").read_text()
    assert "nan" not in md and "+- 0.0000" not in md and "(n=1)" in md, md
    assert "accumulation~depth undefined (only 2 points, at least 3 needed)" in md, md
