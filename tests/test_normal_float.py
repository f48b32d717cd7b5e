"""`cpt_jax.formats.NormalFloat` and the preset ``nf4`` (cpt_jax/extensions/normal_float.py),
written only through the public format protocol: QLoRA's NF4 levels as published by
bitsandbytes, the same construction at 2..8 bits, 64-element absmax blocks along each
product's contraction, nearest and unbiased stochastic rounding."""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import cpt_jax
from cpt_jax import formats
from cpt_jax.extensions import normal_float as nf
from cpt_jax.formats import NormalFloat, quantize

# bitsandbytes' get_4bit_type("nf4") (bitsandbytes/functional.py), copied from QLoRA's
# Appendix E: the published codebook the format must hold.
PUBLISHED_NF4 = [-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
                 -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
                 0.07958029955625534, 0.16093020141124725, 0.24611230194568634,
                 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
                 0.7229568362236023, 1.0]


def _reference(x: np.ndarray, levels: np.ndarray, block: int) -> np.ndarray:
    """Nearest level (ties to the lower) times each block's absmax, one 1-D row."""
    out = np.empty_like(x)
    for start in range(0, x.size, block):
        part = x[start:start + block]
        s = np.abs(part).max() or 1.0
        v = part / s
        out[start:start + block] = [levels[np.argmin(np.abs(levels - e))] * s for e in v]
    return out


def test_nf4_holds_the_published_levels_and_the_construction_reproduces_them():
    assert nf.LEVELS[4 - 2, :16].tolist() == np.float32(PUBLISHED_NF4).tolist()
    np.testing.assert_allclose(nf.normal_float_levels(4), PUBLISHED_NF4, atol=3e-7)
    for b in range(2, 9):
        levels = nf.normal_float_levels(b)
        assert levels.size == 2 ** b and np.all(np.diff(levels) > 0)
        assert (levels[0], levels[-1]) == (-1.0, 1.0) and np.sum(levels == 0) == 1
        assert np.sum(levels > 0) == 2 ** (b - 1)      # one more positive level
        np.testing.assert_array_equal(nf.LEVELS[b - 2, :2 ** b],
                                      np.float32(PUBLISHED_NF4 if b == 4 else levels))


def test_nearest_rounding_is_the_nearest_level_times_each_blocks_absmax():
    x = np.asarray(jax.random.normal(jax.random.key(0), (200,)), np.float32)
    f = jax.jit(lambda x, b: quantize(x, b, NormalFloat()))
    for bits in (2, 4, 7):
        got = np.asarray(f(jnp.asarray(x), jnp.float32(bits)))
        np.testing.assert_allclose(got, _reference(x, nf.LEVELS[bits - 2, :2 ** bits], 64),
                                   rtol=1e-6)
    # by hand, one block of 4 with absmax 2: v = -1, 0.05, 0.45, 1 -> the NF4 levels
    # -1, 0.0796 (0.05 is nearer it than 0), 0.4407 (than 0.5626), 1; times 2
    q = quantize(jnp.array([-2.0, 0.1, 0.9, 2.0]), 4, NormalFloat(block_size=4))
    np.testing.assert_allclose(q, [-2.0, 2 * 0.07958029955625534, 2 * 0.44070982933044434, 2.0])


def test_stochastic_rounding_is_unbiased_between_the_two_neighbouring_levels():
    x = jnp.array([1.0, 0.3, -0.12, 0.05, 0.7])     # absmax 1: v = x
    draws = jax.jit(jax.vmap(lambda k: quantize(x, 4, NormalFloat(), rounding="stochastic",
                                                 key=k)))(jax.random.split(jax.random.key(1), 20000))
    np.testing.assert_allclose(np.mean(np.asarray(draws), axis=0), x, atol=4e-3)
    levels = np.float32(PUBLISHED_NF4)
    for j, v in enumerate(np.asarray(x)):
        lo, hi = levels[levels <= v].max(), levels[levels >= v].min()
        assert set(np.unique(np.asarray(draws[:, j]))) <= {lo, hi}


def test_a_traced_width_compiles_once_and_has_2_to_the_b_levels():
    x = jax.random.normal(jax.random.key(2), (64,))
    f = jax.jit(lambda x, b: quantize(x, b, NormalFloat()))
    for b in range(2, 9):
        assert len(np.unique(np.asarray(f(x, jnp.float32(b))))) <= 2 ** b
    assert f._cache_size() == 1
    np.testing.assert_array_equal(f(x, jnp.float32(32)), x)
    pinned = quantize(x, 7, NormalFloat(width=4))
    np.testing.assert_array_equal(pinned, quantize(x, 4, NormalFloat()))


def test_the_nf4_preset_blocks_each_weight_along_its_contraction():
    config = cpt_jax.get_preset("nf4")
    assert config.activation is None and config.error is None
    model = cpt_jax.quantize_model(nn.Dense(5, use_bias=False), config=config)
    x = jax.random.normal(jax.random.key(3), (4, 130))
    v = model.init(jax.random.key(4), x)

    @jax.jit
    def forward(v, x):
        with cpt_jax.precision(6, 8):
            return model.apply(v, x)

    y = forward(v, x)
    kernel = v["params"]["kernel"]                         # (130, 5): blocks of 64 inputs
    q = jax.jit(lambda k, fmt: quantize(k, 4, fmt), static_argnums=1)
    np.testing.assert_allclose(y, x @ q(kernel, NormalFloat(axis=0)), rtol=1e-5, atol=1e-6)
    assert not np.allclose(y, x @ q(kernel, NormalFloat(axis=1)), atol=1e-6)


def test_cost_traits_export_and_names_answer_for_it():
    fmt = NormalFloat(width=4)
    assert float(formats.bits_per_element(fmt, 8)) == 4.5                 # 4 + 32 / 64
    assert float(formats.bits_per_element(NormalFloat(), 3)) == 3.5
    t = formats.format_traits(fmt)
    assert (t.family, t.blocked, t.block_size, t.element) == ("normal_float", True, 64, None)
    assert formats.along_contraction(fmt, formats.Contraction((0,), channel_axis=1)).axis == 0
    ops = [cpt_jax.cost.OpRecord("d", "dot_general", macs=10, reduction=4, lhs_shape=(1,),
                                 rhs_shape=(1,), out_shape=(1,), quantized=True)]
    # weight 4.5 bits, activation and errors 32: 4.5 * 32 + 32 * (4.5 + 32) per MAC
    assert float(cpt_jax.bitops_per_step(ops, 8, 8, cpt_jax.get_preset("nf4"))) == \
        10 * (4.5 * 32 + 32 * 36.5)
    from cpt_jax.export._checks import grid_kind

    with pytest.raises(ValueError, match="the weight format is NormalFloat"):
        grid_kind(fmt, "weight")
    assert cpt_jax.formats.NormalFloat is NormalFloat and "nf4" in cpt_jax.PRESETS


def test_widths_it_cannot_take_are_refused():
    with pytest.raises(ValueError, match=r"bits must be in \[2, 8\]"):
        quantize(jnp.ones(3), 9, NormalFloat())
    with pytest.raises(ValueError, match=r"bits must be in \[2, 8\]"):
        quantize(jnp.ones(3), 1, NormalFloat())
    with pytest.raises(ValueError, match="NormalFloat.width must be None or an int in"):
        NormalFloat(width=9)
    np.testing.assert_array_equal(jax.jit(lambda x: quantize(x, 9, NormalFloat(width=4)))(
        jnp.ones(3)), jnp.ones(3))
