"""The package's import graph: the data path flows one way, and every folder ships.

Read from the source (AST), module-level and function-level imports alike (a
function-level import is still a dependency; it only hides a cycle from Python).
A *unit* is a top-level module or subpackage of ``cpt_jax``; each has a layer, and
a unit imports only units of lower layers:

    registry, schedules, formats             (0: named tables; what a step and a number are)
    ops, quant_config, context, optim, models (1: quantized operations, recipes)
    interception                             (2: every product a model computes)
    providers, cost                          (3: what a product computes; its cost)
    doors, format_schedules, controllers     (4: quantize_model, schedules over formats,
                                              precision controllers)
    training, allocation, export, extensions (5: extensions register formats, presets,
                                              controllers through the public calls)
    distributed                              (6)
    data                                     (7)
    runner                                   (8: the main job)
"""
from __future__ import annotations

import ast
import os

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(REPO, "cpt_jax")

LAYERS = {
    "registry": 0, "schedules": 0, "formats": 0,
    "ops": 1, "quant_config": 1, "context": 1, "optim": 1, "models": 1,
    "interception": 2,
    "providers": 3, "cost": 3,
    "doors": 4, "format_schedules": 4, "controllers": 4,
    "training": 5, "allocation": 5, "export": 5, "extensions": 5,
    "distributed": 6,
    "data": 7,
    "runner": 8,
}


def _modules():
    """``{dotted module name: path}`` of every ``.py`` file under cpt_jax."""
    out = {}
    for root, _, files in os.walk(PACKAGE):
        for name in files:
            if name.endswith(".py") and name != "conftest.py":  # doctest setup
                path = os.path.join(root, name)
                dotted = os.path.relpath(path, REPO)[:-3].replace(os.sep, ".")
                out[dotted.removesuffix(".__init__")] = path
    return out


def _unit(dotted: str) -> str:
    parts = dotted.split(".")
    return parts[1] if len(parts) > 1 else ""


def _imported(path: str) -> set[str]:
    """Every absolute ``cpt_jax...`` name a module imports, at any depth of its code."""
    names = set()
    for node in ast.walk(ast.parse(open(path).read(), path)):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
    return {n for n in names if n == "cpt_jax" or n.startswith("cpt_jax.")}


def unit_graph() -> dict[str, set[str]]:
    """``{unit: units it imports}`` (the package ``__init__`` is the unit ``""``)."""
    graph: dict[str, set[str]] = {}
    for dotted, path in _modules().items():
        src = _unit(dotted)
        deps = {_unit(n) for n in _imported(path) if n != "cpt_jax"}
        graph.setdefault(src, set()).update(d for d in deps if d and d != src)
    return graph


def find_cycle(graph: dict[str, set[str]]):
    """One cycle of `graph` as a list of nodes, or None (depth-first search)."""
    state: dict[str, int] = {}
    stack = []

    def visit(node):
        state[node] = 1
        stack.append(node)
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                return stack[stack.index(dep):] + [dep]
            if dep not in state:
                found = visit(dep)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_find_cycle_finds_one_and_only_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_every_unit_has_a_layer():
    units = set(unit_graph()) - {""}
    assert units == set(LAYERS), (sorted(units - set(LAYERS)), sorted(set(LAYERS) - units))


def test_units_import_no_cycle():
    graph = {k: v for k, v in unit_graph().items() if k}
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


@pytest.mark.parametrize("unit", sorted(LAYERS))
def test_a_unit_imports_only_lower_layers(unit):
    upward = sorted(d for d in unit_graph().get(unit, ()) if LAYERS[d] >= LAYERS[unit])
    assert not upward, (f"cpt_jax.{unit} (layer {LAYERS[unit]}) imports "
                        f"{[(d, LAYERS[d]) for d in upward]}")


def test_interception_never_imports_a_provider():
    """The seam hands products to providers it is given; it does not choose one."""
    for dotted, path in _modules().items():
        if _unit(dotted) == "interception":
            assert not any(_unit(n) == "providers" for n in _imported(path)), dotted


def test_every_folder_of_the_package_is_a_package_that_ships():
    """A folder without ``__init__.py`` is left out of the wheel by find_packages."""
    setuptools = pytest.importorskip("setuptools")
    shipped = set(setuptools.find_packages(REPO, include=["cpt_jax*"]))
    folders = {os.path.relpath(root, REPO).replace(os.sep, ".")
               for root, _, files in os.walk(PACKAGE)
               if any(f.endswith(".py") for f in files) and "__pycache__" not in root}
    assert folders == shipped, sorted(folders ^ shipped)


EXTRA_MODULES = ("tensorflow_datasets", "tensorflow", "grain", "matplotlib", "sklearn",
                 "tensorboardX", "tensorboard", "tqdm", "ml_collections", "PIL")
"""The ``experiments`` extra's packages (requirements-experiments.txt): the main job's,
the plots' and the data loaders'. The library never needs them."""


def test_the_library_loads_none_of_the_experiments_extra():
    """``import cpt_jax`` and its subpackages other than ``runner`` and ``data`` (loaded
    on first use: ``export``, ``models``, ``allocation``, ``distributed``) load none of
    the extra's packages, in a fresh interpreter (this one has loaded them for other
    tests). Imports inside functions are checked from the source by
    `tests/test_packaging.py` (the library imports only requirements.txt's packages)."""
    import json
    import subprocess
    import sys

    code = ("import json, sys, cpt_jax\n"
            "for name in ('export', 'models', 'allocation', 'distributed'):\n"
            "    getattr(cpt_jax, name)\n"
            "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules})))")
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO)
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    loaded = set(json.loads(result.stdout.strip().splitlines()[-1]))
    assert {"cpt_jax", "flax", "optax"} <= loaded
    assert not loaded & set(EXTRA_MODULES), sorted(loaded & set(EXTRA_MODULES))
