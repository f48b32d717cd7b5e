"""Shared fixtures: the main job's command line run in this process; the multi-process
marker.

Tests marked ``@pytest.mark.multiprocess`` start several gloo-connected processes
(``scripts/multiprocess_check.py``) and take a minute or more each on 2 cores: they run
when ``CPT_JAX_MULTIPROCESS_TEST=1`` (CI sets it), else they are skipped with the reason.

`train_cli` runs ``python -m experiments.train ARGS`` without a new interpreter (no jax
import, no compile cache to warm: a user error costs milliseconds, not seconds), the
way ``app.run`` would: absl flag parsing through `experiments.train.parse_flags`
(``ml_collections`` reads the ``--config.*`` overrides from ``sys.argv``), then
`experiments.train.main`. It returns ``(exit code, stderr)``. The absl flags, their
``--config.*`` override flags and ``sys.argv`` are restored afterwards.
"""
from __future__ import annotations

import contextlib
import io
import os
import sys
import warnings

import pytest

MULTIPROCESS_ENV = "CPT_JAX_MULTIPROCESS_TEST"

# What a test computes must not depend on the machine it runs on: compute="auto" takes
# integer GEMMs only where this host's CPU is in the table of cpt_jax.providers.int_platforms
# (AMX); tests pin "none" (fake quantization) and test the integer path with compute="int".
os.environ.setdefault("CPT_JAX_INT_GEMM", "none")



def pytest_configure(config):
    config.addinivalue_line(
        "markers", f"multiprocess: starts several processes; runs when {MULTIPROCESS_ENV}=1")
    config.addinivalue_line(
        "markers", "slow: the slow tier (tens of seconds each); run with -m slow")


def pytest_collection_modifyitems(config, items):
    if os.environ.get(MULTIPROCESS_ENV) == "1":
        return
    skip = pytest.mark.skip(reason=f"multi-process (gloo) check, minutes on 2 cores; set "
                                   f"{MULTIPROCESS_ENV}=1 or run scripts/multiprocess_check.py")
    for item in items:
        if "multiprocess" in item.keywords:
            item.add_marker(skip)


def _forget_config_overrides(flag_values) -> None:
    for name in [n for n in flag_values if n.startswith("config.")]:
        delattr(flag_values, name)
    flag_values.unparse_flags()


@pytest.fixture
def train_cli(monkeypatch):
    """``train_cli(*args) -> (exit_code, stderr)`` of ``python -m experiments.train ARGS``."""
    from absl import flags

    from experiments import train

    def run(*args):
        argv = ["experiments.train", *args]
        monkeypatch.setattr(sys, "argv", argv)
        err = io.StringIO()
        code = 0
        _forget_config_overrides(flags.FLAGS)
        with contextlib.redirect_stderr(err), warnings.catch_warnings():
            # ml_collections loads the config file with importlib's load_module.
            warnings.filterwarnings("ignore", "the load_module", DeprecationWarning)
            try:
                train.main(train.parse_flags(argv))
            except SystemExit as exc:
                code = exc.code
        return code, err.getvalue()

    yield run
    _forget_config_overrides(flags.FLAGS)
