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


def test_a_quantized_dense_over_tokens_is_one_2d_gemm_with_the_same_values():
    # Inside a precision context, a quantized (batch, tokens, features) x (features,
    # out) is computed on CPU as (batch*tokens, features) x (features, out), so the
    # weight gradient contracts one axis of 2-D operands (XLA CPU then needs no
    # transposed copy of the error); at 32 bits (the quantizers the identity) values
    # and gradients as the plain model's. Not quantized, it is computed as written.
    x = jnp.asarray(np.random.default_rng(0).normal(size=(3, 5, 16)), jnp.float32)
    plain = TokenDense()
    model = cpt_jax.quantize_model(plain)
    params = plain.init(jax.random.key(0), x)

    def loss(p, m, bits=None):
        if bits is None:
            return jnp.sum(jnp.sin(m.apply(p, x)))
        with cpt_jax.precision(bits, grad_bits=bits, rng=jax.random.key(1)):
            return jnp.sum(jnp.sin(m.apply(p, x)))
    g_cpt = jax.jit(jax.value_and_grad(lambda p: loss(p, model, 32.0)))(params)
    g_plain = jax.jit(jax.value_and_grad(lambda p: loss(p, plain)))(params)
    for a, b in zip(jax.tree.leaves(g_cpt), jax.tree.leaves(g_plain)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    if jax.default_backend() != "cpu":
        return  # GPU/TPU keep the 3-D product (no transposed copy to avoid there)
    for bits in (8.0, 32.0):
        forward = _dots(jax.make_jaxpr(lambda p, b=bits: loss(p, model, b))(params).jaxpr)
        assert forward == [((15, 16), (16, 24))]
        backward = _dots(jax.make_jaxpr(jax.grad(lambda p, b=bits: loss(p, model, b)))(params).jaxpr)
        assert all(len(shape) == 2 for shapes in backward for shape in shapes), backward
    outside = _dots(jax.make_jaxpr(lambda p: loss(p, model))(params).jaxpr)
    assert outside == [((3, 5, 16), (16, 24))]


class EveryLayout(nn.Module):
    """Dense over 2-D, 3-D and 4-D inputs, a conv, an einsum and ``@`` / ``jnp.dot``."""

    @nn.compact
    def __call__(self, x4, x2=None, x3=None, img=None):
        w = self.param("w", nn.initializers.normal(0.3), (16, 16))
        y = jnp.sum(jnp.dot(jnp.einsum("bhwc,cd->bhwd", nn.Dense(16, name="d4")(x4), w) @ w, w))
        if x2 is None:
            return y
        ys = (nn.Dense(16, name="d2")(x2), nn.Dense(16, name="d3")(x3),
              nn.Conv(16, (3, 3), name="conv")(img))
        return y + sum(jnp.sum(jnp.sin(y)) for y in ys)


def _layout_inputs(every: bool):
    rng = np.random.default_rng(2)
    # (2, 16, 16, 32): large enough that eagerly XLA sums the 4-D product's weight
    # gradient in another order than a 2-D GEMM's (it did before issue 41, on jax 0.10
    # and 0.12), and the op-by-op einsum / matmul in another than the jitted ones.
    shapes = [(2, 16, 16, 32)] + ([(8, 32), (4, 8, 32), (2, 8, 8, 3)] if every else [])
    return [jnp.asarray(rng.normal(size=s), jnp.float32) for s in shapes]


def _outside_precision_is_the_model(jit: bool, every: bool):
    xs = _layout_inputs(every)
    plain = EveryLayout()
    params = jax.jit(plain.init)(jax.random.key(0), *xs)

    def grads(model, bits=None):
        def loss(p, *x):
            if bits is None:
                return model.apply(p, *x)
            with cpt_jax.precision(bits, grad_bits=bits, rng=jax.random.key(1)):
                return model.apply(p, *x)
        fn = jax.grad(loss, argnums=tuple(range(len(xs) + 1)))
        return (jax.jit(fn) if jit else fn)(params, *xs)

    want = jax.tree.leaves(grads(plain))
    models = [(cpt_jax.quantize_model(plain), None)]
    if every:  # inside a precision context, every product kept in fp32 by a rule
        models.append((cpt_jax.quantize_model(plain, rules=ALL_FP32), 4.0))
    for model, bits in models:
        for a, b in zip(jax.tree.leaves(grads(model, bits)), want, strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_wrapped_model_outside_precision_computes_the_model_bit_for_bit():
    # No precision context: nothing is quantized, so nothing changes (no 2-D GEMM, no
    # op-by-op einsum / matmul): eager gradients of the parameters and the input equal
    # the plain model's, bit for bit (a 4-D Dense, an einsum, @ and jnp.dot).
    _outside_precision_is_the_model(jit=False, every=False)


@pytest.mark.slow
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_every_layout_outside_precision_is_the_model_bit_for_bit(jit):
    # Dense over 2-D, 3-D and 4-D inputs, a conv, an einsum, @ and jnp.dot; without a
    # precision context and inside one with every product kept in fp32 by a rule.
    _outside_precision_is_the_model(jit=jit, every=True)


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
