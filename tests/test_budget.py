"""The ``budget`` controller (cpt_jax/extensions/budget.py): a hand-computed trace of its
rule, its limits, and the main job keeping a run within its budget (issue 42)."""
from __future__ import annotations

import jax
import pytest

import cpt_jax
from cpt_jax import controllers as ctl
from cpt_jax.extensions.budget import budget
from cpt_jax.runner import job as runner
from cpt_jax.runner.validation import validate_config
from experiments.configs import default

# Without ops the cost table is one MAC: c(b, g) = b^2 + 2 b g, static 8/8 = 64 + 128 = 192.
TABLE = ctl.cost_table()


def _trace(controller, steps):
    update = jax.jit(controller.update)
    state, bits = controller.init(), []
    for t in range(steps):
        b, state = update(state, ctl.no_stats(), t)
        bits.append(int(b.forward))
    return bits, state


def test_the_budget_follows_its_rule_step_by_step():
    c = budget(cpt_jax.constant(6), target=0.6, table=TABLE, baseline=192.0, low=3, high=8,
               error_base=cpt_jax.constant(8))
    bits, state = _trace(c, 6)
    # Errors at 8: c(3) = 9 + 48 = 57, c(4) = 80, c(5) = 105, c(6) = 132, c(7) = 161.
    # The allowance after step t is 0.6 * 192 * (t + 1) = 115.2 (t + 1); the cap is one
    # level above the last step's (base 6 + offset + 1).
    # t=0: cap 7; spent 0: 161, 132 > 115.2, 105 fits           -> 5  (spent 105)
    # t=1: cap 6; 105 + 132 = 237 > 230.4, 105 + 105 = 210 fits -> 5  (spent 210)
    # t=2: cap 6; 210 + 132 = 342 <= 345.6                      -> 6  (spent 342)
    # t=3: cap 7; 342 + 161 = 503, + 132 = 474 > 460.8; 447     -> 5  (spent 447)
    # t=4: cap 6; 447 + 132 = 579 > 576; 447 + 105 = 552        -> 5  (spent 552)
    # t=5: cap 6; 552 + 132 = 684 <= 691.2                      -> 6  (spent 684)
    assert bits == [5, 5, 6, 5, 5, 6]
    assert float(state.spent) == pytest.approx(684 / 192)
    assert float(state.offset) == 0.0


def test_a_budget_too_small_stays_at_the_floor_and_a_large_one_rises_a_level_a_step():
    # 0.2 * 192 = 38.4 a step, less than c(3) = 57: nothing fits, the floor (3).
    low = budget(cpt_jax.constant(6), target=0.2, table=TABLE, baseline=192.0, low=3, high=8,
                 error_base=cpt_jax.constant(8))
    assert _trace(low, 3)[0] == [3, 3, 3]
    # A budget of 2 static 8/8 steps a step fits everything: from the base 4, one more
    # level each step (the cap), up to high = 8.
    high = budget(cpt_jax.constant(4), target=2.0, table=TABLE, baseline=192.0, low=3, high=8,
                  error_base=cpt_jax.constant(8))
    assert _trace(high, 6)[0] == [5, 6, 7, 8, 8, 8]


def test_the_budget_moves_formats_over_a_schedule_over_formats():
    fs = cpt_jax.format_schedule(("nvfp4_gemm", "mxfp6", "mxfp8_gemm"), cpt_jax.constant(8))
    table = ctl.cost_table(None, fs.config)
    # The base at 8 bits is MXFP8 (format 2): 8.25-bit operands (a scale per 32), so a
    # step costs more than static 8/8 (table[8, 8] > 192); a 0.9 budget starts below it,
    # on a narrower format, and keeps the steps done within 0.9 static 8/8 steps each.
    assert table[8, 8] > 192
    c = budget(fs, target=0.9, table=table, baseline=192.0, low=0, high=2,
               error_base=cpt_jax.constant(8))
    bits, state = _trace(c, 4)
    assert set(bits) <= {4, 6, 8} and bits[0] < 8
    assert float(state.spent) <= 0.9 * 4


def test_the_budget_refuses_bad_arguments_and_the_job_validates_its_field():
    with pytest.raises(ValueError, match="target=0.0 must be a number > 0"):
        budget(cpt_jax.constant(6), target=0.0, table=TABLE, baseline=192.0, low=3, high=8)
    assert "budget" in ctl.controller_names()
    config = default.get_config()
    config.precision.controller = "budget"
    config.precision.controller_budget = 0.0
    with pytest.raises(ValueError, match=r"config.precision.controller_budget=0.0 must be a "
                                         r"number in \(0, inf\)"):
        validate_config(config, device_count=1)


@pytest.mark.slow
def test_the_main_job_keeps_the_run_within_its_budget(tmp_path):
    config = default.get_config()
    config.num_steps, config.eval_every, config.log_every = 30, 0, 10
    config.plots, config.tensorboard = False, False
    config.precision.controller = "budget"
    config.precision.controller_budget = 0.6
    summary = runner.train_and_evaluate(config, str(tmp_path), progress=False)
    assert summary["controller"] == "budget" and summary["num_compiles"] == 1
    assert summary["relative_cost_static8"] <= 0.6 + 1e-6
    assert summary["relative_cost_static8"] < summary["base_relative_cost_static8"]
    assert len(summary["realized_bits_histogram"]["forward"]) > 1     # it moved the bits
