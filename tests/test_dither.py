"""Stochastic rounding's dither (`cpt_jax.formats.dither_noise`): a statistical check.

The dither is a counter-based hash, not threefry, so its quality is tested here:
unbiased rounding, uniform levels (chi-square), no dependence between neighbouring
elements, rows or steps, the keys a pure function of (seed, step, product), and the
bits a bijection of the element index under one key. Thresholds are 5 sigma (or the
chi-square's 1e-6 quantile): a correct generator fails one with probability < 1e-5.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import cpt_jax
from cpt_jax import formats
from cpt_jax.formats import AffineInt, quantize

N = 1 << 20


def _chi2_limit(df: int) -> float:
    """The chi-square statistic a uniform sample exceeds with probability ~1e-6:
    Wilson-Hilferty, ``df (1 - 2/(9 df) + z sqrt(2/(9 df)))^3`` at ``z = 4.75``."""
    return df * (1 - 2 / (9 * df) + 4.75 * np.sqrt(2 / (9 * df))) ** 3


def _chi2(counts: np.ndarray) -> float:
    expected = counts.sum() / counts.size
    return float(((counts - expected) ** 2 / expected).sum())


def _noise(key, shape):
    return np.asarray(jax.jit(lambda k: formats.dither_noise(k, shape))(key))


@pytest.mark.parametrize("fraction", [0.001, 0.25, 0.5, 0.7, 0.999])
def test_stochastic_rounding_is_unbiased(fraction):
    """E[floor(v + U)] = v: the mean of a million roundings of one value."""
    v = jnp.full((N,), 3.0 + fraction, jnp.float32)
    q = np.asarray(formats.round_to_integer(v, "stochastic", jax.random.key(7)))
    assert set(np.unique(q)) <= {3.0, 4.0}
    sigma = np.sqrt(fraction * (1 - fraction) / N)
    assert abs(q.mean() - (3.0 + fraction)) < 5 * sigma + 1e-7


def test_quantizer_is_unbiased_on_its_grid():
    """An 8-bit affine quantizer with stochastic rounding: the mean over 64 steps'
    keys of each element's quantized value is the element, to 5 sigma of a step."""
    x = jnp.linspace(-1.0, 1.0, 4096)
    step = 2.0 / 255
    keys = jax.random.split(jax.random.key(3), 64)
    q = jax.jit(jax.vmap(lambda k: quantize(x, 8, AffineInt(), rounding="stochastic", key=k)))(keys)
    err = np.asarray(q.mean(0) - x)
    assert np.abs(err).max() < 5 * (step / 2) / np.sqrt(64)
    assert abs(err.mean()) < 5 * (step / 2) / np.sqrt(64 * 4096)


@pytest.mark.parametrize("shape", [(N,), (1024, 1024), (16, 256, 256)])
def test_dither_levels_are_uniform(shape):
    """Chi-square of the dither over 256 levels (its top 8 bits: what an 8-bit error's
    rounding reads) and over 256 levels of its low bits."""
    u = _noise(jax.random.key(1), shape).ravel()
    assert u.min() >= 0.0 and u.max() < 1.0
    top = np.bincount((u * 256).astype(np.int64), minlength=256)
    low = np.bincount(((u * 2 ** 24).astype(np.int64) & 255), minlength=256)
    assert _chi2(top) < _chi2_limit(255), _chi2(top)
    assert _chi2(low) < _chi2_limit(255), _chi2(low)
    assert abs(u.mean() - 0.5) < 5 * np.sqrt(1 / 12 / u.size)


def _pair_chi2(a: np.ndarray, b: np.ndarray, levels: int = 16) -> float:
    cells = (a * levels).astype(np.int64) * levels + (b * levels).astype(np.int64)
    return _chi2(np.bincount(cells, minlength=levels * levels))


def test_neighbouring_elements_are_independent():
    """Pairs (U_i, U_i+1) along a row, (U_ij, U_i+1,j) down a column and (U_i, U_i+1024)
    of a flat tensor: uniform on a 16 x 16 grid, correlation ~0."""
    u = _noise(jax.random.key(2), (1024, 1024))
    pairs = [(u[:, :-1], u[:, 1:]), (u[:-1, :], u[1:, :])]
    flat = u.ravel()
    pairs.append((flat[:-1024], flat[1024:]))
    for a, b in pairs:
        a, b = a.ravel(), b.ravel()
        assert _pair_chi2(a, b) < _chi2_limit(255)
        assert abs(np.corrcoef(a, b)[0, 1]) < 5 / np.sqrt(a.size)


def test_steps_and_products_draw_independent_dithers():
    """The same element under the keys of consecutive steps (``fold_in(rng, step)``),
    and of two products of one step (``fold_in(key, i)``): independent."""
    rng = jax.random.key(0)
    steps = [_noise(jax.random.fold_in(rng, t), (N,)) for t in range(3)]
    products = [_noise(jax.random.fold_in(jax.random.fold_in(rng, 5), i), (N,)) for i in range(2)]
    for a, b in [(steps[0], steps[1]), (steps[1], steps[2]), tuple(products)]:
        assert _pair_chi2(a, b) < _chi2_limit(255)
        assert abs(np.corrcoef(a, b)[0, 1]) < 5 / np.sqrt(N)
        assert np.mean(a == b) < 1e-4


def test_dither_bits_are_a_bijection_of_the_index():
    """Under one key no two elements share their 32 bits."""
    bits = np.asarray(formats.dither_bits(jax.random.key(4), (N,)))
    assert np.unique(bits).size == N


def test_dither_is_a_pure_function_of_the_key():
    """Same key, same dither (jitted or not, any shape's row-major order); different key,
    different dither; any PRNG implementation."""
    key = jax.random.fold_in(jax.random.key(9), 17)
    a = _noise(key, (64, 32))
    np.testing.assert_array_equal(a, np.asarray(formats.dither_noise(key, (64, 32))))
    np.testing.assert_array_equal(a.ravel(), _noise(key, (2048,)))
    assert not np.array_equal(a, _noise(jax.random.fold_in(key, 1), (64, 32)))
    rbg = _noise(jax.random.key(9, impl="rbg"), (4096,))
    assert 0.0 <= rbg.min() and rbg.max() < 1.0 and abs(rbg.mean() - 0.5) < 0.03


@pytest.mark.parametrize("dtype,resolution", [(jnp.bfloat16, 8), (jnp.float16, 11)])
def test_low_precision_dither_is_exact_in_its_dtype(dtype, resolution):
    """bfloat16 / float16 dithers are multiples of 2^-r below 1 (no value rounds up to 1)."""
    u = np.asarray(formats.dither_noise(jax.random.key(0), (N,), dtype)).astype(np.float64)
    assert u.max() < 1.0
    np.testing.assert_array_equal(u * 2 ** resolution, np.round(u * 2 ** resolution))
    counts = np.bincount((u * 2 ** resolution).astype(np.int64), minlength=2 ** resolution)
    assert _chi2(counts[:256] if resolution > 8 else counts) < _chi2_limit(
        255 if resolution > 8 else 2 ** resolution - 1) * (1.2 if resolution > 8 else 1.0)


def test_training_rounds_errors_with_keys_of_seed_and_step():
    """The same quantized train step from the same state twice: equal parameters at
    every step; the same parameters with another state key: different parameters (the
    errors' stochastic rounding is the only randomness)."""
    import optax

    from cpt_jax.models import MLP
    from cpt_jax.training import create_train_state, make_train_step_with_bits

    model = cpt_jax.quantize_model(MLP(hidden=(32,), num_classes=4), cpt_jax.CPT_RULES)
    x = jax.random.normal(jax.random.key(0), (16, 8))
    batch = {"inputs": x, "labels": jnp.arange(16) % 4}
    start = create_train_state(model, optax.sgd(0.5), jax.random.key(0), x)
    step = make_train_step_with_bits(model, optax.sgd(0.5), donate=False)

    def run(state):
        params = []
        for _ in range(3):
            state, _ = step(state, batch, 4.0, 4.0)
            params.append(np.asarray(state.params["dense1"]["kernel"]))
        return params

    first, again = run(start), run(start)
    other = run(start.replace(rng=jax.random.key(1)))
    for a, b in zip(first, again):
        np.testing.assert_array_equal(a, b)
    assert not np.array_equal(first[0], other[0])
    assert step.num_compiles == 1
