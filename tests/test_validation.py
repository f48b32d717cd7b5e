"""Config validation: every bad field gives a ValueError naming field, value, allowed."""
from __future__ import annotations

import pytest

from cpt_jax.runner.validation import validate_config
from experiments.configs import default


def _config(**overrides):
    config = default.get_config()
    for path, value in overrides.items():
        *parents, leaf = path.split("__")
        node = config
        for parent in parents:
            node = node[parent]
        with node.ignore_type():
            node[leaf] = value
    return config


def test_default_config_is_valid():
    validate_config(default.get_config(), device_count=1)


CASES = [
    # (field override(s), expected message (regex))
    ({"num_steps": 0}, r"config\.num_steps=0 must be an integer >= 1"),
    ({"num_steps": 2.5}, r"config\.num_steps=2\.5 must be an integer >= 1"),
    ({"batch_size": 0}, r"config\.batch_size=0 must be an integer >= 1"),
    ({"batch_size": 5000}, r"config\.batch_size=5000 must be <= 1497, the number of training "
                           r"examples of 'digits'"),
    ({"eval_batch_size": -1}, r"config\.eval_batch_size=-1 must be an integer >= 0"),
    ({"seed": -3}, r"config\.seed=-3 must be an integer in \[0, "),
    ({"log_every": 0}, r"config\.log_every=0 must be an integer >= 1"),
    ({"eval_every": -5}, r"config\.eval_every=-5 must be an integer >= 0"),
    ({"checkpoint_every": -1}, r"config\.checkpoint_every=-1 must be an integer >= 0"),
    ({"keep_checkpoints": 0}, r"config\.keep_checkpoints=0 must be an integer >= 1"),
    ({"param_sharding": "zero3"}, r"config\.param_sharding='zero3' must be 'replicate'"),
    ({"nonfinite": "explode"}, r"config\.nonfinite='explode' is unknown; choose one of "
                               r"\['skip', 'ignore', 'stop'\]"),
    ({"tensorboard": "yes"}, r"config\.tensorboard='yes' must be True or False"),
    ({"plots": 1}, r"config\.plots=1 must be True or False"),
    ({"augment": "no"}, r"config\.augment='no' must be True, False or None"),
    ({"dataset": "cifar11"}, r"config\.dataset='cifar11' is unknown; choose one of \[.*'cifar10'"),
    ({"model": "resnet21"}, r"config\.model='resnet21' is unknown; choose one of \[.*'resnet20'"),
    ({"data_dir": "/no/such/dir"}, r"config\.data_dir='/no/such/dir' is not a directory"),
    ({"num_devices": 4}, r"config\.num_devices=4 must be <= 1, the number of devices"),
    ({"num_devices": -1}, r"config\.num_devices=-1 must be an integer >= 0"),
    ({"precision__schedule": "cos_grow"},
     r"config\.precision\.schedule='cos_grow' is unknown; choose one of \[.*'cos_growth'"),
    ({"precision__min_bits": 9}, r"config\.precision\.min_bits=9 must be <= "
                                 r"config\.precision\.max_bits=8"),
    ({"precision__min_bits": 0}, r"config\.precision\.min_bits=0 must be an integer in "
                                 r"\[1, 32\]"),
    ({"precision__max_bits": 33}, r"config\.precision\.max_bits=33 must be an integer in "
                                  r"\[1, 32\]"),
    ({"precision__grad_bits": 0}, r"config\.precision\.grad_bits=0 must be an integer >= 1"),
    ({"precision__eval_bits": 40}, r"config\.precision\.eval_bits=40 must be an integer in "
                                   r"\[0, 32\]"),
    ({"precision__num_cycles": 0}, r"config\.precision\.num_cycles=0 must be an integer >= 1"),
    ({"precision__num_cycles": 2000}, r"config\.precision\.num_cycles=2000 must be <= "
                                      r"config\.num_steps=1500"),
    ({"precision__schedule": "critical_period", "precision__deficit_steps": 2000},
     r"config\.precision\.deficit_steps=2000 must be an integer in \[0, 1500\]"),
    ({"precision__quantizer": "fp4"}, r"config\.precision\.quantizer='fp4' is unknown; choose "
                                      r"one of \['cpt', 'int8', 'symmetric', .*'block_float', "
                                      r"'fp8_tensor', .*'mxfp4', .*'nvfp4'"),
    ({"precision__keep_full_precision": ("classifier(",)},
     r"config\.precision\.keep_full_precision\[0\]='classifier\(' is not a valid regex"),
    ({"precision__bit_offsets": (("conv1",),)},
     r"config\.precision\.bit_offsets\[0\]=\('conv1',\) must be a \(regex, bits_offset\) pair"),
    ({"optimizer__name": "lamb"}, r"config\.optimizer\.name='lamb' is unknown; choose one of "
                                  r"\['sgd', 'adam', 'adamw'\]"),
    ({"optimizer__learning_rate": 0.0}, r"config\.optimizer\.learning_rate=0\.0 must be a "
                                        r"number in \(0, inf\)"),
    ({"optimizer__learning_rate": float("nan")},
     r"config\.optimizer\.learning_rate=nan must be a number in \(0, inf\)"),
    ({"optimizer__momentum": 1.5}, r"config\.optimizer\.momentum=1\.5 must be a number in "
                                   r"\[0, 1\)"),
    ({"optimizer__weight_decay": -1e-4}, r"config\.optimizer\.weight_decay=-0\.0001 must be a "
                                         r"number in \[0, inf\)"),
    ({"optimizer__lr_schedule": "linear"}, r"config\.optimizer\.lr_schedule='linear' is "
                                           r"unknown; choose one of \['step', 'cosine', "
                                           r"'constant'\]"),
    ({"optimizer__warmup_steps": 1500}, r"config\.optimizer\.warmup_steps=1500 must be < "
                                        r"config\.num_steps=1500"),
    ({"optimizer__grad_clip": -1.0}, r"config\.optimizer\.grad_clip=-1\.0 must be a number "
                                     r"in \[0, inf\)"),
    ({"optimizer__nesterov": "maybe"}, r"config\.optimizer\.nesterov='maybe' must be True or "
                                       r"False"),
]


@pytest.mark.parametrize("overrides,message", CASES,
                         ids=lambda v: "+".join(v) if isinstance(v, dict) else None)
def test_each_bad_field_is_named_with_value_and_allowed(overrides, message):
    with pytest.raises(ValueError, match=message) as info:
        validate_config(_config(**overrides), device_count=1)
    assert "\n" not in str(info.value)


def test_int8_presets_take_any_width_wider_ones_fake_quantized_in_the_same_program():
    for name in ("int8", "int8_per_token"):
        validate_config(_config(precision__quantizer=name, precision__max_bits=10),
                        device_count=1)


def test_batch_must_split_over_the_devices():
    with pytest.raises(ValueError, match=r"config\.batch_size=63 must be divisible by the 8 "
                                         r"devices"):
        validate_config(_config(batch_size=63), device_count=8)
    validate_config(_config(batch_size=64), device_count=8)


def test_full_precision_skips_bit_checks():
    validate_config(_config(precision__schedule="none", precision__min_bits=0), device_count=1)
