"""The guides' code blocks run as written (docs/bring_your_own_model.md, docs/nnx.md);
every figure is in one place; the API reference has a page per name of ``cpt_jax.__all__``."""
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


# --------------------------------------------------------------------------- one place

PERFORMANCE = "docs/performance.md"
ABOUT_OVERHEAD = re.compile(r"overhead\.py|vs_pytorch\.py|quant(ized)? / (plain )?fp32")
A_FIGURE = re.compile(r"\b\d\.\d\d\b|\b\d+ ms\b")


@pytest.mark.parametrize("page", ["README.md", "BUILD.md"])
def test_the_overhead_figures_are_kept_in_performance_md_only(page):
    """BUILD.md's copy of the overhead table (2026-12-01) contradicted the README's
    (2026-12-05): the figures live in docs/performance.md, the other pages point there."""
    text = (ROOT / page).read_text()
    assert PERFORMANCE in text
    for paragraph in re.split(r"\n\s*\n", text):
        if ABOUT_OVERHEAD.search(paragraph):
            assert not A_FIGURE.findall(paragraph), (page, paragraph[:300])


def test_build_md_points_to_the_preset_table_instead_of_listing_presets():
    text = (ROOT / "BUILD.md").read_text()
    line = next(line for line in text.splitlines() if "`quantizer` (" in line)
    assert "cpt_jax.PRESETS" in line and "docs/formats.md" in text.split(line, 1)[1][:200]
    assert "| preset | weights |" in (ROOT / "docs/formats.md").read_text()


# --------------------------------------------------------------------------- API reference

@pytest.fixture(scope="module")
def apigen():
    sys.path.insert(0, str(ROOT / "docs"))
    try:
        import apigen
    finally:
        sys.path.pop(0)
    return apigen


def test_every_name_of_cpt_jax_all_has_an_api_page(apigen):
    """The pages come from each module's ``__all__`` (docs/apigen.py, at every Sphinx
    build); a re-export's page is the one where its object is documented. CI builds
    the site and checks the same on it (``python docs/apigen.py --check SITE``)."""
    import cpt_jax

    pages = apigen.plan()
    expected = apigen.expected_pages()
    assert set(expected) == {f"cpt_jax.{name}" for name in cpt_jax.__all__}
    for name, page in expected.items():
        target = page.removeprefix("api/").removesuffix(".html")
        if target.startswith("generated/"):
            module, _, symbol = target.removeprefix("generated/").rpartition(".")
            assert symbol in pages[module][0], (name, target)   # autosummary writes its page
        else:
            assert target in pages, (name, target)


def test_every_public_module_page_covers_its_all(apigen):
    import importlib

    for module, (symbols, links, submodules) in apigen.plan().items():
        listed = getattr(importlib.import_module(module), "__all__", None)
        if listed is None:
            continue
        named = set(symbols) | set(links) | {sub.rpartition(".")[2] for sub in submodules}
        assert named == set(listed), (module, sorted(set(listed) ^ named))
        assert not set(symbols) & set(links), module
