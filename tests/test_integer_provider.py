"""The integer provider through `quantize_model`: ``compute="int"`` and ``"auto"``.

What the compiled program runs is read from its optimized HLO (`benchmarks.hlo.gemms`):
every quantized product's three GEMMs are int8 x int8 -> int32, none runs on int32
operands, and on XLA CPU every int8 GEMM sits in the YNNPACK fusion (the fast kernel;
a transposed operand would send it to XLA's own loop, ~4x slower than float32 here).
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from nnx_stacks import ScannedBlocks

import cpt_jax
from benchmarks.hlo import gemms
from cpt_jax import providers
from cpt_jax.providers.integer import IntegerFallbackWarning, integer_path

X = jnp.asarray(np.random.default_rng(0).normal(size=(32, 24)), jnp.float32)
Y = jnp.arange(32) % 5


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(48)(x))
        x = nn.relu(nn.Dense(48)(x))
        return nn.Dense(5)(x)


def _step(config):
    """A jitted value-and-grad step of the MLP (CPT's rules: the head stays fp32) at
    traced widths, 8-bit stochastic errors: ``(step, params)``."""
    model = cpt_jax.quantize_model(MLP(), rules=cpt_jax.CPT_RULES, config=config)
    params = model.init(jax.random.key(1), X)

    @jax.jit
    def step(params, bits, seed):
        def loss(p):
            with cpt_jax.precision(bits, grad_bits=8, rng=jax.random.key(seed)):
                logits = model.apply(p, X)
            return optax.softmax_cross_entropy_with_integer_labels(logits, Y).mean()
        return jax.value_and_grad(loss)(params)
    return step, params


def _gemms(step, params):
    return gemms(step.lower(params, jnp.float32(6), 0).compile().as_text())


def test_every_gemm_of_a_quantized_layer_is_int8_on_the_fast_kernel_one_compile():
    step, params = _step(cpt_jax.QuantConfig(compute="int"))
    int_gemms = [g for g in _gemms(step, params) if g.integer]
    # 2 quantized layers x 3 GEMMs, less the first layer's input gradient (the input
    # is not differentiated: XLA drops it)
    assert len(int_gemms) == 5, int_gemms
    assert all(g.out == "s32" for g in int_gemms)
    assert not [g for g in _gemms(step, params) if g.lhs == "s32" or g.rhs == "s32"]
    if jax.default_backend() == "cpu" and any(g.library for g in int_gemms):
        assert {g.library for g in int_gemms} == {"__ynn_fusion"}, int_gemms
    losses = [float(step(params, jnp.float32(b), 0)[0]) for b in range(3, 9)]
    assert step._cache_size() == 1 and all(np.isfinite(losses))


def test_int_compute_has_fake_quantizations_forward_values():
    step_i, params = _step(cpt_jax.QuantConfig(compute="int"))
    step_f, _ = _step(cpt_jax.QuantConfig(compute="fake"))
    for bits in (3.0, 8.0):
        (li, gi), (lf, gf) = step_i(params, bits, 0), step_f(params, bits, 0)
        np.testing.assert_allclose(li, lf, rtol=1e-5)
        for a, b in zip(jax.tree.leaves(gi), jax.tree.leaves(gf)):
            scale = float(jnp.abs(b).max()) + 1e-6
            assert float(jnp.abs(a - b).max()) < 0.1 * scale  # another error draw for dx


def test_auto_is_fake_quantization_bit_for_bit_where_integers_are_not_faster(monkeypatch):
    monkeypatch.setenv("CPT_JAX_INT_GEMM", "none")
    assert providers.default_provider(cpt_jax.CPT_CONFIG) is providers.FAKE_QUANT
    step_a, params = _step(cpt_jax.CPT_CONFIG)
    step_f, _ = _step(cpt_jax.QuantConfig(compute="fake"))
    assert not [g for g in _gemms(step_a, params) if g.integer]
    for a, b in zip(jax.tree.leaves(step_a(params, 5.0, 3)), jax.tree.leaves(step_f(params, 5.0, 3))):
        np.testing.assert_array_equal(a, b)


def test_auto_takes_integers_on_the_platforms_of_the_table(monkeypatch):
    monkeypatch.setenv("CPT_JAX_INT_GEMM", jax.default_backend())
    assert providers.default_provider(cpt_jax.CPT_CONFIG) is providers.INTEGER
    assert providers.default_provider(cpt_jax.get_preset("mxfp8")) is providers.BLOCK_FORMATS
    step_a, params = _step(cpt_jax.CPT_CONFIG)
    step_i, _ = _step(cpt_jax.QuantConfig(compute="int"))
    assert len([g for g in _gemms(step_a, params) if g.integer]) == 5
    for a, b in zip(jax.tree.leaves(step_a(params, 4.0, 1)), jax.tree.leaves(step_i(params, 4.0, 1))):
        np.testing.assert_array_equal(a, b)


def test_the_host_decision_reads_the_cpu_flags():
    from cpt_jax.providers.int_platforms import integer_gemm_platforms
    assert integer_gemm_platforms(frozenset({"amx_int8", "amx_tile"}), env="auto") == ("cpu",)
    assert integer_gemm_platforms(frozenset({"avx2", "avx512_vnni"}), env="") == ()
    with pytest.raises(ValueError, match="unknown platform"):
        integer_gemm_platforms(env="gpu")


def test_integer_path_says_which_products_run_on_integers():
    model = cpt_jax.quantize_model(MLP(), rules=cpt_jax.CPT_RULES,
                                   config=cpt_jax.QuantConfig(compute="int"))
    ops = cpt_jax.count_ops(model, model.init(jax.random.key(0), X), X)
    paths = [integer_path(op.product, len(op.lhs_shape), len(op.rhs_shape)) if op.quantized
             else None for op in ops]
    assert paths == ["int", "int", None]


def test_int_compute_on_an_affine_conv_runs_fake_quant_and_warns():
    x = jnp.asarray(np.random.default_rng(1).normal(size=(2, 6, 6, 3)), jnp.float32)

    def run(compute):
        model = cpt_jax.quantize_model(nn.Conv(4, (3, 3)), config=cpt_jax.QuantConfig(
            compute=compute))
        v = model.init(jax.random.key(0), x)
        with cpt_jax.precision(4, 8, rng=jax.random.key(1)):
            return model.apply(v, x)
    with pytest.warns(IntegerFallbackWarning, match="conv"):
        y = run("int")
    np.testing.assert_array_equal(y, run("fake"))


class Block(nnx.Module):
    def __init__(self, rngs):
        self.up = nnx.Linear(16, 32, rngs=rngs)
        self.down = nnx.Linear(32, 16, rngs=rngs)

    def __call__(self, x):
        return x + self.down(nnx.relu(self.up(x)))


def Scanned(rngs):  # noqa: N802  (a model class to its callers)
    """Two `Block` s stacked by ``nnx.vmap``, run by ``nnx.scan`` (`nnx_stacks`)."""
    return ScannedBlocks(Block, rngs)


def test_integer_gemms_under_nnx_scan_train_with_one_compile():
    model = cpt_jax.quantize_model(Scanned(nnx.Rngs(0)), config=cpt_jax.QuantConfig(compute="int"))
    optimizer = nnx.Optimizer(model, optax.sgd(0.05), wrt=nnx.Param)
    x = jnp.asarray(np.random.default_rng(2).normal(size=(8, 16)), jnp.float32)

    @nnx.jit
    def train(model, optimizer, bits, seed):
        def loss(model):
            with cpt_jax.precision(bits, grad_bits=8, rng=jax.random.key(seed)):
                return jnp.mean((model(x) - x[:, ::-1]) ** 2)
        value, grads = nnx.value_and_grad(loss)(model)
        optimizer.update(model, grads)
        return value

    losses = [float(train(model, optimizer, jnp.float32(b), i)) for i, b in enumerate((3, 5, 8, 4))]
    assert all(np.isfinite(losses)) and losses[-1] < losses[0]


@pytest.mark.slow
def test_integer_gemms_under_shard_map_with_varying_and_replicated_parameters():
    code = textwrap.dedent("""
        import jax, jax.numpy as jnp, numpy as np, flax.linen as nn
        from jax.sharding import PartitionSpec as P
        import cpt_jax
        assert jax.device_count() == 2
        mesh = jax.sharding.Mesh(np.array(jax.devices()), ("peers",))
        model = cpt_jax.quantize_model(nn.Dense(8), config=cpt_jax.QuantConfig(compute="int"))
        x = jnp.asarray(np.random.default_rng(0).normal(size=(2, 16, 12)), jnp.float32)
        v = model.init(jax.random.key(0), x[0])
        stacked = jax.tree.map(lambda a: jnp.stack([a, 2 * a]), v)     # one model per peer

        def grads(v, x):
            def loss(v):
                with cpt_jax.precision(4.0, grad_bits=8.0, rng=jax.random.key(0)):
                    return jnp.sum(model.apply(v, x) ** 2)
            return jax.grad(loss)(v)

        varying = jax.jit(jax.shard_map(lambda v, x: jax.tree.map(
            lambda a: a[None], grads(jax.tree.map(lambda a: a[0], v), x[0])),
            mesh=mesh, in_specs=(P("peers"), P("peers")), out_specs=P("peers")))
        replicated = jax.jit(jax.shard_map(lambda v, x: jax.tree.map(
            lambda a: jax.lax.pmean(a, "peers"), grads(v, x[0])),
            mesh=mesh, in_specs=(P(), P("peers")), out_specs=P()))
        gv, gr = varying(stacked, x), replicated(v, x)
        one = grads(v, x[0])
        for a, b in zip(jax.tree.leaves(gv), jax.tree.leaves(one)):
            np.testing.assert_allclose(a[0], b, rtol=1e-5, atol=1e-5)
        assert all(bool(jnp.all(jnp.isfinite(a))) for a in jax.tree.leaves((gv, gr)))
        print("OK")
    """)
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS="--xla_force_host_platform_device_count=2")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=root, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0 and "OK" in out.stdout, out.stderr[-3000:]


def test_a_ragged_dot_keeps_fake_quantization_and_says_the_integer_path_does_not_cover_it():
    class Experts(nn.Module):   # a grouped GEMM (MoE), as MaxText's sparse matmul writes it
        @nn.compact
        def __call__(self, x):
            w = self.param("w", nn.initializers.lecun_normal(), (3, 24, 8))
            return jax.lax.ragged_dot(x, w, jnp.array([10, 12, 10], jnp.int32))

    def run(compute):
        model = cpt_jax.quantize_model(Experts(), config=cpt_jax.QuantConfig(compute=compute))
        v = model.init(jax.random.key(0), X)
        with cpt_jax.precision(4, 8, rng=jax.random.key(1)):
            return model.apply(v, X)
    with pytest.warns(IntegerFallbackWarning, match="dot_general and einsum products; a "
                                                    "ragged_dot keeps fake quantization"):
        y = run("int")
    np.testing.assert_array_equal(y, run("fake"))
