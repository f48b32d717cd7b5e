"""`IntCodes`: the integer formats' codes plus scales (`cpt_jax.formats.encode`).

* ``encode(x).decode()`` is `quantize` bit for bit (the sign of zero included) per
  tensor, channel, token, 1-D and 2-D tile, on zeros, ties, a range wider than
  float32 and non-finite inputs (which `quantize` passes through: their codes are
  NaN for NaN, the end codes for +-Inf), nearest and stochastic (same key), with a
  traced width under `jit`;
* the codes are integers inside the format's code bounds;
* `IntCodes.bits_per_element` is `formats.bits_per_element`;
* the export's weight codes (`ops.grids.kernel_codes`, now from `encode`) are those
  of the former grid computation, code for code.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cpt_jax import formats
from cpt_jax.formats import AffineInt, IntCodes, SymmetricInt, encode, quantize
from cpt_jax.ops import grids

SCALINGS = {
    "tensor": {},
    "channel_last": {"channel_axis": -1},
    "channel_first": {"channel_axis": 0},
    "token": {"scale_axes": (-1,)},
    "tile_1d": {"scale_axes": (-1,), "tile": 4},
    "tile_2d": {"scale_axes": (0, 1), "tile": (3, 4)},
}
FORMAT_TYPES = (AffineInt, SymmetricInt)
WIDTHS = (1, 2, 3, 4, 8, 12)


def _bits_of(a) -> np.ndarray:
    return np.asarray(a, np.float32).view(np.uint32)


def _assert_bit_equal(a, b):
    np.testing.assert_array_equal(_bits_of(a), _bits_of(b))


def _inputs(finite: bool = True) -> jnp.ndarray:
    """(7, 10): normal values, zeros, a row of exact ties, a constant row, a row
    spanning float32's range (prescaled grids), a tiny row; specials if not `finite`."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(7, 10)).astype(np.float32)
    x[0, ::3] = 0.0                                   # zeros
    x[1] = np.arange(10) * 0.5                        # ties at the half steps
    x[2] = 0.25                                       # a constant row
    x[3] = np.linspace(-3e38, 3e38, 10)               # wider than float32 (hi - lo = inf)
    x[4] *= 1e-30
    x[5, 0], x[5, 9] = -0.0, 0.0
    if not finite:
        x[6, 1], x[6, 4], x[6, 7] = np.inf, -np.inf, np.nan
    return jnp.asarray(x)


def _fmt(fmt_type, scaling):
    return fmt_type(**SCALINGS[scaling])


@pytest.mark.parametrize("scaling", SCALINGS)
@pytest.mark.parametrize("fmt_type", FORMAT_TYPES, ids=lambda t: t.__name__)
def test_decode_of_encode_is_quantize_bit_for_bit(fmt_type, scaling):
    fmt = _fmt(fmt_type, scaling)
    for finite in (True, False):
        x = _inputs(finite)
        for bits in WIDTHS:
            q = encode(x, bits, fmt).decode()
            q = jnp.where(jnp.isfinite(x), q, x)   # quantize passes non-finite through
            _assert_bit_equal(q, quantize(x, bits, fmt))


@pytest.mark.parametrize("scaling", ["tensor", "token", "tile_2d"])
@pytest.mark.parametrize("fmt_type", FORMAT_TYPES, ids=lambda t: t.__name__)
def test_stochastic_rounding_is_quantize_with_the_same_key(fmt_type, scaling):
    fmt, x, key = _fmt(fmt_type, scaling), _inputs(), jax.random.key(3)
    for bits in (2, 4, 8):
        q = encode(x, bits, fmt, "stochastic", key).decode()
        _assert_bit_equal(q, quantize(x, bits, fmt, rounding="stochastic", key=key))


@pytest.mark.parametrize("scaling", ["tensor", "channel_last", "tile_1d"])
@pytest.mark.parametrize("fmt_type", FORMAT_TYPES, ids=lambda t: t.__name__)
def test_traced_widths_under_jit_compile_once(fmt_type, scaling):
    fmt, x = _fmt(fmt_type, scaling), _inputs(finite=False)

    @jax.jit
    def through_codes(x, bits):
        return jnp.where(jnp.isfinite(x), encode(x, bits, fmt).decode(), x)

    fake = jax.jit(lambda x, bits: quantize(x, bits, fmt))
    for bits in (2.0, 3.0, 5.0, 8.0):
        _assert_bit_equal(through_codes(x, jnp.float32(bits)), fake(x, jnp.float32(bits)))
    assert through_codes._cache_size() == 1


@pytest.mark.parametrize("scaling", SCALINGS)
@pytest.mark.parametrize("fmt_type", FORMAT_TYPES, ids=lambda t: t.__name__)
def test_codes_are_integers_inside_the_code_bounds(fmt_type, scaling):
    fmt, x = _fmt(fmt_type, scaling), _inputs()
    for bits in WIDTHS:
        c = encode(x, bits, fmt)
        lo, hi = (np.asarray(v) for v in c.code_bounds())
        codes = np.asarray(c.codes)
        assert codes.shape == x.shape and codes.dtype == np.float32
        assert np.all(codes == np.round(codes)), (bits, codes)
        assert np.all((codes >= lo) & (codes <= hi)), (bits, lo, hi, codes)
    affine = fmt_type is AffineInt
    assert [float(v) for v in encode(x, 4, fmt).code_bounds()] == (
        [0.0, 15.0] if affine else [-7.0, 7.0])


@pytest.mark.parametrize("fmt_type", FORMAT_TYPES, ids=lambda t: t.__name__)
def test_non_finite_inputs_hold_nan_or_the_end_codes(fmt_type):
    x = _inputs(finite=False)
    c = encode(x, 4, fmt_type())
    lo, hi = (float(v) for v in c.code_bounds())
    row = np.asarray(c.codes)[6]
    assert (row[1], row[4]) == (hi, lo) and np.isnan(row[7])


def test_codes_plus_scales_hold_the_formula():
    x = jnp.array([[0.0, 1.0, 2.0, 3.0], [-1.0, -0.5, 0.0, 0.5]])
    a = encode(x, 2, AffineInt(channel_axis=0))
    assert a.kind == "affine" and a.codes.tolist() == [[0, 1, 2, 3], [0, 1, 2, 3]]
    assert a.scale.tolist() == [[1.0], [0.5]] and a.offset.tolist() == [[0.0], [-1.0]]
    assert a.prescale.tolist() == [[1.0], [1.0]] and np.all(np.isinf(a.cap))
    assert a.step().tolist() == [[1.0], [0.5]] and a.origin().tolist() == [[0.0], [-1.0]]
    s = encode(x, 3, SymmetricInt())
    assert s.kind == "symmetric" and s.offset is None and s.prescale is None
    assert s.step().tolist() == [[1.0]] and s.origin().tolist() == [[0.0]]
    assert s.scale.tolist() == [[1.0]]   # max|x| / 3 = 1: codes round(x), half to even
    assert s.codes.tolist() == [[0.0, 1.0, 2.0, 3.0], [-1.0, 0.0, 0.0, 0.0]]


def test_int_codes_is_a_pytree_through_jit():
    x, fmt = _inputs(), AffineInt(scale_axes=(-1,), tile=4)
    c = jax.jit(lambda x: jax.tree.map(lambda v: v, encode(x, 4, fmt)))(x)
    assert isinstance(c, IntCodes) and c.scale_elements == 4 and c.scale_bits == 64.0
    assert len(jax.tree_util.tree_leaves(c)) == 6  # codes, scale, offset, prescale, cap, bits
    back = jax.tree.map(np.asarray, encode(x, 4, fmt))  # the leaves out and in again
    _assert_bit_equal(back.decode(), quantize(x, 4, fmt))
    whole = jax.jit(lambda x: encode(x, 4, fmt).decode())  # as fake quant compiles it
    _assert_bit_equal(whole(x), jax.jit(lambda x: quantize(x, 4, fmt))(x))


def test_symmetric_codes_are_encodes():
    x = _inputs()
    fmt = SymmetricInt(scale_axes=(-1,), tile=4)
    codes, scale = formats.symmetric_codes(x, 6, fmt)
    c = encode(x, 6, fmt)
    _assert_bit_equal(codes, c.codes)
    _assert_bit_equal(scale, c.scale)


COST_FORMATS = {
    "tensor": {},
    "channel": {"channel_axis": -1},
    "token": {"scale_axes": (-1,)},
    "tile_1d": {"scale_axes": (-1,), "tile": 128},
    "tile_2d": {"scale_axes": (0, 1), "tile": (16, 8)},
}


@pytest.mark.parametrize("scaling", COST_FORMATS)
@pytest.mark.parametrize("fmt_type", FORMAT_TYPES, ids=lambda t: t.__name__)
def test_bits_per_element_is_the_formats(fmt_type, scaling):
    fmt = fmt_type(**COST_FORMATS[scaling])
    x = jax.random.normal(jax.random.key(0), (32, 256))
    for bits in (2, 4, 6, 8, 16, 32):
        got = encode(x, bits, fmt).bits_per_element()
        assert float(got) == float(formats.bits_per_element(fmt, bits)), (bits, fmt)
    if scaling == "tile_1d":
        assert float(encode(x, 4, fmt).bits_per_element()) == 4.0 + (
            64.0 if fmt_type is AffineInt else 32.0) / 128
    traced = jax.jit(lambda b: encode(x, b, fmt).bits_per_element())(jnp.float32(5))
    assert float(traced) == float(formats.bits_per_element(fmt, 5))


def test_encode_refuses_what_it_cannot_encode():
    x = jnp.ones(3)
    with pytest.raises(ValueError, match="AffineInt or a SymmetricInt"):
        encode(x, 4, formats.BlockFloat())
    with pytest.raises(ValueError, match="needs a PRNG"):
        encode(x, 4, SymmetricInt(), "stochastic")
    with pytest.raises(ValueError, match="bits must be >= 1"):
        encode(x, 0, SymmetricInt())


# --------------------------------------------------------------------------- export

def _former_kernel_codes(kernel, bits, kind, channel_axis):
    """`kernel_codes` before it read `encode`: min / max per channel, `grid_from_range`,
    `raw_codes`, shifted into int8."""
    kernel = jnp.asarray(kernel, jnp.float32)
    if channel_axis is None:
        keep = ()
    else:
        axes = channel_axis if isinstance(channel_axis, tuple) else (channel_axis,)
        keep = tuple(sorted(a % kernel.ndim for a in axes))
    reduce = tuple(d for d in range(kernel.ndim) if d not in keep) or None
    lo, hi = grids.finite_min_max(kernel, reduce if keep else None)
    shape = tuple(kernel.shape[d] if d in keep else 1 for d in range(kernel.ndim))
    lo, hi = jnp.reshape(lo, shape), jnp.reshape(hi, shape)
    origin, scale = grids.grid_from_range(kind, bits, lo, hi)
    code_min, code_max, shift = grids.code_bounds(kind, bits)
    codes = grids.raw_codes(kernel, origin, scale, code_min, code_max)
    return ((codes - shift).astype(jnp.int8), scale.reshape(-1),
            (origin + shift * scale).reshape(-1))


@pytest.mark.parametrize("channel_axis", [None, -1, 0, (1, 2)], ids=str)
@pytest.mark.parametrize("kind", ["affine", "symmetric"])
def test_export_codes_are_unchanged(kind, channel_axis):
    w = jax.random.normal(jax.random.key(1), (3, 4, 5)) * jnp.arange(1.0, 6.0)
    w = w.at[0, 0, 0].set(0.0).at[1, 2, 3].set(jnp.nan)
    for bits in range(2, 9):
        got = grids.kernel_codes(w, bits, kind, channel_axis)
        want = _former_kernel_codes(w, bits, kind, channel_axis)
        for g, e in zip(got, want):
            assert g.dtype == e.dtype and g.shape == e.shape
        finite = np.isfinite(np.asarray(w))
        np.testing.assert_array_equal(np.asarray(got[0])[finite], np.asarray(want[0])[finite])
        _assert_bit_equal(got[1], want[1])
        _assert_bit_equal(got[2], want[2])


def test_export_refuses_a_channel_of_every_axis():
    with pytest.raises(ValueError, match="keeps every axis"):
        grids.kernel_codes(jnp.ones((2, 3)), 8, "affine", (0, 1))
