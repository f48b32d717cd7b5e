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



TIERS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tiers.txt")


def pytest_configure(config):
    config.addinivalue_line(
        "markers", f"multiprocess: starts several processes; runs when {MULTIPROCESS_ENV}=1")
    config.addinivalue_line(
        "markers", "slow: the slow tier (seconds to tens of seconds each); run with -m slow")
    config.addinivalue_line(
        "markers", "extended: the slowest end-to-end tests, by hand (-m extended), not in CI")


def _measured_tiers() -> dict[str, str]:
    """``{node id: tier}`` of tests/tiers.txt (scripts/tier_tests.py, from durations)."""
    if not os.path.exists(TIERS) or os.environ.get("CPT_JAX_TIERS") == "none":
        return {}
    with open(TIERS) as f:
        rows = [line.split(" ", 1) for line in f if line.strip() and not line.startswith("#")]
    return {node.strip(): tier for tier, node in rows}


@pytest.hookimpl(tryfirst=True)   # before -m deselects by marker
def pytest_collection_modifyitems(config, items):
    tiers = _measured_tiers()
    for item in items:
        tier = tiers.get(item.nodeid)
        if tier is not None:
            item.add_marker(getattr(pytest.mark, tier))
        if "extended" in item.keywords and "slow" not in item.keywords:
            item.add_marker(pytest.mark.slow)   # -m "not slow" (the fast tier) leaves it out
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


@pytest.fixture(autouse=True)
def _no_precision_left_active():
    """A test that leaves a `cpt_jax.precision` context active (its stack, or its part of
    JAX's jit-cache key) fails, and the state is reset for the worker's next tests: a
    leaked key made later tests' ``f._cache_size()`` read 0 (the cache of another key)."""
    yield
    from jax._src.config import config_ext

    from cpt_jax import context

    stack = list(context._LOCAL.stack)
    key = context._CACHE_KEY[0]._obj if context._CACHE_KEY else None
    keyed = config_ext.unset if key is None else key.get_local()
    context._LOCAL.stack.clear()
    if keyed is not config_ext.unset:
        key.set_local(config_ext.unset)
    leaked = stack + ([f"jit-cache key {keyed!r}"] if keyed is not config_ext.unset else [])
    if leaked:
        pytest.fail(f"the test left a precision context active: {leaked}", pytrace=False)
