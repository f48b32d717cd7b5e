"""The guides' code blocks run as written (docs/bring_your_own_model.md, docs/nnx.md)."""
from __future__ import annotations

import pathlib
import re
import sys
import types
import warnings

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
GUIDES = {
    "docs/bring_your_own_model.md": (
        "(2, 5, 32)",                       # decode's logits
        "query_key", "attention",
        "RawAttention/einsum_1 400",        # raw einsum attention, named by the module
        "\n1\n"),                           # one compilation for the cyclic schedule
    "docs/nnx.md": (
        "Decoder/einsum_1     dot_general   18432 quantized",
        "embed/attend         dot_general   49152 fp32",
        "\n1 True\n"),                      # one compilation, the loss goes down
}


def python_blocks(path: pathlib.Path) -> list:
    return re.findall(r"```python\n(.*?)```", path.read_text(), flags=re.S)


@pytest.mark.slow
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
    for expected in GUIDES[guide]:
        assert expected in out, (expected, out)
