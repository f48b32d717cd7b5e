"""Shared fixtures: the main job's command line run in this process.

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
import sys
import warnings

import pytest


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
