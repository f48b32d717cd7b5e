"""Tests for the GCN / GraphSAGE, LSTM LM and Transformer models (tiny shapes)."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from cpt_jax.data.graph import GraphData, gcn_norm_edges
from cpt_jax.models.gcn import GCN, GraphSAGE, aggregate, mean_aggregate
from cpt_jax.models.lstm import LSTMLanguageModel
from cpt_jax.models.transformer import (
    TransformerBlock,
    TransformerClassifier,
    TransformerLM,
    causal_mask,
)

KEY = jax.random.key(0)


def _random_graph(n=9, f=6, c=3, e=16, seed=0) -> tuple[GraphData, np.ndarray]:
    rng = np.random.default_rng(seed)
    send, recv, w = gcn_norm_edges(rng.integers(0, n, e), rng.integers(0, n, e), n)
    a_hat = np.zeros((n, n), np.float32)
    a_hat[recv, send] = w
    labels = rng.integers(0, c, n).astype(np.int32)
    mask = np.ones(n, bool)
    g = GraphData(features=jnp.asarray(rng.random((n, f)), jnp.float32),
                  labels=jnp.asarray(labels), senders=jnp.asarray(send),
                  receivers=jnp.asarray(recv), edge_weight=jnp.asarray(w),
                  train_mask=jnp.asarray(mask), val_mask=jnp.asarray(mask),
                  test_mask=jnp.asarray(mask), num_classes=c, num_nodes=n)
    return g, a_hat


def _intercepted_dense(model, variables, *args, **kwargs) -> set[str]:
    """Paths of the nn.Dense modules whose __call__ an interceptor sees."""
    seen = set()

    def interceptor(next_fun, a, kw, context):
        if isinstance(context.module, nn.Dense) and context.method_name == "__call__":
            seen.add("/".join(context.module.path))
        return next_fun(*a, **kw)

    with nn.intercept_methods(interceptor):  # abstract trace, no compile
        jax.eval_shape(lambda v, *a: model.apply(v, *a, **kwargs), variables,
                       *args)
    return seen


def _grad_step_changes_loss(model, variables, inputs, loss_fn, rngs=None):
    """One normalized SGD step on ``loss_fn(model(params, inputs))`` lowers it."""
    def loss(params):
        out = model.apply({**variables, "params": params}, inputs, train=True,
                          rngs=rngs)
        return loss_fn(out)

    @jax.jit
    def step(params):
        l0, grads = jax.value_and_grad(loss)(params)
        gnorm = optax.tree.norm(grads)
        new = jax.tree_util.tree_map(lambda p, g: p - 0.5 * g / gnorm, params,
                                     grads)
        return l0, gnorm, loss(new)

    l0, gnorm, l1 = step(variables["params"])
    assert np.isfinite(float(l0)) and float(gnorm) > 0
    assert float(l1) < float(l0)


def _jit(model):
    """(jitted init, jitted apply) of a model; bools are static."""
    return (jax.jit(model.init),
            jax.jit(model.apply, static_argnames=("train", "return_carry")))


def _np_init(model, *args, seed=0, scale=0.3):
    """Variables of ``model.init`` shapes filled from numpy (no XLA compile of
    the random initializers, which is slow on the shared test CPUs)."""
    shapes = jax.eval_shape(model.init, KEY, *args)
    rng = np.random.default_rng(seed)

    def fill(path, s):
        value = rng.uniform(-scale, scale, s.shape)
        if getattr(path[-1], "key", None) == "scale":  # LayerNorm scales
            value = value + 1.0
        return jnp.asarray(value, s.dtype)

    return jax.tree_util.tree_map_with_path(fill, shapes)


# ------------------------------------------------------------------ GCN
def test_aggregate_equals_dense_normalized_adjacency():
    g, a_hat = _random_graph()
    h = np.random.default_rng(1).normal(size=(g.num_nodes, 4)).astype(np.float32)
    out = aggregate(jnp.asarray(h), g.senders, g.receivers, g.edge_weight)
    np.testing.assert_allclose(out, a_hat @ h, rtol=1e-5, atol=1e-6)


def test_gcn_forward_equals_dense_formula():
    g, a_hat = _random_graph()
    model = GCN(num_classes=g.num_classes, hidden=5)
    init, apply = _jit(model)
    v = init(KEY, g)
    p = jax.tree_util.tree_map(np.asarray, v["params"])
    # give the biases non-zero values so they are checked too
    p["bias_0"] = np.linspace(-1, 1, 5).astype(np.float32)
    p["bias_1"] = np.linspace(-1, 1, 3).astype(np.float32)
    x = np.asarray(g.features)
    h = np.maximum(a_hat @ (x @ p["dense_0"]["kernel"]) + p["bias_0"], 0)
    expected = a_hat @ (h @ p["dense_1"]["kernel"]) + p["bias_1"]
    out = apply({"params": p}, g)
    np.testing.assert_allclose(out, expected, rtol=1e-4, atol=1e-5)
    # a plain dict works as input too
    d = {k: getattr(g, k) for k in ("features", "senders", "receivers", "edge_weight")}
    np.testing.assert_allclose(apply({"params": p}, d), out, rtol=1e-6)
    assert _intercepted_dense(model, v, g) == {"dense_0", "dense_1"}


def test_gcn_dropout_and_grad_step():
    g, _ = _random_graph()
    model = GCN(num_classes=g.num_classes, hidden=8)
    apply = _jit(model)[1]
    v = _np_init(model, g)
    a = apply(v, g, train=True, rngs={"dropout": jax.random.key(1)})
    b = apply(v, g, train=True, rngs={"dropout": jax.random.key(2)})
    assert a.shape == (g.num_nodes, g.num_classes)
    assert not np.allclose(a, b)                              # dropout active
    np.testing.assert_array_equal(apply(v, g), apply(v, g))

    def xent(logits):
        return optax.softmax_cross_entropy_with_integer_labels(logits, g.labels).mean()

    _grad_step_changes_loss(GCN(num_classes=g.num_classes, hidden=8, dropout=0.0),
                            v, g, xent)


def test_graphsage_mean_aggregate_and_grad_step():
    g, a_hat = _random_graph()
    adj = (a_hat > 0).astype(np.float32)
    np.fill_diagonal(adj, 0.0)
    h = np.random.default_rng(2).normal(size=(g.num_nodes, 3)).astype(np.float32)
    expected = adj @ h / np.maximum(adj.sum(1, keepdims=True), 1)
    out = mean_aggregate(jnp.asarray(h), g.senders, g.receivers)
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-6)

    model = GraphSAGE(num_classes=g.num_classes, hidden=8, dropout=0.0)
    v = _np_init(model, g)
    assert jax.jit(model.apply)(v, g).shape == (g.num_nodes, g.num_classes)
    assert _intercepted_dense(model, v, g) == {"self_0", "neigh_0", "self_1", "neigh_1"}

    def xent(logits):
        return optax.softmax_cross_entropy_with_integer_labels(logits, g.labels).mean()

    _grad_step_changes_loss(model, v, g, xent)


# ------------------------------------------------------------------ LSTM
def _lm_xent(targets):
    def fn(logits):
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()
    return fn


@pytest.mark.slow
def test_lstm_shapes_scan_loop_and_carry():
    vocab, b, t = 30, 2, 6
    model = LSTMLanguageModel(vocab_size=vocab, embed=8, hidden=12, dropout=0.5)
    init, apply = _jit(model)
    x = jax.random.randint(KEY, (b, t), 0, vocab)
    v = init(KEY, x)
    logits, carry = apply(v, x, return_carry=True)
    assert logits.shape == (b, t, vocab)
    assert len(carry) == 2 and carry[0][0].shape == (b, 12)
    # the scanned and the unrolled recurrences agree
    loop = LSTMLanguageModel(vocab_size=vocab, embed=8, hidden=12, use_scan=False)
    np.testing.assert_allclose(_jit(loop)[1](v, x), logits, rtol=1e-5, atol=1e-6)
    # two halves with the carry passed on == the whole sequence
    first, c1 = apply(v, x[:, :3], return_carry=True)
    second, _ = apply(v, x[:, 3:], initial_carry=c1, return_carry=True)
    np.testing.assert_allclose(jnp.concatenate([first, second], 1), logits,
                               rtol=1e-5, atol=1e-6)
    # without a carry the state restarts from zeros (a different answer)
    assert not np.allclose(apply(v, x[:, 3:], return_carry=True)[0], second)
    # every matmul is an intercepted nn.Dense
    assert _intercepted_dense(model, v, x) == {
        "lstm_0/ih", "lstm_0/cell/hh", "lstm_1/ih", "lstm_1/cell/hh", "decoder"}
    # initial parameters are uniform in [-0.05, 0.05]
    leaves = jax.tree_util.tree_leaves(v["params"])
    assert max(float(jnp.abs(p).max()) for p in leaves) <= 0.05


def test_lstm_grad_step():
    vocab = 20
    model = LSTMLanguageModel(vocab_size=vocab, embed=8, hidden=8, dropout=0.0)
    tokens = jax.random.randint(KEY, (2, 7), 0, vocab)
    v = _np_init(model, tokens[:, :-1])
    _grad_step_changes_loss(model, v, tokens[:, :-1], _lm_xent(tokens[:, 1:]))


# ------------------------------------------------------------------ Transformer
def _tiny_lm(**kw):
    return TransformerLM(vocab_size=40, d_model=16, num_heads=2, num_layers=1,
                         mlp_dim=32, max_len=12, **kw)


@pytest.mark.slow
def test_transformer_lm_causal_dense_layers_and_grad_step():
    model = _tiny_lm(dropout=0.1)
    apply = _jit(model)[1]
    tokens = jax.random.randint(KEY, (2, 9), 0, 40)
    x, y = tokens[:, :-1], tokens[:, 1:]
    v = _np_init(model, x)
    base = apply(v, x)
    assert base.shape == (2, 8, 40)
    # causal: changing token `pos` changes no logit before it
    pos = 5
    changed = apply(v, x.at[:, pos].set((x[:, pos] + 1) % 40))
    np.testing.assert_allclose(changed[:, :pos], base[:, :pos], rtol=1e-5,
                               atol=1e-6)
    assert not np.allclose(changed[:, pos:], base[:, pos:])
    with pytest.raises(ValueError, match="max_len"):
        jax.eval_shape(model.apply, v, jnp.zeros((1, 13), jnp.int32))
    # every projection is an intercepted nn.Dense
    seen = _intercepted_dense(model, v, x)
    for name in ("attn/query", "attn/key", "attn/value", "attn/out",
                 "mlp/fc1", "mlp/fc2"):
        assert f"encoder/block_0/{name}" in seen
    assert "lm_head" in seen and len(seen) == 7
    # dropout is active in training, and a step lowers the loss
    a = apply(v, x, train=True, rngs={"dropout": jax.random.key(1)})
    b = apply(v, x, train=True, rngs={"dropout": jax.random.key(2)})
    assert not np.allclose(a, b)
    _grad_step_changes_loss(model, v, x, _lm_xent(y),
                            rngs={"dropout": jax.random.key(3)})


def test_transformer_lm_tied_head():
    model = _tiny_lm(dropout=0.0, tie_embeddings=True)
    x = jax.random.randint(KEY, (1, 5), 0, 40)
    v = _np_init(model, x)
    assert "lm_head" not in v["params"]
    emb = v["params"]["encoder"]["embed"]["embedding"]

    @jax.jit
    def run(v, x):
        return model.apply(v, x, mutable=["intermediates"],
                           capture_intermediates=lambda m, _: m.name == "ln_final")

    logits, state = run(v, x)
    h = state["intermediates"]["encoder"]["ln_final"]["__call__"][0]
    assert logits.shape == (1, 5, 40)
    np.testing.assert_allclose(logits, h @ emb.T, rtol=1e-5, atol=1e-5)


def test_transformer_classifier_ignores_padding():
    model = TransformerClassifier(vocab_size=40, num_classes=3, d_model=16,
                                  num_heads=2, num_layers=1, mlp_dim=32,
                                  max_len=12, dropout=0.1)
    apply = _jit(model)[1]
    x = jnp.array([[5, 6, 7, 0, 0, 0], [9, 8, 7, 6, 5, 4]], jnp.int32)
    v = _np_init(model, x)
    out = apply(v, x)
    assert out.shape == (2, 3)
    # tokens under the mask's padded positions change nothing
    mask = x != 0
    x_junk = jnp.where(mask, x, 11)
    np.testing.assert_allclose(apply(v, x_junk, mask=mask), out,
                               rtol=1e-5, atol=1e-6)
    # but a real token does
    assert not np.allclose(apply(v, x.at[0, 1].set(12)), out)
    assert "classifier" in _intercepted_dense(model, v, x)
    labels = jnp.array([0, 2])

    def xent(logits):
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

    _grad_step_changes_loss(model, v, x, xent, rngs={"dropout": jax.random.key(0)})


def test_transformer_block_standalone():
    blk = TransformerBlock(d_model=16, num_heads=4, mlp_dim=32)
    apply = _jit(blk)[1]
    x = jax.random.normal(KEY, (2, 5, 16))
    v = _np_init(blk, x, causal_mask(5))
    y = apply(v, x, causal_mask(5))
    assert y.shape == x.shape
    y2 = apply(v, x.at[:, 4].add(1.0), causal_mask(5))
    np.testing.assert_allclose(y2[:, :4], y[:, :4], rtol=1e-5, atol=1e-6)
    assert not np.allclose(y2[:, 4], y[:, 4])
    with pytest.raises(ValueError, match="d_model"):
        jax.eval_shape(blk.apply, v, jnp.ones((1, 5, 8)))
