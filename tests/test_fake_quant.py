"""Tests for cpt_jax.ops.fake_quant: straight-through forward quantizer, error quantizer."""
from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cpt_jax import quantize_grad
from cpt_jax.formats import AffineInt, BlockFloat, FixedPoint, Float, SymmetricInt, quantize
from cpt_jax.ops import fake_quant

FORMATS = [AffineInt(), AffineInt(channel_axis=-1), SymmetricInt(), FixedPoint(3),
           BlockFloat(), Float(4)]
IDS = [repr(f) for f in FORMATS]

_JQ = jax.jit(quantize, static_argnames=("fmt", "rounding"))
X = jnp.asarray(np.random.default_rng(0).normal(size=(4, 3)), jnp.float32)
W = jnp.asarray(np.random.default_rng(1).normal(size=(4, 3)), jnp.float32)


@pytest.mark.parametrize("fmt", FORMATS, ids=IDS)
def test_fake_quant_forward_is_quantize_and_gradient_is_identity(fmt):
    bits = 6

    @jax.jit
    def run(x):
        y = fake_quant(x, bits, fmt)
        # Straight-through: d/dx sum(W * Q(x)) = W, whatever Q does.
        g = jax.grad(lambda v: jnp.sum(W * fake_quant(v, bits, fmt)))(x)
        return y, g, quantize(x, bits, fmt)

    y, g, q = run(X)
    # Compared inside the same program: XLA may fuse `code * s + min` differently in
    # different programs (or eagerly), which moves AffineInt/SymmetricInt by an ulp.
    chex.assert_trees_all_equal(y, q)
    chex.assert_trees_all_equal(g, W)
    assert not np.array_equal(np.asarray(y), np.asarray(X))  # it did quantize


def test_fake_quant_vjp_with_explicit_cotangent_and_stochastic_forward():
    key = jax.random.key(3)

    @jax.jit
    def run(x, ct):
        y, vjp = jax.vjp(
            lambda v: fake_quant(v, 3, AffineInt(), rounding="stochastic", key=key), x)
        return y, vjp(ct)[0], quantize(x, 3, AffineInt(), rounding="stochastic", key=key)

    y, dx, want = run(X, W)
    chex.assert_trees_all_equal(y, want)
    chex.assert_trees_all_equal(dx, W)


def test_fake_quant_gradient_wrt_bits_is_zero():
    g = jax.grad(lambda b: jnp.sum(fake_quant(X, b, AffineInt())))(jnp.float32(4))
    assert float(g) == 0.0


@pytest.mark.parametrize("rounding", ["stochastic", "nearest"])
@pytest.mark.parametrize("fmt", [AffineInt(), SymmetricInt(), BlockFloat(), Float(4)],
                         ids=["AffineInt", "SymmetricInt", "BlockFloat", "Float4"])
def test_quantize_grad_identity_forward_quantized_cotangent(fmt, rounding):
    bits = 5
    key = jax.random.key(7)
    ct = jnp.asarray(np.random.default_rng(2).normal(size=X.shape) * 1e-3, jnp.float32)

    @jax.jit
    def run(x, ct):
        y, vjp = jax.vjp(lambda v: quantize_grad(v, bits, fmt, rounding=rounding, key=key), x)
        return y, vjp(ct)[0], quantize(ct, bits, fmt, rounding=rounding, key=key)

    y, dx, want = run(X, ct)
    chex.assert_trees_all_equal(y, X)  # identity forward
    chex.assert_trees_all_equal(dx, want)
    assert not np.array_equal(np.asarray(dx), np.asarray(ct))


def test_quantize_grad_default_is_stochastic_affine():
    key = jax.random.key(11)
    ct = jnp.linspace(-1.0, 1.0, 12).reshape(4, 3)

    @jax.jit
    def run(x, ct):
        _, vjp = jax.vjp(lambda v: quantize_grad(v, 3, key=key), x)
        return vjp(ct)[0], quantize(ct, 3, AffineInt(), rounding="stochastic", key=key)

    got, want = run(X, ct)
    chex.assert_trees_all_equal(got, want)
    with pytest.raises(ValueError, match="key"):
        quantize_grad(X, 3)  # stochastic by default: needs a key


def test_quantize_grad_in_a_chain_quantizes_the_error_of_its_output():
    # L = sum(c * (A @ quantize_grad(x))): the cotangent reaching quantize_grad is
    # A^T c, and that is what gets quantized: dL/dx = Q(A^T c).
    a = jnp.asarray(np.random.default_rng(5).normal(size=(2, 4)), jnp.float32)
    c = jnp.asarray(np.random.default_rng(6).normal(size=(2, 3)), jnp.float32)
    key = jax.random.key(0)

    @jax.jit
    def run(x):
        g = jax.grad(lambda v: jnp.sum(c * (a @ quantize_grad(v, 4, AffineInt(), key=key))))(x)
        return g, quantize(a.T @ c, 4, AffineInt(), rounding="stochastic", key=key)

    g, want = run(X)
    chex.assert_trees_all_close(g, want, atol=1e-6)


def test_traced_bits_under_jit_compile_once():
    traces = []

    @jax.jit
    def step(x, ct, bits, grad_bits, key):
        traces.append(1)
        y, vjp = jax.vjp(lambda v: quantize_grad(fake_quant(v, bits, AffineInt()), grad_bits,
                                                 AffineInt(), key=key), x)
        return y, vjp(ct)[0]

    key = jax.random.key(1)
    ct = jnp.asarray(np.random.default_rng(3).normal(size=X.shape), jnp.float32)
    for b in (2, 3, 5, 8, 32):
        y, dx = step(X, ct, jnp.float32(b), jnp.float32(b + 1), key)
        chex.assert_trees_all_close(y, _JQ(X, jnp.float32(b), AffineInt()), atol=1e-6)
        chex.assert_trees_all_close(
            dx, _JQ(ct, jnp.float32(b + 1), AffineInt(), rounding="stochastic", key=key),
            atol=1e-6)
    assert len(traces) == 1
    # 32 bits: both quantizers are the identity.
    y, dx = step(X, ct, jnp.float32(32), jnp.float32(32), key)
    chex.assert_trees_all_equal(y, X)
    chex.assert_trees_all_equal(dx, ct)


def test_validation():
    with pytest.raises(ValueError, match="bits"):
        fake_quant(X, 0)
    with pytest.raises(ValueError, match="rounding"):
        fake_quant(X, 4, rounding="down")
    with pytest.raises(ValueError, match="fmt"):
        fake_quant(X, 4, "int")
    with pytest.raises(ValueError, match="key"):
        fake_quant(X, 4, rounding="stochastic")
    with pytest.raises(ValueError, match="bits"):
        quantize_grad(X, 0, key=jax.random.key(0))


def test_dtype_preserved():
    xb = X.astype(jnp.bfloat16)
    y = fake_quant(xb, 4)
    chex.assert_type(y, jnp.bfloat16)
    g = jax.grad(lambda v: jnp.sum(fake_quant(v, 4).astype(jnp.float32)))(xb)
    chex.assert_type(g, jnp.bfloat16)
    chex.assert_type(quantize_grad(xb, 4, key=jax.random.key(0)), jnp.bfloat16)
