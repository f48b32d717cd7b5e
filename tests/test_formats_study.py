"""experiments.formats_study: its plan, the recipe patch and the cost with scale bits."""
from __future__ import annotations

import pytest

from cpt_jax import cost as cost_lib
from cpt_jax.quant_config import get_preset
from cpt_jax.runner import job as runner
from experiments import formats_study as fs
from experiments import study_utils as su


def test_plan_covers_static_and_cyclic_formats():
    assert fs.format_plan("fp32")["overrides"] == {"precision.schedule": "none"}
    static = fs.format_plan("nvfp4")["overrides"]
    assert static["precision.schedule"] == "constant" and static["precision.max_bits"] == 8
    cyclic = fs.format_plan("mx_float")["overrides"]
    assert (cyclic["precision.schedule"], cyclic["precision.min_bits"],
            cyclic["precision.max_bits"]) == ("cos_growth", 4, 8)
    with pytest.raises(ValueError, match="--formats"):
        fs.format_plan("fp7")


def test_quantizer_preset_patches_the_runner_only_inside():
    original = runner.quant_config_from_config
    with fs.quantizer_preset("mxfp4"):
        assert runner.quant_config_from_config(None) is get_preset("mxfp4")
    assert runner.quant_config_from_config is original


def test_cost_counts_stored_bits_against_static_8():
    config = su.with_overrides(su.load_config(fs.TASK_CONFIGS["digits"]),
                               {**fs.format_plan("mxfp8")["overrides"], "num_steps": 10})
    ops = [cost_lib.OpRecord("conv", "conv", macs=100, reduction=9, lhs_shape=(1,),
                             rhs_shape=(1,), out_shape=(1,)),
           cost_lib.OpRecord("classifier", "dot_general", macs=10, reduction=5, lhs_shape=(1,),
                             rhs_shape=(1,), out_shape=(1,), quantized=False)]
    b = 8.25  # MXFP8 and its E5M2 errors: 8 bits + 8 per 32
    want = (100 * 3 * b * b + 10 * 3 * 32 * 32) / (100 * 3 * 64 + 10 * 3 * 32 * 32)
    assert fs.format_cost(config, "mxfp8", ops) == pytest.approx(want, rel=1e-6)
    want_fp32 = (110 * 3 * 32 * 32) / (100 * 3 * 64 + 10 * 3 * 32 * 32)
    assert fs.format_cost(config, "fp32", ops) == pytest.approx(want_fp32, rel=1e-6)


def test_summary_pairs_each_format_with_fp32_of_the_same_seed():
    rows = [{"task": "t", "format": f, "schedule": "s", "seed": seed, "metric": m,
             "metric_name": "accuracy", "higher_is_better": True, "relative_cost_static8": 1.0}
            for f, seed, m in [("fp32", 0, 0.9), ("fp32", 1, 0.8), ("mxfp4", 0, 0.85),
                               ("mxfp4", 1, 0.78)]]
    summary = {r["format"]: r for r in fs.summarize(rows)}
    assert fs.paired_deltas(rows, "t", "mxfp4") == pytest.approx([-0.05, -0.02])
    assert summary["mxfp4"]["metric_mean"] == pytest.approx(0.815)
    assert summary["mxfp4"]["delta_fp32_pm"].startswith("-0.0350")
