"""What `pip install cpt_jax` ships and needs (issue 43, item 6).

The license and changelog are there, the version has one source, the core install
depends only on what the library imports (the main job's and the data loaders'
dependencies are the ``experiments`` extra), the stated Python range is pyproject's,
and the README's snippet runs. CI builds the wheel and runs the snippet from it in a
clean virtualenv (``.ci/run``); `tests/test_imports.py` checks that ``import cpt_jax``
loads none of the extra's packages.
"""
from __future__ import annotations

import ast
import hashlib
import importlib.metadata
import os
import re
import sys
import tomllib

import pytest

import cpt_jax

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "cpt_jax")
APACHE_2_MD5 = "3b83ef96387f14655fc854ddc3c6bd57"
"""MD5 of https://www.apache.org/licenses/LICENSE-2.0.txt (the file every Apache-2.0
project ships, e.g. jax's, optax's, chex's)."""

# Import name -> distribution (lower case, as requirements() reads them), for the packages
# cpt_jax imports.
DISTRIBUTIONS = {
    "jax": "jax", "flax": "flax", "optax": "optax", "numpy": "numpy", "absl": "absl-py",
    "orbax": "orbax-checkpoint", "scipy": "scipy", "sklearn": "scikit-learn",
    "matplotlib": "matplotlib", "PIL": "pillow", "tqdm": "tqdm", "tensorboardX": "tensorboardx",
    "tensorflow_datasets": "tensorflow-datasets", "grain": "grain",
}
BROUGHT_BY_A_REQUIREMENT = {"etils": "orbax-checkpoint", "jaxlib": "jax",
                            "tensorflow": "tensorflow-datasets (tfds.load, optional)",
                            "pytest": "the doctests' conftest.py"}
EXTRA_ONLY = ("runner", "data")
"""Subpackages whose imports may come from the ``experiments`` extra."""
OPTIONAL = {os.path.join("schedules", "plots.py"): {"matplotlib"}}
"""Library functions that need an extra's package, imported when called, and say so
when it is missing (`cpt_jax.schedules.plot_schedules`)."""


def read(name: str) -> str:
    with open(os.path.join(ROOT, name)) as f:
        return f.read()


def requirements(name: str) -> set[str]:
    names = set()
    for line in read(name).splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            names.add(re.split(r"[<>=!~\[; ]", line, maxsplit=1)[0].lower())
    return names


def pyproject() -> dict:
    return tomllib.loads(read("pyproject.toml"))


def third_party_imports(where) -> set[str]:
    """Top-level names of the non-stdlib, non-cpt_jax modules imported (at any depth) by
    the files under cpt_jax accepted by `where(relative path)`."""
    names = set()
    for root, _, files in os.walk(PACKAGE):
        for file in files:
            path = os.path.join(root, file)
            if not file.endswith(".py") or not where(os.path.relpath(path, PACKAGE)):
                continue
            for node in ast.walk(ast.parse(read(path), path)):
                if isinstance(node, ast.Import):
                    names.update(a.name.split(".")[0] for a in node.names)
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names.add(node.module.split(".")[0])
    return {n for n in names if n not in sys.stdlib_module_names and n != "cpt_jax"}


def test_license_is_the_apache_2_text_pyproject_names():
    text = read("LICENSE")
    assert hashlib.md5(text.encode()).hexdigest() == APACHE_2_MD5
    project = pyproject()["project"]
    assert project["license"] == "Apache-2.0" and project["license-files"] == ["LICENSE"]


def test_the_version_has_one_source_and_the_changelog_has_its_entry():
    config = pyproject()
    assert "version" not in config["project"]
    assert config["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "cpt_jax.__version__"}
    assert re.fullmatch(r"\d+\.\d+\.\d+", cpt_jax.__version__)
    changelog = read("CHANGELOG.md")
    assert "## [Unreleased]" in changelog
    assert f"## [{cpt_jax.__version__}]" in changelog
    try:   # an installed copy (pip install -e .) reports the same version
        installed = importlib.metadata.version("cpt_jax")
    except importlib.metadata.PackageNotFoundError:
        return
    assert installed == cpt_jax.__version__


def test_the_wheel_ships_py_typed():
    assert os.path.isfile(os.path.join(PACKAGE, "py.typed"))
    assert pyproject()["tool"]["setuptools"]["package-data"]["cpt_jax"] == ["py.typed"]


def test_core_requirements_are_what_the_library_imports():
    core = requirements("requirements.txt")
    library = third_party_imports(lambda rel: rel.split(os.sep)[0] not in EXTRA_ONLY
                                  and rel not in OPTIONAL and not rel.endswith("conftest.py"))
    for rel, names in OPTIONAL.items():   # imported inside the function, nowhere else
        assert third_party_imports(lambda r, rel=rel: r == rel) - {"jax", "numpy"} == names
    unknown = library - set(DISTRIBUTIONS) - set(BROUGHT_BY_A_REQUIREMENT)
    assert not unknown, f"map these imports to their distributions: {sorted(unknown)}"
    needed = {DISTRIBUTIONS[n] for n in library if n in DISTRIBUTIONS}
    assert needed <= core, f"the library imports {sorted(needed - core)}, not in requirements.txt"
    # The core lists nothing the library does not import (runner/data's absl counts).
    everything = third_party_imports(lambda rel: not rel.endswith("conftest.py"))
    used = {DISTRIBUTIONS[n] for n in everything if n in DISTRIBUTIONS}
    assert core <= used, f"requirements.txt lists {sorted(core - used)}, imported nowhere"


def test_the_experiments_extra_holds_the_rest_and_test_docs_include_it():
    core, extra = requirements("requirements.txt"), requirements("requirements-experiments.txt")
    everything = third_party_imports(lambda rel: not rel.endswith("conftest.py"))
    unknown = everything - set(DISTRIBUTIONS) - set(BROUGHT_BY_A_REQUIREMENT)
    assert not unknown, sorted(unknown)
    needed = {DISTRIBUTIONS[n] for n in everything if n in DISTRIBUTIONS}
    assert needed <= core | extra, sorted(needed - core - extra)
    assert not core & extra and "ml-collections" in extra   # the job's configs
    for heavy in ("tensorflow-datasets", "grain", "matplotlib", "scikit-learn",
                  "tensorboardx"):
        assert heavy in extra and heavy not in core, heavy
    dynamic = pyproject()["tool"]["setuptools"]["dynamic"]
    extras = dynamic["optional-dependencies"]
    assert extras["experiments"] == {"file": ["requirements-experiments.txt"]}
    for name in ("test", "docs"):
        assert extras[name]["file"][0] == "requirements-experiments.txt", name


def test_build_md_states_pyprojects_python_range():
    spec = pyproject()["project"]["requires-python"]
    minimum = re.fullmatch(r">=\s*(3\.\d+)", spec)
    assert minimum, f"requires-python {spec!r}: update this test's reading of it"
    build = read("BUILD.md")
    assert f"Python >= {minimum.group(1)}" in build, "BUILD.md must state requires-python"
    assert not re.search(r"Python 3\.\d+ to 3\.\d+", build), "a second, hand-kept range"
    classifiers = pyproject()["project"]["classifiers"]
    tested = re.findall(r"\| (3\.\d+)\.\d+ \| \d", build)   # BUILD.md's tested-versions table
    assert tested and all(f"Programming Language :: Python :: {v}" in classifiers
                          for v in tested), (tested, classifiers)


def test_readme_installs_the_experiments_extra_for_the_job():
    readme = read("README.md")
    first = next(line for line in readme.splitlines() if "pip install" in line)
    assert 'pip install -e ".[experiments]"' in first and "experiments.train" in first
    assert "sphinx-build" in readme   # how to build the API reference


@pytest.mark.slow
def test_the_readme_snippet_runs_three_steps():
    """What CI runs from the wheel in a clean virtualenv (scripts/readme_snippet.py)."""
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    try:
        import readme_snippet
    finally:
        sys.path.pop(0)
    result = readme_snippet.run(3)
    assert result["compiles"] == 1 and result["loss"] > 0


def test_plotting_without_matplotlib_names_the_extra(monkeypatch):
    from cpt_jax import schedules

    monkeypatch.setitem(sys.modules, "matplotlib", None)   # as in a core install
    with pytest.raises(ImportError, match=r"pip install 'cpt_jax\[experiments\]'"):
        schedules.plot_schedules(schedules.constant(8), 10)
