"""The codebase's structural rules hold: short functions, no private names across modules.

* No function or method in `cpt_jax` is longer than 80 lines (docstring included).
* No module imports another module's private (``_name``) names, nor reaches for one as
  ``module._name``: what is shared is public.
"""
from __future__ import annotations

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "cpt_jax"
MAX_FUNCTION_LINES = 80
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


def private_crossings(tree: ast.AST, path: str, modules: set[str]) -> list[str]:
    """Imports of `_name` from cpt_jax modules, and `module._name` attribute reads."""
    found = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.ImportFrom) and node.module
                and node.module.split(".")[0] == "cpt_jax"):
            found += [f"{path}:{node.lineno} from {node.module} import {a.name}"
                      for a in node.names if _is_private(a.name)]
        elif (isinstance(node, ast.Attribute) and _is_private(node.attr)
              and isinstance(node.value, ast.Name) and node.value.id in modules):
            found.append(f"{path}:{node.lineno} {node.value.id}.{node.attr}")
    return found


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
