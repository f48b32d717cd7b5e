"""How cpt_jax lays out the products it intercepts (independent of quantization)."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import cpt_jax

try:
    from jax.extend.core import jaxprs_in_params
except ImportError:  # older jax
    from jax.core import jaxprs_in_params

ALL_FP32 = ((r".*", None),)


class TokenDense(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(24, name="proj")(x)


def _dots(jaxpr) -> list:
    """Every dot_general equation's operand shapes, through sub-jaxprs."""
    out = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            out.append(tuple(tuple(v.aval.shape) for v in eqn.invars))
        for sub in jaxprs_in_params(eqn.params):
            out += _dots(sub)
    return out


def test_a_dense_over_tokens_is_one_2d_gemm_with_the_same_values():
    # (batch, tokens, features) x (features, out): computed on CPU as (batch*tokens,
    # features) x (features, out), so the weight gradient contracts one axis of 2-D operands
    # (XLA CPU then needs no transposed copy of the error); values and gradients as
    # the plain model's.
    x = jnp.asarray(np.random.default_rng(0).normal(size=(3, 5, 16)), jnp.float32)
    plain = TokenDense()
    model = cpt_jax.quantize_model(plain, rules=ALL_FP32)
    params = plain.init(jax.random.key(0), x)

    def loss(p, m):
        return jnp.sum(jnp.sin(m.apply(p, x)))
    np.testing.assert_allclose(model.apply(params, x), plain.apply(params, x), rtol=1e-6)
    g_cpt, g_plain = jax.grad(loss)(params, model), jax.grad(loss)(params, plain)
    for a, b in zip(jax.tree.leaves(g_cpt), jax.tree.leaves(g_plain)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    if jax.default_backend() != "cpu":
        return  # GPU/TPU keep the 3-D product (no transposed copy to avoid there)
    forward = _dots(jax.make_jaxpr(lambda p: model.apply(p, x))(params).jaxpr)
    assert forward == [((15, 16), (16, 24))]
    backward = _dots(jax.make_jaxpr(jax.grad(lambda p: loss(p, model)))(params).jaxpr)
    assert all(len(shape) == 2 for shapes in backward for shape in shapes), backward


def test_other_dots_keep_their_dimension_numbers():
    # A batched dot (attention's q.k) and a weight-first dot are computed as written.
    q = jnp.ones((2, 4, 8))
    w = jnp.ones((8, 3))

    class Batched(nn.Module):
        @nn.compact
        def __call__(self, q):
            first = jax.lax.dot_general(w, q, (((0,), (2,)), ((), ())))  # (3, 2, 4)
            return jnp.einsum("btd,bsd->bts", q, q) + first.sum()
    model = cpt_jax.quantize_model(Batched(), rules=ALL_FP32)
    params = Batched().init(jax.random.key(0), q)
    shapes = _dots(jax.make_jaxpr(lambda p: model.apply(p, q))(params).jaxpr)
    assert sorted(shapes) == [((2, 4, 8), (2, 4, 8)), ((8, 3), (2, 4, 8))]
    np.testing.assert_allclose(model.apply(params, q), Batched().apply(params, q))


@pytest.mark.slow
def test_flax_attention_through_cpt_jax_has_the_plain_values():
    # nn.MultiHeadDotProductAttention: DenseGeneral q/k/v (features -> heads x head_dim,
    # a 3-D kernel, computed as written) and the output projection; values and
    # gradients as the plain module's.
    x = jnp.asarray(np.random.default_rng(1).normal(size=(2, 6, 16)), jnp.float32)
    plain = nn.MultiHeadDotProductAttention(num_heads=4, qkv_features=16)
    model = cpt_jax.quantize_model(plain, rules=ALL_FP32)
    params = plain.init(jax.random.key(0), x)

    def loss(p, m):
        return jnp.sum(jnp.tanh(m.apply(p, x)))
    np.testing.assert_allclose(model.apply(params, x), plain.apply(params, x),
                               rtol=1e-5, atol=1e-6)
    for a, b in zip(jax.tree.leaves(jax.grad(loss)(params, model)),
                    jax.tree.leaves(jax.grad(loss)(params, plain))):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
