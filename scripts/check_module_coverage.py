"""Every module of cpt_jax is exercised: at least one of its functions ran.

    python -m pytest -q -n 2 --dist loadfile -m "not extended" --cov=cpt_jax --cov-report=
    python scripts/check_module_coverage.py [.coverage]

Reads the coverage data of a test run (pytest-cov, combined over the xdist workers)
and, for every ``.py`` file under ``cpt_jax/`` (``conftest.py``, the doctest setup,
aside), asks whether a line inside one of its function or method bodies was executed.
Being imported is not enough (``import cpt_jax`` imports nearly every module and runs
only its definitions). A module with no function at all (re-exports, constants) has
nothing to run and passes (its import may precede the measurement). Exits 1 listing
the modules that no test exercised, else prints one line. CI runs it after its run of the fast and slow tiers
(`-m "not extended"`), so that a test moved to the extended tier (scripts/tier_tests.py)
cannot leave a module untested in CI.
"""
from __future__ import annotations

import ast
import os
import sys

import coverage

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "cpt_jax")


def function_body_lines(path: str) -> set[int]:
    """Line numbers of the statements inside every function body of a module."""
    lines: set[int] = set()
    for node in ast.walk(ast.parse(open(path).read(), path)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for stmt in node.body:
                for sub in ast.walk(stmt):
                    if isinstance(sub, ast.stmt):
                        lines.add(sub.lineno)
    return lines


def main(argv: list[str]) -> int:
    data_file = argv[1] if len(argv) > 1 else os.path.join(ROOT, ".coverage")
    if not os.path.exists(data_file):
        print(f"no coverage data at {data_file}: run pytest with --cov=cpt_jax first",
              file=sys.stderr)
        return 2
    data = coverage.CoverageData(basename=data_file)
    data.read()
    executed = {os.path.realpath(f): set(data.lines(f) or ()) for f in data.measured_files()}
    missing, counted = [], 0
    for root, _, files in os.walk(PACKAGE):
        for name in sorted(files):
            if not name.endswith(".py") or name == "conftest.py":
                continue
            path = os.path.realpath(os.path.join(root, name))
            ran = executed.get(path, set())
            body = function_body_lines(path)
            ok = bool(ran & body) if body else True   # nothing to run but its import
            counted += 1
            if not ok:
                missing.append(os.path.relpath(path, ROOT))
    if missing:
        print(f"{len(missing)} of {counted} cpt_jax modules had no function run by these "
              f"tests:\n  " + "\n  ".join(sorted(missing)), file=sys.stderr)
        return 1
    print(f"all {counted} cpt_jax modules exercised (a function of each ran, where it has one)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
