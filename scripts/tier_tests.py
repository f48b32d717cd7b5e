"""Assign tests to tiers from their measured durations (a junit XML of a run).

The fast tier (the README's test command) must stay within its budget on the 2-core
machine; the slow tier is what CI adds on the oldest jax; the extended tier (the
slowest end-to-end tests) runs by hand (`-m extended` or `-m ""`), not in CI, so CI
stays within its 60 minutes. A test marked ``slow`` or ``extended`` in its own file
keeps that mark; this file only moves tests to a slower tier, never back.

    python -m pytest -q -n 2 --dist loadfile -m "" --junitxml=run.xml
    python scripts/tier_tests.py run.xml --fast-budget-s 380 --slow-budget-s 1000

writes ``tests/tiers.txt`` (``<tier> <node id>`` per line), which ``tests/conftest.py``
reads at collection. Budgets are test-seconds (the sum over both workers).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import xml.etree.ElementTree as ET

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIERS = os.path.join(ROOT, "tests", "tiers.txt")
KEEP_IN_CI = ("test_integer_gemm.py", "test_integer_provider.py", "shard_map", "gossip",
              "test_library_traps.py", "test_docs.py", "test_user_extension.py",
              "test_two_processes_reach", "test_a_crashed_process", "test_format_goldens.py",
              "test_export.py::test_int8_model_matches_fake_quant_per_model_kind[mlp]",
              "test_export.py::test_orbax_and_numpy_round_trips",
              "test_export.py::test_integer_products_are_in_the_program",
              "test_domain_models.py::test_lstm_grad_step")
"""CI runs these whatever their time: the integer GEMMs, jax.shard_map, the library's
traps, the guides, a user's extension, the multi-process checks, and a test of each
module the rest would leave unexercised (export and its providers, the LSTM: CI's
module-coverage check, scripts/check_module_coverage.py, fails without them)."""


def node_id(case: ET.Element) -> str:
    """``tests/test_x.py::[Class::]test_y[param]`` of a junit test case."""
    parts = case.get("classname", "").split(".")
    for i in range(len(parts), 0, -1):
        if os.path.exists(os.path.join(ROOT, *parts[:i]) + ".py"):
            return "::".join(["/".join(parts[:i]) + ".py", *parts[i:], case.get("name", "")])
    raise ValueError(f"no test file for {case.get('classname')!r}")


def durations(path: str) -> dict[str, float]:
    return {node_id(c): float(c.get("time", 0)) for c in ET.parse(path).iter("testcase")}


def collected(marker: str) -> list[str]:
    """The node ids pytest collects for ``-m marker`` by the marks in the test files
    (``CPT_JAX_TIERS=none``: tests/tiers.txt not applied)."""
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", marker,
                          "-p", "no:cacheprovider"], cwd=ROOT, capture_output=True, text=True,
                         env=dict(os.environ, JAX_PLATFORMS="cpu", CPT_JAX_TIERS="none")).stdout
    return [line.strip() for line in out.splitlines() if "::" in line]


def over_budget(ids: list[str], times: dict[str, float], budget: float,
                keep: tuple[str, ...] = ()) -> list[str]:
    """The slowest of `ids` to move out so the rest sum to at most `budget`; ids that
    contain one of `keep` stay (their time counts)."""
    ranked = sorted((i for i in ids if not any(k in i for k in keep)),
                    key=lambda i: times.get(i, 0.0), reverse=True)
    total = sum(times.get(i, 0.0) for i in ids)
    moved = []
    for i in ranked:
        if total <= budget:
            break
        moved.append(i)
        total -= times.get(i, 0.0)
    return moved


def fastest_of_each_file(ids: list[str], times: dict[str, float]) -> tuple[str, ...]:
    """The fastest test of every test file among `ids`: kept in CI, so that no file's
    tests all move to the extended tier."""
    best: dict[str, str] = {}
    for i in ids:
        f = i.split("::")[0]
        if f not in best or times.get(i, 0.0) < times.get(best[f], 0.0):
            best[f] = i
    return tuple(best.values())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("junit", nargs="+", help="junit XML of runs (the latest time of a test wins)")
    p.add_argument("--fast-budget-s", type=float, default=380.0)
    p.add_argument("--slow-budget-s", type=float, default=1000.0)
    p.add_argument("--keep-in-ci", default=",".join(KEEP_IN_CI),
                   help="comma-separated substrings of node ids never moved to extended")
    args = p.parse_args()
    times: dict[str, float] = {}
    for path in args.junit:
        times.update(durations(path))
    fast = collected("not slow and not extended")
    to_slow = over_budget(fast, times, args.fast_budget_s)
    slow = collected("slow and not extended") + to_slow
    keep = tuple(k for k in args.keep_in_ci.split(",") if k) + fastest_of_each_file(slow, times)
    to_extended = over_budget(slow, times, args.slow_budget_s, keep)
    to_slow = [i for i in to_slow if i not in set(to_extended)]
    with open(TIERS, "w") as f:
        f.write("# Generated by scripts/tier_tests.py from measured durations: <tier> <node id>.\n")
        for tier, ids in (("slow", to_slow), ("extended", to_extended)):
            for i in sorted(ids):
                f.write(f"{tier} {i}\n")
    kept = sum(times.get(i, 0.0) for i in fast if i not in set(to_slow) | set(to_extended))
    print(f"fast tier: {len(fast) - len(to_slow) - len([i for i in to_extended if i in fast])} "
          f"tests, {kept:.0f} test-s; moved to slow {len(to_slow)}, to extended "
          f"{len(to_extended)}; wrote {TIERS}")


if __name__ == "__main__":
    main()
