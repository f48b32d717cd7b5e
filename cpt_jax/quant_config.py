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
from cpt_jax.formats import AffineInt, Format, SymmetricInt

SCALINGS = ("dynamic", "delayed")


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
    """

    weight: Optional[TensorQuant] = TensorQuant(AffineInt(channel_axis=-1), "nearest")
    activation: Optional[TensorQuant] = TensorQuant(AffineInt(), "nearest")
    error: Optional[TensorQuant] = TensorQuant(AffineInt(), "stochastic")
    bits_offset: float = 0.0
    grad_bits_offset: float = 0.0
    int8: bool = False

    def __post_init__(self):
        if self.int8:
            for field in ("weight", "activation"):
                tq = getattr(self, field)
                if tq is None or not isinstance(tq.fmt, SymmetricInt):
                    raise ValueError(
                        f"QuantConfig(int8=True) needs {field}=TensorQuant(SymmetricInt(...)), "
                        f"got {tq!r}")

    def replace(self, **changes) -> "QuantConfig":
        return dataclasses.replace(self, **changes)


CPT_CONFIG = QuantConfig()
"""CPT's quantizer: affine min-max, weights per channel, errors stochastic."""

INT8_CONFIG = QuantConfig(
    weight=TensorQuant(SymmetricInt(channel_axis=-1)),
    activation=TensorQuant(SymmetricInt()),
    error=TensorQuant(AffineInt(), "stochastic"),
    int8=True)
"""Symmetric integer operands that feed a real int8 x int8 -> int32 product."""

FULL_PRECISION = "full_precision"
"""Rule target that keeps matching modules in full precision."""

RuleTarget = Union[QuantConfig, None, str]
