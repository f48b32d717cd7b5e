"""Every preset's quantizers and products give the outputs saved before the format
refactor (issue 32), bit for bit: `scripts/format_goldens.py` records and compares."""
from __future__ import annotations

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "scripts"))
import format_goldens  # noqa: E402


@pytest.mark.slow
def test_every_preset_gives_its_saved_outputs_bit_for_bit():
    saved = json.load(open(format_goldens.GOLDENS))
    version = format_goldens.jax_version()
    if version not in saved:
        pytest.skip(f"no goldens recorded for jax {version} (recorded: {sorted(saved)})")
    current = format_goldens.record()
    want = format_goldens.expected(saved, version)
    changed = {k: (want[k], current.get(k)) for k in format_goldens.compare(want, current)}
    assert not changed, f"{len(changed)} outputs differ (saved, now): {sorted(changed.items())[:20]}"
    assert set(current) == set(saved[version]), "a preset's outputs are not saved: --add-new"


def test_the_goldens_cover_every_preset_and_include_specials():
    saved = json.load(open(format_goldens.GOLDENS))
    assert {"0.10", "0.12"} <= set(saved)
    import cpt_jax
    for version in ("0.10", "0.12"):
        entries = saved[version]
        assert {k.split("/")[0] for k in entries} == set(cpt_jax.PRESETS)
    x = format_goldens.special_inputs()
    import numpy as np
    assert np.isnan(x).any() and np.isinf(x).any() and (x == 0).any()
