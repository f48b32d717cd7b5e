"""The per-token and tiled presets (``symmetric_per_token``, ``int8_per_token``,
``symmetric_tile128``, ``int8_tile128``) on models written as a third-party user
writes them, in styles the rest of the zoo does not have:

- an NNX mixture-of-experts layer: top-2 routing, tokens grouped by expert, the
  experts as two ``jax.lax.ragged_dot`` s;
- a Linen decoder with ``nn.scan`` over ``nn.remat`` layers, learned positions and
  attention as raw einsums in a ``(batch, heads, tokens, dim)`` layout;
- an NNX model used from Linen through ``nnx.bridge.ToLinen``: a 1-D conv front-end
  and a grouped-query attention (4 query heads sharing 2 key/value heads).

For each model and preset: a jitted train step with a traced bit-width runs 3 steps
(bits 4, 6, 8) with one compile, the loss is finite and changes, the gradients are
finite; every product the program binds is a recorded, quantized product; each
activation's per-token (or tiled) scales lie along the product's contraction, one
scale per row of the GEMM (its grid step checked against a per-row reference, as
``tests/test_per_token_and_tiles.py`` does). A 128 tile longer than a contraction is
one ragged block: one scale per row, the per-token grid (docs/formats.md).
"""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax import lax

import cpt_jax
from cpt_jax.formats import SymmetricInt, grid_step, quantize
from cpt_jax.interception import ACTIVATION, WEIGHT
from cpt_jax.providers.fake_quant import operand_quant

PRESETS = ("symmetric_per_token", "int8_per_token", "symmetric_tile128", "int8_tile128")
BITS = (4.0, 6.0, 8.0)
VOCAB = 11
KEY = jax.random.key(0)
PRODUCT_PRIMITIVES = ("dot_general", "conv_general_dilated", "ragged_dot_general",
                      "ragged_dot")


def _tokens(b=2, t=6, seed=0):
    return jnp.asarray(np.random.default_rng(seed).integers(0, VOCAB, size=(b, t)), jnp.int32)


def _lm_loss(logits, tokens):
    return optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], tokens[:, 1:]).mean()


# --------------------------------------------------------------------------- NNX MoE (ragged_dot)

class TopTwoMoE(nnx.Module):
    """A mixture of experts as MoE libraries write it: softmax router, top-2, tokens
    sorted by expert, each expert's FFN a ``ragged_dot`` over its group."""

    def __init__(self, d, hidden, experts, rngs):
        self.embed = nnx.Embed(VOCAB, d, rngs=rngs)
        self.router = nnx.Linear(d, experts, use_bias=False, rngs=rngs)
        init = nnx.initializers.normal(0.3)
        self.w_up = nnx.Param(init(rngs.params(), (experts, d, hidden)))
        self.w_down = nnx.Param(init(rngs.params(), (experts, hidden, d)))
        self.head = nnx.Linear(d, VOCAB, rngs=rngs)
        self.experts = experts

    def __call__(self, tokens):
        x = self.embed(tokens)
        flat = x.reshape(-1, x.shape[-1])
        gates, choice = lax.top_k(jax.nn.softmax(self.router(flat)), 2)   # (n, 2)
        expert = choice.reshape(-1)
        order = jnp.argsort(expert)
        token_of = order // 2
        group_sizes = jnp.bincount(expert, length=self.experts).astype(jnp.int32)
        h = jax.nn.silu(lax.ragged_dot(flat[token_of], self.w_up[...], group_sizes))
        y = lax.ragged_dot(h, self.w_down[...], group_sizes) * gates.reshape(-1)[order][:, None]
        mixed = jnp.zeros_like(flat).at[token_of].add(y)
        return self.head(x + mixed.reshape(x.shape))


# --------------------------------------------------------------------------- Linen scan + remat

class EinsumAttentionLayer(nn.Module):
    """Pre-norm decoder layer with raw einsum attention in (batch, heads, tokens, dim)."""

    heads: int = 2
    head_dim: int = 4

    @nn.compact
    def __call__(self, x, _):
        d = x.shape[-1]
        init = nn.initializers.lecun_normal()
        wq, wk, wv = (self.param(n, init, (d, self.heads, self.head_dim)) for n in ("wq", "wk", "wv"))
        wo = self.param("wo", init, (self.heads, self.head_dim, d))
        h = nn.LayerNorm(name="ln1")(x)
        q = jnp.einsum("btd,dhk->bhtk", h, wq)
        k = jnp.einsum("btd,dhk->bhtk", h, wk)
        v = jnp.einsum("btd,dhk->bhtk", h, wv)
        t = x.shape[1]
        scores = jnp.einsum("bhtk,bhsk->bhts", q, k) / np.sqrt(self.head_dim)
        scores = jnp.where(jnp.tril(jnp.ones((t, t), bool)), scores, -1e9)
        attn = jnp.einsum("bhts,bhsk->bhtk", jax.nn.softmax(scores, axis=-1), v)
        x = x + jnp.einsum("bhtk,hkd->btd", attn, wo)
        h = nn.LayerNorm(name="ln2")(x)
        x = x + nn.Dense(d, name="down")(nn.gelu(nn.Dense(2 * d, name="up")(h)))
        return x, None


class ScannedDecoder(nn.Module):
    d: int = 8
    layers: int = 2
    max_len: int = 16

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(VOCAB, self.d, name="embed")(tokens)
        pos = self.param("pos", nn.initializers.normal(0.02), (self.max_len, self.d))
        x = x + pos[: tokens.shape[1]]
        stack = nn.scan(nn.remat(EinsumAttentionLayer), variable_axes={"params": 0},
                        split_rngs={"params": True}, length=self.layers)
        x, _ = stack(name="layers")(x, None)
        return nn.Dense(VOCAB, name="lm_head")(nn.LayerNorm(name="ln_f")(x))


# --------------------------------------------------------------------------- NNX via ToLinen

class ConvGQA(nnx.Module):
    """A 1-D conv front-end and a grouped-query attention (4 query heads, 2 kv heads)."""

    def __init__(self, d, rngs, q_heads=4, kv_heads=2, head_dim=4):
        self.conv = nnx.Conv(d, d, kernel_size=(3,), padding="CAUSAL", rngs=rngs)
        self.q = nnx.Linear(d, q_heads * head_dim, use_bias=False, rngs=rngs)
        self.kv = nnx.Linear(d, 2 * kv_heads * head_dim, use_bias=False, rngs=rngs)
        self.o = nnx.Linear(q_heads * head_dim, d, use_bias=False, rngs=rngs)
        self.shape = (q_heads, kv_heads, head_dim)

    def __call__(self, x):
        q_heads, kv_heads, hd = self.shape
        b, t, _ = x.shape
        x = x + nnx.gelu(self.conv(x))
        q = self.q(x).reshape(b, t, kv_heads, q_heads // kv_heads, hd)
        k, v = jnp.split(self.kv(x).reshape(b, t, 2 * kv_heads, hd), 2, axis=2)
        scores = jnp.einsum("btgrk,bsgk->bgrts", q, k) / np.sqrt(hd)
        scores = jnp.where(jnp.tril(jnp.ones((t, t), bool)), scores, -1e9)
        attn = jnp.einsum("bgrts,bsgk->btgrk", jax.nn.softmax(scores, axis=-1), v)
        return x + self.o(attn.reshape(b, t, q_heads * hd))


class BridgedConvGQA(nn.Module):
    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(VOCAB, 8, name="embed")(tokens)
        x = nnx.bridge.ToLinen(ConvGQA, args=(8,), name="body")(x)
        return nn.Dense(VOCAB, name="lm_head")(x)


# --------------------------------------------------------------------------- harness

@dataclasses.dataclass(frozen=True)
class Built:
    """A quantized model as its training step sees it."""

    apply: Callable            # (params, tokens) -> logits, products intercepted
    params: Any
    ops: list                  # cpt_jax.count_ops: the recorded products
    plain_jaxpr: Any           # the unquantized model's forward program


def _linen(model: nn.Module, config, tokens) -> Built:
    qmodel = cpt_jax.quantize_model(model, config=config)
    variables = jax.jit(qmodel.init)(KEY, tokens)
    plain = jax.make_jaxpr(lambda p: model.apply({"params": p}, tokens))(variables["params"])
    return Built(lambda p, x: qmodel.apply({"params": p}, x), variables["params"],
                 cpt_jax.count_ops(qmodel, variables, tokens), plain)


def _nnx(make: Callable, config, tokens) -> Built:
    graphdef, params = nnx.split(make())
    plain = jax.make_jaxpr(lambda p: nnx.merge(graphdef, p)(tokens))(params)
    qmodel = cpt_jax.quantize_model(make(), config=config)
    qgraphdef, qparams = nnx.split(qmodel)
    return Built(lambda p, x: nnx.merge(qgraphdef, p)(x), qparams,
                 cpt_jax.count_ops(qmodel, tokens), plain)


MODELS = {
    "nnx_moe_ragged_dot": lambda config, tokens: _nnx(
        lambda: TopTwoMoE(8, 8, 4, nnx.Rngs(0)), config, tokens),
    "linen_scan_remat_einsum": lambda config, tokens: _linen(ScannedDecoder(), config, tokens),
    "to_linen_conv_gqa": lambda config, tokens: _linen(BridgedConvGQA(), config, tokens),
}

EXPECTED_PRODUCTS = {
    "nnx_moe_ragged_dot": ["embed", "router", "TopTwoMoE/ragged_dot_0", "TopTwoMoE/ragged_dot_1",
                           "head"],
    "linen_scan_remat_einsum": ["embed", *(f"layers/einsum_{i}" for i in range(6)),
                                "layers/up", "layers/down", "lm_head"],
    "to_linen_conv_gqa": ["embed", "body/conv", "body/q", "body/kv", "body/einsum_0",
                          "body/einsum_1", "body/o", "lm_head"],
}


def _sub_jaxprs(value):
    if hasattr(value, "eqns"):
        yield value
    elif hasattr(value, "jaxpr") and hasattr(value.jaxpr, "eqns"):
        yield value.jaxpr
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from _sub_jaxprs(v)


def program_products(jaxpr) -> list[str]:
    """The product equations of a program (each body once), independent of cpt_jax: a
    ``dot_general`` that contracts nothing (an elementwise scale) is not a product."""
    out = []
    for eqn in getattr(jaxpr, "jaxpr", jaxpr).eqns:
        name = eqn.primitive.name
        if name in PRODUCT_PRIMITIVES and (
                name != "dot_general" or eqn.params["dimension_numbers"][0][0]):
            out.append(name)
        for value in eqn.params.values():
            for sub in _sub_jaxprs(value):
                out.extend(program_products(sub))
    return out


def _products(ops):
    return [op for op in ops if op.product is not None and "index" not in (
        op.product.lhs.role, op.product.rhs.role)]


def _per_row_step(x, axes, bits):
    """The `SymmetricInt` grid step of one scale per row of `axes` (numpy): per token,
    or a 128 tile longer than the row (one ragged block), ``max_row |x| / (2^(b-1) - 1)``."""
    return np.max(np.abs(np.asarray(x)), axis=axes, keepdims=True) / (2.0 ** (bits - 1) - 1)


def expected_scale_axes(product, operand, preset) -> tuple[int, ...]:
    """Per token: one scale per row of the GEMM, over all the contracted axes. Tiled:
    the tiles run along the innermost contracted axis of a dot (each other contracted
    index its own row of tiles: 1 x 128 per head), a conv's along its features."""
    if "tile" in preset and product.kind != "conv" and len(operand.contracting) > 1:
        return (operand.contracting[-1],)
    return tuple(sorted(operand.contracting))


def assert_scales_along_each_contraction(ops, preset):
    """Each activation operand: scales over its contracted axes (`expected_scale_axes`),
    equal to the per-row reference on a tensor whose rows are 10^4 apart (a 128 tile
    is longer than every contraction here: one block, the per-row grid); each weight
    per output channel (``*_per_token``; a ragged dot's stacked experts per expert and
    channel) or tiled along its contraction (``*_tile128``)."""
    for op in _products(ops):
        product = op.product
        for operand, shape in ((product.lhs, op.lhs_shape), (product.rhs, op.rhs_shape)):
            fmt = operand_quant(product, operand).fmt
            if operand.role == WEIGHT:
                if "tile" in preset:
                    assert sorted(fmt.scale_axes) == list(
                        expected_scale_axes(product, operand, preset)), (op.name, fmt)
                elif product.kind == "ragged_dot":  # stacked experts: per expert and channel
                    assert fmt.channel_axis is None and operand.channel_axis is not None
                    assert tuple(fmt.scale_axes) == operand.contracting, (op.name, fmt)
                else:
                    assert fmt.channel_axis == operand.channel_axis is not None, (op.name, fmt)
                continue
            assert operand.role == ACTIVATION, op.name
            axes = expected_scale_axes(product, operand, preset)
            assert tuple(sorted(fmt.scale_axes)) == axes, (op.name, fmt, axes)
            assert all(shape[a] <= 128 for a in axes), (op.name, shape)
            x = np.random.default_rng(1).normal(size=shape).astype(np.float32)
            x *= np.logspace(-2, 2, shape[0], dtype=np.float32).reshape(
                (-1,) + (1,) * (len(shape) - 1))
            step = np.broadcast_to(grid_step(jnp.asarray(x), 4, fmt), shape)
            np.testing.assert_allclose(step, np.broadcast_to(_per_row_step(x, axes, 4), shape),
                                       rtol=1e-6, err_msg=op.name)


def train_three_steps(built: Built, tokens):
    """3 jitted Adam steps at bits 4, 6, 8 (traced): losses, gradient finiteness, compiles."""
    optimizer = optax.adam(1e-2)

    @jax.jit
    def step(params, opt_state, bits, t):
        def loss(p):
            with cpt_jax.precision(bits, grad_bits=8, rng=jax.random.fold_in(KEY, t)):
                return _lm_loss(built.apply(p, tokens), tokens)

        value, grads = jax.value_and_grad(loss)(params)
        finite = jnp.all(jnp.stack([jnp.all(jnp.isfinite(g)) for g in jax.tree.leaves(grads)]))
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value, finite

    params, opt_state = built.params, optimizer.init(built.params)
    losses, finite = [], []
    for t, bits in enumerate(BITS):
        params, opt_state, value, ok = step(params, opt_state, jnp.float32(bits), jnp.int32(t))
        losses.append(float(value))
        finite.append(bool(ok))
    return losses, finite, step._cache_size()


# the fast tier: the MoE (its products' scales and its training); every other model x
# preset in the slow tier (CI runs it), the fast tier's 5 minutes being shared
FAST = {("nnx_moe_ragged_dot", "int8_per_token")}
FAST_TRAINING = FAST


def _cases(fast):
    return [pytest.param(m, p, marks=() if (m, p) in fast else pytest.mark.slow)
            for m in MODELS for p in PRESETS]


@functools.cache
def _built(model, preset):
    tokens = _tokens()
    return MODELS[model](cpt_jax.get_preset(preset), tokens), tokens


@pytest.mark.parametrize("model, preset", _cases(FAST))
def test_every_product_is_quantized_with_scales_along_its_contraction(model, preset):
    built, _ = _built(model, preset)
    assert [op.name for op in built.ops] == EXPECTED_PRODUCTS[model]
    assert all(op.quantized for op in built.ops)
    # every product equation of the plain model's program is a recorded product
    assert len(_products(built.ops)) == len(program_products(built.plain_jaxpr))
    assert_scales_along_each_contraction(built.ops, preset)


@pytest.mark.parametrize("model, preset", _cases(FAST_TRAINING))
def test_trains_three_steps_at_traced_bits_with_one_compile(model, preset):
    built, tokens = _built(model, preset)
    losses, finite, compiles = train_three_steps(built, tokens)
    assert compiles == 1
    assert np.all(np.isfinite(losses)) and all(finite), (losses, finite)
    assert losses[-1] != losses[0], losses


# --------------------------------------------------------------------------- the int8 product

def _forward(built: Built, tokens, bits=4.0):
    def f(p, x, b):
        with cpt_jax.precision(b, 8, rng=KEY):
            return built.apply(p, x)
    jaxpr = jax.make_jaxpr(f)(built.params, tokens, bits)
    return jax.jit(f)(built.params, tokens, bits), jaxpr


def int8_products(jaxpr) -> int:
    """The int8 x int8 -> int32 dot_generals of a program (each body once)."""
    n = 0
    for eqn in getattr(jaxpr, "jaxpr", jaxpr).eqns:
        if (eqn.primitive.name == "dot_general"
                and eqn.params.get("preferred_element_type") == jnp.int32):
            n += 1
        for value in eqn.params.values():
            for sub in _sub_jaxprs(value):
                n += int8_products(sub)
    return n


@pytest.mark.slow
@pytest.mark.parametrize("model", list(MODELS))
def test_int8_per_token_runs_every_weight_dot_on_int8_codes_and_equals_fake_quant(model):
    """Every dot_general runs on int8 codes: those with a weight, the einsum projections
    ``"btd,dhk->bhtk"`` too (JAX lowers them kernel first), and attention's two products
    of activations (per-token grids are constant along head_dim and along the keys);
    ragged dots and convs (on CPU) fall back to fake quant (documented): the whole model
    equals its fake-quant twin up to the float rounding of the rescale."""
    tokens = _tokens()
    built, _ = _built(model, "int8_per_token")
    y_int8, jaxpr = _forward(built, tokens)
    y_fake, _ = _forward(_built(model, "symmetric_per_token")[0], tokens)
    dots = [op for op in _products(built.ops) if op.kind == "dot_general"]
    with_weight = [op for op in dots if WEIGHT in (op.product.lhs.role, op.product.rhs.role)]
    assert int8_products(jaxpr) == len(dots) >= len(with_weight) > 0
    np.testing.assert_allclose(y_int8, y_fake, rtol=1e-4, atol=1e-4 * float(jnp.abs(y_fake).max()))


class HeadsOutProjection(nn.Module):
    """An attention output projection contracting (heads, head_dim) at once."""

    @nn.compact
    def __call__(self, attn):
        wo = self.param("wo", nn.initializers.lecun_normal(), (2, 128, 8))
        return jnp.einsum("bhtk,hkd->btd", attn, wo)


@pytest.mark.parametrize("preset", ["symmetric_tile128", "int8_tile128"])
def test_a_tile_over_heads_and_head_dim_is_one_by_128_per_head(preset):
    """A 128 tile on a (heads=2, head_dim=128) contraction is one scale per head of
    each token (128 contracted elements), not one per 256: the second head, 10^3
    smaller, keeps its values at 4 bits."""
    rng = np.random.default_rng(2)
    attn = jnp.asarray(rng.normal(size=(1, 2, 3, 128)), jnp.float32).at[:, 1].multiply(1e-3)
    model = cpt_jax.quantize_model(HeadsOutProjection(), config=cpt_jax.get_preset(preset))
    v = model.init(KEY, attn)

    @jax.jit
    def apply(v, attn):
        with cpt_jax.precision(4, 8, rng=KEY):
            return model.apply(v, attn)
    y = apply(v, attn)
    per_head = jnp.einsum("bhtk,hkd->btd", quantize(attn, 4, SymmetricInt(scale_axes=(-1,))),
                          quantize(v["params"]["wo"], 4, SymmetricInt(scale_axes=(1,))))
    np.testing.assert_allclose(y, per_head, rtol=1e-5, atol=1e-5 * float(jnp.abs(y).max()))
    (op,) = cpt_jax.count_ops(model, v, attn)
    assert operand_quant(op.product, op.product.lhs).fmt.scale_axes == (3,)
    assert operand_quant(op.product, op.product.rhs).fmt.scale_axes == (1,)


class WeightFirstProjection(nn.Module):
    @nn.compact
    def __call__(self, x):
        w = self.param("w", nn.initializers.lecun_normal(), (200, 2, 4))
        return jnp.einsum("btd,dhk->bhtk", x, w)


@pytest.mark.parametrize("int8, fake", [("int8_per_token", "symmetric_per_token"),
                                        ("int8_tile128", "symmetric_tile128")])
def test_a_weight_first_einsum_runs_on_int8_codes(int8, fake):
    """``einsum("btd,dhk->bhtk")`` binds ``dot_general(w, x)``: the int8 product runs it
    swapped (x . w, 200 features: tiles 128 + 72), transposed back, equal to fake quant,
    and its gradient is finite."""
    x = jnp.asarray(np.random.default_rng(3).normal(size=(2, 3, 200)), jnp.float32)
    x = x * jnp.logspace(-2, 2, 3)[:, None]

    def run(name):
        model = cpt_jax.quantize_model(WeightFirstProjection(), config=cpt_jax.get_preset(name))
        v = model.init(KEY, x)

        def f(p, b):
            with cpt_jax.precision(b, 8, rng=KEY):
                return model.apply({"params": p}, x)
        y, grad = jax.jit(lambda p: (f(p, 4.0), jax.grad(lambda q: jnp.sum(f(q, 4.0) ** 2))(p)))(
            v["params"])
        return y, jax.make_jaxpr(f)(v["params"], 4.0), grad

    y_int8, jaxpr, grad = run(int8)
    y_fake, fake_jaxpr, _ = run(fake)
    assert int8_products(jaxpr) == 1 and int8_products(fake_jaxpr) == 0
    np.testing.assert_allclose(y_int8, y_fake, rtol=1e-5, atol=1e-5 * float(jnp.abs(y_fake).max()))
    assert y_int8.shape == (2, 2, 3, 4)
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree.leaves(grad))
