"""Every preset's quantizers and products give the outputs saved before the format
refactor (issue 32), bit for bit: `scripts/format_goldens.py` records and compares.

One test per registered preset: a preset (or the formats it uses) without outputs
recorded for the running jax version is skipped, naming the command that records
them (a new preset lands first, its outputs are recorded on each jax version)."""
from __future__ import annotations

import json
import os
import sys

import numpy as np
import pytest

import cpt_jax

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "scripts"))
import format_goldens  # noqa: E402


def _saved() -> dict:
    return json.load(open(format_goldens.GOLDENS))


@pytest.mark.slow
@pytest.mark.parametrize("name", list(cpt_jax.PRESETS))
def test_every_preset_gives_its_saved_outputs_bit_for_bit(name):
    version = format_goldens.jax_version()
    want = format_goldens.expected(_saved(), version)
    mine = {k: v for k, v in want.items() if k.split("/")[0] == name}
    if not mine:
        pytest.skip(f"no goldens of preset {name!r} recorded for jax {version}: record them "
                    f"with `{format_goldens.RECORD_COMMAND} {name}` on each jax version")
    current = format_goldens.record_preset(name)
    changed = {k: (mine[k], current.get(k)) for k in format_goldens.compare(mine, current)}
    assert not changed, f"{len(changed)} outputs differ (saved, now): {sorted(changed.items())[:20]}"
    assert set(current) == set(mine), (f"some outputs of the preset are not saved: "
                                       f"{format_goldens.RECORD_COMMAND} {name}")


def test_the_goldens_are_of_registered_presets_and_include_specials():
    saved = _saved()
    assert {"0.10", "0.12"} <= set(saved)
    for version in ("0.10", "0.12"):
        entries = saved[version]
        assert format_goldens.recorded_presets(entries) <= set(cpt_jax.PRESETS)
        assert {"cpt", "int8", "mxfp8", "nvfp4_gemm"} <= format_goldens.recorded_presets(entries)
    for section, entries in saved.items():   # a release's / CPU class's overrides
        minor = ".".join(section.split("+")[0].split(".")[:2])
        assert set(entries) <= set(saved[minor]), section
    x = format_goldens.special_inputs()
    assert np.isnan(x).any() and np.isinf(x).any() and (x == 0).any()


def test_a_weight_only_preset_is_recorded_without_its_fp32_tensors():
    config = cpt_jax.QuantConfig(weight=cpt_jax.TensorQuant(cpt_jax.SymmetricInt()),
                                 activation=None, error=None)
    entries = format_goldens.quantize_entries("weights_only", config)
    assert {k.split("/")[1] for k in entries} == {"weight"}
    assert entries["weights_only/weight/32"] == format_goldens.digest(format_goldens.special_inputs())
