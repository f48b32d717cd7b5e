"""Integer arithmetic in all three GEMMs (`cpt_jax.ops.integer_gemm`, ``compute="int"``).

The references are fake quantization's own formulas (`cpt_jax.formats.quantize`,
`fake_quant` / `quantize_grad` with the same keys) and float32 products: the forward
and the weight gradient equal them up to float32 summation rounding, the input
gradient with a per-channel weight is an unbiased estimate of the same quantity (its
error folded with the weight's scale, another draw).
"""
from __future__ import annotations

import itertools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from cpt_jax.formats import AffineInt, SymmetricInt, quantize
from cpt_jax.ops.fake_quant import fake_quant, quantize_grad
from cpt_jax.ops.integer_gemm import IntGemmSpec, int_dot_general
from cpt_jax.ops.product_op import einsum_dimension_numbers
from cpt_jax.quant_config import TensorQuant

KEY = jax.random.key(7)
DENSE = (((1,), (0,)), ((), ()))
WIDTHS = jnp.arange(2.0, 9.0)


def _normal(seed, shape, scale=1.0, shift=0.0):
    return jnp.asarray(np.random.default_rng(seed).normal(size=shape) * scale + shift,
                       jnp.float32)


def _spec(lhs_fmt, rhs_fmt, dims=DENSE, err=AffineInt(), rounding="stochastic"):
    return IntGemmSpec(dims, TensorQuant(lhs_fmt), TensorQuant(rhs_fmt),
                       None if err is None else TensorQuant(err, rounding))


def _int_and_fake(spec, x, w, c):
    """``(y, dx, dw)`` of ``sum(c * dot(x, w))`` through the integer op and through
    fake quantization (same widths, same error key), over every width 2..8 (forward
    and error at the same width), in one compiled function each."""
    dims = spec.dimension_numbers

    def integer(x, w, b):
        def loss(x, w):
            y = int_dot_general(spec, x, w, b, b, (None, None, KEY))
            return jnp.sum(c * y), y
        (dx, dw), y = jax.grad(loss, (0, 1), has_aux=True)(x, w)
        return y, dx, dw

    def fake(x, w, b):
        def loss(x, w):
            y = lax.dot_general(fake_quant(x, b, spec.lhs.fmt), fake_quant(w, b, spec.rhs.fmt),
                                dims)
            y = quantize_grad(y, b, spec.error.fmt, rounding="stochastic", key=KEY)
            return jnp.sum(c * y), y
        (dx, dw), y = jax.grad(loss, (0, 1), has_aux=True)(x, w)
        return y, dx, dw

    run = lambda f: jax.jit(jax.vmap(f, in_axes=(None, None, 0)))(x, w, WIDTHS)
    return run(integer), run(fake)


def _assert_sums_close(got, want, scale):
    """Equal up to float32 summation rounding: relative to the sum of magnitudes."""
    tol = 2e-6 * float(jnp.max(scale))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=tol)


FORMATS = {
    "affine/tensor x affine/channel (CPT)": (AffineInt(), AffineInt(channel_axis=-1)),
    "symmetric/tensor x symmetric/channel (int8)": (SymmetricInt(), SymmetricInt(channel_axis=-1)),
    "affine/tensor x symmetric/tensor": (AffineInt(), SymmetricInt()),
    "symmetric/token x symmetric/channel (int8_per_token)": (SymmetricInt(scale_axes=(-1,)),
                                                             SymmetricInt(channel_axis=-1)),
    "affine/token x affine/tensor": (AffineInt(scale_axes=(-1,)), AffineInt()),
}


@pytest.mark.parametrize("name", [pytest.param(n, marks=() if "CPT" in n else pytest.mark.slow)
                                  for n in sorted(FORMATS)])
def test_forward_and_weight_gradient_equal_fake_quant_at_every_width(name):
    lhs_fmt, rhs_fmt = FORMATS[name]
    x, w = _normal(0, (24, 40)), _normal(1, (40, 12), scale=jnp.linspace(0.2, 2.0, 12))
    c = _normal(2, (24, 12))
    (yi, dxi, dwi), (yf, dxf, dwf) = _int_and_fake(_spec(lhs_fmt, rhs_fmt), x, w, c)
    scale = jax.vmap(lambda b: jnp.abs(quantize(x, b, lhs_fmt)) @ jnp.abs(
        quantize(w, b, rhs_fmt)))(WIDTHS)
    _assert_sums_close(yi, yf, scale)
    per_token = lhs_fmt.scale_axes is not None
    if not per_token:  # dW = x_q^T g_q on the same codes
        _assert_sums_close(dwi, dwf, jnp.abs(dwf).max() + 1.0)
    per_channel = rhs_fmt.channel_axis is not None
    if not per_channel and isinstance(lhs_fmt, SymmetricInt):  # one error for both GEMMs
        _assert_sums_close(dxi, dxf, jnp.abs(dxf).max() + 1.0)
    for d in (dxi, dwi):
        assert bool(jnp.all(jnp.isfinite(d)))


@pytest.mark.slow
def test_affine_zero_points_at_the_ends_of_the_grid():
    """All-positive activations (a ReLU's: the minimum is the grid's origin) and an
    all-negative weight column: codes at both ends of int8 at 8 bits."""
    x = jnp.abs(_normal(3, (16, 32))) + 0.5
    w = _normal(4, (32, 8)).at[:, 3].set(-jnp.abs(_normal(5, (32,))) - 1.0)
    c = _normal(6, (16, 8))
    spec = _spec(AffineInt(), AffineInt(channel_axis=-1))
    (yi, _, dwi), (yf, _, dwf) = _int_and_fake(spec, x, w, c)
    _assert_sums_close(yi, yf, jnp.abs(yf).max() * 40)
    _assert_sums_close(dwi, dwf, jnp.abs(dwf).max() * 40)


@pytest.mark.slow
def test_input_gradient_with_a_per_channel_weight_is_unbiased():
    """``dx = Q(g s_W) c_W^T + g o_W``: over many error draws its mean is ``g W_q^T``, the
    expectation of fake quantization's ``Q(g) W_q^T``, within the sampling error."""
    x = _normal(7, (8, 16))
    w = _normal(8, (16, 6), scale=jnp.linspace(0.3, 3.0, 6))
    c = _normal(9, (8, 6))
    spec = _spec(AffineInt(), AffineInt(channel_axis=-1))

    def dx(key):
        return jax.grad(lambda x: jnp.sum(c * int_dot_general(spec, x, w, 4.0, 6.0,
                                                              (None, None, key))))(x)

    draws = jax.jit(jax.vmap(dx))(jax.random.split(jax.random.key(0), 256))
    exact = c @ quantize(w, 4, AffineInt(channel_axis=-1)).T
    se = draws.std(0) / np.sqrt(draws.shape[0]) + 1e-6
    assert float(jnp.max(jnp.abs(draws.mean(0) - exact) / se)) < 5.0
    assert float(jnp.mean(draws.std(0))) > 0  # it is stochastic


def test_wider_widths_are_fake_quantization_bit_for_bit():
    """Forward 12 bits (and errors 12 bits): the fake-quant branch, the same values."""
    x, w, c = _normal(10, (12, 20)), _normal(11, (20, 5)), _normal(12, (12, 5))
    spec = _spec(AffineInt(), AffineInt(channel_axis=-1))
    for bits, grad_bits in ((12.0, 12.0), (8.0, 12.0), (12.0, 8.0)):
        def integer(x, w, bits=bits, grad_bits=grad_bits):
            return jnp.sum(c * int_dot_general(spec, x, w, bits, grad_bits, (None, None, KEY)))

        def fake(x, w, bits=bits, grad_bits=grad_bits):
            y = fake_quant(x, bits, AffineInt()) @ fake_quant(w, bits, AffineInt(channel_axis=-1))
            return jnp.sum(c * quantize_grad(y, grad_bits, AffineInt(), key=KEY))
        gi = jax.jit(jax.grad(integer, (0, 1)))(x, w)
        gf = jax.jit(jax.grad(fake, (0, 1)))(x, w)
        for a, b in zip(gi, gf):
            np.testing.assert_array_equal(a, b)
    y32 = int_dot_general(spec, x, w, 32.0, None, (None, None, None))
    np.testing.assert_allclose(y32, x @ w, rtol=1e-6, atol=1e-6)


def test_non_finite_inputs_stay_visible_in_the_outputs_they_touch():
    """No int8 code holds NaN or Inf: a non-finite input makes its scale group's step
    non-finite (the ranges include every element), so what that group scales is too."""
    x, w, c = _normal(13, (6, 10)), _normal(14, (10, 4)), jnp.ones((6, 4))
    spec = _spec(AffineInt(), AffineInt(channel_axis=-1))
    run = jax.jit(lambda x, w: int_dot_general(spec, x, w, 6.0, 8.0, (None, None, KEY)))
    for bad in (jnp.nan, jnp.inf, -jnp.inf):
        assert not np.isfinite(np.asarray(run(x.at[2, 3].set(bad), w))).any()  # per tensor
        y = np.asarray(run(x, w.at[4, 1].set(bad)))                            # per channel
        assert not np.isfinite(y[:, 1]).any() and np.isfinite(np.delete(y, 1, axis=1)).all()
    gx, gw = jax.grad(lambda x, w: jnp.sum(c.at[1, 2].set(jnp.nan) * run(x, w)), (0, 1))(x, w)
    assert not np.isfinite(np.asarray(gx)).any() and not np.isfinite(np.asarray(gw)).any()
    y = run(x, w)
    assert np.isfinite(np.asarray(y)).all()


@pytest.mark.parametrize("spec_str", ["btd,dk->btk", *(pytest.param(s, marks=pytest.mark.slow) for s in
                                      ("bqd,bkd->bqk", "dk,btd->btk", "bhqd,bkhd->bhqk",
                                       "ij,ij->i"))])
def test_einsum_as_dot_general_and_through_the_integer_op(spec_str):
    a_shape, b_shape = [tuple(range(3, 3 + len(t))) for t in spec_str.split("->")[0].split(",")]
    sizes = {}
    for t, shape in zip(spec_str.split("->")[0].split(","), (a_shape, b_shape)):
        for ch, n in zip(t, shape):
            sizes.setdefault(ch, n)
    a_shape = tuple(sizes[ch] for ch in spec_str.split(",")[0])
    b_shape = tuple(sizes[ch] for ch in spec_str.split(",")[1].split("->")[0])
    a, b = _normal(15, a_shape), _normal(16, b_shape)
    dims, perm = einsum_dimension_numbers(spec_str)
    np.testing.assert_allclose(jnp.transpose(lax.dot_general(a, b, dims), perm),
                               jnp.einsum(spec_str, a, b), rtol=1e-5, atol=1e-5)
    spec = _spec(AffineInt(), AffineInt(), dims=dims)
    y = jnp.transpose(int_dot_general(spec, a, b, 8.0, None, (None, None, None)), perm)
    want = jnp.einsum(spec_str, quantize(a, 8, AffineInt()), quantize(b, 8, AffineInt()))
    np.testing.assert_allclose(y, want, rtol=0, atol=1e-4 * float(jnp.abs(want).max()))


def test_a_product_is_three_int8_gemms_with_int32_accumulation():
    spec = _spec(AffineInt(), AffineInt(channel_axis=-1), dims=(((2,), (0,)), ((), ())))
    x, w = _normal(17, (2, 8, 16)), _normal(18, (16, 4))
    jaxpr = str(jax.make_jaxpr(jax.grad(
        lambda x, w, b: jnp.sum(int_dot_general(spec, x, w, b, b, (None, None, KEY)) ** 2),
        (0, 1)))(x, w, 4.0))
    int_dots = re.findall(r"i32\[[\d,]*\] = dot_general\[", jaxpr)
    assert len(int_dots) == 3, int_dots  # forward, input gradient, weight gradient
    assert "i8[" in jaxpr


@pytest.mark.slow
def test_bf16_operands_give_bf16_outputs_and_gradients():
    x, w = _normal(19, (4, 8)).astype(jnp.bfloat16), _normal(20, (8, 3)).astype(jnp.bfloat16)
    spec = IntGemmSpec(DENSE, TensorQuant(AffineInt()), TensorQuant(AffineInt(channel_axis=-1)),
                       TensorQuant(AffineInt(), "stochastic"), out_dtype=jnp.bfloat16)
    f = lambda x, w: int_dot_general(spec, x, w, 8.0, 8.0, (None, None, KEY))
    dx, dw = jax.grad(lambda x, w: jnp.sum(f(x, w)).astype(jnp.float32), (0, 1))(x, w)
    assert f(x, w).dtype == dx.dtype == dw.dtype == jnp.bfloat16


@pytest.mark.parametrize("lhs_fmt,rhs_fmt", list(itertools.islice(FORMATS.values(), 2)))
def test_static_and_traced_widths_agree(lhs_fmt, rhs_fmt):
    x, w = _normal(21, (6, 9)), _normal(22, (9, 3))
    spec = _spec(lhs_fmt, rhs_fmt)
    static = int_dot_general(spec, x, w, 5.0, 7.0, (None, None, KEY))
    traced = jax.jit(lambda b, g: int_dot_general(spec, x, w, b, g, (None, None, KEY)))(5.0, 7.0)
    np.testing.assert_allclose(static, traced, rtol=1e-5, atol=1e-6)  # fused vs op by op
