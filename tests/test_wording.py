"""What a user reads (issue 43, item 9): errors that name what was expected, once, and
no noise (a probe line, ``+- 0.0000``, ``Spearman +nan``).

The rerun of a finished run and the export's orbax lines are end-to-end runs:
``tests/test_runner.py::test_a_finished_run_rerun_keeps_its_record_and_names_extend``.
"""
from __future__ import annotations

import logging

import jax.numpy as jnp
import optax
import pytest

from experiments import study_utils as su


def _one_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


# --------------------------------------------------------------------------- the CLI

def test_a_config_file_without_get_config_names_the_file(tmp_path, train_cli):
    path = tmp_path / "my_config.py"   # after another config file in this process, too
    path.write_text("import ml_collections\n\ndef make():\n    return None\n")
    code, err = train_cli(f"--workdir={tmp_path / 'run'}", f"--config={path}")
    line = _one_line(err)
    assert code == 2 and f"--config={path}" in line and "get_config()" in line, line
    assert "config_config" not in line   # absl's internal flag name, meaningless to a user
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("flag, suggestion", [
    ("--config.num_stepz=3", "--config.num_steps?"),
    ("--config.precision.schedul=cpt", "--config.precision.schedule?"),
])
def test_a_misspelled_field_says_did_you_mean_once(tmp_path, train_cli, flag, suggestion):
    code, err = train_cli(f"--workdir={tmp_path}", "--config=experiments/configs/default.py",
                          flag)
    line = _one_line(err)
    assert code == 2 and line.lower().count("did you mean") == 1, line
    assert suggestion in line and "\\n" not in line, line
    assert line.startswith(f"error: {flag.split('=')[0]}: the config has no field "), line


def test_an_unknown_field_without_a_near_name_has_no_suggestion(tmp_path, train_cli):
    code, err = train_cli(f"--workdir={tmp_path}", "--config=experiments/configs/default.py",
                          "--config.no_such_field=3")
    line = _one_line(err)
    assert code == 2 and "did you mean" not in line.lower()
    assert "--config.no_such_field: the config has no field 'no_such_field'" in line


def test_the_backend_probe_line_is_dropped_and_nothing_else():
    """jax logs ``Unable to initialize backend 'tpu': ...`` at INFO when it probes a
    platform nobody asked for; the programs of experiments/ drop that line only."""
    import experiments  # noqa: F401 - installs the filter
    from experiments import cli_logs

    seen = []

    class Keep(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    logger = logging.getLogger(cli_logs.BACKEND_LOGGER)
    handler, level = Keep(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        logger.info("Unable to initialize backend 'tpu': INTERNAL: Failed to open libtpu.so")
        logger.info("Unable to initialize backend 'cuda': no supported devices")
        logger.warning("A Google TPU may be present on this machine, but ...")
        logger.info("another message of the backend")
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    assert seen == ["A Google TPU may be present on this machine, but ...",
                    "another message of the backend"]


# --------------------------------------------------------------------------- batches

@pytest.fixture(scope="module")
def tiny_step():
    import jax

    from cpt_jax import quantize_model
    from cpt_jax.models import MLP
    from cpt_jax.schedules import constant
    from cpt_jax.training import create_train_state, make_eval_step, make_train_step

    model = quantize_model(MLP(hidden=(8,), num_classes=3))
    x, y = jnp.ones((4, 5)), jnp.zeros((4,), jnp.int32)
    state = create_train_state(model, optax.sgd(0.1), jax.random.key(0), x)
    step = make_train_step(model, optax.sgd(0.1), constant(8), donate=False)
    return state, step, make_eval_step(model), x, y


def test_a_tuple_batch_says_what_a_batch_is(tiny_step):
    state, step, eval_step, x, y = tiny_step
    with pytest.raises(TypeError, match=r"a batch is a dict \{'inputs': x, 'labels': y\}.*"
                                        r"got a tuple \(for a tuple \(x, y\): "):
        step(state, (x, y))
    with pytest.raises(TypeError, match="a batch is a dict"):
        eval_step(state, (x, y), 8.0)


def test_a_batch_without_labels_names_the_key_and_the_keys_there(tiny_step):
    state, step, eval_step, x, _ = tiny_step
    with pytest.raises(ValueError, match=r"the batch has no 'labels' \(its keys: \['x'\]\)|"
                                         r"the batch has no 'inputs' \(its keys: \['x'\]\)"):
        step(state, {"x": x})
    with pytest.raises(ValueError, match=r"the batch has no 'labels' \(its keys: \['inputs'\]\)"):
        step(state, {"inputs": x})
    with pytest.raises(ValueError, match=r"no 'labels'.*a batch is a dict"):
        eval_step(state, {"inputs": x}, 8.0)


def test_a_good_batch_still_trains(tiny_step):
    state, step, _, x, y = tiny_step
    new_state, metrics = step(state, {"inputs": x, "labels": y})
    assert int(new_state.step) == 1 and jnp.isfinite(metrics["loss"])


# --------------------------------------------------------------------------- study tables

def test_one_seed_prints_the_mean_alone_not_plus_minus_zero():
    assert su.pm_of([0.98]) == "0.9800 (n=1)"
    assert su.pm(*su.mean_std([0.98]), n=1) == "0.9800 (n=1)"
    assert su.pm_of([0.5, 0.7]) == "0.6000 +- 0.1414"   # sample std of two: |a - b| / sqrt(2)
    assert su.pm(0.5, 0.0) == "0.5000 +- 0.0000"        # equal seeds: a real zero spread


def test_an_undefined_correlation_says_why_instead_of_nan():
    assert su.rho_text([1, 2, 3], [1, 2, 3]) == "+1.00"
    assert su.rho_text([1.0, 2.0], [4.0, 1.0], ("accumulation", "depth")) == (
        "undefined (only 2 points, at least 3 needed)")
    assert su.rho_text([1, 2, 3], [2, 2, 2], ("reuse", "depth")) == "undefined (depth is constant)"
    c = su.correlations([1, 2], [2, 1])
    assert c["undefined"] == "only 2 points, at least 3 needed"
    line = su.describe_correlation(c, "metric ~ cost")
    assert "nan" not in line and "undefined" in line and "n = 2" in line
    assert su.correlations([1, 2, 3], [1, 3, 2])["undefined"] is None
