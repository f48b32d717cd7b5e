"""Critical-period study protocol: the paper's per-dataset defaults and the t <= D rule.

A tiny real run (digits, MLP) checks the logged forward bits step by step against the
rule written out here.
"""
from __future__ import annotations

import json
import os

import pytest

from experiments import critical_period
from experiments import study_utils as su


def _tiny_config(**overrides):
    return su.with_overrides(su.load_config(), {
        "model": "mlp", "model_kwargs": {"hidden": (16,)}, "num_steps": 20, "log_every": 1,
        "eval_every": 0, "batch_size": 32, **overrides})


@pytest.mark.parametrize("dataset,expected", [
    ("cifar10", (3, True)), ("cifar100", (3, True)), ("imagenet2012", (4, False)),
    ("imagenette", (4, False)), ("cora", (3, False)), ("citeseer", (3, False)),
    ("ptb", (5, False)), ("digits", (3, False)), ("sst2", (3, False)),
])
def test_paper_defaults_per_dataset(dataset, expected):
    assert critical_period.paper_defaults(dataset) == expected


def test_deficit_config_sets_the_rule():
    config = _tiny_config()
    on = critical_period.deficit_config(config, 5, 10, 3, 8, 0, inclusive=True)
    off = critical_period.deficit_config(config, 5, 10, 3, 8, 0)
    assert on.precision.deficit_inclusive is True and off.precision.deficit_inclusive is False
    assert on.num_steps == off.num_steps == 15
    # D = 0 has no deficit under either rule.
    zero = critical_period.deficit_config(config, 0, 10, 3, 8, 0, inclusive=True)
    assert zero.precision.deficit_inclusive is False


@pytest.mark.slow
@pytest.mark.parametrize("inclusive", [False, True])
def test_logged_bits_follow_the_rule(tmp_path, inclusive):
    deficit, budget = 6, 6
    out = critical_period.run_critical_period(
        _tiny_config(), str(tmp_path), deficits=[deficit], budget=budget, low_bits=3,
        high_bits=8, seeds=[0], inclusive=inclusive)
    with open(os.path.join(out["runs"][0]["directory"], "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    bits = {r["step"]: r["bits"] for r in records if "bits" in r}   # 1-based steps
    low_steps = deficit + 1 if inclusive else deficit               # 0-based t <= D or t < D
    assert bits == {s: 3.0 if s - 1 < low_steps else 8.0 for s in range(1, deficit + budget + 1)}
    mean = (low_steps * 3 + (deficit + budget - low_steps) * 8) / (deficit + budget)
    assert out["rows"][0]["mean_bits"] == pytest.approx(mean)
    with open(tmp_path / "critical_period.md") as f:
        assert ("t <= D" if inclusive else "t < D") in f.read()
