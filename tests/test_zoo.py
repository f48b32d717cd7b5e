"""Every product of any Flax model, Linen or NNX, measured independently (issue 22).

Each model of the zoo below is written the ordinary ways of Flax code (layers, raw
``@`` / ``jnp.einsum`` / ``lax.dot_general`` on ``self.param``s, NNX, attention
modules and hand-written attention, tied embeddings, logical partitioning,
``nn.scan`` / ``nnx.scan``, encoder-decoder ``method=``, mixture of experts with
``ragged_dot``, grouped and transposed convolutions). The measurement knows nothing
of cpt_jax's interception: it takes the program JAX builds for the loss and for its
gradient (``jax.make_jaxpr``) and evaluates it equation by equation on concrete
arrays (scan bodies once per iteration, jit/remat/custom-derivative bodies
inlined), capturing the operands of every ``dot_general`` / ``conv_general_dilated``
/ ``ragged_dot_general`` it binds -- the forward products, and the backward ones in
the gradient's program. At ``bits = grad_bits = 2`` a quantized operand lies on at
most 4 values per tensor, or per slice along one axis (a per-channel weight); every
captured operand must. The MACs of cpt_jax's cost records must equal the MACs of
the forward products evaluated.
"""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax import lax
from zoo_measurement import (
    KEY,
    _tokens,
    _x,
    assert_every_product_quantized,
    check_linen,
    check_nnx,
    evaluate,
    measure,
    on_grid,
    precision_loss,
    run_jaxpr,
)

import cpt_jax

# --------------------------------------------------------------------------- Linen

class LinenLayers(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(6, name="dense")(x))
        x = nn.DenseGeneral((2, 3), name="general")(x)
        x = nn.Einsum((2, 3, 6), "bhc,hcf->bf", name="einsum")(x)
        return nn.Dense(3, name="head")(nn.relu(x))


class LinenRaw(nn.Module):
    """Projections and attention written with raw ops on its own parameters."""

    heads: int = 2
    dim: int = 4

    @nn.compact
    def __call__(self, x):
        d = x.shape[-1]
        init = nn.initializers.normal(0.5)
        wq = self.param("wq", init, (d, self.heads, self.dim))
        wk = self.param("wk", init, (d, self.heads, self.dim))
        wv = self.param("wv", init, (d, self.heads * self.dim))
        wo = self.param("wo", init, (self.heads * self.dim, d))
        w_mlp = self.param("w_mlp", init, (d, 2 * d))
        q = jnp.einsum("btd,dhk->bthk", x, wq)
        k = jnp.einsum("btd,dhk->bthk", x, wk)
        v = (x @ wv).reshape(x.shape[:2] + (self.heads, self.dim))
        probs = jax.nn.softmax(jnp.einsum("bthk,bshk->bhts", q, k) / np.sqrt(self.dim))
        o = jnp.einsum("bhts,bshk->bthk", probs, v).reshape(x.shape[:2] + (-1,))
        x = x + lax.dot_general(o, wo, (((2,), (0,)), ((), ())))
        h = jnp.tanh(jnp.dot(x, w_mlp))
        return jnp.tensordot(h, w_mlp, axes=[[2], [1]]) + jnp.matmul(x, wo.T @ wo)


@pytest.mark.slow
def test_linen_layers():
    check_linen(LinenLayers(), _x(3, 5))


@pytest.mark.slow
def test_linen_raw_ops_on_own_parameters():
    qmodel, v = check_linen(LinenRaw(), _x(2, 3, 8))
    layers = cpt_jax.quantized_layers(qmodel, v, _x(2, 3, 8))
    assert [layer.path for layer in layers] == [
        "LinenRaw/einsum_0", "LinenRaw/einsum_1", "LinenRaw/matmul_0", "LinenRaw/einsum_2",
        "LinenRaw/einsum_3", "LinenRaw/dot_general_0", "LinenRaw/dot_0", "LinenRaw/tensordot_0",
        "LinenRaw/matmul_1", "LinenRaw/matmul_2"]


class Convs(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Conv(4, (3, 3), strides=2, name="strided")(x))
        x = nn.relu(nn.Conv(4, (3, 3), feature_group_count=2, name="grouped")(x))
        x = nn.relu(nn.Conv(4, (3, 3), kernel_dilation=2, padding="VALID", name="dilated")(x))
        x = nn.ConvTranspose(2, (3, 3), strides=(2, 2), name="up")(x)
        w = self.param("w", nn.initializers.normal(0.5), (3, 3, 2, 3))
        x = lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
        return jnp.mean(x, axis=(1, 2))


@pytest.mark.slow
def test_conv_net_with_grouped_dilated_and_transposed_convs():
    check_linen(Convs(), _x(2, 9, 9, 2))


class TiedLM(nn.Module):
    """Tied embedding: ``attend`` and ``jnp.dot(x, E.T)``."""

    @nn.compact
    def __call__(self, tokens):
        embed = nn.Embed(11, 6, name="embed")
        x = embed(tokens)
        x = nn.relu(nn.Dense(6, name="hidden")(x))
        return embed.attend(x) + jnp.dot(x, embed.embedding.T)


def test_tied_embeddings():
    qmodel, v = check_linen(TiedLM(), _tokens(2, 4))
    paths = [layer.path for layer in cpt_jax.quantized_layers(qmodel, v, _tokens(2, 4))]
    assert paths == ["embed", "hidden", "embed/attend", "TiedLM/dot_0"]
    ops = cpt_jax.count_ops(qmodel, v, _tokens(2, 4))
    assert ops[-1].quantized and ops[-1].rhs_shape == (6, 11)


class Attention(nn.Module):
    @nn.compact
    def __call__(self, x):
        mask = nn.make_causal_mask(jnp.ones(x.shape[:2]))
        return nn.MultiHeadDotProductAttention(num_heads=2, name="attn")(x, mask=mask)


@pytest.mark.slow
def test_linen_multi_head_attention():
    qmodel, v = check_linen(Attention(), _x(2, 3, 8))
    paths = [layer.path for layer in cpt_jax.quantized_layers(qmodel, v, _x(2, 3, 8))]
    assert paths == ["attn/query", "attn/key", "attn/value", "attn/query_key",
                     "attn/weights_value", "attn/out"]


class JaxAttention(nn.Module):
    @nn.compact
    def __call__(self, x):
        q, k, v = (nn.DenseGeneral((2, 4), name=n)(x) for n in ("q", "k", "v"))
        return jax.nn.dot_product_attention(q, k, v, is_causal=True).reshape(x.shape[:2] + (8,))


@pytest.mark.slow
def test_jax_nn_dot_product_attention():
    qmodel, v = check_linen(JaxAttention(), _x(2, 3, 8))
    paths = [layer.path for layer in cpt_jax.quantized_layers(qmodel, v, _x(2, 3, 8))]
    assert paths[-2:] == ["JaxAttention/query_key", "JaxAttention/weights_value"]


class Block(nn.Module):
    @nn.compact
    def __call__(self, carry, _):
        w = self.param("w", nn.initializers.normal(0.5), (carry.shape[-1], carry.shape[-1]))
        return jnp.tanh(nn.Dense(carry.shape[-1], name="dense")(carry) + carry @ w), None


class Scanned(nn.Module):
    @nn.compact
    def __call__(self, x):
        stack = nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True},
                        length=3)
        return stack(name="layers")(x, None)[0]


@pytest.mark.slow
def test_linen_scan_stack():
    qmodel, v = check_linen(Scanned(), _x(2, 6))
    ops = cpt_jax.count_ops(qmodel, v, _x(2, 6))
    assert [(op.name, op.calls) for op in ops] == [("layers/dense", 3),
                                                   ("layers/matmul_0", 3)]


class Remat(nn.Module):
    @nn.compact
    def __call__(self, x):
        block = nn.remat(Block)(name="block")
        return block(block(x, None)[0], None)[0]


@pytest.mark.slow
def test_linen_remat_and_a_module_called_twice():
    check_linen(Remat(), _x(2, 6))


class Seq2Seq(nn.Module):
    def setup(self):
        self.embed = nn.Embed(11, 8)
        self.encoder = nn.Dense(8)
        self.cross = nn.MultiHeadDotProductAttention(num_heads=2)

    def encode(self, tokens):
        return nn.relu(self.encoder(self.embed(tokens)))

    def decode(self, encoded, targets):
        return self.embed.attend(self.cross(self.embed(targets), encoded))

    def __call__(self, tokens, targets):
        return self.decode(self.encode(tokens), targets)


@pytest.mark.slow
def test_encoder_decoder_with_method():
    src, tgt = _tokens(2, 4), _tokens(2, 3, seed=1)
    model = Seq2Seq()
    qmodel = cpt_jax.quantize_model(model, rules=[])
    variables = qmodel.init(KEY, src, tgt)
    encoded = model.apply(variables, src, method="encode")
    loss = precision_loss(lambda p, e, t: qmodel.apply({"params": p}, e, t, method="decode"),
                          encoded, tgt)
    ops = cpt_jax.count_ops(qmodel, variables, encoded, tgt, method="decode")
    assert_every_product_quantized(loss, variables["params"], cpt_jax.cost.total_macs(ops))
    assert ops[-1].name == "embed/attend"


class Boxed(nn.Module):
    """lm1b / MaxText style: every parameter boxed with logical axis names."""

    @nn.compact
    def __call__(self, tokens):
        embed = nn.Embed(11, 8, embedding_init=nn.with_logical_partitioning(
            nn.initializers.normal(1.0), ("vocab", "embed")), name="embed")
        x = embed(tokens)
        w = self.param("w", nn.with_logical_partitioning(nn.initializers.normal(0.5),
                                                         ("embed", "mlp")), (8, 16))
        x = x + jnp.einsum("btm,em->bte", jax.nn.relu(x @ w), w)
        x = nn.Dense(8, kernel_init=nn.with_logical_partitioning(
            nn.initializers.lecun_normal(), ("embed", "mlp")), name="dense")(x)
        return embed.attend(x)


@pytest.mark.slow
def test_boxed_parameters_run_and_keep_their_sharding():
    qmodel, v = check_linen(Boxed(), _tokens(2, 4))
    float_v = Boxed().init(KEY, _tokens(2, 4))
    assert nn.get_partition_spec(v) == nn.get_partition_spec(float_v)
    devices = np.array(jax.devices()[:1])
    rules = (("vocab", None), ("embed", None), ("mlp", "model"))
    mesh = jax.sharding.Mesh(devices, ("model",))
    use = getattr(jax, "set_mesh", None) or getattr(jax.sharding, "use_mesh", None)
    with (use(mesh) if use else mesh), nn.logical_axis_rules(rules):
        y = jax.jit(lambda v, t: qmodel.apply(v, t))(v, _tokens(2, 4))
    assert y.shape == (2, 4, 11)


class MoE(nn.Module):
    experts: int = 3

    @nn.compact
    def __call__(self, x):
        tokens = x.reshape(-1, x.shape[-1])
        router = nn.Dense(self.experts, name="router")(tokens)
        choice = jnp.argmax(router, axis=-1)
        order = jnp.argsort(choice)
        group_sizes = jnp.bincount(choice, length=self.experts).astype(jnp.int32)
        w_in = self.param("w_in", nn.initializers.normal(0.5),
                          (self.experts, x.shape[-1], 6))
        w_out = self.param("w_out", nn.initializers.normal(0.5), (self.experts, 6, x.shape[-1]))
        h = jax.nn.relu(lax.ragged_dot(tokens[order], w_in, group_sizes))
        y = lax.ragged_dot(h, w_out, group_sizes)
        gate = jax.nn.softmax(router)[order, choice[order]][:, None]
        return (y * gate)[jnp.argsort(order)].reshape(x.shape)


@pytest.mark.slow
def test_mixture_of_experts_with_ragged_dot():
    qmodel, v = check_linen(MoE(), _x(2, 5, 6))
    kinds = [op.kind for op in cpt_jax.count_ops(qmodel, v, _x(2, 5, 6))]
    assert kinds == ["dot_general", "ragged_dot", "ragged_dot"]


# --------------------------------------------------------------------------- NNX

class NNXLayers(nnx.Module):
    def __init__(self, rngs):
        self.conv = nnx.Conv(2, 3, (3, 3), rngs=rngs)
        self.general = nnx.LinearGeneral(3, (2, 4), rngs=rngs)
        self.einsum = nnx.Einsum("bwhk,hkf->bwf", (2, 4, 5), (5,), rngs=rngs)
        self.head = nnx.Linear(5, 3, rngs=rngs)

    def __call__(self, x):
        x = nnx.relu(self.conv(x)).mean(axis=1)
        return self.head(nnx.relu(self.einsum(self.general(x))))


@pytest.mark.slow
def test_nnx_layers():
    check_nnx(NNXLayers(nnx.Rngs(0)), _x(2, 5, 5, 2))


class NNXRaw(nnx.Module):
    def __init__(self, rngs):
        self.w = nnx.Param(jax.random.normal(rngs.params(), (6, 6)))
        self.u = nnx.Param(jax.random.normal(rngs.params(), (6, 2, 3)))

    def __call__(self, x):
        h = jnp.tanh(x @ self.w[...])
        return jnp.einsum("bf,fhk->bhk", h, self.u[...])


def test_nnx_raw_ops():
    model = check_nnx(NNXRaw(nnx.Rngs(0)), _x(3, 6))
    assert [op.name for op in cpt_jax.count_ops(model, _x(3, 6))] == ["NNXRaw/matmul_0",
                                                                      "NNXRaw/einsum_0"]


class TiedEmbed(nnx.Embed):
    """A subclass of ``nnx.Embed`` whose ``attend`` gives the logits (Gemma style)."""

    def attend(self, query):
        return super().attend(query) * 0.5


class GQADecoder(nnx.Module):
    """Flax-examples style NNX decoder: ``nnx.Einsum`` projections, grouped-query
    attention with ``jnp.einsum``, logits through the tied embedding."""

    def __init__(self, rngs, vocab=11, d=8, heads=4, kv_heads=2, head_dim=2):
        self.heads, self.kv_heads = heads, kv_heads
        self.embed = TiedEmbed(vocab, d, rngs=rngs)
        self.q = nnx.Einsum("btd,dnh->btnh", (d, heads, head_dim), rngs=rngs)
        self.kv = nnx.Einsum("btd,cdkh->cbtkh", (2, d, kv_heads, head_dim), rngs=rngs)
        self.o = nnx.Einsum("btnh,nhd->btd", (heads, head_dim, d), rngs=rngs)
        self.mlp = nnx.Linear(d, d, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens)
        q = self.q(x)
        k, v = self.kv(x)
        b, t, _, h = q.shape
        q = q.reshape(b, t, self.kv_heads, self.heads // self.kv_heads, h)
        logits = jnp.einsum("btkgh,bskh->bkgts", q, k) / np.sqrt(h)
        mask = jnp.tril(jnp.ones((t, t), bool))
        probs = jax.nn.softmax(jnp.where(mask, logits, -1e9), axis=-1)
        attn = jnp.einsum("bkgts,bskh->btkgh", probs, v).reshape(b, t, self.heads, h)
        x = x + self.o(attn)
        x = x + nnx.relu(self.mlp(x))
        return self.embed.attend(x)


@pytest.mark.slow
def test_nnx_gqa_decoder_with_tied_logits():
    model = check_nnx(GQADecoder(nnx.Rngs(0)), _tokens(2, 4))
    names = [op.name for op in cpt_jax.count_ops(model, _tokens(2, 4))]
    assert names == ["embed", "q", "kv", "GQADecoder/einsum_0", "GQADecoder/einsum_1", "o",
                     "mlp", "embed/attend"]


class NNXAttention(nnx.Module):
    def __init__(self, rngs):
        self.embed = nnx.Embed(11, 8, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(num_heads=2, in_features=8, decode=False,
                                           rngs=rngs)
        self.out = nnx.Linear(8, 8, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens)
        return self.embed.attend(self.out(self.attn(x)))


@pytest.mark.slow
def test_nnx_multi_head_attention_and_attend():
    model = check_nnx(NNXAttention(nnx.Rngs(0)), _tokens(2, 4))
    names = [op.name for op in cpt_jax.count_ops(model, _tokens(2, 4))]
    assert names == ["embed", "attn/query", "attn/key", "attn/value", "attn/query_key",
                     "attn/weights_value", "attn/out", "out", "embed/attend"]


class NNXBlock(nnx.Module):
    def __init__(self, rngs):
        self.linear = nnx.Linear(6, 6, rngs=rngs)
        self.w = nnx.Param(jax.random.normal(rngs.params(), (6, 6)) * 0.5)

    def __call__(self, x):
        return jnp.tanh(self.linear(x) + x @ self.w[...])


class NNXScanned(nnx.Module):
    def __init__(self, rngs):
        @nnx.split_rngs(splits=3)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def create(rngs):
            return NNXBlock(rngs)
        self.blocks = create(rngs)
        self.head = nnx.Linear(6, 2, rngs=rngs)

    def __call__(self, x):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def body(x, block):
            return block(x)
        return self.head(body(x, self.blocks))


@pytest.mark.slow
def test_nnx_scan_stack():
    model = check_nnx(NNXScanned(nnx.Rngs(0)), _x(2, 6))
    ops = cpt_jax.count_ops(model, _x(2, 6))
    assert [(op.name, op.calls) for op in ops] == [("blocks/linear", 3),
                                                   ("blocks/matmul_0", 3), ("head", 1)]


# --------------------------------------------------------------------------- the measurement

@pytest.mark.slow
def test_the_measurement_sees_an_unquantized_product():
    """The check can fail: a float model's products are off the grid, and a model
    with one product left in fp32 is caught forward and backward."""
    model = LinenRaw()
    variables = model.init(KEY, _x(2, 3, 8))
    forward, _ = measure(precision_loss(lambda p, x: model.apply({"params": p}, x),
                                        _x(2, 3, 8)), variables["params"])
    assert len(forward) == 10 and not any(on_grid(o) for p in forward for o in p.operands)
    qmodel = cpt_jax.quantize_model(model, rules=[("dot_general_0", None)])
    forward, gradient = measure(precision_loss(lambda p, x: qmodel.apply({"params": p}, x),
                                               _x(2, 3, 8)), variables["params"])
    off = [p for p in forward if not all(on_grid(o) for o in p.operands)]
    # A product kept in fp32 is computed as written, (2, 3, 8) x (8, 8) (a quantized
    # (..., K) x (K, N) dot is one 2-D GEMM on CPU).
    assert len(off) == 1 and [o.shape for o in off[0].operands] == [(2, 3, 8), (8, 8)]
    assert any(not all(on_grid(o) for o in p.operands) for p in gradient[len(forward):])


@pytest.mark.slow
def test_the_interpreter_counts_scan_iterations_and_inlines_remat():
    def f(ws, x):
        y, _ = lax.scan(lambda c, w: (jnp.tanh(c @ w), None), x, ws)
        return jnp.sum(jax.checkpoint(lambda y: y @ ws[0])(y))

    ws, x = _x(3, 4, 4), _x(2, 4)
    bound = evaluate(jax.make_jaxpr(f)(ws, x), [ws, x])
    assert [b.macs for b in bound] == [2 * 4 * 4] * 4
    np.testing.assert_allclose(bound[1].operands[0], jnp.tanh(x @ ws[0]), rtol=1e-6)
    out = run_jaxpr(jax.make_jaxpr(jax.grad(f))(ws, x), [ws, x], [])
    np.testing.assert_allclose(out[0], jax.grad(f)(ws, x), rtol=1e-5)
    assert len(evaluate(jax.make_jaxpr(jax.grad(f))(ws, x), [ws, x])) > len(bound)
