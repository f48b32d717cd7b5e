"""The block-scaled hardware formats: OCP Microscaling (MX) and NVIDIA's NVFP4.

`MX` shares an E8M0 (power-of-two) scale per block of 32 along one axis; `NVFP4`
has E4M3 scales per block of 16 under an fp32 tensor scale. Each is a frozen
dataclass answering the format protocol itself (``grid``, ``traits``,
``bits_per_element``, ``along``, ...: `FormatProtocol`) and giving its codes and
block scales to a low-precision GEMM (``gemm_operand``); their parts (elements,
scales, block views) are computed in `_blocks`. `HARDWARE_FORMATS` adds the scaled
FP formats of `_scaled` (`OCPFloat`, `ScaledFloat`).
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from cpt_jax.formats._axis_scaled import repr_without_defaults
from cpt_jax.formats._blocks import mx_grid, mx_parts, nvfp4_grid, nvfp4_parts
from cpt_jax.formats._elements import ELEMENTS, MX_ELEMENTS
from cpt_jax.formats._protocol import Contraction, FormatTraits
from cpt_jax.formats._scaled import OCPFloat, ScaledFloat
from cpt_jax.formats._scaling import check_axis

Array = jax.Array

MX_SCALE_ROUNDINGS = ("floor", "up")
"""`MX.scale_rounding`: the OCP spec's floor, or JAX's / cuDNN's round-up of ``amax / max``."""


@dataclasses.dataclass(frozen=True)
class MX:
    """OCP Microscaling (MX spec v1.0): blocks of `block_size` share a power-of-two scale.

    Consecutive blocks of `block_size` elements along `axis` (zero-padded at the
    end) share ``X = 2^clip(floor(log2 amax) - emax_elem, -127, 127)`` (an E8M0
    scale); elements are the saturating casts of ``x / X``; ``q = X * elem``.

    * ``"e4m3" "e5m2" "e3m2" "e2m3" "e2m1"``: MXFP8/MXFP6/MXFP4, ``emax_elem`` =
      8, 15, 4, 2, 2 (`OCPFloat` elements).
    * ``"int8"``: MXINT8, ``elem = clip(rint(64 x/X), -127, 127) / 64``, emax 0.
    * ``"int"`` (traced width ``b``, 2..8 are the MX widths):
      ``elem = clip(rint(2^(b-2) x/X), -(2^(b-1)-1), 2^(b-1)-1) / 2^(b-2)``
      (MXINT8 at 8).
    * ``"float"`` (traced width): bits 4/6/8 use e2m1/e2m3/e4m3; between them the
      widest element not above ``bits`` (5 -> e2m1, 7 -> e2m3).

    `axis` should be the dimension the product contracts (see docs/formats.md).

    `scale_rounding` picks the shared exponent of a float element:

    * ``"floor"`` (the OCP spec, section 6.3): ``floor(log2 amax) - emax_elem``;
      the block's largest element can exceed the element's maximum and saturate
      (e4m3: amax in ``[448, 512) * X``).
    * ``"up"`` (JAX's ``jax.nn.get_scaled_dot_general_config`` and cuDNN):
      ``X = 2^ceil(log2(amax / largest))``, the E8M0 cast of ``amax / largest``
      rounded up: nothing saturates, the largest element may use one binade less.

    Example:
      >>> from cpt_jax.formats import quantize
      >>> quantize(jnp.array([3.0, 0.26, -0.1, 0.0]), 4, MX("e2m1", block_size=4)).tolist()
      [3.0, 0.25, -0.0, 0.0]
      >>> x = jnp.array([500.0, 1.0])      # floor: X = 1, 500 saturates; up: X = 2
      >>> [quantize(x, 8, MX(block_size=2, scale_rounding=r)).tolist() for r in ("floor", "up")]
      [[448.0, 1.0], [512.0, 1.0]]
    """

    element: str = "e4m3"
    block_size: int = 32
    axis: int = -1
    scale_rounding: str = dataclasses.field(default="floor", repr=False)

    def __post_init__(self):
        if self.element not in MX_ELEMENTS:
            raise ValueError(f"MX.element must be one of {MX_ELEMENTS}, got {self.element!r}")
        if not isinstance(self.block_size, (int, np.integer)) or self.block_size < 1:
            raise ValueError(f"MX.block_size must be an int >= 1, got {self.block_size!r}")
        check_axis(self.axis, "MX.axis")
        if self.scale_rounding not in MX_SCALE_ROUNDINGS:
            raise ValueError(f"MX.scale_rounding must be one of {MX_SCALE_ROUNDINGS}, "
                             f"got {self.scale_rounding!r}")
        if self.scale_rounding == "up" and self.element in ("int8", "int"):
            raise ValueError(f"MX.scale_rounding='up' needs a float element, got "
                             f"{self.element!r}")

    def __repr__(self) -> str:
        return repr_without_defaults(self, ("element", "block_size", "axis"))


    def grid(self, x: Array, bits: Array, rounding: str, key: Array | None) -> Array:
        return mx_grid(x, bits, self, rounding, key)

    def check_bits(self, bits: Any) -> None:
        """ValueError for a static width below what it has: MX("int") 2, MX("float") 4."""
        lowest = {"int": 2, "float": 4}.get(self.element)
        if lowest is not None and np.min(np.asarray(bits)) < lowest:
            raise ValueError(f"bits must be >= {lowest} for {self}, got {bits!r}")

    def element_width(self, bits: Array) -> Array:
        """The element's width: its OCP element's, 8 (``"int8"``), ``bits`` (``"int"``),
        4 / 6 / 8 (``"float"``, the widest not above ``bits``)."""
        if self.element in ELEMENTS:
            return jnp.float32(ELEMENTS[self.element].width)
        if self.element == "int8":
            return jnp.float32(8.0)
        if self.element == "float":
            return jnp.where(bits >= 8, 8.0, jnp.where(bits >= 6, 6.0, 4.0))
        return bits

    def bits_per_element(self, bits: Array) -> Array:
        """The element and an E8M0 scale per block: ``+ 8 / block_size``."""
        return self.element_width(bits) + 8.0 / self.block_size

    def traits(self) -> FormatTraits:
        return FormatTraits("mx", "tile", True, self.axis, self.block_size, False, self.element)

    def along(self, c: Contraction) -> MX:
        """Blocks along `Contraction.block_axis` (none: as it is)."""
        axis = c.block_axis
        return self if axis is None else dataclasses.replace(self, axis=int(axis))

    def as_quantizer(self):
        from cpt_jax.formats._composed import IntElement, Quantizer, Scaling, ocp_element

        if self.element == "float":
            raise ValueError(f"as_quantizer: {self!r} picks its element by bits (e2m1 / e2m3 "
                             f"/ e4m3): no one FloatElement")
        if self.scale_rounding != "floor":
            raise ValueError(f"as_quantizer: {self!r}: scale_rounding='up' (ceil(log2(amax / "
                             f"largest))) is not a Scaling.scale_format")
        element = (ocp_element(self.element) if self.element in ELEMENTS
                   else IntElement(True, 8 if self.element == "int8" else None))
        return Quantizer(element, Scaling(scale_axes=(self.axis,), tile=self.block_size,
                                          scale_format="e8m0"))

    def gemm_operand(self, x3: Array, bits, rounding: str, key: Array | None):
        """Codes and E8M0 block scales along axis 2 (`cpt_jax.formats.codes.GemmOperand`)."""
        from cpt_jax.formats.codes import block_operand, e8m0

        elem, shared, _ = mx_parts(x3, bits, self, rounding, key)
        return block_operand(elem, e8m0(shared), x3.shape[1], False, self.element,
                             jnp.float8_e8m0fnu)


@dataclasses.dataclass(frozen=True)
class NVFP4:
    """NVIDIA NVFP4: e2m1 elements, blocks of 16 with an E4M3 scale, an fp32 tensor scale.

    As NVIDIA describes it (NVIDIA Technical Blog, "Introducing NVFP4 for
    Efficient and Accurate Low-Precision Inference", 2025; Transformer Engine's
    NVFP4 recipe): ``s_t = 448 * 6 / amax(x)`` (fp32, per tensor; 1 if amax is 0);
    per block of 16 along `axis` ``s_b = e4m3(amax_b / 6 * s_t)`` (the stored
    E4M3 scale, round to nearest); ``q = e2m1(x / (s_b / s_t)) * s_b / s_t``
    (saturating; a block whose scale rounds to 0 becomes 0). The width is 4;
    ``bits >= 32`` is identity.

    ``block_2d=True`` (the NVFP4 *training* recipe's weights, NVIDIA "Pretraining
    Large Language Models with NVFP4", 2025): blocks of 16 x 16 over `axis` and
    `other_axis` (default: the last axis that is not `axis`), so a weight and its
    transpose are quantized to the same values; a 1-D tensor keeps 1 x 16 blocks.

    Example:
      >>> from cpt_jax.formats import quantize
      >>> quantize(jnp.array([6.0, 1.1, -0.4, 0.0]), 4, NVFP4())
      Array([ 6. ,  1. , -0.5,  0. ], dtype=float32)
      >>> w = jax.random.normal(jax.random.key(0), (32, 48))
      >>> q = quantize(w, 4, NVFP4(axis=0, block_2d=True))
      >>> bool(jnp.all(q.T == quantize(w.T, 4, NVFP4(axis=0, block_2d=True))))
      True
    """

    axis: int = -1
    block_size: int = 16
    block_2d: bool = dataclasses.field(default=False, repr=False)
    other_axis: int | None = dataclasses.field(default=None, repr=False)

    def __post_init__(self):
        check_axis(self.axis, "NVFP4.axis")
        if self.block_size != 16:
            raise ValueError(f"NVFP4.block_size is 16 (NVIDIA's format), got {self.block_size!r}")
        if not isinstance(self.block_2d, (bool, np.bool_)):
            raise ValueError(f"NVFP4.block_2d must be a bool, got {self.block_2d!r}")
        if self.other_axis is not None:
            check_axis(self.other_axis, "NVFP4.other_axis")

    def __repr__(self) -> str:
        return repr_without_defaults(self, ("axis", "block_size"))


    def grid(self, x: Array, bits: Array, rounding: str, key: Array | None) -> Array:
        return nvfp4_grid(x, bits, self, rounding, key)

    def element_width(self, bits: Array) -> Array:
        return jnp.float32(4.0)

    def bits_per_element(self, bits: Array) -> Array:
        """4 and an E4M3 scale per block: ``+ 8 / 16`` (16 x 16: ``+ 8 / 256``); the fp32
        tensor scale is not counted."""
        return jnp.float32(4.0 + 8.0 / (self.block_size ** 2 if self.block_2d
                                        else self.block_size))

    def traits(self) -> FormatTraits:
        return FormatTraits("nvfp4", "two_level", True, self.axis, self.block_size,
                            bool(self.block_2d), "e2m1")

    def along(self, c: Contraction) -> NVFP4:
        """Blocks along `Contraction.block_axis` (none: as it is)."""
        axis = c.block_axis
        return self if axis is None else dataclasses.replace(self, axis=int(axis))

    def as_quantizer(self):
        raise ValueError(f"as_quantizer: {self!r} has two scale levels (an E4M3 scale per "
                         f"16-block under an fp32 tensor scale): not one Scaling")

    def gemm_operand(self, x3: Array, bits, rounding: str, key: Array | None):
        """Codes, E4M3 block scales along axis 2 and ``1 / s_t`` (`GemmOperand`)."""
        from cpt_jax.formats.codes import block_operand

        elem, s_b, s_t, _ = nvfp4_parts(x3, self, rounding, key)
        return block_operand(elem, s_b, x3.shape[1], self.block_2d, "e2m1", jnp.float8_e4m3fn,
                             tensor_scale=1.0 / s_t)


HARDWARE_FORMATS = (OCPFloat, MX, NVFP4, ScaledFloat)
