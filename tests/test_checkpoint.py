"""Checkpoints: exact kill-and-resume, torn and corrupt checkpoints, PRNG keys, keep-k."""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from cpt_jax import checkpoint as ckpt_lib
from cpt_jax.models import MLP
from cpt_jax.training import create_train_state

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Small and deterministic: digits, an MLP, one CPU thread for XLA.
RUN_FLAGS = [
    "--config=experiments/configs/default.py", "--config.model=mlp",
    "--config.num_steps=200", "--config.precision.num_cycles=4",
    "--config.checkpoint_every=25", "--config.keep_checkpoints=2",
    "--config.log_every=5", "--config.eval_every=0", "--config.plots=false",
    "--config.tensorboard=false", "--progress=false",
]


@pytest.fixture(scope="module")
def compile_cache(tmp_path_factory):
    """A persistent XLA compilation cache shared by this module's subprocess runs."""
    return str(tmp_path_factory.mktemp("jax_cache"))


def _env(cache_dir=None):
    env = dict(os.environ)
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=REPO,
               XLA_FLAGS="--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1")
    if cache_dir:
        env.update(JAX_COMPILATION_CACHE_DIR=cache_dir,
                   JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                   JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
    return env


def _train_cmd(workdir):
    return [sys.executable, "-m", "experiments.train", f"--workdir={workdir}"] + RUN_FLAGS


def _start(workdir, cache_dir):
    os.makedirs(workdir, exist_ok=True)
    log = open(os.path.join(workdir, "stderr.txt"), "a")
    proc = subprocess.Popen(_train_cmd(workdir), cwd=REPO, env=_env(cache_dir),
                            stdout=subprocess.DEVNULL, stderr=log)
    log.close()
    return proc


def _finish(proc, workdir):
    proc.wait(timeout=600)
    with open(os.path.join(workdir, "stderr.txt")) as f:
        err = f.read()
    assert proc.returncode == 0, err[-3000:]
    with open(os.path.join(workdir, "summary.json")) as f:
        return json.load(f)


def _logged_steps(workdir):
    try:
        with open(os.path.join(workdir, "metrics.jsonl")) as f:
            return [json.loads(line)["step"] for line in f if line.startswith('{"step"')]
    except (OSError, ValueError, KeyError):
        return []


def _saving_now(workdir, min_step):
    """True while orbax writes the checkpoint of a step >= min_step (its tmp folder)."""
    try:
        names = os.listdir(os.path.join(workdir, "checkpoints"))
    except OSError:
        return False
    return any("orbax-checkpoint-tmp" in n and int(n.split(".")[0]) >= min_step
               for n in names if n.split(".")[0].isdigit())


def _complete_checkpoints(workdir):
    """Steps of the checkpoints with a manifest (looked at without touching them)."""
    root = os.path.join(workdir, "checkpoints")
    return sorted(int(n) for n in os.listdir(root) if n.isdigit()
                  and os.path.isfile(os.path.join(root, n, ckpt_lib.MANIFEST_NAME)))


def _kill_when(proc, condition, timeout=400):
    """SIGKILL `proc` as soon as `condition()` holds; returns when it is dead."""
    try:
        deadline = time.time() + timeout
        while time.time() < deadline and proc.poll() is None and not condition():
            time.sleep(0.01)
        assert proc.poll() is None, "the run finished before it could be killed"
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == -signal.SIGKILL


def _train_lines(workdir):
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [line for line in f if '"final"' not in line]


def test_sigterm_and_sigkill_mid_save_and_mid_training_then_resume_is_bit_identical(
        tmp_path, compile_cache):
    """One run stopped three times (SIGTERM; SIGKILL while saving; SIGKILL while training)
    and resumed each time ends bit-identical to an uninterrupted run."""
    seed = random.randrange(10**6)
    print(f"random kill steps from seed {seed}")
    rng = random.Random(seed)
    killed_dir, ref_dir = str(tmp_path / "killed"), str(tmp_path / "ref")

    # The uninterrupted reference runs alongside; once it trains, the compile cache is warm.
    reference_proc = _start(ref_dir, compile_cache)
    deadline = time.time() + 400
    while not _logged_steps(ref_dir) and reference_proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)

    # 0) SIGTERM (preemption): a checkpoint at the step it stopped, a summary, exit code 3.
    term_at = rng.randrange(10, 40)
    proc = _start(killed_dir, compile_cache)
    deadline = time.time() + 400
    while (proc.poll() is None and time.time() < deadline
           and (_logged_steps(killed_dir) or [0])[-1] < term_at):
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=300) == 3
    with open(os.path.join(killed_dir, "summary.json")) as f:
        stopped = json.load(f)
    assert stopped["interrupted"] and term_at <= stopped["steps"] < 200
    assert _complete_checkpoints(killed_dir)[-1] == stopped["steps"]

    # 1) killed while saving a checkpoint (step 50 or later), or at step >= 100 at the latest.
    first_save = rng.choice([50, 75])
    _kill_when(_start(killed_dir, compile_cache),
               lambda: _saving_now(killed_dir, first_save)
               or (_logged_steps(killed_dir) or [0])[-1] >= 100)
    killed_at = (_logged_steps(killed_dir) or [0])[-1]
    mid_save = _saving_now(killed_dir, 0)  # the torn save is left for the runner to handle
    assert _complete_checkpoints(killed_dir)[-1] >= 25

    # 2) resumed, then killed mid-training at a random later step.
    target = rng.randrange(min(killed_at + 10, 170), 171)
    print(f"SIGTERM at {stopped['steps']}, SIGKILL at {killed_at} (mid-save: {mid_save}), "
          f"SIGKILL at >= {target}")
    _kill_when(_start(killed_dir, compile_cache),
               lambda: (_logged_steps(killed_dir) or [0])[-1] >= target)

    # 3) resumed to the end.
    resumed = _finish(_start(killed_dir, compile_cache), killed_dir)
    reference = _finish(reference_proc, ref_dir)
    assert resumed["resumed_from_step"] is not None and resumed["resumed_from_step"] >= 25
    assert resumed["steps"] == reference["steps"] == 200
    assert resumed["params_sha256"] == reference["params_sha256"]
    assert resumed["num_compiles"] == 1
    # metrics.jsonl: the same records (bits, loss, cost) in the same order, no duplicates.
    assert _train_lines(killed_dir) == _train_lines(ref_dir)
    assert _logged_steps(killed_dir) == list(range(5, 201, 5))


# --------------------------------------------------------------------------- unit tests

def _state(seed=0):
    model = MLP(hidden=(8,), num_classes=3)
    tx = optax.chain(optax.add_decayed_weights(1e-4), optax.sgd(0.1, momentum=0.9))
    return create_train_state(model, tx, jax.random.key(seed), jnp.zeros((2, 4)))


def _bump(state, step):
    return state.replace(step=jnp.int32(step),
                         params=jax.tree_util.tree_map(lambda x: x + step, state.params),
                         rng=jax.random.fold_in(state.rng, step))


def _same(a, b):
    la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
    return len(la) == len(lb) and all(np.array_equal(np.asarray(x), np.asarray(y))
                                      for x, y in zip(la, lb))


def test_roundtrip_keeps_typed_key_optimizer_state_and_meta(tmp_path):
    state = _bump(_state(), 7)
    manager = ckpt_lib.CheckpointManager(str(tmp_path), keep=3)
    manager.save(7, state, {"records": [{"step": 5, "loss": 1.5}]})
    restored = manager.restore_latest(_state(seed=1))
    assert restored.step == 7 and restored.meta["records"] == [{"step": 5, "loss": 1.5}]
    assert jnp.issubdtype(restored.state.rng.dtype, jax.dtypes.prng_key)
    assert np.array_equal(jax.random.key_data(restored.state.rng), jax.random.key_data(state.rng))
    assert _same(restored.state.params, state.params)
    assert _same(restored.state.opt_state, state.opt_state)
    assert int(restored.state.step) == 7


def test_keeps_only_the_newest_k(tmp_path):
    manager = ckpt_lib.CheckpointManager(str(tmp_path), keep=2)
    state = _state()
    for step in (10, 20, 30):
        manager.save(step, _bump(state, step))
    assert manager.steps() == [20, 30]


def _corrupt_one_data_file(step_dir):
    files = sorted(os.path.join(r, f) for r, _, fs in os.walk(step_dir) for f in fs
                   if os.sep + "d" + os.sep in os.path.join(r, f))
    path = max(files, key=os.path.getsize)
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2] ^= 0xFF
    open(path, "wb").write(bytes(data))


def test_corrupt_checkpoint_is_skipped_with_a_warning(tmp_path, caplog):
    manager = ckpt_lib.CheckpointManager(str(tmp_path), keep=3)
    state = _state()
    manager.save(10, _bump(state, 10))
    manager.save(20, _bump(state, 20))
    _corrupt_one_data_file(manager.step_dir(20))
    assert "sha256" in ckpt_lib.verify_manifest(manager.step_dir(20), 20)
    with caplog.at_level("WARNING"):
        restored = ckpt_lib.CheckpointManager(str(tmp_path), keep=3).restore_latest(state)
    assert restored.step == 10 and _same(restored.state.params, _bump(state, 10).params)
    assert any("Skipping unusable checkpoint" in r.getMessage() and "/20" in r.getMessage()
               for r in caplog.records)
    assert os.listdir(os.path.join(str(tmp_path), ckpt_lib.INVALID_DIR))


def test_torn_checkpoints_are_skipped(tmp_path, caplog):
    manager = ckpt_lib.CheckpointManager(str(tmp_path), keep=5)
    state = _state()
    manager.save(10, _bump(state, 10))
    manager.save(20, _bump(state, 20))
    # Killed after orbax's rename, before the manifest: no manifest -> not used.
    os.remove(os.path.join(manager.step_dir(20), ckpt_lib.MANIFEST_NAME))
    # Killed inside orbax's save: a temporary folder, never listed.
    tmp = os.path.join(str(tmp_path), "30.orbax-checkpoint-tmp-123")
    os.makedirs(os.path.join(tmp, "state"))
    with caplog.at_level("WARNING"):
        fresh = ckpt_lib.CheckpointManager(str(tmp_path), keep=5)
        assert 30 not in fresh.steps()
        restored = fresh.restore_latest(state)
    assert restored.step == 10
    assert any("no cpt_manifest.json" in r.getMessage() for r in caplog.records)
    # The next save of step 20 works (the torn one was moved aside).
    fresh.save(20, _bump(state, 20))
    assert fresh.restore_latest(state).step == 20


def test_resume_refuses_a_checkpoint_of_another_config(tmp_path):
    from experiments.configs import default

    config = default.get_config()
    saved = ckpt_lib.config_to_json(config)
    ckpt_lib.check_resume_compatible(saved, config)
    config.log_every = 7  # operational: allowed
    ckpt_lib.check_resume_compatible(saved, config)
    config.precision.max_bits = 6
    with pytest.raises(ValueError, match=r"config.precision.max_bits=6 \(checkpoint: 8\)"):
        ckpt_lib.check_resume_compatible(saved, config)
