"""A format, a preset and a controller defined in a user's own module (tests/
user_extension.py, outside cpt_jax) and registered with the public calls work in
`quantize_model`, the cost, `format_traits` and the main job's command line, where a
config file that imports the module registers them (issue 42)."""
from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import textwrap

import flax.linen as nn
import jax
import numpy as np
import pytest

import cpt_jax
from cpt_jax import formats

TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)


@pytest.fixture
def user():
    """The user's module, imported (so registered) for one test, then unregistered."""
    sys.modules.pop("user_extension", None)
    module = importlib.import_module("user_extension")
    yield module
    module.unregister()
    sys.modules.pop("user_extension", None)


def _config_file(tmp_path, **fields) -> str:
    """A --config file in its own folder that imports the user's module."""
    overrides = "".join(f"    config.{k} = {v!r}\n" for k, v in fields.items())
    path = tmp_path / "my_config.py"
    path.write_text(textwrap.dedent(f"""\
        import sys
        sys.path.insert(0, {TESTS!r})
        import user_extension  # noqa: F401  (registers thirds and every_other)
        from experiments.configs import default


        def get_config():
            config = default.get_config()
        """) + overrides + "    return config\n")
    return str(path)


def test_the_users_format_works_in_the_library(user):
    fmt = user.Thirds()
    assert formats.format_traits(fmt).family == "thirds"
    assert float(formats.bits_per_element(fmt, 6)) == 3.0
    model = cpt_jax.quantize_model(nn.Dense(4, use_bias=False), config=cpt_jax.get_preset("thirds"))
    x = jax.random.normal(jax.random.key(0), (2, 6))
    v = model.init(jax.random.key(1), x)
    with cpt_jax.precision(5, 5, rng=jax.random.key(2)):
        y = model.apply(v, x)
    want = formats.quantize(x, 5, fmt) @ formats.quantize(v["params"]["kernel"], 5, fmt)
    np.testing.assert_allclose(y, want, rtol=1e-6)
    ops = cpt_jax.count_ops(model, v, x)
    # 2 x 4 outputs of 6 MACs, every tensor 3 bits: b_w b_a + b_g (b_w + b_a) = 9 + 18
    assert float(cpt_jax.bitops_per_step(ops, 5, 5, cpt_jax.get_preset("thirds"))) == 48 * 27


def test_a_config_file_importing_the_users_module_offers_it_on_the_command_line(
        user, tmp_path, train_cli, capsys):
    config = _config_file(tmp_path)
    from experiments import train

    train.print_help(["experiments.train", f"--config={config}"])
    text = capsys.readouterr().out
    quantizer = next(line for line in text.splitlines() if "--config.precision.quantizer=" in line)
    controller = next(line for line in text.splitlines() if "--config.precision.controller=" in line)
    assert "thirds" in quantizer and "every_other" in controller
    assert "every_other: steps between raises" in text
    code, err = train_cli("--workdir", str(tmp_path / "bad"), f"--config={config}",
                          "--config.precision.controller=every_other",
                          "--config.precision.controller_every=0")
    assert code == 2 and "config.precision.controller_every=0 must be an integer >= 1" in err


@pytest.mark.slow
def test_the_main_job_trains_with_the_users_preset_and_controller(tmp_path):
    config = _config_file(tmp_path, num_steps=6, eval_every=0, log_every=3, plots=False,
                          tensorboard=False, batch_size=32)
    work = tmp_path / "run"
    run = subprocess.run(
        [sys.executable, "-m", "experiments.train", f"--workdir={work}", f"--config={config}",
         "--config.precision.quantizer=thirds", "--config.precision.controller=every_other",
         "--config.precision.controller_lift=3", "--config.precision.schedule=constant",
         "--config.precision.max_bits=5", "--progress=false"],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
        env={**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT})
    assert run.returncode == 0, run.stderr[-2000:]
    summary = json.load(open(work / "summary.json"))
    assert summary["controller"] == "every_other" and summary["num_compiles"] == 1
    # constant 5 bits, +3 on steps 0, 2, 4: three steps at 8, three at 5
    assert summary["realized_bits_histogram"]["forward"] == {"5": 3, "8": 3}
