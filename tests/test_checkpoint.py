"""Checkpoints: exact kill-and-resume, torn and corrupt checkpoints, PRNG keys, keep-k."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from cpt_jax.models import MLP
from cpt_jax.runner import checkpoint as ckpt_lib
from cpt_jax.training import create_train_state

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KILL_POINTS = os.path.join(REPO, "tests", "kill_points.py")

# Digits and the default CNN, 40 steps, a checkpoint every 10; XLA as a user runs it
# (default, multi-threaded Eigen: no XLA_FLAGS).
RUN_FLAGS = [
    "--config=experiments/configs/default.py", "--config.num_steps=40",
    "--config.precision.num_cycles=4", "--config.checkpoint_every=10",
    "--config.keep_checkpoints=3", "--config.log_every=5", "--config.eval_every=0",
    "--config.plots=false", "--config.tensorboard=false", "--progress=false",
]


@pytest.fixture(scope="module")
def compile_cache(tmp_path_factory):
    """A persistent XLA compilation cache shared by this module's subprocess runs."""
    return str(tmp_path_factory.mktemp("jax_cache"))


def _env(cache_dir, kill=None):
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "CPT_TEST_KILL")}
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=REPO, JAX_COMPILATION_CACHE_DIR=cache_dir,
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
               JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
    if kill:
        env["CPT_TEST_KILL"] = kill
    return env


def _start(workdir, cache_dir, kill=None):
    """The CLI in a subprocess, to be killed at `kill` (`tests/kill_points.py`)."""
    os.makedirs(workdir, exist_ok=True)
    with open(os.path.join(workdir, "stderr.txt"), "a") as log:
        return subprocess.Popen([sys.executable, KILL_POINTS, f"--workdir={workdir}"]
                                + RUN_FLAGS, cwd=REPO, env=_env(cache_dir, kill),
                                stdout=subprocess.DEVNULL, stderr=log)


def _run(workdir, cache_dir, kill=None):
    """The exit code of `_start`'s run."""
    return _start(workdir, cache_dir, kill).wait(timeout=600)


def _stderr(workdir):
    with open(os.path.join(workdir, "stderr.txt")) as f:
        return f.read()[-3000:]


def _summary(workdir):
    with open(os.path.join(workdir, "summary.json")) as f:
        return json.load(f)


def _logged_steps(workdir):
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [json.loads(line)["step"] for line in f if line.startswith('{"step"')]


def _complete_checkpoints(workdir):
    """Steps of the checkpoints with a manifest (looked at without touching them)."""
    root = os.path.join(workdir, "checkpoints")
    return sorted(int(n) for n in os.listdir(root) if n.isdigit()
                  and os.path.isfile(os.path.join(root, n, ckpt_lib.MANIFEST_NAME)))


def _torn_saves(workdir):
    root = os.path.join(workdir, "checkpoints")
    return sorted(n for n in os.listdir(root) if "orbax-checkpoint-tmp" in n)


def _train_lines(workdir):
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [line for line in f if '"final"' not in line]


@pytest.mark.slow
def test_sigterm_and_sigkill_mid_save_and_mid_training_then_resume_is_bit_identical(
        tmp_path, compile_cache):
    """One run stopped four times at fixed points (SIGTERM; SIGKILL inside orbax's save;
    SIGKILL between orbax's commit and the manifest; SIGKILL mid-training) and resumed
    each time ends bit-identical to an uninterrupted run, under default XLA flags."""
    killed, ref = str(tmp_path / "killed"), str(tmp_path / "ref")
    sigkill = -signal.SIGKILL
    reference = _start(ref, compile_cache)  # the uninterrupted run, alongside

    # 0) SIGTERM after step 12 (a preemption): a checkpoint at 12, a summary, exit code 3.
    assert _run(killed, compile_cache, "term:12") == 3, _stderr(killed)
    stopped = _summary(killed)
    assert stopped["interrupted"] and stopped["steps"] == 12
    assert _complete_checkpoints(killed) == [10, 12]

    # 1) SIGKILL inside orbax's save of step 20: its temporary folder is left, torn.
    assert _run(killed, compile_cache, "kill_in_save:20") == sigkill, _stderr(killed)
    assert _complete_checkpoints(killed) == [10, 12] and _torn_saves(killed)

    # 2) SIGKILL after orbax committed step 30, before its manifest: 30 has no manifest.
    assert _run(killed, compile_cache, "kill_manifest:30") == sigkill, _stderr(killed)
    assert os.path.isdir(os.path.join(killed, "checkpoints", "30"))
    assert _complete_checkpoints(killed)[-1] == 20 and not _torn_saves(killed)

    # 3) resumed from 20 (30 is set aside), SIGKILL mid-training after step 35.
    assert _run(killed, compile_cache, "kill:35") == sigkill, _stderr(killed)
    assert _complete_checkpoints(killed)[-1] == 30
    assert os.listdir(os.path.join(killed, "checkpoints", ckpt_lib.INVALID_DIR))

    # 4) resumed from 30 to the end; the uninterrupted reference.
    assert _run(killed, compile_cache) == 0, _stderr(killed)
    assert reference.wait(timeout=600) == 0, _stderr(ref)
    resumed, reference = _summary(killed), _summary(ref)
    assert resumed["resumed_from_step"] == 30
    assert resumed["steps"] == reference["steps"] == 40
    assert resumed["params_sha256"] == reference["params_sha256"]
    assert resumed["num_compiles"] == 1
    # metrics.jsonl: the same records (bits, loss, cost) in the same order, no duplicates.
    assert _train_lines(killed) == _train_lines(ref)
    assert _logged_steps(killed) == list(range(5, 41, 5))


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


def test_a_checkpoint_of_another_model_is_refused_and_left_in_place(tmp_path):
    manager = ckpt_lib.CheckpointManager(str(tmp_path), keep=3)
    manager.save(10, _state())  # MLP(hidden=(8,)), 4 inputs
    other = create_train_state(MLP(hidden=(16,), num_classes=3), optax.sgd(0.1),
                               jax.random.key(0), jnp.zeros((2, 4)))
    with pytest.raises(ckpt_lib.IncompatibleCheckpointError,
                       match=r"holds another model's state: it holds 4 leaves this model "
                             r"lacks \(opt_state/1/0/trace/classifier/bias"):
        ckpt_lib.CheckpointManager(str(tmp_path), keep=3).restore_latest(other)
    wider = create_train_state(MLP(hidden=(16,), num_classes=3), optax.chain(
        optax.add_decayed_weights(1e-4), optax.sgd(0.1, momentum=0.9)),
        jax.random.key(0), jnp.zeros((2, 4)))
    with pytest.raises(ckpt_lib.IncompatibleCheckpointError,
                       match=r"params/classifier/kernel has shape \(8, 3\) and dtype float32 "
                             r"there, \(16, 3\) and float32 here"):
        ckpt_lib.CheckpointManager(str(tmp_path), keep=3).restore_latest(wider)
    # Neither skipped nor moved aside: the checkpoint is intact, only not this model's.
    assert not os.path.exists(os.path.join(str(tmp_path), ckpt_lib.INVALID_DIR))
    assert ckpt_lib.CheckpointManager(str(tmp_path), keep=3).restore_latest(_state()).step == 10


def test_another_programs_checkpoint_directory_is_refused(tmp_path):
    import orbax.checkpoint as ocp

    with ocp.CheckpointManager(str(tmp_path)) as foreign:  # e.g. a Flax example's
        foreign.save(5, args=ocp.args.StandardSave({"w": np.zeros(3, np.float32)}))
        foreign.wait_until_finished()
    before = sorted(os.listdir(os.path.join(str(tmp_path), "5")))
    with pytest.raises(ckpt_lib.IncompatibleCheckpointError, match="is not a cpt_jax checkpoint"):
        ckpt_lib.CheckpointManager(str(tmp_path), keep=3).restore_latest(_state())
    assert sorted(os.listdir(os.path.join(str(tmp_path), "5"))) == before


def test_resume_with_a_longer_num_steps_names_extend(tmp_path):
    from experiments.configs import default

    config = default.get_config()
    saved = ckpt_lib.config_to_json(config)
    config.num_steps = 3000
    with pytest.raises(ValueError, match=r"config.num_steps=3000 \(checkpoint: 1500\)\. "
                                         r"To continue this run .* --extend"):
        ckpt_lib.check_resume_compatible(saved, config)
    ckpt_lib.check_resume_compatible(saved, config, allow=("num_steps",))
    config.seed = 1  # --extend allows the length only
    with pytest.raises(ValueError, match=r"config.seed=1 \(checkpoint: 0\)") as info:
        ckpt_lib.check_resume_compatible(saved, config, allow=("num_steps",))
    assert "--extend" not in str(info.value)


def test_our_checkpoint_missing_an_item_is_corrupt_not_foreign(tmp_path, caplog):
    import shutil

    manager = ckpt_lib.CheckpointManager(str(tmp_path), keep=3)
    state = _state()
    manager.save(10, _bump(state, 10))
    manager.save(20, _bump(state, 20))
    shutil.rmtree(os.path.join(manager.step_dir(20), "meta"))  # it has its manifest: ours
    with caplog.at_level("WARNING"):
        restored = ckpt_lib.CheckpointManager(str(tmp_path), keep=3).restore_latest(state)
    assert restored.step == 10
    assert any("missing file meta/" in r.getMessage() for r in caplog.records)


def test_a_checkpoint_older_than_a_config_field_resumes_while_the_field_is_off():
    from experiments.configs import default

    config = default.get_config()
    saved = ckpt_lib.config_to_json(config)
    saved["precision"] = {k: v for k, v in saved["precision"].items()
                          if not k.startswith("controller")}   # written before controllers
    ckpt_lib.check_resume_compatible(saved, config)
    config.precision.controller_hold = 3   # not read while the controller is none
    ckpt_lib.check_resume_compatible(saved, config)
    config.precision.controller = "on_instability"
    with pytest.raises(ValueError, match=r"config.precision.controller='on_instability' "
                                         r"\(checkpoint: '<unset>'\)"):
        ckpt_lib.check_resume_compatible(saved, config)
    # Between two runs that both use a controller, its fields count.
    saved = ckpt_lib.config_to_json(config)
    config.precision.controller_hold = 4
    with pytest.raises(ValueError, match=r"controller_hold=4 \(checkpoint: 3\)"):
        ckpt_lib.check_resume_compatible(saved, config)
