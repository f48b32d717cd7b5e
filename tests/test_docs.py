"""The guides' code blocks run as written (docs/bring_your_own_model.md)."""
from __future__ import annotations

import pathlib
import re
import sys
import types
import warnings

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
GUIDES = ["docs/bring_your_own_model.md"]


def python_blocks(path: pathlib.Path) -> list:
    return re.findall(r"```python\n(.*?)```", path.read_text(), flags=re.S)


@pytest.mark.parametrize("guide", GUIDES)
def test_guide_code_blocks_run_in_order(guide, capsys):
    blocks = python_blocks(ROOT / guide)
    assert blocks, f"{guide} has no python blocks"
    module = types.ModuleType("cpt_guide")   # dataclasses look their module up
    sys.modules["cpt_guide"] = module
    namespace = module.__dict__
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        for i, block in enumerate(blocks):
            exec(compile(block, f"{guide}[block {i}]", "exec"), namespace)
    out = capsys.readouterr().out
    assert "(2, 5, 32)" in out               # decode's logits
    assert "query_key" in out and "attention" in out
    assert "\n1\n" in out                    # one compilation for the cyclic schedule
