"""Every product of someone else's Flax model (issue 14).

The models below are written the way the Flax examples write them (lm1b/wmt
Transformers, the imagenet ResNet, an NNX model with ``nnx.scan``), not for
cpt_jax. For each, the products cpt_jax records are compared with the
``dot_general`` / ``conv_general_dilated`` equations of ``jax.make_jaxpr`` of the
*float* model: same count, same MACs.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import cpt_jax
from cpt_jax import AffineInt, QuantConfig, TensorQuant, context, precision, quantize
from cpt_jax.doors import FP32_ATTENTION, QuantDotGeneral, quantized_layers

KEY = jax.random.key(0)
PRODUCT_PRIMITIVES = ("dot_general", "conv_general_dilated")


# --------------------------------------------------------------------------- models

@dataclasses.dataclass(frozen=True)
class TransformerConfig:
    """As the Flax wmt/lm1b examples: one config object the modules read."""

    vocab_size: int = 13
    emb_dim: int = 8
    num_heads: int = 2
    mlp_dim: int = 16
    num_layers: int = 2
    dtype: jnp.dtype = jnp.float32


class MlpBlock(nn.Module):
    config: TransformerConfig

    @nn.compact
    def __call__(self, x):
        y = nn.relu(nn.Dense(self.config.mlp_dim, dtype=self.config.dtype)(x))
        return nn.Dense(x.shape[-1], dtype=self.config.dtype)(y)


class DecoderLayer(nn.Module):
    config: TransformerConfig

    @nn.compact
    def __call__(self, x, mask=None, encoded=None):
        cfg = self.config
        y = nn.LayerNorm(dtype=cfg.dtype)(x)
        y = nn.MultiHeadDotProductAttention(num_heads=cfg.num_heads, dtype=cfg.dtype)(y, mask=mask)
        x = x + y
        if encoded is not None:
            y = nn.LayerNorm(dtype=cfg.dtype)(x)
            x = x + nn.MultiHeadDotProductAttention(num_heads=cfg.num_heads)(y, encoded)
        return x + MlpBlock(cfg)(nn.LayerNorm(dtype=cfg.dtype)(x))


class TransformerLM(nn.Module):
    """lm1b-style: shared embedding, causal self-attention, a `logitdense` head."""

    config: TransformerConfig

    @nn.compact
    def __call__(self, tokens):
        cfg = self.config
        x = nn.Embed(cfg.vocab_size, cfg.emb_dim, name="embed")(tokens)
        mask = nn.make_causal_mask(tokens)
        for i in range(cfg.num_layers):
            x = DecoderLayer(cfg, name=f"decoderblock_{i}")(x, mask)
        return nn.Dense(cfg.vocab_size, name="logitdense")(nn.LayerNorm()(x))


class Seq2Seq(nn.Module):
    """wmt-style: `encode` and `decode` methods, logits through the tied embedding."""

    config: TransformerConfig

    def setup(self):
        self.embed = nn.Embed(self.config.vocab_size, self.config.emb_dim)
        self.encoder = DecoderLayer(self.config)
        self.decoder = DecoderLayer(self.config)

    def encode(self, inputs):
        return self.encoder(self.embed(inputs))

    def decode(self, encoded, targets):
        y = self.decoder(self.embed(targets), nn.make_causal_mask(targets), encoded)
        return self.embed.attend(y)

    def __call__(self, inputs, targets):
        return self.decode(self.encode(inputs), targets)


class ResNetBlock(nn.Module):
    filters: int
    strides: tuple = (1, 1)

    @nn.compact
    def __call__(self, x, train: bool = True):
        norm = functools.partial(nn.BatchNorm, use_running_average=not train, momentum=0.9)
        y = nn.relu(norm()(nn.Conv(self.filters, (3, 3), self.strides, use_bias=False)(x)))
        y = norm()(nn.Conv(self.filters, (3, 3), use_bias=False)(y))
        if x.shape != y.shape:
            x = norm()(nn.Conv(self.filters, (1, 1), self.strides, use_bias=False)(x))
        return nn.relu(x + y)


class ResNet(nn.Module):
    """imagenet-example style: auto-named Conv_0/BatchNorm_0 ..., head `Dense_0`."""

    num_classes: int = 3

    @nn.compact
    def __call__(self, x, train: bool = True):
        x = nn.Conv(4, (3, 3), use_bias=False)(x)
        x = nn.relu(nn.BatchNorm(use_running_average=not train)(x))
        x = ResNetBlock(4)(x, train)
        x = ResNetBlock(8, (2, 2))(x, train)
        return nn.Dense(self.num_classes)(jnp.mean(x, axis=(1, 2)))


def _tokens(shape=(2, 5), seed=0):
    return jnp.asarray(np.random.default_rng(seed).integers(1, 13, size=shape), jnp.int32)


def _random_variables(model, *inputs, method=None):
    """Random variables of the model's tree (eval_shape: nothing compiled)."""
    rng = np.random.default_rng(1)
    shapes = jax.eval_shape(functools.partial(model.init, method=method), KEY, *inputs)

    def fill(path, leaf):
        value = rng.normal(size=leaf.shape) * 0.5
        if any(getattr(k, "key", None) == "var" for k in path):
            value = np.abs(value) + 0.5
        return jnp.asarray(value, leaf.dtype)

    return jax.tree_util.tree_map_with_path(fill, shapes)


def jaxpr_products(fn, *args, primitives=PRODUCT_PRIMITIVES):
    """MACs of every dot_general / conv equation of ``make_jaxpr(fn)`` (scan bodies
    times their length): the independent reference."""
    def walk(jaxpr, times, out):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name not in primitives:
                pass
            elif eqn.primitive.name == "dot_general":
                (lc, _), _ = eqn.params["dimension_numbers"]
                lhs = eqn.invars[0].aval.shape
                out.append(times * math.prod(eqn.outvars[0].aval.shape)
                           * math.prod(lhs[d] for d in lc))
            elif eqn.primitive.name == "conv_general_dilated":
                dn = eqn.params["dimension_numbers"]
                rhs = eqn.invars[1].aval.shape
                k = math.prod(rhs[d] for d in dn.rhs_spec[1:])
                out.append(times * math.prod(eqn.outvars[0].aval.shape) * k)
            inner = times * eqn.params.get("length", 1) if eqn.primitive.name == "scan" else times
            for value in eqn.params.values():
                for sub in (value if isinstance(value, (tuple, list)) else (value,)):
                    sub = getattr(sub, "jaxpr", sub)
                    if hasattr(sub, "eqns"):
                        walk(sub, inner, out)
        return out

    return sorted(walk(jax.make_jaxpr(fn)(*args).jaxpr, 1, []))


def recorded_products(qmodel, variables, *inputs, **kw):
    return sorted(op.macs for op in cpt_jax.count_ops(qmodel, variables, *inputs, **kw)
                  if op.macs > 0)


# --------------------------------------------------------------------------- every product

def test_transformer_lm_every_product_is_recorded_and_attention_is_quantized():
    cfg = TransformerConfig()
    model, tokens = TransformerLM(cfg), _tokens()
    qmodel = cpt_jax.quantize_model(model, rules=cpt_jax.CPT_RULES)
    v = _random_variables(model, tokens)
    assert recorded_products(qmodel, v, tokens) == jaxpr_products(
        lambda v, t: model.apply(v, t), v, tokens)
    layers = quantized_layers(qmodel, v, tokens)
    paths = [layer.path for layer in layers]
    # Attention products under the attention module's path, quantized by default.
    attn = "decoderblock_0/MultiHeadDotProductAttention_0"
    assert f"{attn}/query_key" in paths and f"{attn}/weights_value" in paths
    by_path = {layer.path: layer for layer in layers}
    assert by_path[f"{attn}/query_key"].kind == "attention"
    assert by_path[f"{attn}/query_key"].config is not None
    # CPT_RULES keeps the last product (the head, here `logitdense`) in fp32.
    assert paths[-1] == "logitdense" and by_path["logitdense"].config is None
    assert by_path["embed"].kind == "lookup" and by_path["embed"].config is not None
    # Counting the attention products at fp32 vs not at all changes the cost.
    ops = cpt_jax.count_ops(qmodel, v, tokens)
    assert sum(op.macs for op in ops if op.kind == "attention") > 0


@pytest.mark.slow
def test_attention_products_change_the_output_and_a_rule_keeps_them_fp32():
    cfg = TransformerConfig(num_layers=1)
    model, tokens = TransformerLM(cfg), _tokens()
    v = _random_variables(model, tokens)
    only_attention = [(r"(query_key|weights_value)$", cpt_jax.CPT_CONFIG), (".*", None)]
    with precision(3):
        y_attn = cpt_jax.quantize_model(model, only_attention).apply(v, tokens)
        y_keep = cpt_jax.quantize_model(model, [FP32_ATTENTION, (".*", None)]).apply(v, tokens)
    y = model.apply(v, tokens)
    assert not np.allclose(np.asarray(y_attn), np.asarray(y), atol=1e-3)
    np.testing.assert_array_equal(np.asarray(y_keep), np.asarray(y))


@pytest.mark.slow
def test_query_key_product_is_the_fake_quantized_einsum():
    layer = nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=4, out_features=4)
    x = jnp.asarray(np.random.default_rng(3).normal(size=(1, 3, 4)), jnp.float32)
    v = _random_variables(layer, x)
    rules = [(r"query_key$", cpt_jax.CPT_CONFIG), (".*", None)]
    with precision(3):
        _, inter = cpt_jax.quantize_model(layer, rules).apply(
            v, x, sow_weights=True, mutable=["intermediates"])
    q = nn.DenseGeneral((2, 2), name="query").apply({"params": v["params"]["query"]}, x)
    k = nn.DenseGeneral((2, 2), name="key").apply({"params": v["params"]["key"]}, x)
    q = q / jnp.sqrt(2.0)
    logits = jnp.einsum("...qhd,...khd->...hqk", quantize(q, 3, AffineInt()),
                        quantize(k, 3, AffineInt()))
    want = jax.nn.softmax(logits)
    got = inter["intermediates"]["attention_weights"][0]
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_resnet_with_batchnorm_every_conv_recorded_stats_identical_in_fp32():
    model, x = ResNet(), jnp.asarray(np.random.default_rng(0).normal(size=(2, 8, 8, 3)),
                                     jnp.float32)
    qmodel = cpt_jax.quantize_model(model, rules=cpt_jax.CPT_RULES)
    v = _random_variables(model, x)
    assert recorded_products(qmodel, v, x, mutable=["batch_stats"]) == jaxpr_products(
        lambda v, x: model.apply(v, x, mutable=["batch_stats"]), v, x)
    layers = quantized_layers(qmodel, v, x, mutable=["batch_stats"])
    assert layers[-1].path == "Dense_0" and layers[-1].config is None  # the head, fp32
    assert all(layer.config is not None for layer in layers[:-1])
    y_f, s_f = model.apply(v, x, mutable=["batch_stats"])
    y_q, s_q = qmodel.apply(v, x, mutable=["batch_stats"])
    np.testing.assert_array_equal(np.asarray(y_f), np.asarray(y_q))
    jax.tree_util.tree_map(np.testing.assert_array_equal, s_f, s_q)


# --------------------------------------------------------------------------- layer kinds

class Kinds(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.ConvTranspose(3, (3, 3), strides=(2, 2), name="up")(x)
        x = nn.ConvLocal(2, (3, 3), name="local")(x)
        x = nn.DenseGeneral((2, 3), name="dense_general")(x)
        return nn.Einsum((2, 3, 4), "bhwgc,gcf->bhwf", name="einsum")(x)


def _layer_reference(module, params, x, bits):
    """The float layer on the fake-quantized input and per-channel kernel."""
    kernel = params["kernel"]
    qk = quantize(kernel, bits, AffineInt(channel_axis=kernel.ndim - 1))
    return module.apply({"params": {**params, "kernel": qk}}, quantize(x, bits, AffineInt()))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["up", "local", "dense_general", "einsum"])
def test_layers_without_an_injection_point_are_quantized(name):
    model = Kinds()
    x = jnp.asarray(np.random.default_rng(0).normal(size=(1, 3, 3, 2)), jnp.float32)
    v = _random_variables(model, x)
    _, inter = model.apply(v, x, capture_intermediates=True, mutable=["intermediates"])
    inputs = {"up": x, "local": inter["intermediates"]["up"]["__call__"][0],
              "dense_general": inter["intermediates"]["local"]["__call__"][0],
              "einsum": inter["intermediates"]["dense_general"]["__call__"][0]}
    layer = {"up": nn.ConvTranspose(3, (3, 3), strides=(2, 2)),
             "local": nn.ConvLocal(2, (3, 3)), "dense_general": nn.DenseGeneral((2, 3)),
             "einsum": nn.Einsum((2, 3, 4), "bhwgc,gcf->bhwf")}[name]
    qlayer = cpt_jax.quantize_model(layer, rules=[], config=QuantConfig(error=None))
    p = v["params"][name]
    with precision(4):
        got = qlayer.apply({"params": p}, inputs[name])
    want = _layer_reference(layer, p, inputs[name], 4)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    assert not np.allclose(np.asarray(got), np.asarray(layer.apply({"params": p}, inputs[name])))
    # And the layer's recorded product matches its jaxpr. (ConvLocal lowers to a
    # patch-extracting conv with a one-hot kernel, data movement, then one
    # dot_general: its product.)
    qlayer = cpt_jax.quantize_model(layer)
    prims = ("dot_general",) if name == "local" else PRODUCT_PRIMITIVES
    assert recorded_products(qlayer, {"params": p}, inputs[name]) == jaxpr_products(
        lambda v, x: layer.apply(v, x), {"params": p}, inputs[name], primitives=prims)


@pytest.mark.slow
def test_embed_lookup_and_attend_are_quantized():
    embed = nn.Embed(7, 4)
    tokens = jnp.array([[0, 3, 6]])
    v = _random_variables(embed, tokens)
    table = v["params"]["embedding"]
    qtable = quantize(table, 3, AffineInt(channel_axis=0))   # one range per row
    q = cpt_jax.quantize_model(embed)
    with precision(3):
        looked_up = q.apply(v, tokens)
        query = jnp.ones((1, 4)) * 0.3
        attended = q.apply(v, query, method="attend")
    np.testing.assert_array_equal(np.asarray(looked_up), np.asarray(qtable[tokens]))
    np.testing.assert_allclose(np.asarray(attended),
                               np.asarray(quantize(query, 3, AffineInt()) @ qtable.T), rtol=1e-6)


# --------------------------------------------------------------------------- methods

@pytest.mark.slow
def test_any_method_works_and_quantizes_without_shadowing_config():
    cfg = TransformerConfig(num_layers=1)
    model, src, tgt = Seq2Seq(cfg), _tokens((2, 4)), _tokens((2, 3), seed=1)
    qmodel = cpt_jax.quantize_model(model)
    assert qmodel.config is cfg and isinstance(qmodel, Seq2Seq)   # not shadowed
    v = _random_variables(model, src, tgt)
    enc_f = model.apply(v, src, method=Seq2Seq.encode)
    for method in ("encode", Seq2Seq.encode, lambda m, x: m.encode(x)):
        np.testing.assert_array_equal(np.asarray(qmodel.apply(v, src, method=method)),
                                      np.asarray(enc_f))        # fp32 outside precision
        with precision(3):
            enc_q = qmodel.apply(v, src, method=method)
        assert not np.allclose(np.asarray(enc_q), np.asarray(enc_f), atol=1e-3)
    with precision(3):
        dec = qmodel.apply(v, enc_f, tgt, method="decode")
    assert dec.shape == (2, 3, cfg.vocab_size)
    # decode's last product (the tied-embedding `attend`) is what CPT_RULES keeps fp32.
    layers = quantized_layers(cpt_jax.quantize_model(model, cpt_jax.CPT_RULES), v, enc_f, tgt,
                              method="decode")
    assert layers[-1].path == "embed/attend" and layers[-1].config is None


# --------------------------------------------------------------------------- rules, names

def test_a_rule_that_matches_nothing_warns_with_the_paths():
    qmodel = cpt_jax.quantize_model(ResNet(), rules=[("classifier", None)])
    x = jnp.ones((1, 8, 8, 3))
    with pytest.warns(UserWarning, match=r"'classifier' matches no product.*Dense_0"):
        jax.eval_shape(qmodel.init, KEY, x)


def test_door_names_come_from_the_module_path_and_are_stable():
    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.Dense(4, dot_general_cls=QuantDotGeneral)(x)
            return nn.Dense(2, dot_general_cls=QuantDotGeneral, name="head")(x)

    v = _random_variables(Net(), jnp.ones((1, 3)))
    names = [[op.name for op in cpt_jax.count_ops(Net(), v, jnp.ones((1, 3)))]
             for _ in range(2)]
    assert names == [["Dense_0", "head"], ["Dense_0", "head"]]


# --------------------------------------------------------------------------- traps

def test_a_context_outside_jit_warns_instead_of_silently_reusing_the_first_trace():
    qmodel = cpt_jax.quantize_model(nn.Dense(3))
    v = _random_variables(qmodel, jnp.ones((1, 4)))
    f = jax.jit(qmodel.apply)
    with pytest.warns(context.StalePrecisionWarning, match="inside the jitted function"):
        with precision(8):
            f(v, jnp.ones((1, 4)))
    with warnings.catch_warnings():   # inside the jitted function: no warning
        warnings.simplefilter("error")

        @jax.jit
        def g(v, x, bits):
            with precision(bits):
                return qmodel.apply(v, x)
        g(v, jnp.ones((1, 4)), 3.0)


def test_scanned_layers_get_their_own_rounding_keys_and_count_per_iteration():
    class Body(nn.Module):
        @nn.compact
        def __call__(self, carry, x):
            return carry, nn.Dense(4, name="dense")(x)

    scanned = nn.scan(Body, variable_broadcast="params", split_rngs={"params": False},
                      length=3)
    stochastic = QuantConfig(activation=TensorQuant(AffineInt(), "stochastic"), weight=None,
                             error=None)
    qmodel = cpt_jax.quantize_model(scanned(), rules=[], config=stochastic)
    x = jnp.asarray(np.random.default_rng(0).normal(size=(3, 2, 5)), jnp.float32)
    xs = x[:1] * (1.0 + 1e-6 * jnp.arange(3.0)[:, None, None])  # ~equal inputs
    v = _random_variables(qmodel, 0, xs)
    ops = cpt_jax.count_ops(qmodel, v, 0, xs)
    assert len(ops) == 1 and ops[0].calls == 3 and ops[0].macs == 3 * 2 * 5 * 4

    @jax.jit
    def run(v, xs):
        with precision(2, rng=jax.random.key(1)):
            return qmodel.apply(v, 0, xs)[1]

    y = np.asarray(run(v, xs))
    # With one key for all iterations the three (almost equal) inputs would round
    # the same way; with per-iteration keys their rounding differs.
    assert not np.allclose(y[0], y[1], atol=1e-3) and not np.allclose(y[1], y[2], atol=1e-3)


class NNXBlock(nnx.Module):
    def __init__(self, rngs):
        self.linear = nnx.Linear(4, 4, rngs=rngs)

    def __call__(self, x):
        return nnx.relu(self.linear(x))


class NNXScanned(nnx.Module):
    """NNX with ``nnx.vmap``-created layers run by ``nnx.scan`` (the NNX docs' idiom)."""

    def __init__(self, rngs):
        @nnx.split_rngs(splits=3)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def create(rngs):
            return NNXBlock(rngs)
        self.blocks = create(rngs)
        self.head = nnx.Linear(4, 2, rngs=rngs)

    def __call__(self, x):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def body(x, block):
            return block(x)
        return self.head(body(x, self.blocks))


def test_nnx_scan_counts_per_iteration_and_matches_the_jaxpr():
    model = cpt_jax.quantize_model(NNXScanned(nnx.Rngs(0)), rules=[("head", None)])
    x = jnp.ones((2, 4))
    ops = cpt_jax.count_ops(model, x)
    graphdef, state = nnx.split(model)
    want = jaxpr_products(lambda s, x: nnx.merge(graphdef, s)(x), state, x)
    assert sorted(op.macs for op in ops) == want
    assert [op.calls for op in ops] == [3, 1]


class ConventionAttention(nn.Module):
    """A hand-written attention following Flax's einsum-class convention."""

    num_heads: int = 2
    qk_attn_weights_einsum_cls: object = None
    attn_weights_value_einsum_cls: object = None

    @nn.compact
    def __call__(self, x):
        b, t, d = x.shape
        q, k, v = (nn.Dense(d, name=n)(x).reshape(b, t, self.num_heads, -1)
                   for n in ("query", "key", "value"))
        qk = self.qk_attn_weights_einsum_cls() if self.qk_attn_weights_einsum_cls else jnp.einsum
        wv = (self.attn_weights_value_einsum_cls() if self.attn_weights_value_einsum_cls
              else jnp.einsum)
        probs = jax.nn.softmax(qk("bqhd,bkhd->bhqk", q, k), axis=-1)
        return wv("bhqk,bkhd->bqhd", probs, v).reshape(b, t, d)


def test_attention_following_flax_convention_is_intercepted():
    model, x = ConventionAttention(), jnp.ones((1, 3, 4)) * 0.5
    v = _random_variables(model, x)
    qmodel = cpt_jax.quantize_model(model)
    paths = [layer.path for layer in quantized_layers(qmodel, v, x)]
    assert paths == ["query", "key", "value", "ConventionAttention/query_key",
                     "ConventionAttention/weights_value"]   # the root is named by its class
    assert recorded_products(qmodel, v, x) == jaxpr_products(lambda v, x: model.apply(v, x), v, x)


@jax.custom_vjp
def _own_product(x, w):
    return x @ w


_own_product.defvjp(lambda x, w: (x @ w, (x, w)), lambda res, g: (g @ res[1].T, res[0].T @ g))


class OwnVJP(nn.Module):
    @nn.compact
    def __call__(self, x):
        w = self.param("w", nn.initializers.ones, (x.shape[-1], 2))
        return nn.Dense(2, name="dense")(x) + _own_product(x, w)


def test_a_product_inside_the_users_custom_vjp_warns_once_and_stays_fp32():
    qmodel = cpt_jax.quantize_model(OwnVJP())
    x = jnp.ones((1, 3))
    with pytest.warns(UserWarning, match=r"OwnVJP/matmul_0: a product inside a custom_vjp"):
        v = qmodel.init(KEY, x)
    ops = cpt_jax.count_ops(qmodel, v, x)
    assert [(op.name, op.quantized) for op in ops] == [("dense", True), ("OwnVJP/matmul_0", False)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")      # once per model
        cpt_jax.count_ops(qmodel, v, x)


class PallasLayer(nn.Module):
    @nn.compact
    def __call__(self, x):
        from jax.experimental import pallas as pl

        def kernel(x_ref, o_ref):
            o_ref[...] = jnp.dot(x_ref[...], x_ref[...].T)

        w = self.param("w", nn.initializers.ones, (x.shape[-1], x.shape[-1]))
        h = x @ w
        return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((h.shape[0],) * 2,
                                                                      h.dtype),
                              interpret=True)(h)


@pytest.mark.slow
def test_a_product_inside_a_pallas_kernel_warns_and_is_left_alone():
    qmodel = cpt_jax.quantize_model(PallasLayer())
    x = jnp.asarray(np.random.default_rng(0).normal(size=(8, 8)), jnp.float32)
    with pytest.warns(UserWarning, match="inside a Pallas kernel"):
        v = qmodel.init(KEY, x)
        with precision(2):
            y = qmodel.apply(v, x)
    h = quantize(x, 2, AffineInt()) @ quantize(v["params"]["w"], 2, AffineInt(channel_axis=1))
    np.testing.assert_allclose(np.asarray(y), np.asarray(h @ h.T), rtol=1e-5)


def test_cudnn_attention_warns_and_xla_attention_is_quantized():
    class Attn(nn.Module):
        implementation: str = None

        @nn.compact
        def __call__(self, x):
            return jax.nn.dot_product_attention(x, x, x, implementation=self.implementation)

    x = jnp.asarray(np.random.default_rng(0).normal(size=(1, 3, 2, 4)), jnp.float32)
    names = [op.name for op in cpt_jax.count_ops(cpt_jax.quantize_model(Attn()), {}, x)]
    assert names == ["Attn/query_key", "Attn/weights_value"]
    with pytest.warns(UserWarning, match="attention computed by cuDNN"):
        try:
            cpt_jax.count_ops(cpt_jax.quantize_model(Attn("cudnn")), {}, x)
        except Exception:  # no cuDNN on this machine
            pass


@pytest.mark.slow
def test_a_stateful_provider_gets_its_state_at_init_for_every_layer_kind():

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.ConvTranspose(3, (3, 3), strides=(2, 2), name="up")(x)
            x = nn.ConvLocal(2, (3, 3), name="local")(x)
            embed = nn.Embed(5, 2, name="embed")
            return embed.attend(nn.DenseGeneral((2,), name="dense_general")(x))

    x = jnp.ones((1, 3, 3, 2))
    qmodel = cpt_jax.doors.delayed_scaling_model(Net())
    v = jax.eval_shape(qmodel.init, KEY, x)
    assert set(v["batch_stats"]) == {"up", "local", "dense_general", "embed"}
    v = _random_variables(qmodel, x)
    with precision(4):
        _, updates = qmodel.apply(v, x, mutable=["batch_stats"])
    # Training updates the same tree it started from (a train step can carry it).
    assert jax.tree_util.tree_structure(updates) == jax.tree_util.tree_structure(
        {"batch_stats": v["batch_stats"]})
    # One history per product: a layer's own is `input_history`, a named product's
    # (`embed/attend`) is prefixed by its name.
    histories = {f"{layer}/{name}": h for layer, stats in updates["batch_stats"].items()
                 for name, h in stats["delayed_quant"].items()}
    assert sorted(histories) == ["dense_general/input_history", "embed/attend_input_history",
                                 "local/input_history", "up/input_history"]
    assert all(int(h.count) == 1 for h in histories.values())


def test_nnx_scan_iterations_get_their_own_rounding_keys():
    stochastic = QuantConfig(activation=TensorQuant(AffineInt(), "stochastic"), weight=None,
                             error=None)
    linear = cpt_jax.quantize_model(nnx.Linear(5, 4, rngs=nnx.Rngs(0)), config=stochastic)
    x = jnp.asarray(np.random.default_rng(0).normal(size=(1, 2, 5)), jnp.float32)
    xs = x * (1.0 + 1e-6 * jnp.arange(3.0)[:, None, None])   # ~equal inputs

    @nnx.jit
    def run(linear, xs):
        @nnx.scan(in_axes=(None, nnx.Carry, 0), out_axes=(nnx.Carry, 0))
        def body(linear, carry, x):
            return carry, linear(x)

        with precision(2, rng=jax.random.key(1)):
            return body(linear, 0.0, xs)[1]

    y = np.asarray(run(linear, xs))
    assert not np.allclose(y[0], y[1], atol=1e-3) and not np.allclose(y[1], y[2], atol=1e-3)


@jax.jit
def _jitted_product(x, w):
    return jnp.tanh(x @ w)


def _scan_body(carry, w):
    return jnp.tanh(carry @ w), None


class CachedHelpers(nn.Module):
    """Products inside functions JAX caches traces of: a jitted helper and a
    module-level scan body, each called twice."""

    @nn.compact
    def __call__(self, x):
        w = self.param("w", nn.initializers.normal(0.5), (x.shape[-1], x.shape[-1]))
        ws = jnp.stack([w, w.T])
        y = _jitted_product(_jitted_product(x, w), w)
        y = lax_scan_twice(y, ws)
        return y


def lax_scan_twice(y, ws):
    y, _ = jax.lax.scan(_scan_body, y, ws)
    y, _ = jax.lax.scan(_scan_body, y, ws)
    return y


@pytest.mark.slow
def test_products_in_cached_traces_are_each_intercepted_and_never_reused():
    x = jnp.asarray(np.random.default_rng(0).normal(size=(4, 6)), jnp.float32)
    model = CachedHelpers()
    v = model.init(KEY, x)
    _jitted_product(x, v["params"]["w"])           # traced once outside any model
    qmodel = cpt_jax.quantize_model(model)
    ops = cpt_jax.count_ops(qmodel, v, x)
    assert [(op.name, op.calls) for op in ops] == [
        ("CachedHelpers/matmul_0", 1), ("CachedHelpers/matmul_1", 1),
        ("CachedHelpers/matmul_2", 2), ("CachedHelpers/matmul_3", 2)]

    def run(v, x, bits):
        with precision(bits):
            return qmodel.apply(v, x)

    w = v["params"]["w"]
    for bits in (2, 3):   # two outer traces (no leaked tracer), and eagerly (no stale one)
        # Through a jit boundary or a stack the weight is no longer a parameter's
        # traced value: it is quantized per tensor, as an activation.
        q = functools.partial(quantize, bits=bits, fmt=AffineInt())
        want = jnp.tanh(q(jnp.tanh(q(x) @ q(w))) @ q(w))
        for wi in (w, w.T, w, w.T):
            want = jnp.tanh(q(want) @ q(wi))
        for got in (jax.jit(run)(v, x, jnp.float32(bits)), run(v, x, float(bits))):
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
