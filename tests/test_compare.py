"""experiments/compare.py: the side-by-side table and figure of finished runs."""
import json
import os

import numpy as np
import pytest

from cpt_jax import schedules
from experiments import compare


def _fake_run(directory, schedule, accuracy, cost_static8, metric="accuracy", steps=40):
    os.makedirs(directory)
    bits = None if schedule == "none" else 8.0
    with open(os.path.join(directory, "metrics.jsonl"), "w") as f:
        for step in range(10, steps + 1, 10):
            f.write(json.dumps({"step": step, "loss": 2.0 / step, "bits": bits,
                                "cumulative_relative_cost": step / steps}) + "\n")
    summary = {"metric": metric, f"final_test_{metric}": accuracy,
               f"final_test_{metric}_fp32": accuracy - 0.01, "relative_cost_fp32": 0.5,
               "relative_cost_static8": cost_static8, "mean_bits": 5.5, "num_compiles": 1,
               "steps": steps, "num_steps": steps, "wall_time_s": 12.34, "schedule": schedule,
               "min_bits": 3, "max_bits": 8, "num_cycles": 2}
    with open(os.path.join(directory, "summary.json"), "w") as f:
        json.dump(summary, f)
    return str(directory)


def test_table_and_figure_of_two_runs(tmp_path):
    a = _fake_run(tmp_path / "a", "constant", 0.91, 1.0)
    b = _fake_run(tmp_path / "b", "cos_growth", 0.9, 0.63)
    table = compare.compare(compare.parse_runs(f"static={a},cpt={b}"), str(tmp_path / "out"))
    lines = table.splitlines()
    assert lines[0].startswith("| run | test accuracy |")
    assert lines[2].startswith("| static | 0.9100 | 0.9000 |")
    assert lines[3].startswith("| cpt | 0.9000 | 0.8900 |") and "| 0.6300 |" in lines[3]
    assert (tmp_path / "out" / "compare.md").read_text().strip() == table
    assert (tmp_path / "out" / "compare.png").stat().st_size > 10_000


def test_bits_per_step_is_the_schedule_named_in_the_summary(tmp_path):
    run = compare.load_run("cpt", _fake_run(tmp_path / "b", "cos_growth", 0.9, 0.63))
    expected = schedules.schedule_values(
        schedules.cyclic("cos_growth", min_bits=3, max_bits=8, num_cycles=2, total_steps=40), 40)
    np.testing.assert_array_equal(run["bits_per_step"], expected)
    fp32 = compare.load_run("fp32", _fake_run(tmp_path / "c", "none", 0.9, 16.0))
    assert fp32["bits_per_step"].size == 0


def test_parse_runs_labels_and_errors(tmp_path):
    assert compare.parse_runs("x=/a/b, /c/d/") == [("x", "/a/b"), ("d", "/c/d/")]
    with pytest.raises(ValueError, match="empty"):
        compare.parse_runs(" , ")
    with pytest.raises(ValueError, match="no summary.json"):
        compare.load_run("x", str(tmp_path))


def test_runs_of_different_metrics_are_refused(tmp_path):
    a = _fake_run(tmp_path / "a", "constant", 0.9, 1.0)
    b = _fake_run(tmp_path / "b", "constant", 120.0, 1.0, metric="perplexity")
    with pytest.raises(ValueError, match="different metrics"):
        compare.compare([("a", a), ("b", b)], str(tmp_path / "out"))


def test_moving_average_is_a_trailing_mean():
    np.testing.assert_allclose(compare.moving_average([1, 2, 3, 4], 2), [1, 1.5, 2.5, 3.5])
