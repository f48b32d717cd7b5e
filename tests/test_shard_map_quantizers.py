"""Quantized train steps under ``jax.shard_map`` (issue 41).

Under ``shard_map`` every value's type names the mesh axes it varies over; a
``lax.cond`` whose branches return different such types, or a ``custom_vjp`` whose
cotangent varies where its input does not, is refused when the step is traced. The
CPU guard of stochastic rounding (`cpt_jax.formats.guarded_on_cpu`, tensors of at
least ``FAST_REDUCTION_MIN_SIZE`` elements) returned a constant from one branch, and
the decentralized job crashed on its first 8-bit step.

The types are the same on a mesh of one device, so the fast tests lower or trace the
steps here, in this process (no second jax): gossip's step (per-peer parameters,
errors stochastic and nearest), a peer's `train_step_body` and a user's data-parallel
step (replicated parameters; and replicated operands with a rounding key per device)
with a product of every provider building a ``lax.cond`` / ``lax.switch`` /
``lax.platform_dependent`` / ``custom_vjp`` (int8, FP8 compute, the low-precision GEMMs
at a traced width, a format schedule, the measured quantization effect), delayed
scaling's history, and scanned NNX layers (``nnx.scan``). The slow tests run the
steps on two devices (one subprocess) and check their values.
"""
from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import textwrap

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P
from nnx_stacks import ScannedBlocks

import cpt_jax
from cpt_jax import formats, schedules
from cpt_jax.distributed import gossip as dec
from cpt_jax.format_schedules import format_switch
from cpt_jax.providers.delayed_scaling import DelayedScalingProvider
from cpt_jax.quant_config import PRESETS, TensorQuant
from cpt_jax.training import classification_loss, train_step_body

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
D = 128   # (128, 128) errors and weights: the CPU guard of stochastic rounding runs
TX, EIGHT = optax.sgd(0.1), schedules.constant(8)
NEAREST = PRESETS["cpt"].replace(error=TensorQuant(formats.AffineInt(), "nearest"))
CPT_RULES = [("l1", NEAREST), ("head", None)]
"""l0: CPT (errors stochastic), l1: CPT with errors nearest, the classifier fp32."""
AUDIT_RULES = CPT_RULES[:1] + [
    ("l2", PRESETS["int8"]), ("l3", PRESETS["fp8_compute"]), ("l4", PRESETS["fp8_gemm"]),
    ("l5", format_switch(["mxfp6", "mxfp8_gemm"])), ("head", None)]
"""... and a product of each provider with a cond / switch / custom_vjp."""


class Net(nn.Module):
    layers: int = 2

    @nn.compact
    def __call__(self, x, train=False):
        for i in range(self.layers):
            x = nn.relu(nn.Dense(D, name=f"l{i}")(x))
        return nn.Dense(4, name="head")(x)


class Block(nnx.Module):
    def __init__(self, rngs):
        self.linear = nnx.Linear(D, D, rngs=rngs)

    def __call__(self, x):
        return nnx.relu(self.linear(x))


def Scanned(rngs):  # noqa: N802  (a model class to its callers)
    """Two `Block` s stacked by ``nnx.vmap``, run by ``nnx.scan`` (`nnx_stacks`)."""
    return ScannedBlocks(Block, rngs)


@functools.partial(jax.jit, static_argnums=1)
def batch(key, n):
    k1, k2 = jax.random.split(key)
    return {"inputs": jax.random.normal(k1, (n, D)),
            "labels": jax.random.randint(k2, (n,), 0, 4)}


def one(tree, i):
    return jax.tree.map(lambda v: v[i], tree)


def peers_and_data(model, num_peers: int, abstract: bool = False):
    """Every peer's state (compiled, or only its shapes) and a batch per peer."""
    init = jax.jit(lambda k: dec.init_peer_state(model, TX, k, jnp.zeros((D, D)), num_peers))
    peers = jax.eval_shape(init, jax.random.key(0)) if abstract else init(jax.random.key(0))
    data = [batch(jax.random.key(1 + i), D) for i in range(num_peers)]
    return peers, jax.tree.map(lambda *v: jnp.stack(v), *data)


def grads_of(model, variables, b, key, bits=8.0):
    def loss(params):
        with cpt_jax.precision(bits, 8.0, rng=key):
            logits, _ = model.apply({**variables, "params": params}, b["inputs"], mutable=True)
        return classification_loss(logits, b)[0]
    return jax.grad(loss)(variables["params"])


def data_parallel(model, mesh, per_device: str = ""):
    """A user's step: replicated parameters, a batch per device. The gradient of a
    replicated parameter is summed over the devices (JAX's transpose of its implicit
    cast to varying). `per_device` "key" / "key_bits": replicated operands (the whole
    batch on every device), but a rounding key (and a width) per device."""
    def body(variables, b, key, bits):
        if per_device:
            device = jax.lax.axis_index(dec.PEER_AXIS)
            key = jax.random.fold_in(key, device)
            bits = bits + 0.0 * device if per_device == "key_bits" else bits
        return grads_of(model, variables, b, key, bits)
    spec = P() if per_device else P(dec.PEER_AXIS)
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), spec, P(), P()),
                                 out_specs=P()))


def scan_grads(graphdef, state, x, key):
    def loss(state):
        with cpt_jax.precision(8.0, 8.0, rng=key):
            return jnp.mean(jnp.sin(nnx.merge(graphdef, state)(x)))
    return jax.grad(loss)(state)


def scan_data_parallel(graphdef, mesh):
    return jax.jit(jax.shard_map(lambda s, x, k: scan_grads(graphdef, s, x, k), mesh=mesh,
                                 in_specs=(P(), P(dec.PEER_AXIS), P()), out_specs=P()))


def abstract_variables(module):
    return jax.eval_shape(module.init, jax.random.key(0), jnp.zeros((1, D)))


# --------------------------------------------------------------------------- fast: traced

@pytest.fixture(scope="module")
def mesh():
    assert D * D >= formats.FAST_REDUCTION_MIN_SIZE
    return dec.make_peer_mesh(1)


@pytest.fixture(scope="module")
def full():
    return jax.eval_shape(lambda: batch(jax.random.key(4), D))


def test_a_gossip_step_with_stochastic_and_nearest_errors_lowers(mesh):
    # The decentralized job's 8-bit step on per-peer parameters: it crashed (issue 41).
    model = cpt_jax.quantize_model(Net(), rules=CPT_RULES)
    peers, data = peers_and_data(model, 1, abstract=True)
    step = dec.make_decentralized_step(model, TX, mesh, EIGHT, EIGHT, donate=False)
    # Lowered (on jax 0.12 too); the errors' finiteness conds of the CPU guard in it.
    assert "stablehlo.case" in step.lower(peers, data).as_text()


def test_every_provider_traces_in_a_peers_step(mesh):
    # A peer's train_step_body (make_train_step's body, as gossip runs it, here with
    # the measured quantization effect's cond), per-peer parameters, traced widths.
    audit = cpt_jax.quantize_model(Net(layers=6), rules=AUDIT_RULES)
    peers, data = peers_and_data(audit, 1, abstract=True)

    def body(s, b):
        new, metrics = train_step_body(audit, TX, classification_loss, one(s, 0), one(b, 0),
                                       jnp.float32(6), jnp.float32(8), "skip", None, {}, [0],
                                       stats=True, measure_every=2)
        return jax.tree.map(lambda v: v[None], new), jax.tree.map(lambda v: v[None], metrics)
    spec = P(dec.PEER_AXIS)
    jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec, spec), out_specs=(spec, spec))).trace(
        peers.train, data)


@pytest.mark.parametrize("per_device", ["", "key_bits"], ids=["replicated", "per_device_key_bits"])
def test_every_provider_traces_in_a_data_parallel_step(mesh, full, per_device):
    audit = cpt_jax.quantize_model(Net(layers=6), rules=AUDIT_RULES)
    data_parallel(audit, mesh, per_device).trace(
        abstract_variables(Net(layers=6)), full, jax.random.key(5), jnp.float32(6))


@pytest.mark.parametrize("config", ["format_switch", "mxfp4"])
def test_a_product_on_replicated_operands_with_a_key_per_device_traces(mesh, full, config):
    # format_switch: one branch rounds its errors stochastically (nvfp4_gemm), the
    # others draw no key, and each must return the same type; mxfp4: its errors,
    # quantized with a per-device key, vary where the product's output does not.
    config = (format_switch(["nvfp4_gemm", "mxfp6", "mxfp8_gemm"]) if config == "format_switch"
              else PRESETS[config])
    model = cpt_jax.quantize_model(Net(layers=1), rules=[("l0", config), ("head", None)])
    data_parallel(model, mesh, "key").trace(abstract_variables(Net(layers=1)), full,
                                            jax.random.key(5), jnp.float32(6))


def _per_device(op: str):
    """``op`` on a replicated (8, 8) operand with a key, a width or a history per device."""
    from cpt_jax.ops import fake_quant, int8_dot_general, quantize_grad, quantize_with_range
    from cpt_jax.ops.scale_history import delayed_scale_quantize, init_history
    dims = (((1,), (0,)), ((), ()))
    return {
        "fake_quant": lambda x, k, b: fake_quant(x, b, rounding="stochastic", key=k),
        "quantize_grad": lambda x, k, b: quantize_grad(x, b, key=k),
        "quantize_with_range": lambda x, k, b: quantize_with_range(x, -1.0, 1.0, b),
        "int8_dot_general": lambda x, k, b: int8_dot_general(x, x, dims, b, keys=(k, k)),
        "delayed_scale_quantize": lambda x, k, b: delayed_scale_quantize(
            x, 8, jax.tree.map(lambda h: h + 0 * b.astype(h.dtype), init_history()),
            formats.SymmetricInt())[0],
    }[op]


@pytest.mark.parametrize("op", ["fake_quant", "quantize_grad", "quantize_with_range",
                                "int8_dot_general", "delayed_scale_quantize"])
def test_each_quantized_op_differentiates_a_replicated_operand(mesh, op):
    # The custom_vjp's cotangent of a replicated x, quantized with a per-device key /
    # width / history, is summed over the devices (it was refused: issue 41).
    fn = _per_device(op)

    def body(x, key, bits):
        device = jax.lax.axis_index(dec.PEER_AXIS)
        key, bits = jax.random.fold_in(key, device), bits + 0.0 * device
        return jax.grad(lambda x: jnp.sum(jnp.sin(fn(x, key, bits))))(x)
    jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P(), P()), out_specs=P())).trace(
        jax.ShapeDtypeStruct((8, 8), jnp.float32), jax.random.key(0), jnp.float32(6))


def test_delayed_scaling_and_nnx_scan_trace_under_shard_map(mesh, full):
    # Delayed scaling: per-peer histories (in batch_stats) and a batch all peers share
    # (the layer's input replicated: the history's cond). Scanned NNX layers.
    delayed = cpt_jax.quantize_model(Net(), config=PRESETS["fp8_delayed"],
                                     provider=DelayedScalingProvider())
    peers, _ = peers_and_data(delayed, 1, abstract=True)

    def body(s, b):
        new, metrics = train_step_body(delayed, TX, classification_loss, one(s, 0), b,
                                       jnp.float32(6), jnp.float32(8), "skip", None, {}, [0])
        return jax.tree.map(lambda v: v[None], new), jax.tree.map(lambda v: v[None], metrics)
    spec = P(dec.PEER_AXIS)
    jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec, P()), out_specs=(spec, spec))).trace(
        peers.train, full)
    graphdef, state = nnx.split(cpt_jax.quantize_model(
        nnx.eval_shape(lambda: Scanned(nnx.Rngs(6)))))
    scan_data_parallel(graphdef, mesh).trace(state, full["inputs"], jax.random.key(5))


# --------------------------------------------------------------------------- slow: values

_TWO_DEVICES = textwrap.dedent(r"""
    import json, sys
    import jax, numpy as np
    from flax import nnx
    sys.path.insert(0, "tests")
    from test_shard_map_quantizers import *
    from cpt_jax.training import make_train_step

    assert jax.device_count() == 2, jax.devices()
    mesh, out = dec.make_peer_mesh(2), {}

    def gap(a, b):
        return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y))))
                   for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))

    def halves(tree):
        return [jax.tree.map(lambda v: v[i * D:(i + 1) * D], tree) for i in range(2)]

    # gossip: the peers' mean after exact gossip == the mean of each peer's local step
    model = cpt_jax.quantize_model(Net(), rules=CPT_RULES)
    peers, data = peers_and_data(model, 2)
    step = dec.make_decentralized_step(model, TX, mesh, EIGHT, EIGHT, donate=False)
    new = step(dec.shard_peers(peers, mesh), dec.shard_peers(data, mesh))[0].params
    local = make_train_step(model, TX, EIGHT, EIGHT, donate=False)
    steps = [local(one(peers.train, i), one(data, i))[0].params for i in range(2)]
    out["gossip_finite"] = all(bool(np.all(np.isfinite(v))) for v in jax.tree.leaves(new))
    out["gossip_peers_differ"] = gap(steps[0], steps[1]) > 0
    out["gossip_mean_vs_local_mean"] = gap(jax.tree.map(lambda v: v.mean(0), new),
                                           jax.tree.map(lambda a, b: (a + b) / 2, *steps))

    # data parallel, a low-precision GEMM among the products (its custom_vjp's weight
    # gradient summed over the devices): == the sum of the two halves' gradients
    dp = cpt_jax.quantize_model(Net(layers=3), rules=[("l2", PRESETS["fp8_gemm"])] + CPT_RULES)
    variables = jax.jit(Net(layers=3).init)(jax.random.key(3), jax.numpy.zeros((1, D)))
    full, key = batch(jax.random.key(4), 2 * D), jax.random.key(5)
    bits = jax.numpy.float32(8)   # traced in both (a static width rounds otherwise)
    got = data_parallel(dp, mesh)(variables, full, key, bits)
    ref = jax.jit(lambda b, bits: grads_of(dp, variables, b, key, bits))
    out["dp_vs_sum_of_halves"] = gap(got, jax.tree.map(lambda a, b: a + b,
                                                       *[ref(h, bits) for h in halves(full)]))

    # nnx.scan, the same
    graphdef, state = nnx.split(cpt_jax.quantize_model(Scanned(nnx.Rngs(6))))
    got = scan_data_parallel(graphdef, mesh)(state, full["inputs"], key)
    ref = jax.jit(lambda x: scan_grads(graphdef, state, x, key))
    out["scan_vs_sum_of_halves"] = gap(got, jax.tree.map(
        lambda a, b: a + b, *[ref(h) for h in halves(full["inputs"])]))
    print("RESULT " + json.dumps(out))
""")


@pytest.fixture(scope="module")
def two_devices():
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS="--xla_force_host_platform_device_count=2",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", _TWO_DEVICES], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    return json.loads(lines[-1][len("RESULT "):])


@pytest.mark.slow
def test_a_gossip_step_on_two_devices_keeps_the_mean_of_the_peers_local_steps(two_devices):
    assert two_devices["gossip_finite"] and two_devices["gossip_peers_differ"]
    assert two_devices["gossip_mean_vs_local_mean"] < 1e-6


@pytest.mark.slow
def test_data_parallel_gradients_on_two_devices_are_the_sum_of_the_devices(two_devices):
    assert two_devices["dp_vs_sum_of_halves"] < 1e-6
    assert two_devices["scan_vs_sum_of_halves"] < 1e-6
