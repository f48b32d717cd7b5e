"""NormalFloat: QLoRA's NF4 codebook, and the same construction at 2..8 bits; preset ``nf4``.

Written only through the public format protocol (`cpt_jax.formats.FormatProtocol`) and
registered with the public calls, as a user's own module would be.

A NormalFloat-``b`` value is ``s * c`` with ``c`` one of the ``2^b`` codebook levels
and ``s`` the absmax of its block of 64 elements along the product's contraction
(Dettmers et al., "QLoRA: Efficient Finetuning of Quantized LLMs", 2023, section 3).
The levels are quantiles of the standard normal distribution, normalized to [-1, 1],
with an exact zero (asymmetric: one more positive level):

    delta_b = (1 / (2 (2^b - 1)) + 1 / (2 * 2^b)) / 2,   o_b = 1 - delta_b
    positive: Phi^-1(p) for the 2^(b-1) points p of linspace(o_b, 1/2, 2^(b-1) + 1)
              without its last (1/2)
    negative: -Phi^-1(p) for linspace(o_b, 1/2, 2^(b-1)) without its last
    levels = sort(negative, 0, positive) / max

``o_4 = 0.9677083``: the offset of bitsandbytes' ``create_normal_map`` (bitsandbytes,
``bitsandbytes/functional.py``), whose 16 NF4 levels (``get_4bit_type("nf4")``) are
`NF4_LEVELS` here, as published; the construction above reproduces them to 3e-7
(float32 rounding of the offset). Nearest rounding picks the nearer of the two levels
around ``v = x / s`` (ties to the lower); stochastic rounding picks the upper one with
probability ``(v - lo) / (hi - lo)``, so ``E[q] = x``.

Stored bits: ``b`` per element plus an fp32 absmax per 64 (``b + 0.5``; QLoRA's double
quantization of the absmax to 8 bits is not modelled).

Preset ``nf4``: NF4 weights (4 bits whatever the schedule's width, blocks along each
product's contraction: a Dense kernel's inputs, a conv kernel's input channels);
activations and errors stay float32, QLoRA's setting (4-bit stored weights,
higher-precision compute).
"""
from __future__ import annotations

import dataclasses
from statistics import NormalDist
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from cpt_jax import formats
from cpt_jax.quant_config import QuantConfig, TensorQuant, register_preset

Array = jax.Array
BLOCK = 64
MIN_BITS, MAX_BITS = 2, 8

NF4_LEVELS = (-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
              -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
              0.07958029955625534, 0.16093020141124725, 0.24611230194568634,
              0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
              0.7229568362236023, 1.0)
"""bitsandbytes' NF4 codebook (``get_4bit_type("nf4")``, QLoRA's Appendix E), as published."""


def normal_float_levels(bits: int) -> np.ndarray:
    """The ``2^bits`` NormalFloat levels (module docstring), float64, increasing.

    Example:
      >>> np.round(normal_float_levels(2), 4).tolist()
      [-1.0, 0.0, 0.4358, 1.0]
    """
    half = 2 ** (bits - 1)
    offset = 1.0 - 0.5 * (1.0 / (2 * (2 ** bits - 1)) + 1.0 / (2 * 2 ** bits))
    ppf = NormalDist().inv_cdf
    positive = [ppf(p) for p in np.linspace(offset, 0.5, half + 1)[:-1]]
    negative = [-ppf(p) for p in np.linspace(offset, 0.5, half)[:-1]]
    levels = np.sort(np.array(positive + [0.0] + negative))
    return levels / levels.max()


def _table() -> np.ndarray:
    """Every width's levels as rows of 2^8 (float32, padded with +inf: still sorted)."""
    rows = np.full((MAX_BITS - MIN_BITS + 1, 2 ** MAX_BITS), np.inf, np.float32)
    for b in range(MIN_BITS, MAX_BITS + 1):
        rows[b - MIN_BITS, :2 ** b] = NF4_LEVELS if b == 4 else normal_float_levels(b)
    return rows


LEVELS = _table()
"""``LEVELS[b - 2, :2^b]``: the levels of NormalFloat-``b`` (float32; NF4's as published)."""


@formats.register_format
@dataclasses.dataclass(frozen=True)
class NormalFloat:
    """QLoRA's NormalFloat: ``2^b`` normal-quantile levels times a 64-element absmax.

    ``q = s * c``, ``s = max|x|`` over each block of `block_size` along `axis`, ``c``
    the level nearest ``x / s`` (or a stochastic choice of the two around it, unbiased);
    levels and formulas in the module docstring. `width` None follows the traced bits
    (2..8: NF2..NF8; a traced width outside is clipped into it), an int pins it (4:
    NF4 whatever the schedule). ``bits >= 32`` is full precision.

    Example:
      >>> from cpt_jax.formats import NormalFloat, quantize
      >>> quantize(jnp.array([-2.0, 0.1, 0.9, 2.0]), 4, NormalFloat(block_size=4)).tolist()
      [-2.0, 0.15916059911251068, 0.8814196586608887, 2.0]
    """

    width: int | None = None
    block_size: int = BLOCK
    axis: int = -1

    def __post_init__(self):
        if self.width is not None and (isinstance(self.width, bool) or self.width not in
                                       range(MIN_BITS, MAX_BITS + 1)):
            raise ValueError(f"NormalFloat.width must be None or an int in "
                             f"[{MIN_BITS}, {MAX_BITS}], got {self.width!r}")
        if not isinstance(self.block_size, int) or self.block_size < 1:
            raise ValueError(f"NormalFloat.block_size must be an int >= 1, got {self.block_size!r}")
        if not isinstance(self.axis, int) or isinstance(self.axis, bool):
            raise ValueError(f"NormalFloat.axis must be an int axis, got {self.axis!r}")

    def check_bits(self, bits: Any) -> None:
        """A static width must be 2..8 (or >= 32, full precision) unless `width` is set."""
        b = np.asarray(bits)
        if self.width is None and np.any((b < MIN_BITS) | ((b > MAX_BITS) & (b < 32))):
            raise ValueError(f"bits must be in [{MIN_BITS}, {MAX_BITS}] (or >= 32) for "
                             f"{self}, got {bits!r}")

    def element_width(self, bits: Array) -> Array:
        """``width``, else the bits clipped to 2..8."""
        if self.width is not None:
            return jnp.float32(self.width)
        return jnp.clip(jnp.asarray(bits, jnp.float32), MIN_BITS, MAX_BITS)

    def bits_per_element(self, bits: Array) -> Array:
        """The element and an fp32 absmax per block: ``b + 32 / block_size``."""
        return self.element_width(bits) + 32.0 / self.block_size

    def traits(self) -> formats.FormatTraits:
        """A block-scaled format (blocks along the contraction); no element a real
        low-precision product takes, no range grid (export refuses it)."""
        return formats.FormatTraits("normal_float", "tile", True, self.axis, self.block_size)

    def along(self, contraction: formats.Contraction) -> NormalFloat:
        """Blocks along the operand's contracted axis (`Contraction.block_axis`)."""
        axis = contraction.block_axis
        return self if axis is None else dataclasses.replace(self, axis=int(axis))

    def levels(self, bits: Array) -> tuple[Array, Array]:
        """``(row, n)``: the levels at `bits` padded to 256 with +inf, and their count."""
        if self.width is not None:
            return jnp.asarray(LEVELS[self.width - MIN_BITS]), jnp.int32(2 ** self.width)
        b = jnp.clip(jnp.asarray(bits, jnp.float32), MIN_BITS, MAX_BITS).astype(jnp.int32)
        return jnp.asarray(LEVELS)[b - MIN_BITS], jnp.left_shift(jnp.int32(1), b)

    def grid(self, x: Array, bits: Array, rounding: str, key: Array | None) -> Array:
        """``s * c`` per block along `axis` (module docstring)."""
        rank = max(x.ndim, 1)
        if not -rank <= self.axis < rank:
            raise ValueError(f"NormalFloat.axis={self.axis} is out of range for a tensor of "
                             f"rank {x.ndim}")
        view, inner, restore = formats.block_view(jnp.atleast_1d(x),
                                                  [(self.axis % rank, self.block_size)])
        absmax = formats.masked_absmax(view, inner)
        scale = jnp.where(absmax > 0, absmax, 1.0)
        v = view / scale
        row, n = self.levels(bits)
        i = jnp.clip(jnp.searchsorted(row, v), 1, n - 1)
        lo, hi = row[i - 1], row[i]
        if rounding == "stochastic" and key is not None:  # quantize checks there is a key
            u = formats.dither_noise(key, v.shape)
            up = u * (hi - lo) < v - lo
        else:
            up = hi - v < v - lo
        return restore(jnp.where(up, hi, lo) * scale).reshape(x.shape)


NF4 = QuantConfig(weight=TensorQuant(NormalFloat(width=4, axis=-2)), activation=None, error=None)
register_preset("nf4", NF4, "QLoRA's NF4 weights (4-bit NormalFloat, an fp32 absmax per 64 "
                            "along the contraction); activations and errors in fp32.")

__all__ = ["LEVELS", "NF4", "NF4_LEVELS", "NormalFloat", "normal_float_levels"]
