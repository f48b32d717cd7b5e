"""Tests of cpt_jax.distributed.mesh: data parallelism over a mesh, FSDP, multi-process batches.

Host-side helpers are tested in this process (one CPU device). The 8-device checks
run once in a subprocess with ``XLA_FLAGS=--xla_force_host_platform_device_count=8``
(the device count is fixed when jax first initializes, and other test files may
already have done that here). The two-process check (``jax.distributed`` over gloo
on loopback) takes minutes on a loaded 2-core machine, so it runs only with
``CPT_JAX_MULTIPROCESS_TEST=1``; the same check is ``scripts/multiprocess_check.py``.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from cpt_jax.distributed import mesh as parallel

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_fsdp_spec_shards_the_largest_divisible_axis_of_large_leaves():
    assert parallel.fsdp_spec((3, 3, 16, 32), 8) == P(None, None, None, "data")
    assert parallel.fsdp_spec((64, 10), 8, min_size=100) == P("data")
    assert parallel.fsdp_spec((64, 10), 8, min_size=1024) == P()      # too small
    assert parallel.fsdp_spec((9, 7, 5, 3), 8, min_size=1) == P()      # nothing divisible
    assert parallel.fsdp_spec((), 8) == P()
    with pytest.raises(ValueError, match="num_shards"):
        parallel.fsdp_spec((8,), 0)


def test_state_shardings_rejects_unknown_strategy():
    mesh = parallel.make_mesh(1)
    with pytest.raises(ValueError, match="strategy"):
        parallel.state_shardings({"w": jnp.ones(3)}, mesh, "zero")


def test_mesh_from_config_on_one_device_and_errors():
    config = ml_collections.ConfigDict({"batch_size": 6, "num_devices": 0})
    if jax.device_count() == 1:
        assert parallel.mesh_from_config(config) is None
    config.num_devices = jax.device_count() + 1
    with pytest.raises(ValueError, match="num_devices"):
        parallel.mesh_from_config(config)
    with pytest.raises(ValueError, match="num_devices"):
        parallel.make_mesh(jax.device_count() + 1)


def test_local_batch_slice_and_global_batch_on_one_process():
    mesh = parallel.make_mesh(1)
    assert parallel.local_batch_slice(12, mesh) == slice(0, 12)
    with pytest.raises(ValueError, match="global_batch_size"):
        parallel.local_batch_slice(0, mesh)
    x = np.arange(24, dtype=np.float32).reshape(12, 2)
    g = parallel.global_batch_from_local({"inputs": x}, mesh)
    assert g["inputs"].shape == (12, 2)
    np.testing.assert_array_equal(np.asarray(g["inputs"]), x)


_DEVICE_SCRIPT = textwrap.dedent(r"""
    import json
    import jax, jax.numpy as jnp, numpy as np, optax, ml_collections
    from cpt_jax import quantize_model, schedules, CPT_RULES
    from cpt_jax.distributed import mesh as parallel
    from cpt_jax.models import SmallCNN
    from cpt_jax.training import create_train_state, make_train_step

    assert jax.device_count() == 8
    out = {}
    model = quantize_model(SmallCNN(features=(8, 16), norm="batch"), rules=CPT_RULES)
    x = jax.random.normal(jax.random.key(1), (16, 8, 8, 1))
    y = jnp.arange(16) % 10
    batch = {"inputs": x, "labels": y}
    tx = optax.sgd(0.1, momentum=0.9, nesterov=True)
    fresh = lambda: create_train_state(model, tx, jax.random.key(0), x, train=False)
    mesh = parallel.make_mesh(8)
    cyc = schedules.cyclic("cos_growth", min_bits=4, max_bits=8, num_cycles=1, total_steps=2)

    def maxdiff(a, b):
        return max(jax.tree_util.tree_leaves(jax.tree_util.tree_map(
            lambda u, v: float(jnp.max(jnp.abs(u - v))), a, b)))

    # fp32: two steps on one device and on the mesh
    step1 = make_train_step(model, tx, None, None, donate=False)
    step8 = make_train_step(model, tx, None, None, donate=False)
    s1, s8 = fresh(), parallel.replicate(fresh(), mesh)
    b8 = parallel.shard_batch(batch, mesh)
    for _ in range(2):
        s1, m1 = step1(s1, batch)
        s8, m8 = step8(s8, b8)
    out["fp32_params"] = maxdiff(s1.params, s8.params)
    out["fp32_stats"] = maxdiff(s1.batch_stats, s8.batch_stats)
    out["fp32_loss"] = abs(float(m1["loss"]) - float(m8["loss"]))

    # cyclic forward bits (traced) + 8-bit stochastic errors: one device, replicated,
    # FSDP. Compared after the first step (a later step may differ by a rounding flip:
    # a 1e-7 reduction-order difference that crosses a quantization boundary).
    steps = {k: make_train_step(model, tx, cyc, schedules.constant(8), donate=False)
             for k in ("single", "replicate", "fsdp")}
    states = {"single": fresh(), "replicate": parallel.shard_state(fresh(), mesh, "replicate"),
              "fsdp": parallel.shard_state(fresh(), mesh, "fsdp", min_size=64)}
    out["fsdp_in_spec"] = str(states["fsdp"].params["conv2"]["kernel"].sharding.spec)
    bits = []
    for t in range(2):
        metrics = {}
        for k in steps:
            states[k], metrics[k] = steps[k](states[k], batch if k == "single" else b8)
        bits.append(float(metrics["replicate"]["bits"]))
        if t == 0:
            out["int8_params"] = maxdiff(states["single"].params, states["replicate"].params)
            out["int8_stats"] = maxdiff(states["single"].batch_stats,
                                        states["replicate"].batch_stats)
            out["int8_loss"] = abs(float(metrics["single"]["loss"])
                                   - float(metrics["replicate"]["loss"]))
            out["fsdp_vs_replicated"] = maxdiff(states["replicate"].params, states["fsdp"].params)
    out["fsdp_out_spec"] = str(states["fsdp"].params["conv2"]["kernel"].sharding.spec)
    out["cyclic_bits"] = bits
    out["cyclic_expected"] = np.asarray(schedules.schedule_values(cyc, 2)).tolist()
    out["cyclic_compiles"] = {k: v.num_compiles for k, v in steps.items()}
    out["batch_spec"] = str(b8["inputs"].sharding.spec)

    # per-process local batch -> global array (one process: all rows)
    rows = parallel.local_batch_slice(16, mesh)
    g = parallel.global_batch_from_local({"inputs": np.asarray(x)[rows]}, mesh)
    out["local_rows"] = [rows.start, rows.stop]
    out["global_from_local_equal"] = bool(np.array_equal(np.asarray(g["inputs"]), np.asarray(x)))
    out["global_from_local_spec"] = str(g["inputs"].sharding.spec)

    cfg = ml_collections.ConfigDict({"batch_size": 16, "num_devices": 0})
    out["config_mesh"] = dict(parallel.mesh_from_config(cfg).shape)
    try:
        parallel.mesh_from_config(ml_collections.ConfigDict({"batch_size": 12,
                                                             "num_devices": 0}))
        out["config_error"] = None
    except ValueError as e:
        out["config_error"] = str(e)

    # the main job with FSDP-sharded parameters: trains, checkpoints and resumes
    import tempfile
    from cpt_jax import runner
    from experiments.configs import default
    cfg = default.get_config()
    cfg.update({"model": "mlp", "num_steps": 4, "log_every": 2, "eval_every": 0,
                "checkpoint_every": 2, "plots": False, "tensorboard": False,
                "batch_size": 16, "param_sharding": "fsdp"})
    cfg.precision.num_cycles = 1
    import os, shutil
    with tempfile.TemporaryDirectory() as workdir:
        first = runner.train_and_evaluate(cfg, workdir, progress=False)
        shutil.rmtree(os.path.join(workdir, "checkpoints", "4"))  # as if stopped after 2
        resumed = runner.train_and_evaluate(cfg, workdir, progress=False)
    out["fsdp_runner"] = [first["steps"], resumed["resumed_from_step"], resumed["steps"],
                          first["params_sha256"] == resumed["params_sha256"]]
    print("RESULT " + json.dumps(out))
""")


@pytest.fixture(scope="module")
def device_results():
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS="--xla_force_host_platform_device_count=8",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", _DEVICE_SCRIPT], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    return json.loads(lines[-1][len("RESULT "):])


@pytest.mark.slow
@pytest.mark.parametrize("name", ["fp32", "int8"])
def test_data_parallel_step_equals_single_device_step(device_results, name):
    assert device_results[name + "_params"] < 1e-5
    assert device_results[name + "_stats"] < 1e-5        # BN statistics of the global batch
    assert device_results[name + "_loss"] < 1e-5


@pytest.mark.slow
def test_traced_precision_on_the_mesh_compiles_once(device_results):
    assert device_results["cyclic_bits"] == device_results["cyclic_expected"]
    assert len(set(device_results["cyclic_expected"])) == 2
    assert device_results["cyclic_compiles"] == {"single": 1, "replicate": 1, "fsdp": 1}


@pytest.mark.slow
def test_fsdp_shards_parameters_and_matches_replicated(device_results):
    assert "data" in device_results["fsdp_in_spec"]
    assert device_results["fsdp_out_spec"] == device_results["fsdp_in_spec"]
    assert device_results["fsdp_vs_replicated"] < 1e-5


@pytest.mark.slow
def test_main_job_trains_and_resumes_with_fsdp_parameters(device_results):
    first_steps, resumed_from, steps, same_params = device_results["fsdp_runner"]
    assert (first_steps, resumed_from, steps) == (4, 2, 4)
    assert same_params  # the resumed run ends on the uninterrupted run's parameters


@pytest.mark.slow
def test_batch_sharding_and_global_batch_from_local(device_results):
    assert "data" in device_results["batch_spec"]
    assert device_results["local_rows"] == [0, 16]
    assert device_results["global_from_local_equal"]
    assert "data" in device_results["global_from_local_spec"]
    assert device_results["config_mesh"] == {"data": 8}
    assert "divisible" in device_results["config_error"]


@pytest.mark.multiprocess
def test_two_processes_reach_the_parameters_of_one_process():
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "multiprocess_check.py"),
                           "--steps=2"], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=900)
    # The exit code first: a failed check may print no JSON at all.
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["process_count"] == 2 and result["process0_rows"] == [0, 16]
    assert max(result["fp32_max_abs_param_diff_per_step"]) < 1e-5
    assert result["int8_max_abs_param_diff_per_step"][0] <= 2e-4   # a few rounding flips
    assert result["int8_losses_multi"][0] == pytest.approx(result["int8_losses_single"][0], abs=1e-5)
