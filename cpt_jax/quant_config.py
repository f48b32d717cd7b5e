"""Quantization configuration: which format and rounding each tensor of an op uses.

A `QuantConfig` describes one quantized dot/conv: its weight (the kernel, right-hand
operand), its activation (the input, left-hand operand) and its error (the cotangent
of its output). The default is CPT's recipe (Fu et al. 2021):

* weights: `AffineInt` per output channel, nearest rounding, forward bits;
* activations: `AffineInt` per tensor, nearest rounding, forward bits;
* errors: `AffineInt` per tensor, stochastic rounding, backward bits.

A tensor set to None stays in full precision. `bits_offset` shifts this op's
forward bits relative to the context's (per-layer allocation), `grad_bits_offset`
its backward bits; the result is clipped to ``[1, 32]``.
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Union

from cpt_jax import formats
from cpt_jax.formats import (MX, NVFP4, AffineInt, BlockFloat, Format, OCPFloat, ScaledFloat,
                             SymmetricInt)

SCALINGS = ("dynamic", "delayed")
ACTIVATION_RANGES = ("batch", "running")


@dataclasses.dataclass(frozen=True)
class TensorQuant:
    """How one tensor is quantized: a number format and a rounding mode."""

    fmt: Format = AffineInt()
    rounding: str = "nearest"

    def __post_init__(self):
        formats.check_format(self.fmt)
        if self.rounding not in formats.ROUNDINGS:
            raise ValueError(
                f"TensorQuant.rounding must be one of {formats.ROUNDINGS}, got {self.rounding!r}")


@dataclasses.dataclass(frozen=True)
class QuantConfig:
    """Quantization of one dot/conv: weight, activation, error, offsets, int8 path.

    Attributes:
      weight: format of the kernel (None: full precision).
      activation: format of the input (None: full precision).
      error: format of the output's cotangent at the backward bits (None: fp32).
      bits_offset: added to the context's forward bits for this op.
      grad_bits_offset: added to the context's backward bits for this op.
      int8: run the forward product on int8 codes with int32 accumulation (needs
        `SymmetricInt` weight and activation formats and bits <= 8).
      activation_range: ``"batch"``: each activation's own range; ``"running"``: a
        moving average of the training ranges, used in evaluation (CPT's
        QuantMeasure; per-tensor `AffineInt`/`SymmetricInt`; `cpt_jax.activation_ranges`).
      fp8_compute: run the forward product on float8 codes with fp32 accumulation
        (`cpt_jax.format_providers.FP8_COMPUTE`; needs per-tensor or per-row
        `ScaledFloat` / `OCPFloat` e4m3/e5m2 weight and activation, nearest).
    """

    weight: Optional[TensorQuant] = TensorQuant(AffineInt(channel_axis=-1), "nearest")
    activation: Optional[TensorQuant] = TensorQuant(AffineInt(), "nearest")
    error: Optional[TensorQuant] = TensorQuant(AffineInt(), "stochastic")
    bits_offset: float = 0.0
    grad_bits_offset: float = 0.0
    int8: bool = False
    activation_range: str = "batch"
    fp8_compute: bool = False

    def __post_init__(self):
        if self.fp8_compute:
            check_fp8_compute(self)
        if self.activation_range not in ACTIVATION_RANGES:
            raise ValueError(f"QuantConfig.activation_range must be one of {ACTIVATION_RANGES}, "
                             f"got {self.activation_range!r}")
        fmt = getattr(self.activation, "fmt", None)
        if self.activation_range == "running" and (
                self.int8 or not isinstance(fmt, (AffineInt, SymmetricInt))
                or fmt.channel_axis is not None):
            raise ValueError("QuantConfig(activation_range='running') needs a per-tensor "
                             f"AffineInt or SymmetricInt activation and int8=False, got {fmt!r}")
        if self.int8:
            for field in ("weight", "activation"):
                tq = getattr(self, field)
                if tq is None or not isinstance(tq.fmt, SymmetricInt):
                    raise ValueError(
                        f"QuantConfig(int8=True) needs {field}=TensorQuant(SymmetricInt(...)), "
                        f"got {tq!r}")

    def replace(self, **changes) -> "QuantConfig":
        return dataclasses.replace(self, **changes)


def check_fp8_compute(config: QuantConfig) -> None:
    """Raise ValueError unless `config`'s weight and activation can be float8 operands:
    `OCPFloat` or `ScaledFloat` ("tensor" / "row") with an e4m3/e5m2 element, nearest."""
    if config.int8:
        raise ValueError("QuantConfig: int8=True and fp8_compute=True exclude each other")
    for field in ("weight", "activation"):
        tq = getattr(config, field)
        fmt = getattr(tq, "fmt", None)
        ok = (isinstance(fmt, (OCPFloat, ScaledFloat)) and fmt.element in ("e4m3", "e5m2")
              and getattr(fmt, "granularity", "tensor") in ("tensor", "row")
              and tq.rounding == "nearest")
        if not ok:
            raise ValueError(
                f"QuantConfig(fp8_compute=True) needs {field} in OCPFloat or ScaledFloat "
                f"('tensor'/'row') with an e4m3/e5m2 element and nearest rounding, got {tq!r}")


# --------------------------------------------------------------------------- presets

def _same(fmt_forward, fmt_error, error_rounding="nearest", weight_fmt=None) -> QuantConfig:
    """Activation `fmt_forward`, weight `weight_fmt` (default: the same), error `fmt_error`."""
    return QuantConfig(weight=TensorQuant(weight_fmt or fmt_forward),
                       activation=TensorQuant(fmt_forward),
                       error=TensorQuant(fmt_error, error_rounding))


def _mx(element, error_element=None, error_rounding="nearest") -> QuantConfig:
    """MX blocks along the contraction: activations' features (-1), kernels' inputs (-2)."""
    return _same(MX(element), MX(error_element or element), error_rounding,
                 weight_fmt=MX(element, axis=-2))


PRESETS = {
    "cpt": QuantConfig(),
    "int8": QuantConfig(weight=TensorQuant(SymmetricInt(channel_axis=-1)),
                        activation=TensorQuant(SymmetricInt()),
                        error=TensorQuant(AffineInt(), "stochastic"), int8=True),
    "symmetric": QuantConfig(weight=TensorQuant(SymmetricInt(channel_axis=-1)),
                             activation=TensorQuant(SymmetricInt())),
    "block_float": QuantConfig(weight=TensorQuant(BlockFloat(), "stochastic"),
                               activation=TensorQuant(BlockFloat(), "stochastic"),
                               error=TensorQuant(BlockFloat(), "stochastic")),
    "fp8_tensor": _same(ScaledFloat("e4m3"), ScaledFloat("e5m2")),
    "fp8_delayed": _same(ScaledFloat("e4m3"), ScaledFloat("e5m2")),
    "fp8_compute": _same(ScaledFloat("e4m3"), ScaledFloat("e5m2")).replace(fp8_compute=True),
    "fp8_rowwise": _same(ScaledFloat("e4m3", "row"), ScaledFloat("e5m2", "row"),
                         weight_fmt=ScaledFloat("e4m3", "row", axis=-2)),
    "fp8_blockwise": _same(ScaledFloat("e4m3", "tile"), ScaledFloat("e4m3", "tile"),
                           weight_fmt=ScaledFloat("e4m3", "block", axis=-2)),
    "mxfp8": _mx("e4m3", "e5m2"),
    "mxfp6": _mx("e2m3", "e3m2"),
    "mxfp4": _mx("e2m1", error_rounding="stochastic"),
    "mxint8": _mx("int8"),
    "nvfp4": _same(NVFP4(), NVFP4(), "stochastic", weight_fmt=NVFP4(axis=-2)),
    "mx_int": _mx("int", error_rounding="stochastic"),
    "mx_float": _mx("float", error_rounding="stochastic"),
}
"""Quantizer recipes by name (`get_preset`); one table, the source of every preset.

=============  ================================================================
``cpt``        CPT (Fu et al. 2021): `AffineInt`, weights per output channel,
               errors stochastic; at the context's traced widths.
``int8``       `SymmetricInt` operands feeding a real int8 x int8 -> int32 product.
``symmetric``  `SymmetricInt` weights (per output channel) and activations, fake
               quant; errors as ``cpt``.
``block_float`` `BlockFloat` (one shared exponent per tensor) everywhere, stochastic.
``fp8_tensor`` per-tensor current scaling (Transformer Engine): E4M3 weights and
               activations, E5M2 errors, ``X = amax / max`` of the current tensor.
``fp8_compute`` ``fp8_tensor`` with the forward product on float8 operands and
               fp32 accumulation (`cpt_jax.format_providers.FP8_COMPUTE`).
``fp8_delayed`` the same grids; activations scaled from their amax history with
               ``cpt_jax.scaling.delayed_scaling_model(model, config=PRESETS[
               "fp8_delayed"], fmt=...)`` (Transformer Engine's delayed scaling).
``fp8_rowwise`` one scale per row: amax over the contracted axis.
``fp8_blockwise`` DeepSeek-V3: 1x128 activation and error tiles, 128x128 weight
               blocks, E4M3 everywhere.
``mxfp8/6/4``  OCP MX v1.0, blocks of 32 along the contraction (E4M3/E2M3/E2M1;
               errors E5M2/E3M2/E2M1 stochastic). ``mxint8``: MXINT8.
``nvfp4``      NVIDIA NVFP4 (e2m1, E4M3 scale per 16, fp32 per tensor), errors
               stochastic.
``mx_int``     MX("int") at the traced width: a cyclic schedule over MX widths
               that compiles once. ``mx_float``: MX("float"), 4/6/8-bit elements.
=============  ================================================================

The fixed-width formats (OCP, MX elements, NVFP4) ignore the width except
``bits >= 32`` (full precision); the papers' formats and MX("int"/"float") use it.
Weight formats block along axis -2, the input features of a Dense kernel
``(in, out)`` and of a conv kernel ``HWIO``; activations along -1 (features);
errors along -1 (the axis the input-gradient product contracts; see
docs/formats.md for the weight gradient).
"""

CPT_CONFIG = PRESETS["cpt"]
"""CPT's quantizer: affine min-max, weights per channel, errors stochastic."""

INT8_CONFIG = PRESETS["int8"]
"""Symmetric integer operands that feed a real int8 x int8 -> int32 product."""


def get_preset(name: str) -> QuantConfig:
    """The `QuantConfig` recipe called `name` in `PRESETS`.

    Args:
      name: a key of `PRESETS` (e.g. ``"cpt"``, ``"fp8_tensor"``, ``"mxfp4"``).

    Returns:
      The frozen `QuantConfig`.

    Example:
      >>> get_preset("mxfp8").weight.fmt
      MX(element='e4m3', block_size=32, axis=-2)
    """
    if name not in PRESETS:
        raise ValueError(f"unknown quantizer preset {name!r}; known: {sorted(PRESETS)}")
    return PRESETS[name]


def operand_bits(config: Optional[QuantConfig], bits, grad_bits) -> tuple:
    """Stored bits per element ``(b_w, b_a, b_g)`` of an op under `config`, scales included.

    ``formats.bits_per_element`` of the weight and activation formats at the
    forward width and of the error format at `grad_bits`; a tensor kept in full
    precision (None, or `grad_bits` None) counts 32; ``config=None`` is
    ``(bits, bits, grad_bits)`` (the papers' accounting).

    Example:
      >>> [float(b) for b in operand_bits(get_preset("mxfp4"), 4, 4)]
      [4.25, 4.25, 4.25]
    """
    if config is None:
        g = 32.0 if grad_bits is None else grad_bits
        return bits, bits, g

    def count(tq, b):
        if tq is None or b is None:
            return 32.0
        return formats.bits_per_element(tq.fmt, b)

    return count(config.weight, bits), count(config.activation, bits), count(config.error, grad_bits)

FULL_PRECISION = "full_precision"
"""Rule target that keeps matching modules in full precision."""

RuleTarget = Union[QuantConfig, None, str]
