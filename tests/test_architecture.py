"""The codebase's structural rules hold: short functions, no private names across modules,
small format modules, a curated top level.

* No function or method in `cpt_jax` is longer than 80 lines (docstring included).
* No module imports another module's private (``_name``) names, nor reaches for one as
  ``module._name``: what is shared is public.
* No module of `cpt_jax.formats` is longer than 400 lines (one idea per module).
* ``cpt_jax.__all__`` holds at most 80 names: the library's own (the runner, data,
  optimizers and distributed pieces are imported from their subpackages).
"""
from __future__ import annotations

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "cpt_jax"
MAX_FUNCTION_LINES = 80
MAX_FORMATS_MODULE_LINES = 400
MAX_TOP_LEVEL_NAMES = 80
SOURCES = sorted(p for p in PACKAGE.rglob("*.py") if p.name != "conftest.py")


def _module_names() -> set[str]:
    """Every cpt_jax module's short name (how other modules alias it: `formats`, `lp`...)."""
    return {p.stem for p in SOURCES if p.stem != "__init__"} | {
        p.parent.name for p in SOURCES if p.stem == "__init__"}


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def long_functions(tree: ast.AST, path: str) -> list[str]:
    """`path:line name (n lines)` for every function longer than MAX_FUNCTION_LINES."""
    return [f"{path}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
            for node in ast.walk(tree)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES]


def _folder(dotted: str) -> str:
    """The package a module belongs to: ``cpt_jax.interception._product`` ->
    ``cpt_jax.interception``."""
    return dotted.rsplit(".", 1)[0]


def private_crossings(tree: ast.AST, path: str, modules: set[str]) -> list[str]:
    """Imports of `_name` from cpt_jax modules (a folder's own private modules, `_x.py`,
    are its own: ``from cpt_jax.pkg import _x`` and ``from cpt_jax.pkg._x import y``
    only inside ``pkg``), and `module._name` attribute reads."""
    here = _folder(path.removesuffix(".py").replace("/", "."))
    if path.endswith("__init__.py"):
        here = path.removesuffix("/__init__.py").replace("/", ".")
    found = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.ImportFrom) and node.module
                and node.module.split(".")[0] == "cpt_jax"):
            parts = node.module.split(".")
            private_at = [i for i, part in enumerate(parts) if _is_private(part)]
            if private_at and ".".join(parts[:private_at[0]]) != here:
                found.append(f"{path}:{node.lineno} from {node.module} (private to its folder)")
            own_module = node.module == here
            found += [f"{path}:{node.lineno} from {node.module} import {a.name}"
                      for a in node.names if _is_private(a.name)
                      and not (own_module and _is_module(node.module, a.name))]
        elif (isinstance(node, ast.Attribute) and _is_private(node.attr)
              and isinstance(node.value, ast.Name) and node.value.id in modules):
            found.append(f"{path}:{node.lineno} {node.value.id}.{node.attr}")
    return found


def _is_module(package: str, name: str) -> bool:
    """Whether ``package.name`` is a module file or folder of the source tree."""
    base = PACKAGE.parent.joinpath(*package.split("."), name)
    return base.with_suffix(".py").exists() or base.is_dir()


def test_a_folders_private_modules_are_its_own():
    source = ("from cpt_jax.interception import _product\n"
              "from cpt_jax.interception._product import Product\n")
    tree = ast.parse(source)
    assert private_crossings(tree, "cpt_jax/interception/_operations.py", set()) == []
    assert len(private_crossings(tree, "cpt_jax/doors/_nnx.py", set())) == 2


def test_the_checks_catch_what_they_look_for():
    source = ("from cpt_jax.formats import _round\n"
              "import cpt_jax.formats as formats\n"
              "def f():\n    return formats._round\n"
              "def g():\n" + "    x = 1\n" * MAX_FUNCTION_LINES)
    tree = ast.parse(source)
    assert len(private_crossings(tree, "m.py", {"formats"})) == 2
    assert [s.split()[1] for s in long_functions(tree, "m.py")] == ["g"]


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_module_follows_the_structural_rules(path):
    tree = ast.parse(path.read_text())
    rel = str(path.relative_to(PACKAGE.parent))
    problems = long_functions(tree, rel) + private_crossings(tree, rel, _module_names())
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("path", sorted((PACKAGE / "formats").glob("*.py")), ids=lambda p: p.name)
def test_a_formats_module_is_at_most_400_lines(path):
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_FORMATS_MODULE_LINES, f"formats/{path.name}: {lines} lines"


def test_the_top_level_is_the_librarys_own_at_most_80_names():
    import cpt_jax

    names = cpt_jax.__all__
    assert len(names) <= MAX_TOP_LEVEL_NAMES, len(names)
    assert len(set(names)) == len(names)
    assert not {"runner", "data", "optim", "distributed"} & set(names)
    assert {"quantize_model", "precision", "cyclic", "PRESETS", "register_preset",
            "register_controller", "register_format", "bitops_per_step", "make_train_step",
            "TrainState"} <= set(names)
    for name in names:
        assert getattr(cpt_jax, name) is not None, name
    # names that left the list still resolve, where they live now
    assert cpt_jax.QuantDotGeneral is cpt_jax.doors.QuantDotGeneral
    assert cpt_jax.total_macs is cpt_jax.cost.total_macs and cpt_jax.runner.__name__ == "cpt_jax.runner"
