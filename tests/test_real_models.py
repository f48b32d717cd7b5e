"""The zoo extended to the shapes of published LLM code (issue 29), measured
independently of cpt_jax's records (`zoo_measurement`):

- a mixture-of-experts decoder (Linen; and NNX blocks under ``nnx.scan``): top-k
  router, tokens sorted by expert, experts run by a ``@jax.jit`` helper calling
  ``lax.ragged_dot``, layers under ``nn.scan`` + ``nn.remat``, an RMSNorm whose
  scale is an einsum, tied logits; also with the experts under ``jax.shard_map``
  (measured on a one-device mesh, trained on two devices in a subprocess);
- an NNX decoder exposed to Linen through ``nnx.bridge.ToLinen``;
- a FeedForward whose projections share its scope (``nn.share_scope``);
- an NNX model running each layer through ``nnx.split`` -> ``jax.checkpoint`` ->
  ``nnx.update``.

Each one: every product on the 2-bit grid forward and backward, cost MACs = measured
MACs, every product under its own name, `CPT_RULES` keeping exactly the last product
in fp32 (and nothing else), and the MoE decoder trains with one compile.
"""
from __future__ import annotations

import functools
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
from jax import lax
from jax.sharding import PartitionSpec as P
from zoo_measurement import (
    KEY,
    _tokens,
    _x,
    check_linen,
    check_nnx,
    measure,
    on_grid,
    precision_loss,
)

import cpt_jax

VOCAB = 13


# --------------------------------------------------------------------------- the MoE decoder

class RMSNorm(nn.Module):
    """The scale applied as an einsum with no contraction (as published code does)."""

    @nn.compact
    def __call__(self, x):
        scale = self.param("scale", nn.initializers.ones, (x.shape[-1],))
        x = x * lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6)
        return jnp.einsum("...d,d->...d", x, scale)


@functools.partial(jax.jit, static_argnames="transpose")
def grouped_matmul(x, w, group_sizes, transpose=False):
    """The experts of sorted tokens: a jitted helper, as MoE libraries write it."""
    if transpose:
        w = jnp.swapaxes(w, 1, 2)
    return lax.ragged_dot(x, w, group_sizes)


def route(tokens, w_in, w_out, router_logits, top_k):
    """Top-k routing with the tokens sorted by expert, the experts as ragged_dots, the
    outputs put back in token order and combined by their gate."""
    n, experts = router_logits.shape
    gates, choice = lax.top_k(jax.nn.softmax(router_logits), top_k)     # (n, k)
    flat = choice.reshape(-1)
    order = jnp.argsort(flat)
    token_of = order // top_k
    group_sizes = jnp.bincount(flat, length=experts).astype(jnp.int32)
    h = jax.nn.gelu(grouped_matmul(tokens[token_of], w_in, group_sizes))
    y = grouped_matmul(h, w_out, group_sizes)
    weights = gates.reshape(-1)[order][:, None]
    return jnp.zeros((n, tokens.shape[-1]), y.dtype).at[token_of].add(y * weights)


class MoEFeedForward(nn.Module):
    experts: int = 4
    top_k: int = 2
    hidden: int = 8
    mesh: jax.sharding.Mesh | None = None

    @nn.compact
    def __call__(self, x):
        d = x.shape[-1]
        tokens = x.reshape(-1, d)
        router_logits = nn.Dense(self.experts, use_bias=False, name="router")(tokens)
        init = nn.initializers.normal(0.3)
        w_in = self.param("w_in", init, (self.experts, d, self.hidden))
        w_out = self.param("w_out", init, (self.experts, self.hidden, d))
        fn = functools.partial(route, top_k=self.top_k)
        if self.mesh is not None:    # the tokens split over the data axis, experts replicated
            fn = jax.shard_map(fn, mesh=self.mesh, in_specs=(P("data"), P(), P(), P("data")),
                               out_specs=P("data"))
        return fn(tokens, w_in, w_out, router_logits).reshape(x.shape)


class DecoderLayer(nn.Module):
    heads: int = 2
    mesh: jax.sharding.Mesh | None = None

    @nn.compact
    def __call__(self, x, _):
        b, t, d = x.shape
        h = RMSNorm(name="attn_norm")(x)
        q, k, v = (nn.DenseGeneral((self.heads, d // self.heads), use_bias=False, name=n)(h)
                   for n in ("q", "k", "v"))
        scores = jnp.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(d // self.heads)
        scores = jnp.where(jnp.tril(jnp.ones((t, t), bool)), scores, -1e9)
        attn = jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(scores, axis=-1), v)
        x = x + nn.DenseGeneral(d, axis=(-2, -1), use_bias=False, name="o")(attn)
        x = x + MoEFeedForward(mesh=self.mesh, name="moe")(RMSNorm(name="ffn_norm")(x))
        return x, None


class MoEDecoder(nn.Module):
    layers: int = 2
    d: int = 8
    mesh: jax.sharding.Mesh | None = None

    @nn.compact
    def __call__(self, tokens):
        embed = nn.Embed(VOCAB, self.d, name="embed")
        stack = nn.scan(nn.remat(DecoderLayer), variable_axes={"params": 0},
                        split_rngs={"params": True}, length=self.layers)
        x, _ = stack(mesh=self.mesh, name="layers")(embed(tokens), None)
        return embed.attend(RMSNorm(name="final_norm")(x))


EXPECTED_MOE_NAMES = ["embed", "layers/q", "layers/k", "layers/v", "layers/einsum_0",
                      "layers/einsum_1", "layers/o", "layers/moe/router",
                      "layers/moe/ragged_dot_0", "layers/moe/ragged_dot_1",
                      "embed/attend"]


def _names(ops):
    return [op.name for op in ops]


@pytest.mark.slow
def test_moe_decoder_every_product_quantized_forward_and_backward():
    tokens = _tokens(2, 4, vocab=VOCAB)
    qmodel, variables = check_linen(MoEDecoder(), tokens)
    ops = cpt_jax.count_ops(qmodel, variables, tokens)
    assert _names(ops) == EXPECTED_MOE_NAMES
    assert [op.calls for op in ops if op.name.startswith("layers/")] == [2] * 9
    assert [op.kind for op in ops].count("ragged_dot") == 2


@pytest.mark.slow
def test_moe_experts_under_shard_map_are_quantized():
    """The experts under ``jax.shard_map`` (one-device mesh here: the measurement
    evaluates the per-shard program, whose collectives are then the identity)."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
    tokens = _tokens(2, 4, vocab=VOCAB)
    qmodel, variables = check_linen(MoEDecoder(mesh=mesh), tokens)
    assert _names(cpt_jax.count_ops(qmodel, variables, tokens)) == EXPECTED_MOE_NAMES


def _off_grid(loss, params):
    """Indices (in call order) of the forward products with an operand off the grid,
    and the number of such products in the gradient's program."""
    forward, gradient = measure(loss, params)
    off = lambda products: [i for i, p in enumerate(products) if not p.inner
                            and not all(on_grid(o) for o in p.operands)]
    return off(forward), len(forward), off(gradient)


@pytest.mark.slow
def test_cpt_rules_keep_exactly_the_last_product_of_the_moe_decoder_fp32():
    tokens = _tokens(2, 4, vocab=VOCAB)
    qmodel = cpt_jax.quantize_model(MoEDecoder(), rules=cpt_jax.CPT_RULES)
    variables = qmodel.init(KEY, tokens)
    layers = cpt_jax.quantized_layers(qmodel, variables, tokens)
    assert [p.path for p in layers if p.config is None] == ["embed/attend"]
    assert len({p.path for p in layers}) == len(layers)
    loss = precision_loss(lambda p, x: qmodel.apply({"params": p}, x), tokens)
    forward_off, n_forward, gradient_off = _off_grid(loss, variables["params"])
    assert forward_off == [n_forward - 1]         # the logits, nothing else
    # its two backward products (input and weight gradients) are fp32 too, no others
    assert len(gradient_off) == 3


def _lm_loss(logits, tokens):
    return optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], tokens[:, 1:]).mean()


def train_moe(steps: int = 20, mesh=None, seed: int = 0):
    """20 steps of a cyclic 4..8-bit schedule (errors 8 bits) with `CPT_RULES`; the
    losses and the number of compiles of the step."""
    rng = np.random.default_rng(seed)
    pattern = rng.integers(0, VOCAB, size=(1, 6))
    tokens = jnp.asarray(np.repeat(pattern, 4, axis=0), jnp.int32)
    qmodel = cpt_jax.quantize_model(MoEDecoder(mesh=mesh), rules=cpt_jax.CPT_RULES)
    params = qmodel.init(KEY, tokens)["params"]
    optimizer = optax.adam(3e-2)
    opt_state = optimizer.init(params)
    if mesh is not None:   # committed, replicated: else the second call's inputs differ in
        replicated = jax.sharding.NamedSharding(mesh, P())   # sharding (so for plain Flax)
        params, opt_state, tokens = jax.device_put((params, opt_state, tokens), replicated)
    schedule = cpt_jax.cyclic("cos_growth", min_bits=4, max_bits=8, num_cycles=2,
                              total_steps=steps)

    @jax.jit
    def step(params, opt_state, t):
        bits = schedule(t)

        def loss(p):
            with cpt_jax.precision(bits, grad_bits=8, rng=jax.random.fold_in(KEY, t)):
                return _lm_loss(qmodel.apply({"params": p}, tokens), tokens)

        value, grads = jax.value_and_grad(loss)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    losses = []
    for t in range(steps):
        params, opt_state, value = step(params, opt_state, jnp.int32(t))
        losses.append(float(value))
    return losses, step._cache_size()


@pytest.mark.slow
def test_moe_decoder_trains_with_one_compile():
    losses, compiles = train_moe()
    assert compiles == 1
    assert np.all(np.isfinite(losses))
    assert np.mean(losses[-3:]) < 0.5 * losses[0], losses


@pytest.mark.slow
def test_moe_decoder_trains_under_shard_map_on_two_devices():
    code = textwrap.dedent("""
        import sys, jax, numpy as np
        sys.path.insert(0, "tests")
        from test_real_models import train_moe
        assert jax.device_count() == 2, jax.devices()
        mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
        losses, compiles = train_moe(mesh=mesh)
        print("RESULT", losses[0], np.mean(losses[-3:]), compiles)
    """)
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS="--xla_force_host_platform_device_count=2")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=root, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    first, last, compiles = out.stdout.split("RESULT")[1].split()
    assert float(last) < 0.5 * float(first)
    assert int(compiles) == 1


# --------------------------------------------------------------------------- NNX through the bridge

class NNXBlock(nnx.Module):
    def __init__(self, d, rngs):
        self.q = nnx.Linear(d, d, use_bias=False, rngs=rngs)
        self.k = nnx.Linear(d, d, use_bias=False, rngs=rngs)
        self.up = nnx.Linear(d, 2 * d, rngs=rngs)
        self.down = nnx.Linear(2 * d, d, rngs=rngs)

    def __call__(self, x):
        scores = jax.nn.softmax(jnp.einsum("btd,bsd->bts", self.q(x), self.k(x)), axis=-1)
        x = x + jnp.einsum("bts,bsd->btd", scores, x)
        return x + self.down(nnx.gelu(self.up(x)))


class NNXDecoder(nnx.Module):
    def __init__(self, d, layers, rngs):
        self.blocks = nnx.List([NNXBlock(d, rngs) for _ in range(layers)]) if hasattr(
            nnx, "List") else [NNXBlock(d, rngs) for _ in range(layers)]
        self.head = nnx.Linear(d, VOCAB, rngs=rngs)

    def __call__(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class BridgedLM(nn.Module):
    """A Linen model whose decoder is NNX code, through ``nnx.bridge.ToLinen``."""

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(VOCAB, 8, name="embed")(tokens)
        return nnx.bridge.ToLinen(NNXDecoder, args=(8, 2), name="decoder")(x)


@pytest.mark.slow
def test_nnx_decoder_through_to_linen_has_a_name_per_product():
    tokens = _tokens(2, 4, vocab=VOCAB)
    qmodel, variables = check_linen(BridgedLM(), tokens)
    names = _names(cpt_jax.count_ops(qmodel, variables, tokens))
    block = ["q", "k", "einsum_0", "einsum_1", "up", "down"]
    assert names == ["embed", *(f"decoder/blocks/{i}/{n}" for i in (0, 1) for n in block),
                     "decoder/head"]
    layers = cpt_jax.quantized_layers(cpt_jax.quantize_model(BridgedLM(), cpt_jax.CPT_RULES),
                                      variables, tokens)
    assert [p.path for p in layers if p.config is None] == ["decoder/head"]


class LinenInNNX(nnx.Module):
    """The other way round: Linen layers inside NNX code (``nnx.bridge.ToNNX``)."""

    def __init__(self, rngs):
        self.first = nnx.bridge.ToNNX(nn.Dense(6), rngs=rngs)
        self.second = nnx.bridge.ToNNX(nn.Dense(3), rngs=rngs)

    def __call__(self, x):
        return self.second(jnp.tanh(self.first(x)))


def test_linen_layers_through_to_nnx_are_named_by_their_attribute():
    model = LinenInNNX(nnx.Rngs(0))
    x = _x(3, 8)     # 8 inputs: a per-channel weight's column has more values than the grid
    nnx.bridge.lazy_init(model, x)
    qmodel = check_nnx(model, x)
    assert _names(cpt_jax.count_ops(qmodel, x)) == ["first", "second"]


# --------------------------------------------------------------------------- nn.share_scope

class Projection(nn.Module):
    features: int
    kernel_name: str

    @nn.compact
    def __call__(self, x):
        kernel = self.param(self.kernel_name, nn.initializers.lecun_normal(),
                            (x.shape[-1], self.features))
        return jnp.einsum("...d,df->...f", x, kernel)


class FeedForward(nn.Module):
    """Two projections whose parameters live in the FeedForward's own scope."""

    def setup(self):
        self.wi = Projection(16, "wi_kernel")
        self.wo = Projection(8, "wo_kernel")
        nn.share_scope(self, self.wi)
        nn.share_scope(self, self.wo)

    def __call__(self, x):
        return self.wo(nn.gelu(self.wi(x)))


class WithFeedForward(nn.Module):
    @nn.compact
    def __call__(self, x):
        return FeedForward(name="ffn")(nn.Dense(8, name="inp")(x))


def test_projections_under_share_scope_have_distinct_names():
    qmodel, variables = check_linen(WithFeedForward(), _x(2, 3, 8))
    assert set(variables["params"]["ffn"]) == {"wi_kernel", "wo_kernel"}
    assert _names(cpt_jax.count_ops(qmodel, variables, _x(2, 3, 8))) == [
        "inp", "ffn/wi/einsum_0", "ffn/wo/einsum_0"]


# --------------------------------------------------------------------------- NNX functional layers

class CheckpointedLayers(nnx.Module):
    """Each layer run functionally, as unscanned NNX decoders do."""

    def __init__(self, rngs):
        self.layers = nnx.List([NNXBlock(6, rngs) for _ in range(2)]) if hasattr(
            nnx, "List") else [NNXBlock(6, rngs) for _ in range(2)]
        self.head = nnx.Linear(6, 3, rngs=rngs)

    def __call__(self, x):
        for layer in self.layers:
            graphdef, state = nnx.split(layer)

            def run(state, x, graphdef=graphdef):
                module = nnx.merge(graphdef, state)
                return module(x), nnx.state(module)

            x, state = jax.checkpoint(run)(state, x)
            nnx.update(layer, state)
        return self.head(x)


@pytest.mark.slow
def test_nnx_split_checkpoint_update_with_cpt_rules():
    x = _x(2, 3, 6)
    check_nnx(CheckpointedLayers(nnx.Rngs(0)), x)
    qmodel = cpt_jax.quantize_model(CheckpointedLayers(nnx.Rngs(0)), rules=cpt_jax.CPT_RULES)
    y = qmodel(x)                     # a call outside precision: fp32, no side effect
    graphdef, state = nnx.split(qmodel)

    @jax.jit
    def call(state, x, bits):
        with cpt_jax.precision(bits):
            return nnx.merge(graphdef, state)(x)

    assert call(state, x, 4.0).shape == y.shape
    layers = cpt_jax.quantized_layers(qmodel, x)
    assert [p.path for p in layers if p.config is None] == ["head"]
    assert len({p.path for p in layers}) == len(layers) == 13
    graphdef, state = nnx.split(qmodel)
    loss = precision_loss(lambda s, x: nnx.merge(graphdef, s)(x), x)
    forward_off, n_forward, _ = _off_grid(loss, state)
    assert forward_off == [n_forward - 1]


# --------------------------------------------------------------------------- no contraction

def test_an_einsum_without_contraction_is_not_a_product_unless_named():
    x = _x(2, 3, 8)
    model = RMSNorm()
    qmodel = cpt_jax.quantize_model(model, rules=[])
    variables = qmodel.init(KEY, x)
    assert cpt_jax.count_ops(qmodel, variables, x) == []
    assert cpt_jax.quantized_layers(qmodel, variables, x) == []
    with cpt_jax.precision(2):
        np.testing.assert_array_equal(qmodel.apply(variables, x), model.apply(variables, x))
    named = cpt_jax.quantize_model(model, rules=[("einsum_0$", cpt_jax.CPT_CONFIG)])
    ops = cpt_jax.count_ops(named, variables, x)
    assert _names(ops) == ["RMSNorm/einsum_0"]
    with cpt_jax.precision(2):
        quantized = np.asarray(named.apply(variables, x))
    assert not np.allclose(quantized, model.apply(variables, x))


# --------------------------------------------------------------------------- NNX MoE under nnx.scan

class NNXMoEBlock(nnx.Module):
    def __init__(self, d, rngs, experts=3, hidden=8):
        self.router = nnx.Linear(d, experts, use_bias=False, rngs=rngs)
        init = nnx.initializers.normal(0.3)
        self.w_in = nnx.Param(init(rngs.params(), (experts, d, hidden)))
        self.w_out = nnx.Param(init(rngs.params(), (experts, hidden, d)))

    def __call__(self, x):
        tokens = x.reshape(-1, x.shape[-1])
        y = route(tokens, self.w_in[...], self.w_out[...], self.router(tokens), top_k=2)
        return x + y.reshape(x.shape)


class NNXMoEStack(nnx.Module):
    def __init__(self, rngs, d=8, layers=2):
        @nnx.split_rngs(splits=layers)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def create(rngs):
            return NNXMoEBlock(d, rngs)
        self.embed = nnx.Embed(VOCAB, d, rngs=rngs)
        self.blocks = create(rngs)

    def __call__(self, tokens):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def body(x, block):
            return block(x)
        return self.embed.attend(body(self.embed(tokens), self.blocks))


@pytest.mark.slow
def test_nnx_moe_under_nnx_scan():
    tokens = _tokens(2, 4, vocab=VOCAB)
    qmodel = check_nnx(NNXMoEStack(nnx.Rngs(0)), tokens)
    ops = cpt_jax.count_ops(qmodel, tokens)
    assert [(op.name, op.calls) for op in ops] == [
        ("embed", 1), ("blocks/router", 2), ("blocks/ragged_dot_0", 2),
        ("blocks/ragged_dot_1", 2), ("embed/attend", 1)]


# --------------------------------------------------------------------------- products under vmap

class VmapExpert(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(8, name="proj")(nn.relu(nn.Dense(6, name="up")(x)))


class VmappedEnsemble(nn.Module):
    """Three experts as one ``nn.vmap`` (stacked parameters), then a scanned stack of
    two layers under ``nn.vmap`` too: the vmap batches the whole scan body."""

    @nn.compact
    def __call__(self, x):
        experts = nn.vmap(VmapExpert, variable_axes={"params": 0},
                          split_rngs={"params": True}, in_axes=None, axis_size=3)
        y = experts(name="experts")(x).mean(0)
        towers = nn.vmap(_ScannedLayers, variable_axes={"params": 0},
                         split_rngs={"params": True}, in_axes=None, axis_size=2)
        return towers(name="towers")(y)


class _ScannedLayers(nn.Module):
    @nn.compact
    def __call__(self, x):
        body = nn.scan(_Layer, variable_axes={"params": 0}, split_rngs={"params": True},
                       length=2)
        return body(name="layers")(x, None)[0]


class _Layer(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        return nn.tanh(nn.Dense(8, name="dense")(x)), None


@pytest.mark.slow
def test_products_under_nn_vmap_count_once_per_instance():
    x = _x(2, 8)
    qmodel, variables = check_linen(VmappedEnsemble(), x)  # recorded MACs == measured
    ops = {op.name: op for op in cpt_jax.count_ops(qmodel, variables, x)}
    assert ops["experts/up"].calls == 3 and ops["experts/up"].macs == 3 * 2 * 8 * 6
    assert ops["towers/layers/dense"].calls == 2 * 2  # vmap 2 x scan 2


class NNXEnsemble(nnx.Module):
    """Four NNX members created and run by ``nnx.vmap`` (an ensemble)."""

    def __init__(self, rngs):
        @nnx.split_rngs(splits=4)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make(rngs):
            return nnx.Linear(8, 5, rngs=rngs)
        self.members = make(rngs)

    def __call__(self, x):
        @nnx.vmap(in_axes=(0, None), out_axes=0)
        def run(member, x):
            return member(x)
        return run(self.members, x)


def test_products_under_nnx_vmap_count_once_per_instance():
    x = _x(3, 8)
    qmodel = check_nnx(NNXEnsemble(nnx.Rngs(0)), x)
    (op,) = cpt_jax.count_ops(qmodel, x)
    assert (op.calls, op.macs) == (4, 4 * 3 * 8 * 5)


def test_jax_vmap_over_apply_counts_every_instance():
    qmodel = cpt_jax.quantize_model(nn.Dense(5))
    x = _x(7, 3, 8)
    variables = qmodel.init(KEY, x[0])
    ops = cpt_jax.cost.trace_ops(jax.vmap(lambda v, x: qmodel.apply(v, x), (None, 0)),
                                 variables, x)
    assert [op.macs for op in ops] == [7 * 3 * 8 * 5]


@pytest.mark.slow
def test_a_product_under_shard_map_counts_once_per_shard_on_two_devices():
    code = textwrap.dedent("""
        import jax, jax.numpy as jnp, numpy as np, flax.linen as nn, cpt_jax
        from jax.sharding import PartitionSpec as P
        assert jax.device_count() == 2
        mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
        qmodel = cpt_jax.quantize_model(nn.Dense(5))
        x = jnp.ones((8, 3))
        v = qmodel.init(jax.random.key(0), x)
        apply = lambda v, x: qmodel.apply(v, x)
        sharded = jax.shard_map(apply, mesh=mesh, in_specs=(P(), P("data")),
                                out_specs=P("data"))
        (whole,) = cpt_jax.cost.trace_ops(apply, v, x)
        (per_shard,) = cpt_jax.cost.trace_ops(sharded, v, x)
        print("RESULT", whole.macs, per_shard.macs, per_shard.calls)
    """)
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS="--xla_force_host_platform_device_count=2")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    whole, sharded, calls = map(int, out.stdout.split("RESULT")[1].split())
    assert (whole, sharded, calls) == (8 * 3 * 5, 8 * 3 * 5, 2)


class _TwoExperts(nn.Module):
    """Two experts of very different scales as one ragged dot."""

    @nn.compact
    def __call__(self, x, group_sizes):
        big = jax.random.normal(jax.random.key(1), (1, 16, 8))
        w = self.param("experts", lambda k: jnp.concatenate([big, 1e-3 * big], axis=0))
        return lax.ragged_dot(x, w, group_sizes)


def test_a_ragged_dots_weight_is_scaled_per_expert_and_channel():
    """CPT's per-channel weight format on an MoE's stacked experts: one range per
    (expert, output channel), so the expert 1000x smaller keeps its 4-bit grid (a
    range shared across experts would put all its weights on one or two levels)."""
    model = _TwoExperts()
    x = jax.random.normal(jax.random.key(2), (32, 16))
    sizes = jnp.array([16, 16], jnp.int32)
    params = model.init(jax.random.key(0), x, sizes)
    want = model.apply(params, x, sizes)
    quantized = cpt_jax.quantize_model(model, [(".*", cpt_jax.CPT_CONFIG)])  # the last too
    with cpt_jax.precision(4):
        got = quantized.apply(params, x, sizes)
    errors = [float(jnp.linalg.norm(got[rows] - want[rows]) / jnp.linalg.norm(want[rows]))
              for rows in (slice(0, 16), slice(16, 32))]   # the tokens of each expert
    assert 0.0 < errors[0] < 0.25 and 0.0 < errors[1] < 0.25, errors
