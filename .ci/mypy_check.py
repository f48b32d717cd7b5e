"""mypy on cpt_jax against a baseline that only shrinks.

    python .ci/mypy_check.py            # fail on any error beyond the baseline
    python .ci/mypy_check.py --update   # rewrite the baseline (only when it shrank)

The baseline (.ci/mypy_baseline.txt) counts mypy's errors per (file, error code), so
moving code does not count as new errors; a count above its baseline fails, a count
below it asks for the baseline to be lowered.
"""
from __future__ import annotations

import collections
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASELINE = os.path.join(ROOT, ".ci", "mypy_baseline.txt")
ERROR = re.compile(r"^(?P<file>[^:]+):\d+: error: .*\[(?P<code>[a-z0-9-]+)\]$")


def current() -> collections.Counter:
    run = subprocess.run([sys.executable, "-m", "mypy", "--no-error-summary"], cwd=ROOT,
                         capture_output=True, text=True)
    if "No module named mypy" in run.stderr:  # else "0 errors" would pass the check
        sys.exit(f"mypy is not installed for {sys.executable}: pip install -e '.[test]'")
    out = run.stdout
    counts: collections.Counter = collections.Counter()
    for line in out.splitlines():
        m = ERROR.match(line.strip())
        if m:
            counts[f"{m['file']} {m['code']}"] += 1
    return counts


def read_baseline() -> collections.Counter:
    counts: collections.Counter = collections.Counter()
    if os.path.exists(BASELINE):
        for line in open(BASELINE):
            if line.strip() and not line.startswith("#"):
                key, n = line.rsplit(" ", 1)
                counts[key] = int(n)
    return counts


def main() -> int:
    now, base = current(), read_baseline()
    if "--update" in sys.argv:
        grown = {k: (base[k], n) for k, n in now.items() if n > base[k]}
        if grown and base:
            print(f"mypy: refusing to grow the baseline: {grown}")
            return 1
        with open(BASELINE, "w") as f:
            f.write("# mypy errors per (file, code): may only shrink (.ci/mypy_check.py)\n")
            f.writelines(f"{k} {n}\n" for k, n in sorted(now.items()))
        print(f"mypy baseline: {sum(now.values())} errors")
        return 0
    grown = {k: (base[k], n) for k, n in now.items() if n > base[k]}
    for key, (was, is_) in sorted(grown.items()):
        print(f"mypy: {key}: {is_} errors, baseline {was}")
    if grown:
        print("mypy: new type errors (run `python -m mypy` to see them)")
        return 1
    if sum(now.values()) < sum(base.values()):
        print(f"mypy: {sum(now.values())} errors, baseline {sum(base.values())}: lower it with "
              "`python .ci/mypy_check.py --update`")
    print(f"mypy ok: {sum(now.values())} errors, none beyond the baseline")
    return 0


if __name__ == "__main__":
    sys.exit(main())
