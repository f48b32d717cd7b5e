"""A multi-process run (two processes, gloo on loopback) that crashes or changes its
process count: ``scripts/multiprocess_check.py --crash`` and ``--reshard``.

Marked ``multiprocess``: they run with ``CPT_JAX_MULTIPROCESS_TEST=1`` (CI sets it).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

pytestmark = pytest.mark.multiprocess


def _check(*args, tmp_path):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "multiprocess_check.py"),
                           *args, f"--out={tmp_path}", "--timeout=400"], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=900)
    # The exit code first: a failed check may print no JSON at all.
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_crashed_process_is_restarted_and_ends_bit_identical(tmp_path):
    result = _check("--crash", tmp_path=tmp_path)
    # Process 1 died by SIGKILL after step 12 (checkpoint at 8); process 0 was stopped.
    assert result["crash_exit_codes"][1] == -9
    assert result["crash_checkpoints_at_crash"] == [8]
    assert result["crash_resumed_from_step"] == 8 and result["crash_steps"] == 24
    assert result["crash_params_sha256"] == result["crash_reference_params_sha256"]
    assert result["crash_ok"]
    # Both processes shared the workdir: one summary, checkpoints from both.
    assert os.path.isfile(os.path.join(tmp_path, "crash", "summary.json"))
    state = os.path.join(tmp_path, "crash", "checkpoints", "24", "state")
    assert os.path.isdir(os.path.join(state, "ocdbt.process_1"))


def test_a_checkpoint_resumes_on_another_process_count(tmp_path):
    result = _check("--reshard", tmp_path=tmp_path)
    for name in ("multi_to_single", "single_to_multi"):
        assert result[f"reshard_{name}_resumed_from_step"] == 12
        assert result[f"reshard_{name}_same_leaves"]
        # fp32 data parallel: one process or two differ by the reduction order only.
        assert result[f"reshard_{name}_max_abs_param_diff"] < 1e-4
    assert result["reshard_multi_vs_single_max_abs_param_diff"] < 1e-4
    assert result["reshard_ok"]
