"""One format protocol (issue 42): the built-in formats answer it themselves, a format
defined elsewhere answers the same questions (width check, bits per element, traits,
the axes along a product's contraction), and everything that asks (`quantize`, the
cost, `format_traits`, providers, export) asks the format, never its type."""
from __future__ import annotations

import dataclasses
import itertools
import pathlib

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import cpt_jax
from cpt_jax import formats as F
from cpt_jax.formats import Contraction, FormatTraits
from cpt_jax.interception import ACTIVATION, WEIGHT, Operand
from cpt_jax.providers import block_formats, fake_quant

FORMATS_DIR = pathlib.Path(F.__file__).parent
BUILT_INS = [F.AffineInt(), F.AffineInt(channel_axis=-1), F.SymmetricInt(scale_axes=(-1,)),
             F.SymmetricInt(scale_axes=(-1,), tile=4), F.SymmetricInt(scale_axes=(-2, -1), tile=(4, 4)),
             F.BlockFloat(channel_axis=0), F.FixedPoint(3), F.Float(4), F.OCPFloat("e5m2"),
             F.MX("e2m1"), F.MX("int"), F.NVFP4(), F.NVFP4(block_2d=True), F.ScaledFloat(),
             F.ScaledFloat("e4m3", "row"), F.ScaledFloat("e4m3", "block"),
             F.Quantizer(F.IntElement(), F.Scaling(scale_axes=(-1,), tile=8))]


@dataclasses.dataclass(frozen=True)
class Sevenths:
    """A format written only through the protocol: multiples of max|x| / 7 per block of
    `block` along `axis`, 3-bit codes plus an fp32 scale per block, blocked along a
    product's contraction."""

    axis: int = -1
    block: int = 4

    def grid(self, x, bits, rounding, key):
        view, inner, restore = F.block_view(x, [(x.ndim + self.axis if self.axis < 0 else
                                                 self.axis, self.block)])
        scale = jnp.maximum(F.masked_absmax(view, inner) / 7.0, 1e-30)
        return restore(F.round_to_integer(view / scale, rounding, key) * scale)

    def check_bits(self, bits):
        if np.min(np.asarray(bits)) < 3:
            raise ValueError(f"Sevenths needs bits >= 3, got {bits!r}")

    def bits_per_element(self, bits):
        return 3.0 + 32.0 / self.block

    def traits(self):
        return FormatTraits("sevenths", "tile", True, self.axis, self.block)

    def along(self, contraction):
        axis = contraction.block_axis
        return self if axis is None else dataclasses.replace(self, axis=axis)


def test_every_built_in_format_answers_the_protocol_itself():
    for fmt in BUILT_INS:
        assert isinstance(fmt, F.FormatProtocol) and F.is_format(fmt)
        assert F.format_traits(fmt) == fmt.traits()
        if hasattr(fmt, "bits_per_element"):
            assert float(F.bits_per_element(fmt, 4)) == float(fmt.bits_per_element(jnp.float32(4)))
    for cls in F.FORMATS:
        assert callable(cls.grid) and callable(cls.traits), cls


def test_no_format_table_or_isinstance_chain_outside_a_formats_own_module():
    """The dispatch is the format's own methods: no ``type(fmt)``-keyed table, no
    `isinstance` on a format class in the modules that ask formats questions."""
    for name in ("_measures.py", "_traits.py", "_quantize.py", "_composed.py", "codes.py",
                 "_protocol.py"):
        text = (FORMATS_DIR / name).read_text()
        assert "type(fmt)]" not in text and " _GRIDS" not in text, name
        for cls in ("AffineInt", "SymmetricInt", "BlockFloat", "FixedPoint", "OCPFloat", "MX",
                    "NVFP4", "ScaledFloat"):
            assert f"isinstance(fmt, {cls}" not in text and f", {cls})" not in text, (name, cls)


def test_a_protocol_format_is_answered_everywhere():
    fmt = Sevenths()
    x = jnp.linspace(-1.0, 1.0, 8)
    q = F.quantize(x, 4, fmt)
    np.testing.assert_allclose(q[:4], np.round(np.asarray(x[:4]) / (1.0 / 7)) / 7, rtol=1e-6)
    with pytest.raises(ValueError, match="Sevenths needs bits >= 3"):
        F.quantize(x, 2, fmt)
    assert float(F.bits_per_element(fmt, 5)) == 11.0 and float(F.bits_per_element(fmt, 32)) == 32
    assert F.format_traits(fmt).family == "sevenths" and F.is_blocked(fmt)
    c = Contraction((0,), channel_axis=1)
    assert F.along_contraction(fmt, c) == Sevenths(axis=0)
    assert not F.has_fp8_codes(fmt) and not cpt_jax.quant_config.gemm_capable(fmt)
    with pytest.raises(ValueError, match="no single grid step"):
        F.grid_step(x, 4, fmt)


def test_a_protocol_format_runs_in_a_model_blocked_along_each_contraction_and_is_costed():
    fmt = Sevenths()
    config = cpt_jax.QuantConfig(weight=cpt_jax.TensorQuant(fmt), activation=None, error=None)
    model = cpt_jax.quantize_model(nn.Dense(3, use_bias=False), config=config)
    x = jax.random.normal(jax.random.key(0), (2, 8))
    v = model.init(jax.random.key(1), x)
    with cpt_jax.precision(4, 4):
        y = model.apply(v, x)
    kernel = v["params"]["kernel"]                         # (8, 3): blocks along the 8 inputs
    np.testing.assert_allclose(y, x @ F.quantize(kernel, 4, Sevenths(axis=0)), rtol=1e-6)
    ops = cpt_jax.count_ops(model, v, x)
    # 48 MACs; weight 3 + 32/4 = 11 bits, activation and errors fp32:
    # b_w b_a + b_g (b_w + b_a) = 11 * 32 + 32 * (11 + 32) per MAC
    assert float(cpt_jax.bitops_per_step(ops, 4, 4, config)) == 48 * (11 * 32 + 32 * (11 + 32))


def test_export_refuses_a_format_it_cannot_store_naming_it():
    from cpt_jax.export._checks import grid_kind

    with pytest.raises(ValueError, match="the weight format is Sevenths"):
        grid_kind(Sevenths(), "weight")


def test_register_format_names_a_class_in_the_package():
    cls = F.register_format(Sevenths)
    try:
        assert F.Sevenths is Sevenths and "Sevenths" in dir(F)
        with pytest.raises(ValueError, match="or an object with a grid"):
            F.check_format("sevenths")
    finally:
        F.unregister_format(Sevenths)
    assert cls is Sevenths and not hasattr(F, "Sevenths")
    with pytest.raises(ValueError, match="needs a class with a grid"):
        F.register_format(int)


# --------------------------------------------------------------------------- along a product

def _operands():
    """(kind, operand, rank) triples: a Dense's activation and kernel, an einsum's
    two-axis contraction, a conv kernel, a ragged dot's stacked experts, a lookup."""
    return [("dot_general", Operand(ACTIVATION, (1,)), 2), ("dot_general", Operand(WEIGHT, (0,), 1), 2),
            ("einsum", Operand(ACTIVATION, (1, 3)), 4), ("einsum", Operand(WEIGHT, (0, 1), 2), 3),
            ("conv", Operand(WEIGHT, (2, 0, 1), 3), 4), ("ragged_dot", Operand(WEIGHT, (1,), 2), 3),
            ("dot_general", Operand(WEIGHT, (), 0), 2)]


class _Product:
    """What the providers read of a product to lay an operand's format along it."""

    def __init__(self, kind, config):
        self.kind, self.config = kind, config


@pytest.mark.parametrize("fmt", BUILT_INS, ids=repr)
def test_along_contraction_is_what_the_providers_do_today(fmt):
    """`formats.along_contraction` gives each built-in format the layout the providers'
    own functions give it (`fake_quant.operand_quant`, `block_formats.operand_blocks`),
    so the providers can ask the format instead."""
    config = cpt_jax.QuantConfig(weight=cpt_jax.TensorQuant(fmt), activation=cpt_jax.TensorQuant(fmt),
                                 error=None)
    for kind, operand, ndim in _operands():
        product = _Product(kind, config)
        try:
            want = block_formats.operand_blocks(product, operand, ndim).fmt
        except ValueError as exc:   # a 2-D tile on an operand without an output channel
            with pytest.raises(ValueError, match="2-D tile"):
                F.along_contraction(fmt, Contraction(operand.contracting, kind,
                                                     operand.channel_axis, ndim))
            assert "2-D tile" in str(exc)
            continue
        got = F.along_contraction(fmt, Contraction(operand.contracting, kind,
                                                   operand.channel_axis, ndim))
        assert got == want, (kind, operand, got, want)
        assert fake_quant.operand_quant(product, operand).fmt == F.along_contraction(
            fmt, Contraction(operand.contracting, kind, operand.channel_axis)) or F.is_blocked(fmt)


def test_built_in_traits_cover_every_family_once():
    families = {type(f): F.format_traits(f).family for f in BUILT_INS}
    assert set(families.values()) == set(F.FAMILIES)
    for a, b in itertools.combinations(families.items(), 2):
        assert a[1] != b[1] or a[0] is b[0]
