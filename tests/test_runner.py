"""The main job: CLI outputs, one-line user errors, TensorBoard events, non-finite policy."""
from __future__ import annotations

import json
import os
import re
import signal
import struct
import subprocess
import sys
import time

import numpy as np
import pytest

from cpt_jax.runner import job as runner
from experiments.configs import default

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REQUIRED = ("final_test_accuracy", "relative_cost_fp32", "relative_cost_static8",
            "num_compiles", "steps", "wall_time_s", "params_sha256", "skipped_steps",
            "nonfinite_policy")


def _cli(*args, timeout=300):
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO)
    return subprocess.run([sys.executable, "-m", "experiments.train", *args], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=timeout)


def read_tensorboard_scalars(logdir):
    """{tag: [(step, value), ...]} from the event files in `logdir` (TFRecord framing:
    length u64, crc u32, Event proto, crc u32), parsed with tensorboardX's protos."""
    import sys as _sys

    hide = "torch" not in _sys.modules
    if hide:
        _sys.modules["torch"] = None
    try:
        from tensorboardX.proto import event_pb2
    finally:
        if hide:
            del _sys.modules["torch"]
    scalars = {}
    for name in sorted(os.listdir(logdir)):
        if "tfevents" not in name:
            continue
        data = open(os.path.join(logdir, name), "rb").read()
        pos = 0
        while pos + 12 <= len(data):
            (length,) = struct.unpack("<Q", data[pos:pos + 8])
            event = event_pb2.Event.FromString(data[pos + 12:pos + 12 + length])
            pos += 12 + length + 4
            for value in event.summary.value:
                scalars.setdefault(value.tag, []).append((event.step, value.simple_value))
    return scalars


@pytest.mark.slow
def test_cli_default_config_writes_metrics_summary_plots_and_events(tmp_path, train_cli):
    workdir = str(tmp_path / "run")
    code, err = train_cli(f"--workdir={workdir}", "--config=experiments/configs/default.py",
                          "--config.num_steps=12", "--config.log_every=4",
                          "--config.eval_every=8", "--config.precision.num_cycles=2",
                          "--progress=false")
    assert code == 0, err[-3000:]
    with open(os.path.join(workdir, "summary.json")) as f:
        summary = json.load(f)
    for key in REQUIRED:
        assert key in summary, key
    assert summary["num_compiles"] == 1 and summary["steps"] == 12
    assert 0.0 <= summary["final_test_accuracy"] <= 1.0
    assert 0.0 < summary["relative_cost_fp32"] < 1.0
    assert len(summary["params_sha256"]) == 64
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    train = [r for r in records if "step" in r]
    assert [r["step"] for r in train] == [4, 8, 12]
    assert all({"loss", "bits", "grad_bits", "cumulative_relative_cost"} <= set(r) for r in train)
    assert [r["eval"]["step"] for r in records if "eval" in r] == [8]
    assert "final" in records[-1]
    for png in ("bits.png", "curves.png"):
        with open(os.path.join(workdir, png), "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    scalars = read_tensorboard_scalars(os.path.join(workdir, "tensorboard"))
    assert [s for s, _ in scalars["loss"]] == [4, 8, 12]
    np.testing.assert_allclose([v for _, v in scalars["loss"]], [r["loss"] for r in train],
                               rtol=1e-6)
    assert [v for _, v in scalars["bits"]] == [r["bits"] for r in train]


def test_cli_user_error_is_one_line_without_traceback_in_a_real_process(tmp_path):
    # One real interpreter: exit code and stderr as a shell sees them (the other user
    # errors, and every bad data file, go through the same code in process:
    # `train_cli`, tests/test_bad_input.py).
    proc = _cli(f"--workdir={tmp_path}", "--config=experiments/configs/default.py",
                "--config.precision.min_bits=9")
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error: ")]
    assert errors == ["error: config.precision.min_bits=9 must be <= "
                      "config.precision.max_bits=8"], proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("args,message", [
    (["--config.no_such_field=3"],
     "error: --config.no_such_field: the config has no field 'no_such_field'"),
    (["--config.num_steps=many"], "error: flag --config.num_steps=many: invalid literal"),
])
def test_cli_user_error_is_one_line_naming_the_field(tmp_path, train_cli, args, message):
    code, err = train_cli(f"--workdir={tmp_path}", "--config=experiments/configs/default.py",
                          *args)
    assert code == 2
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(message), err


# --------------------------------------------------------------------------- in process

def _tiny_config(**changes):
    config = default.get_config()
    config.model = "mlp"
    config.num_steps = 12
    config.log_every = 4
    config.eval_every = 0
    config.plots = False
    config.tensorboard = False
    config.precision.num_cycles = 2
    for key, value in changes.items():
        node = config
        *parents, leaf = key.split(".")
        for parent in parents:
            node = node[parent]
        node[leaf] = value
    return config


@pytest.mark.slow
def test_nonfinite_stop_reports_step_bits_and_layer(tmp_path):
    config = _tiny_config(**{"nonfinite": "stop", "optimizer.learning_rate": 1e30,
                             "optimizer.lr_schedule": "constant"})
    with pytest.raises(runner.NonFiniteError) as info:
        runner.train_and_evaluate(config, str(tmp_path), progress=False)
    err = info.value
    assert 2 <= err.step <= 4  # step 1 blows the weights up, the next overflows
    assert err.bits in [float(b) for b in range(3, 9)] and err.grad_bits == 8.0
    assert err.layers and all(p.split("/")[0] in ("dense1", "dense2", "classifier")
                              for p in err.layers)
    message = str(err)
    assert f"step {err.step}" in message and f"bits={err.bits:g}" in message
    assert err.layers[0] in message and "\n" not in message
    with open(os.path.join(str(tmp_path), "summary.json")) as f:
        summary = json.load(f)
    assert summary["nonfinite_policy"] == "stop" and summary["skipped_steps"] == 1
    assert summary["nonfinite_stop"]["layers"] == err.layers
    assert summary["steps"] == err.step


@pytest.mark.slow
def test_nonfinite_skip_counts_the_skipped_steps(tmp_path):
    config = _tiny_config(**{"nonfinite": "skip", "optimizer.learning_rate": 1e30,
                             "optimizer.lr_schedule": "constant"})
    summary = runner.train_and_evaluate(config, str(tmp_path), progress=False)
    assert summary["nonfinite_policy"] == "skip" and summary["steps"] == 12
    assert 8 <= summary["skipped_steps"] <= 11
    with open(os.path.join(str(tmp_path), "metrics.jsonl")) as f:
        skipped = [json.loads(line).get("skipped_steps") for line in f]
    assert skipped[:3] == sorted(skipped[:3]) and skipped[2] == summary["skipped_steps"]


def test_first_signal_requests_a_stop_and_second_sigint_interrupts():
    with runner.StopRequest() as stop:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)
        assert stop.signum == signal.SIGTERM
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.5)
    assert signal.getsignal(signal.SIGTERM) is not stop._handle


def test_train_batches_seam_starts_at_the_given_step_and_evaluate_is_exact():
    import jax.numpy as jnp

    run, state = runner.build_run(_tiny_config())
    batches = runner.train_batches(run, 5)
    for step in (5, 6):
        expected = run.task.train_batch(step, run.data_rng)
        got = next(batches)
        for key in ("inputs", "labels"):
            np.testing.assert_array_equal(np.asarray(got[key]), np.asarray(expected[key]))
    # evaluate at 32 bits = the unquantized model on the whole test split
    result = runner.evaluate(run, state, 32.0)["test"]
    correct = total = 0
    for batch in run.task.eval_batches("test"):
        logits = run.task.model.apply({"params": state.params}, batch["inputs"], train=False)
        hit = np.asarray(jnp.argmax(logits, -1) == batch["labels"], np.float64)
        mask = np.asarray(batch.get("mask", np.ones_like(hit)), np.float64)
        correct += float((hit * mask).sum())
        total += float(mask.sum())
    assert result["accuracy"] == pytest.approx(correct / total, abs=1e-9)


# --------------------------------------------------------------------------- final state, --extend

_EXTEND_FLAGS = ["--config=experiments/configs/default.py", "--config.model=mlp",
                 "--config.precision.schedule=linear_growth", "--config.precision.num_cycles=2",
                 "--config.log_every=4", "--config.eval_every=0", "--config.plots=false",
                 "--config.tensorboard=false", "--progress=false"]


def _read(path):
    with open(path, "rb") as f:
        return f.read()


def _records(workdir):
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.startswith('{"step"')]


@pytest.mark.slow
def test_a_default_run_keeps_its_final_state_and_extend_continues_it(tmp_path, train_cli):
    from cpt_jax.runner import checkpoint as ckpt_lib
    from cpt_jax.runner.builders import precision_schedule_from_config

    workdir = str(tmp_path / "run")
    code, err = train_cli(f"--workdir={workdir}", *_EXTEND_FLAGS, "--config.num_steps=12")
    assert code == 0, err
    # checkpoint_every=0 (the default): no periodic checkpoint, the final state still kept.
    assert ckpt_lib.CheckpointManager(os.path.join(workdir, "checkpoints")).steps() == [12]
    first = _records(workdir)
    summary_before = _read(os.path.join(workdir, "summary.json"))

    # A longer run without --extend is refused, names the flag, and changes nothing.
    code, err = train_cli(f"--workdir={workdir}", *_EXTEND_FLAGS, "--config.num_steps=20")
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), err
    assert "config.num_steps=20 (checkpoint: 12)" in lines[0] and "--extend" in lines[0]
    assert _read(os.path.join(workdir, "summary.json")) == summary_before
    # Below the checkpoint's step even --extend refuses.
    code, err = train_cli(f"--workdir={workdir}", *_EXTEND_FLAGS, "--config.num_steps=8",
                          "--extend")
    assert code == 2 and "config.num_steps=8 is below the checkpoint's step 12" in err

    code, err = train_cli(f"--workdir={workdir}", *_EXTEND_FLAGS, "--config.num_steps=20",
                          "--extend")
    assert code == 0, err
    with open(os.path.join(workdir, "summary.json")) as f:
        summary = json.load(f)
    assert (summary["steps"], summary["resumed_from_step"], summary["extended_from_step"]) == (
        20, 12, 12)
    assert summary["schedule_segments"] == [[0, 12], [12, 20]]
    # Steps 1..12 as trained; 13..20 on the schedule rebuilt for 20 steps (period 10).
    config = default.get_config()
    config.precision.schedule, config.precision.num_cycles = "linear_growth", 2
    old, new = (precision_schedule_from_config(config.precision, n) for n in (12, 20))
    records = _records(workdir)
    assert records[:3] == first
    assert [r["bits"] for r in records[3:]] == [float(new(t - 1)) for t in (16, 20)]
    assert float(new(19)) != float(old(19))  # the rebuilt schedule really differs there
    bits = [float(old(t)) for t in range(12)] + [float(new(t)) for t in range(12, 20)]
    assert summary["mean_bits"] == pytest.approx(np.mean(bits))
    assert ckpt_lib.CheckpointManager(os.path.join(workdir, "checkpoints")).steps()[-1] == 20


@pytest.mark.slow
def test_a_schedule_over_formats_runs_compiled_once_and_reports_its_steps(tmp_path):
    config = _tiny_config(**{"precision.formats": "nvfp4_gemm,mxfp6,mxfp8_gemm",
                             "precision.schedule": "cos_growth", "precision.min_bits": 4,
                             "precision.max_bits": 8})
    summary = runner.train_and_evaluate(config, str(tmp_path), progress=False)
    assert summary["num_compiles"] == 1
    assert summary["formats"] == ["nvfp4_gemm", "mxfp6", "mxfp8_gemm"]
    steps = summary["format_steps"]
    assert sum(steps.values()) == 12 and all(steps[name] > 0 for name in summary["formats"])
    with open(os.path.join(str(tmp_path), "summary.json")) as f:
        assert json.load(f)["format_steps"] == steps
    # The cost counts each step in its format: NVFP4 (4.5 bits with scales) and MXFP6
    # (6.25) steps make the run cheaper than static 8/8 integer, which static MXFP8
    # (8.25 bits) is not.
    assert summary["relative_cost_static8"] < 1.0


@pytest.mark.slow
def test_a_finished_run_rerun_keeps_its_record_and_names_extend(tmp_path, train_cli):
    """Issue 43: rerunning a finished run trained nothing and overwrote summary.json
    with a zero-step record (num_compiles 0, steps_per_s 0.0), which
    experiments.compare then reported. The record is kept; the rerun says why."""
    from experiments import compare

    workdir = str(tmp_path / "run")
    flags = (f"--workdir={workdir}", *_EXTEND_FLAGS, "--config.num_steps=12")
    code, err = train_cli(*flags)
    assert code == 0, err
    summary_path = os.path.join(workdir, "summary.json")
    before = _read(summary_path)
    assert json.loads(before)["num_compiles"] == 1

    # The same command again, in a real process, with no platform requested (jax then
    # probes every backend it knows: the TPU probe's "Unable to initialize backend"
    # line is not shown).
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    env["PYTHONPATH"] = REPO
    rerun = subprocess.run([sys.executable, "-m", "experiments.train", *flags], cwd=REPO,
                           env=env, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr
    assert _read(summary_path) == before   # byte for byte
    assert "already finished its 12 steps" in rerun.stderr, rerun.stderr
    assert "--extend" in rerun.stderr and "Traceback" not in rerun.stderr
    assert "Unable to initialize backend" not in rerun.stderr, rerun.stderr
    assert json.loads(rerun.stdout)["num_compiles"] == 1   # the record, printed again
    assert compare.load_run("cpt", workdir)["num_compiles"] == 1
    # --extend to the same length is the same finished run.
    code, err = train_cli(*flags, "--extend")
    assert code == 0 and _read(summary_path) == before, err

    # The export of the finished run logs nothing of orbax (64 INFO lines before).
    export = subprocess.run(
        [sys.executable, "-m", "experiments.export", f"--run_dir={workdir}",
         f"--out={tmp_path / 'int8'}", "--bits=8", "--latency_repeats=1",
         "--calibration_batches=2"], cwd=REPO, env=dict(env, JAX_PLATFORMS="cpu"),
        capture_output=True, text=True, timeout=300)
    assert export.returncode == 0, export.stderr
    assert json.loads(export.stdout)["bits"] == 8
    assert not [line for line in export.stderr.splitlines()
                if re.search(r"orbax|checkpoint|tensorstore", line, re.I)], export.stderr
