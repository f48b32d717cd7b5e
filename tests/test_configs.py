"""Every config file derives from default.get_config(): all its fields, valid, and locked."""
from __future__ import annotations

import importlib
import pathlib

import pytest

from cpt_jax.runner.validation import validate_config
from experiments.configs import default

CONFIG_DIR = pathlib.Path(__file__).resolve().parent.parent / "experiments" / "configs"
NAMES = sorted(p.stem for p in CONFIG_DIR.glob("*.py") if p.stem not in ("__init__", "default"))


def _fields(config, prefix=""):
    out = {}
    for key, value in config.items():
        if hasattr(value, "items") and key != "model_kwargs":
            out.update(_fields(value, f"{prefix}{key}."))
        else:
            out[prefix + key] = value
    return out


def test_there_are_configs_to_check():
    assert {"cifar10_resnet", "cora_gcn", "ptb_lstm"} <= set(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_config_has_every_default_field_and_validates(name):
    config = importlib.import_module(f"experiments.configs.{name}").get_config()
    missing = set(_fields(default.get_config())) - set(_fields(config))
    assert not missing, f"{name} lacks default fields {sorted(missing)}"
    validate_config(config, device_count=1)


@pytest.mark.parametrize("name", NAMES)
def test_locked_config_rejects_unknown_fields(name):
    config = importlib.import_module(f"experiments.configs.{name}").get_config()
    config.lock()
    with pytest.raises(AttributeError):
        config.num_stepz = 3
