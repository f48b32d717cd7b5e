"""Formats as compositions (`cpt_jax.formats.Quantizer` = element x `Scaling`): every
named format that decomposes equals its `as_quantizer` bit for bit (zeros, ties,
+-inf, NaN, subnormals, widths 1..16, static and traced under jit, both roundings);
compositions with no named twin land on their grid and train; bad ones are refused
naming the field; the cost and the traits answer for a Quantizer."""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import cpt_jax
from cpt_jax.formats import (
    ELEMENTS,
    MX,
    NVFP4,
    AffineInt,
    BlockFloat,
    FixedElement,
    FixedPoint,
    Float,
    FloatElement,
    IntElement,
    OCPFloat,
    Quantizer,
    ScaledFloat,
    Scaling,
    SymmetricInt,
    as_quantizer,
    bits_per_element,
    format_traits,
    quantize,
)

WIDTHS = tuple(range(1, 17))
AXIS_OPTIONS = ({}, {"channel_axis": 0}, {"channel_axis": -1}, {"scale_axes": (-1,)},
                {"scale_axes": (0,)}, {"scale_axes": (0, 1)}, {"scale_axes": (-1,), "tile": 16},
                {"scale_axes": (-2,), "tile": 3}, {"scale_axes": (0, 1), "tile": (4, 16)},
                {"scale_axes": (1, 0), "tile": 5})

NAMED = (
    [cls(**opts) for cls in (AffineInt, SymmetricInt, BlockFloat) for opts in AXIS_OPTIONS]
    + [FixedPoint(f) for f in (0, 3, 9)]
    + [Float(e) for e in range(1, 9)]
    + [OCPFloat(e) for e in ELEMENTS]
    + [ScaledFloat(e, g, axis=a, tile=16) for e in ELEMENTS for g, a in (
        ("tensor", -1), ("row", -1), ("row", 0), ("tile", -1), ("tile", 0))]
    + [MX(e, block_size=b, axis=a) for e in (*ELEMENTS, "int8", "int")
       for b, a in ((32, -1), (8, 0))])


def _inputs() -> jax.Array:
    """(7, 70): normals over 1e-30..1e30 by row, zeros, exact ties, +-inf, NaN, subnormals."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(7, 70)) * np.logspace(-30, 30, 7)[:, None]
    x[0, :8] = [0.0, -0.0, np.inf, -np.inf, np.nan, 1e-40, -1e-45, 2.0 ** -130]
    x[1, :10] = np.arange(10) * 0.5 - 2.25       # halves: ties of many grids
    x[2, :] = 0.0                                # an all-zero row (and tiles)
    x[3, :12] = [2.0 ** k for k in range(-6, 6)]  # powers of two: binade edges
    x[4, 20:40] = np.linspace(-3, 3, 20)
    x[5, :] = x[5, 0]                            # a constant row (zero range)
    x[6, 3] = 3e38                               # near the float32 maximum
    return jnp.asarray(x, jnp.float32)


X = _inputs()


def _widths(fmt) -> tuple[int, ...]:
    if isinstance(fmt, Float):
        return tuple(b for b in WIDTHS if b >= fmt.exp_bits + 1)
    if isinstance(fmt, MX) and fmt.element == "int":
        return tuple(b for b in WIDTHS if b >= 2)
    return WIDTHS


def _same_bits(a, b, what):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    diff = a.view(np.uint32) != b.view(np.uint32)
    assert not diff.any(), (what, int(diff.sum()), a[diff][:4], b[diff][:4])


def _noise_in_a_block_view(fmt) -> bool:
    """MX and ScaledFloat("tile") draw stochastic noise in their padded block view."""
    return isinstance(fmt, MX) or (isinstance(fmt, ScaledFloat) and fmt.granularity == "tile")


# Every ninth named format in the fast tier (integer, block float, float, MX and
# ScaledFloat among them), the rest in the slow tier (CI runs both).
NAMED_TIERED = [pytest.param(f, id=repr(f), marks=() if i % 9 == 0 else pytest.mark.slow)
                for i, f in enumerate(NAMED)]


@pytest.mark.parametrize("fmt", NAMED_TIERED)
def test_as_quantizer_is_the_named_format_bit_for_bit(fmt):
    composed = as_quantizer(fmt)
    widths = _widths(fmt)
    traced = jax.jit(lambda x, b, f: quantize(x, b, f), static_argnums=2)
    for b in widths:
        want = traced(X, jnp.float32(b), fmt)
        _same_bits(traced(X, jnp.float32(b), composed), want, (b, "traced"))
    for b in sorted({widths[0], 8, 32} & set(widths + (32,))):
        _same_bits(quantize(X, b, composed), quantize(X, b, fmt), (b, "static"))
    if _noise_in_a_block_view(fmt):
        return  # test_stochastic_rounding_in_a_block_view_is_the_same_distribution
    key = jax.random.key(3)
    for b in sorted({widths[0], max(widths[0], 5)}):
        _same_bits(quantize(X, b, composed, rounding="stochastic", key=key),
                   quantize(X, b, fmt, rounding="stochastic", key=key), (b, "stochastic"))


@pytest.mark.parametrize("fmt", [
    pytest.param(MX("int", block_size=8), marks=pytest.mark.slow), MX("e2m1", axis=0),
    pytest.param(ScaledFloat("e2m1", "tile", tile=16), marks=pytest.mark.slow)], ids=repr)
def test_stochastic_rounding_in_a_block_view_is_the_same_distribution(fmt):
    """The named block formats draw their noise in the padded block view, a Quantizer in
    the tensor's own layout: another draw, the same scales and grid, so the same mean."""
    x = jnp.where(jnp.isfinite(X), X, 0.0)
    keys = jax.random.split(jax.random.key(5), 256)

    def draws(f):
        return jax.vmap(lambda k: quantize(x, 4, f, rounding="stochastic", key=k))(keys)

    named = np.asarray(draws(fmt), np.float64)
    composed = np.asarray(draws(as_quantizer(fmt)), np.float64)
    step = np.maximum(np.ptp(named, axis=0), np.ptp(composed, axis=0))
    assert np.all(np.abs(named.mean(0) - composed.mean(0)) <= 0.3 * step)
    assert np.mean(named != composed) > 0  # indeed another draw


@pytest.mark.parametrize("fmt", NAMED[::7], ids=repr)
def test_a_quantizer_costs_and_measures_as_its_named_twin(fmt):
    for b in (4, 8, 32):
        assert float(bits_per_element(as_quantizer(fmt), b)) == float(bits_per_element(fmt, b))


def test_bfloat16_inputs_keep_their_dtype_bit_for_bit():
    x = X.astype(jnp.bfloat16)
    for fmt in (SymmetricInt(scale_axes=(-1,)), Float(5), MX("e2m1"), AffineInt(channel_axis=0)):
        q = quantize(x, 6, as_quantizer(fmt))
        assert q.dtype == jnp.bfloat16
        _same_bits(q.astype(jnp.float32), quantize(x, 6, fmt).astype(jnp.float32), fmt)


@pytest.mark.parametrize("fmt,why", [
    (NVFP4(), "two scale levels"), (MX("float"), "picks its element by bits"),
    (MX("e4m3", scale_rounding="up"), "scale_rounding='up'"),
    (ScaledFloat(granularity="block"), "rank"), ("int8", "not a named format")])
def test_formats_that_are_not_one_composition_are_refused(fmt, why):
    with pytest.raises(ValueError, match=why):
        as_quantizer(fmt)


# --------------------------------------------------------------------------- no named twin

def _tokens(seed=1):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(4, 150)) * np.logspace(-3, 3, 4)[:, None]
    return jnp.asarray(x, jnp.float32)


def _tile_absmax(x, tile):
    """max|x| per (row, tile of `tile` along the last axis), broadcast to x (float64)."""
    x = np.asarray(x, np.float64)
    out = np.empty_like(x)
    for start in range(0, x.shape[1], tile):
        block = x[:, start:start + tile]
        out[:, start:start + tile] = np.abs(block).max(axis=1, keepdims=True)
    return out


def test_unsigned_max_abs_per_token_tiles_lands_on_its_grid():
    """0 .. 2^b - 1 codes of max|x| / (2^b - 1) per 64-tile of each token (a ReLU
    output's grid); negatives clip to 0. No named format has it."""
    q = Quantizer(IntElement(signed=False), Scaling(scale_axes=(-1,), tile=64))
    x = _tokens()
    for b in (2, 4, 8):
        scale = _tile_absmax(x, 64) / (2.0 ** b - 1)
        codes = np.asarray(quantize(x, b, q), np.float64) / scale
        assert np.allclose(codes, np.round(codes), atol=1e-4)
        assert codes.min() >= -1e-6 and codes.max() <= 2 ** b - 1 + 1e-4
        assert np.all(codes[np.asarray(x) < 0] == 0)


@pytest.mark.parametrize("element,values", [
    (FloatElement(3, 2), ml_dtypes.float6_e3m2fn),
    (FloatElement(3, 2, ocp=True), ml_dtypes.float6_e3m2fn),
    (FloatElement(4, 3), None)])  # QPyTorch e4m3 (largest 480), scaled: no named twin
def test_a_float_element_per_token_max_abs_lands_on_its_grid(element, values):
    q = Quantizer(element, Scaling(scale_axes=(-1,)))
    x = _tokens()
    man, _, largest, _ = element.params(jnp.float32(8))
    scale = np.abs(np.asarray(x, np.float64)).max(axis=1, keepdims=True) / float(largest)
    elem = np.asarray(quantize(x, 8, q), np.float64) / scale
    if values is not None:  # the element's own cast holds every value
        assert np.allclose(elem, elem.astype(np.float32).astype(values).astype(np.float64),
                           rtol=1e-6, atol=0)
    _, e = np.frexp(np.abs(elem) + (elem == 0))
    steps = np.ldexp(1.0, np.maximum(e - 1, -6) - int(man))
    assert np.allclose(elem / steps, np.round(elem / steps), atol=1e-3)
    assert np.abs(elem).max() <= float(largest) * (1 + 1e-6)


@pytest.mark.parametrize("fmt", [
    Quantizer(IntElement(signed=False), Scaling(scale_axes=(-1,), tile=64)),
    Quantizer(FloatElement(3, 2), Scaling(scale_axes=(-1,), scale_format="pow2")),
    Quantizer(FloatElement(4), Scaling(channel_axis=-1)),
    Quantizer(IntElement(True, width=6), Scaling(scale_axes=(-1,), tile=16, scale_format="e8m0"))],
    ids=repr)
def test_a_composition_trains_through_fake_quant_and_a_model(fmt):
    x = _tokens()
    for b in (5, 6, 8):
        g = jax.grad(lambda v, b=b: jnp.sum(cpt_jax.fake_quant(v, b, fmt) ** 2))(x)
        assert bool(jnp.all(jnp.isfinite(g)))
    config = cpt_jax.QuantConfig(weight=cpt_jax.TensorQuant(fmt),
                                 activation=cpt_jax.TensorQuant(fmt),
                                 error=cpt_jax.TensorQuant(fmt, "stochastic"))
    model = cpt_jax.quantize_model(nn.Dense(8), config=config)
    variables = model.init(jax.random.key(0), x)

    def loss(params, bits):
        with cpt_jax.precision(bits, grad_bits=bits, rng=jax.random.key(1)):
            return jnp.mean(model.apply({"params": params}, x) ** 2)

    grad = jax.jit(jax.grad(loss))
    grads = [grad(variables["params"], jnp.float32(b)) for b in (5, 8)]
    assert grad._cache_size() == 1
    assert all(bool(jnp.all(jnp.isfinite(g["kernel"]))) for g in grads)


def test_traits_and_cost_of_a_composition():
    q = Quantizer(IntElement(signed=False), Scaling(scale_axes=(-1,), tile=64))
    t = format_traits(q)
    assert (t.family, t.scale, t.blocked, t.element, t.range_grid) == (
        "quantizer", "tile", False, None, None)
    assert t.family in cpt_jax.formats.FAMILIES
    assert format_traits(Quantizer(FloatElement(4))).scale == "none"
    assert float(bits_per_element(q, 4)) == 4 + 32 / 64
    affine = Quantizer(IntElement(signed=False), Scaling(scale_axes=(-1,), tile=64, range="minmax"))
    assert float(bits_per_element(affine, 4)) == 4 + 64 / 64
    assert float(bits_per_element(Quantizer(FloatElement(2, 1, ocp=True)), 8)) == 4.0
    assert float(bits_per_element(q, 32)) == 32.0


def test_the_names_are_exported():
    for name in ("Quantizer", "Scaling", "IntElement", "FixedElement", "FloatElement",
                 "as_quantizer"):
        assert name in cpt_jax.formats.__all__ and name in cpt_jax.__all__
        assert getattr(cpt_jax, name) is getattr(cpt_jax.formats, name)


# --------------------------------------------------------------------------- refused

@pytest.mark.parametrize("make,field", [
    (lambda: IntElement(signed=1), "IntElement.signed"),
    (lambda: IntElement(width=0), "IntElement.width"),
    (lambda: FixedElement(-1), "FixedElement.frac_bits"),
    (lambda: FloatElement(0), "FloatElement.exp_bits"),
    (lambda: FloatElement(4, -1), "FloatElement.man_bits"),
    (lambda: FloatElement(4, 4, ocp=True), "FloatElement.ocp"),
    (lambda: Scaling(range="mean"), "Scaling.range"),
    (lambda: Scaling(scale_format="e4m3"), "Scaling.scale_format"),
    (lambda: Scaling(range="minmax", scale_format="pow2"), "Scaling.scale_format"),
    (lambda: Scaling(channel_axis=0, scale_axes=(1,)), "Scaling"),
    (lambda: Scaling(tile=64), "Scaling.tile"),
    (lambda: Quantizer("int8"), "Quantizer.element"),
    (lambda: Quantizer(FloatElement(4), "tensor"), "Quantizer.scaling"),
    (lambda: Quantizer(IntElement()), "Quantizer.scaling"),
    (lambda: Quantizer(FixedElement(), Scaling()), "Quantizer.scaling"),
    (lambda: Quantizer(FloatElement(4), Scaling(range="minmax")), "Scaling.range"),
    (lambda: Quantizer(IntElement(signed=True), Scaling(range="minmax")), "Scaling.range"),
    (lambda: Quantizer(IntElement(signed=False), Scaling(scale_format="pow2")),
     "Scaling.scale_format")])
def test_bad_compositions_are_refused_naming_the_field(make, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        make()


def test_a_traced_mantissa_needs_its_exponent_bits():
    with pytest.raises(ValueError, match="exp_bits"):
        quantize(X, 4, Quantizer(FloatElement(4)))
