"""experiments.adaptive_study: its arms, the pairing by seed and the summary."""
from __future__ import annotations

import pytest

from cpt_jax.runner import job as runner
from experiments import adaptive_study as study
from experiments import study_utils as su


def test_each_arm_is_a_valid_config_of_the_main_job():
    base = su.load_config(study.CONFIG)
    for arm in study.ARMS:
        config = su.with_overrides(base, {**study.arm_overrides(arm, 3, 4), "num_steps": 100})
        runner.validate_config(config)
        schedule = runner.precision_schedule_from_config(config.precision, 100)
        errors = runner.grad_schedule_from_config(config.precision, 100)
        controller = runner.controller_from_config(config.precision, schedule, errors)
        assert (controller is not None) == arm.startswith("cpt_"), arm
        bits = [int(schedule(t)) for t in range(100)]
        want = {"static_low": (3, 3), "static_8": (8, 8), "cpt": (3, 8), "cpt_never_fires": (3, 8),
                "cpt_on_instability": (3, 8), "static_low_final_phase": (3, 8)}[arm]
        assert (min(bits), max(bits)) == want, arm
        error_bits = {int(errors(t)) for t in range(100)}
        assert error_bits == ({8} if arm == "static_8" else
                              {4, 8} if arm == "static_low_final_phase" else {4}), arm
        if arm == "static_low_final_phase":
            assert bits.index(8) == 75 and set(bits[75:]) == {8}
            assert int(errors(74)) == 4 and int(errors(75)) == 8
    with pytest.raises(ValueError, match="--arms"):
        study.arm_overrides("cpt_on_plateau", 3, 4)


def test_summary_pairs_arms_by_seed():
    rows = [{"arm": a, "seed": s, "metric": m, "metric_fp32": m, "relative_cost_static8": c,
             "mean_bits": 5.0, "extra_bits": 0}
            for a, s, m, c in [("static_8", 0, 10.0, 1.0), ("static_8", 1, 11.0, 1.0),
                               ("cpt", 0, 10.5, 0.6), ("cpt", 1, 11.1, 0.6)]]
    assert study.paired(rows, "cpt", "static_8") == pytest.approx([0.5, 0.1])
    summary = {r["arm"]: r for r in study.summarize(rows)}
    assert summary["cpt"]["minus_static_8"].startswith("0.3000")
    assert summary["cpt"]["metric_mean"] == pytest.approx(10.8)
    assert study.extra_bits({"mean_bits": 6.0, "base_mean_bits": 5.5, "steps": 20}) == 10
    # cpt and static_8 themselves lie on their own line.
    assert study.minus_line(rows, "cpt") == pytest.approx([0.0, 0.0])
