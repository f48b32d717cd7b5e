"""Per-token and tiled scales (``scale_axes`` / ``tile`` of `AffineInt`, `SymmetricInt`,
`BlockFloat`): the grids against per-row and per-block references, inside products
(laid along each product's contraction), in the real int8 product (equal to fake
quant), and the presets ``symmetric_per_token``, ``int8_per_token``, ``int8_tile128``."""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import cpt_jax
from cpt_jax.formats import (
    AffineInt,
    BlockFloat,
    SymmetricInt,
    bits_per_element,
    grid_step,
    quantize,
)

FORMATS = (AffineInt, SymmetricInt, BlockFloat)


def _x(*shape, seed=0, spread=3.0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=shape) * np.logspace(-spread, spread, shape[-2])[:, None]
    return jnp.asarray(x, jnp.float32)


def _close(a, b, step):
    """Equal up to the float rounding of ``codes * scale (+ min)``: 1e-3 grid steps."""
    diff = np.abs(np.asarray(a) - np.asarray(b))
    assert np.all(diff <= 1e-3 * np.asarray(step)), float(np.max(diff / np.asarray(step)))


@pytest.mark.parametrize("kind", FORMATS)
def test_per_token_is_one_scale_per_row(kind):
    x = _x(2, 5, 24)
    q = quantize(x, 4, kind(scale_axes=(-1,)))
    rows = jnp.stack([jnp.stack([quantize(r, 4, kind()) for r in b]) for b in x])
    _close(q, rows, grid_step(x, 4, kind(scale_axes=(-1,))))
    # ... and is what channel_axis keeps for a 2-D tensor
    np.testing.assert_array_equal(quantize(x[0], 4, kind(scale_axes=(1,))),
                                  quantize(x[0], 4, kind(channel_axis=0)))
    if kind is SymmetricInt:  # rows 10^6 apart: per tensor zeroes the small ones
        assert float(jnp.abs(quantize(x, 4, kind())[:, 0]).max()) == 0.0
        assert float(jnp.mean(q[:, 0] != 0)) > 0.5


@pytest.mark.parametrize("kind", FORMATS)
def test_a_tile_is_one_scale_per_block_with_a_ragged_last_block(kind):
    x = _x(3, 10, seed=1)   # blocks of 4 along the 10 features: 4, 4, 2
    q = quantize(x, 3, kind(scale_axes=(-1,), tile=4))
    ref = jnp.concatenate([jnp.stack([quantize(r[i:i + 4], 3, kind()) for r in x])
                           for i in (0, 4, 8)], axis=1)
    _close(q, ref, grid_step(x, 3, kind(scale_axes=(-1,), tile=4)))


def test_a_two_d_tile_on_a_kernel_is_one_scale_per_block():
    w = _x(8, 6, seed=2)
    q = quantize(w, 4, SymmetricInt(scale_axes=(0, 1), tile=(4, 3)))
    for i in (0, 4):
        for j in (0, 3):
            block = w[i:i + 4, j:j + 3]
            _close(q[i:i + 4, j:j + 3], quantize(block, 4, SymmetricInt()),
                   grid_step(block, 4, SymmetricInt()))


def test_tiles_with_traced_bits_compile_once_and_keep_specials():
    x = _x(4, 256, seed=3).at[0, 5].set(jnp.nan).at[1, 7].set(jnp.inf)
    fmt = SymmetricInt(scale_axes=(-1,), tile=128)
    f = jax.jit(lambda x, b: quantize(x, b, fmt))
    outs = [f(x, jnp.float32(b)) for b in (3, 5, 8)]
    assert f._cache_size() == 1
    assert bool(jnp.isnan(outs[0][0, 5])) and bool(jnp.isinf(outs[0][1, 7]))
    finite = jnp.isfinite(x)
    assert bool(jnp.all(jnp.isfinite(jnp.where(finite, outs[0], 0.0))))
    np.testing.assert_array_equal(f(x, jnp.float32(32)), x)


def test_bad_scalings_are_refused_naming_the_field():
    with pytest.raises(ValueError, match="channel_axis or scale_axes"):
        SymmetricInt(channel_axis=-1, scale_axes=(-1,))
    with pytest.raises(ValueError, match="tile"):
        AffineInt(tile=128)
    with pytest.raises(ValueError, match="tile"):
        SymmetricInt(scale_axes=(-1,), tile=0)
    with pytest.raises(ValueError, match="tile"):
        SymmetricInt(scale_axes=(-1,), tile=(16, 16))
    with pytest.raises(ValueError, match="scale_axes"):
        BlockFloat(scale_axes=())
    assert SymmetricInt(scale_axes=[-1]).scale_axes == (-1,)   # a config file's list
    assert repr(SymmetricInt()) == "SymmetricInt(channel_axis=None)"


def test_a_tile_costs_its_scale_bits():
    assert float(bits_per_element(SymmetricInt(scale_axes=(-1,), tile=128), 8)) == 8.25
    assert float(bits_per_element(AffineInt(scale_axes=(-1,), tile=64), 4)) == 5.0
    assert float(bits_per_element(SymmetricInt(scale_axes=(-1,)), 8)) == 8.0  # O(1/K)


# --------------------------------------------------------------------------- in products

def _near(y, ref):
    """Equal up to the float rounding of the sums (cancellation: relative to max |y|)."""
    ref = np.asarray(ref)
    np.testing.assert_allclose(np.asarray(y), ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())


def _dense(config, x, bits=4.0, features=16):
    model = cpt_jax.quantize_model(nn.Dense(features), config=config)
    v = model.init(jax.random.key(0), x)

    @jax.jit
    def run(v, x, b):
        with cpt_jax.precision(b, 8, rng=jax.random.key(1)):
            return model.apply(v, x)
    return run(v, x, jnp.float32(bits)), v["params"]


def test_per_token_dense_quantizes_each_token_and_each_output_channel():
    x = _x(2, 6, 40)
    y, p = _dense(cpt_jax.get_preset("symmetric_per_token"), x)
    xq = quantize(x, 4, SymmetricInt(scale_axes=(-1,)))
    wq = quantize(p["kernel"], 4, SymmetricInt(channel_axis=-1))
    _near(y, xq @ wq + p["bias"])


@pytest.mark.slow
def test_tiles_lie_along_each_products_contraction():
    x = _x(3, 5, 200, seed=4)   # features 200: tiles 128 + 72
    y, p = _dense(cpt_jax.get_preset("symmetric_tile128"), x, features=8)
    xq = quantize(x, 4, SymmetricInt(scale_axes=(-1,), tile=128))
    wq = quantize(p["kernel"], 4, SymmetricInt(scale_axes=(0,), tile=128))  # (K, N): along K
    _near(y, xq @ wq + p["bias"])
    # ... an attention-style einsum of two activations: both per row of the GEMM
    q, k = _x(2, 4, 32, seed=5), _x(2, 4, 32, seed=6)

    class Scores(nn.Module):
        @nn.compact
        def __call__(self, q, k):
            return jnp.einsum("btd,bsd->bts", q, k)

    model = cpt_jax.quantize_model(Scores(), config=cpt_jax.get_preset("symmetric_per_token"))
    with cpt_jax.precision(4, 8, rng=jax.random.key(1)):
        s = model.apply({}, q, k)
    per_row = SymmetricInt(scale_axes=(-1,))
    _near(s, jnp.einsum("btd,bsd->bts", quantize(q, 4, per_row), quantize(k, 4, per_row)))


@pytest.mark.parametrize("bits", [3.0, 8.0])
def test_int8_per_token_equals_its_fake_quant(bits):
    x = _x(4, 6, 64, seed=7)
    y_int8, _ = _dense(cpt_jax.get_preset("int8_per_token"), x, bits)
    y_fake, _ = _dense(cpt_jax.get_preset("symmetric_per_token"), x, bits)
    _near(y_int8, y_fake)
    y_tensor, _ = _dense(cpt_jax.get_preset("int8"), x, bits)
    assert not np.allclose(y_int8, y_tensor)


def test_int8_per_token_with_batch_dims_and_its_gradient():
    from cpt_jax.ops.int8 import token_scales_in_output
    ls = jnp.arange(6.0).reshape(2, 1, 3)   # (T, K, B) activation: contract 1, batch 2
    s = token_scales_in_output(ls, (((1,), (0,)), ((2,), (1,))), 3)
    assert s.shape == (3, 2, 1) and float(s[2, 1, 0]) == float(ls[1, 0, 2])

    model = cpt_jax.quantize_model(nn.Dense(8), config=cpt_jax.get_preset("int8_per_token"))
    x = _x(3, 16, seed=8)
    v = model.init(jax.random.key(0), x)

    def loss(p, x):
        with cpt_jax.precision(4, 8, rng=jax.random.key(1)):
            return jnp.sum(model.apply({"params": p}, x) ** 2)
    g = jax.jit(jax.grad(loss))(v["params"], x)
    assert all(bool(jnp.all(jnp.isfinite(leaf))) for leaf in jax.tree.leaves(g))


def test_int8_per_token_convolution_falls_back_to_fake_quant():
    x = jnp.asarray(np.random.default_rng(9).normal(size=(2, 5, 5, 3)), jnp.float32)

    def conv_out(name):
        model = cpt_jax.quantize_model(nn.Conv(4, (3, 3)), config=cpt_jax.get_preset(name))
        v = model.init(jax.random.key(0), x)
        with cpt_jax.precision(4, 8, rng=jax.random.key(1)):
            return model.apply(v, x)
    with pytest.warns(cpt_jax.providers.integer.IntegerFallbackWarning, match="conv"):
        int8 = conv_out("int8_per_token")
    np.testing.assert_array_equal(int8, conv_out("symmetric_per_token"))


def test_int8_with_tiled_activations_and_untiled_weights_runs_fake_quant_and_says_so():
    config = cpt_jax.get_preset("int8").replace(
        activation=cpt_jax.TensorQuant(SymmetricInt(scale_axes=(-1,), tile=32)))
    x = _x(2, 4, 8)
    with pytest.warns(cpt_jax.providers.integer.IntegerFallbackWarning, match="dot_general"):
        y_int, _ = _dense(config, x)
    y_fake, _ = _dense(config.replace(compute="fake"), x)
    np.testing.assert_array_equal(y_int, y_fake)


@pytest.mark.parametrize("bits", [4.0, 8.0])
def test_int8_tiles_equal_their_fake_quant(bits):
    x = _x(2, 3, 300, seed=10)   # 300 features: tiles 128, 128, 44
    y_int8, _ = _dense(cpt_jax.get_preset("int8_tile128"), x, bits, features=24)
    y_fake, _ = _dense(cpt_jax.get_preset("symmetric_tile128"), x, bits, features=24)
    _near(y_int8, y_fake)
    y_token, _ = _dense(cpt_jax.get_preset("int8_per_token"), x, bits, features=24)
    assert not np.allclose(y_int8, y_token)


def test_tiled_int8_dot_with_batch_dims_equals_the_dequantized_product():
    from cpt_jax.ops.int8 import Int8Spec, operand_formats, tiled_int8_dot
    from cpt_jax.ops.product_op import dot_general_op
    dims = (((2,), (1,)), ((0,), (0,)))          # (B, T, K) x (B, K, N), batch B
    a, b = _x(2, 3, 10, seed=11), _x(2, 10, 4, seed=12)
    spec = Int8Spec(dot_general_op(dims), 2, -1, tile=4)
    lf, rf = operand_formats(spec)
    lc, ls = cpt_jax.formats.symmetric_codes(a, 6, lf)
    rc, rs = cpt_jax.formats.symmetric_codes(b, 6, rf)
    y = tiled_int8_dot(lc.astype(jnp.int8), ls, rc.astype(jnp.int8), rs, dims, 4)
    _near(y, jax.lax.dot_general(lc * ls, rc * rs, dims))


def test_the_formats_guide_examples_run():
    import doctest
    import os
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                        "docs", "formats.md")
    result = doctest.testfile(path, module_relative=False)
    assert result.attempted >= 3 and result.failed == 0, result
