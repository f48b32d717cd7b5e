"""The scaled FP formats: an OCP element as it is, or with fp32 scales (FP8 recipes).

`OCPFloat` is an OCP element type as a saturating cast; `ScaledFloat` is one with an
fp32 scale ``X = amax / max`` per tensor, row, tile or block (Transformer Engine's
current scaling, DeepSeek-V3's fine-grained FP8). Each answers the format protocol
itself (`FormatProtocol`) and gives its codes and scales to a low-precision GEMM
(``gemm_operand``); `scaled_codes` gives the codes of a real FP8 product.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from cpt_jax.formats._blocks import ocp_grid, scaled_float_grid, scaled_float_parts, scaled_groups
from cpt_jax.formats._elements import ELEMENTS, ElementSpec, float_elements, floor_log2, pow2
from cpt_jax.formats._protocol import Contraction, FormatTraits
from cpt_jax.formats._rounding import check_rounding
from cpt_jax.formats._scaling import check_axis, fp_scale, masked_absmax

Array = jax.Array

SCALED_GRANULARITIES = ("tensor", "row", "tile", "block")


@dataclasses.dataclass(frozen=True)
class OCPFloat:
    """An OCP element type as a saturating cast: ``q = dtype(clip(x, -max, max))``.

    Elements (OCP OFP8 spec v1.0 and OCP Microscaling spec v1.0, section 5.3):
    ``"e4m3"`` (float8_e4m3fn, max 448), ``"e5m2"`` (max 57344), ``"e3m2"``
    (float6_e3m2fn, max 28), ``"e2m3"`` (float6_e2m3fn, max 7.5), ``"e2m1"``
    (float4_e2m1fn, max 6). No scale: values are cast as they are, so this is the
    element grid itself; the width is the element's and any ``bits < 32`` gives it
    (``bits >= 32``: identity). Nearest rounding is half to even, as ml_dtypes.

    Example:
      >>> from cpt_jax.formats import quantize
      >>> quantize(jnp.array([1000., 0.3, -17.]), 8, OCPFloat("e4m3")).tolist()
      [448.0, 0.3125, -16.0]
    """

    element: str = "e4m3"

    def __post_init__(self):
        if self.element not in ELEMENTS:
            raise ValueError(f"OCPFloat.element must be one of {tuple(ELEMENTS)}, got {self.element!r}")

    @property
    def spec(self) -> ElementSpec:
        return ELEMENTS[self.element]


    def grid(self, x: Array, bits: Array, rounding: str, key: Array | None) -> Array:
        return ocp_grid(x, bits, self, rounding, key)

    def element_width(self, bits: Array) -> Array:
        return jnp.float32(self.spec.width)

    def bits_per_element(self, bits: Array) -> Array:
        return jnp.float32(self.spec.width)

    def traits(self) -> FormatTraits:
        return FormatTraits("ocp_float", "none", element=self.element)

    def grid_step(self, x: Array, bits: Array) -> Array:
        a = jnp.minimum(jnp.abs(x), self.spec.largest)
        e = jnp.maximum(floor_log2(jnp.where(a > 0, a, 1.0)), float(self.spec.emin))
        return pow2(e - self.spec.man_bits)

    def representable_range(self, bits: Array, x: Array | None) -> tuple[Array, Array]:
        return jnp.float32(-self.spec.largest), jnp.float32(self.spec.largest)

    def as_quantizer(self):
        from cpt_jax.formats._composed import Quantizer, ocp_element

        return Quantizer(ocp_element(self.element))

    def gemm_operand(self, x3: Array, bits, rounding: str, key: Array | None):
        """Its codes as a `cpt_jax.formats.codes.GemmOperand` (no scale)."""
        from cpt_jax.formats.codes import GemmOperand, code_dtype

        elem = ocp_grid(x3, bits, self, rounding, key)
        return GemmOperand(elem.astype(code_dtype(self.element, False)))


@dataclasses.dataclass(frozen=True)
class ScaledFloat:
    """An OCP float element with an fp32 scale ``X = amax / max``: the FP8 training recipes.

    ``q = X * dtype(x / X)`` (saturating), ``X = amax / largest`` over a group
    (``X = 1`` where amax is 0), with `granularity`:

    * ``"tensor"``: one scale (Transformer Engine's per-tensor current scaling);
    * ``"row"``: one scale per slice along `axis` (rowwise: amax over the
      contracted dimension, one scale per row of the operand);
    * ``"tile"``: blocks of ``1 x tile`` along `axis` (DeepSeek-V3's activations);
    * ``"block"``: ``tile x tile`` blocks over `axis` and `other_axis` (default:
      the last axis that is not `axis`; DeepSeek-V3's 128x128 weight blocks).

    Example:
      >>> from cpt_jax.formats import quantize
      >>> q = quantize(jnp.array([1000., 0.3, -17.]), 8, ScaledFloat("e4m3"))
      >>> [round(v, 3) for v in q.tolist()]  # scale 1000/448; 0.3 -> 9/64 * 1000/448
      [1000.0, 0.314, -16.741]
    """

    element: str = "e4m3"
    granularity: str = "tensor"
    axis: int = -1
    tile: int = 128
    other_axis: int | None = None

    def __post_init__(self):
        if self.element not in ELEMENTS:
            raise ValueError(f"ScaledFloat.element must be one of {tuple(ELEMENTS)}, got {self.element!r}")
        if self.granularity not in SCALED_GRANULARITIES:
            raise ValueError(f"ScaledFloat.granularity must be one of {SCALED_GRANULARITIES}, "
                             f"got {self.granularity!r}")
        check_axis(self.axis, "ScaledFloat.axis")
        if self.other_axis is not None:
            check_axis(self.other_axis, "ScaledFloat.other_axis")
        if not isinstance(self.tile, (int, np.integer)) or self.tile < 1:
            raise ValueError(f"ScaledFloat.tile must be an int >= 1, got {self.tile!r}")

    @property
    def spec(self) -> ElementSpec:
        return ELEMENTS[self.element]

    def grid(self, x: Array, bits: Array, rounding: str, key: Array | None) -> Array:
        return scaled_float_grid(x, bits, self, rounding, key)

    def element_width(self, bits: Array) -> Array:
        return jnp.float32(self.spec.width)

    def bits_per_element(self, bits: Array) -> Array:
        """The element and an fp32 scale per ``1 x tile`` (``+ 32 / tile``) or
        ``tile x tile`` block (``+ 32 / tile^2``); per tensor / row: not counted."""
        per = {"tile": self.tile, "block": self.tile ** 2}.get(self.granularity)
        return jnp.float32(self.spec.width + (32.0 / per if per else 0.0))

    def traits(self) -> FormatTraits:
        blocks = self.granularity in ("tile", "block")
        return FormatTraits("scaled_float", self.granularity, True, self.axis,
                            self.tile if blocks else None, self.granularity == "block",
                            self.element)

    def along(self, c: Contraction) -> ScaledFloat:
        """Along `Contraction.block_axis`; a ``"block"``'s second axis along the weight's
        output channel."""
        axis = c.block_axis
        if axis is None:
            return self
        changes: dict[str, Any] = {"axis": int(axis)}
        if self.granularity == "block" and c.channel_axis is not None:
            changes["other_axis"] = int(c.channel_axis)
        return dataclasses.replace(self, **changes)

    def as_quantizer(self):
        from cpt_jax.formats._composed import Quantizer, Scaling, ocp_element

        if self.granularity == "block":
            raise ValueError(f"as_quantizer: {self!r} is not one Scaling: its second block "
                             f"axis depends on the tensor's rank (a 1-D tensor gets 1 x tile); "
                             f"write Scaling(scale_axes=(other, axis), tile=(t, t)) for a "
                             f"known rank")
        axes = None if self.granularity == "tensor" else (self.axis,)
        tile = self.tile if self.granularity == "tile" else None
        return Quantizer(ocp_element(self.element), Scaling(scale_axes=axes, tile=tile))

    def gemm_operand(self, x3: Array, bits, rounding: str, key: Array | None):
        """Codes and fp32 scales per tensor, row, tile or block (`GemmOperand`)."""
        from cpt_jax.formats.codes import GemmOperand, block_operand, code_dtype

        elem, scale, _ = scaled_float_parts(x3, self, rounding, key)
        codes_dtype = code_dtype(self.element, False)
        if self.granularity == "tensor":
            return GemmOperand(elem.astype(codes_dtype), tensor_scale=scale.reshape(()))
        if self.granularity == "row":
            return GemmOperand(elem.astype(codes_dtype), row_scale=scale)
        return block_operand(elem, scale, x3.shape[1], self.granularity == "block",
                             self.element, jnp.float32)


def scaled_codes(x: Array, fmt: ScaledFloat | OCPFloat, *, rounding: str = "nearest",
                 key: Array | None = None) -> tuple[Array, Array]:
    """The element codes and scale of a per-tensor or per-row FP format: ``q = codes * scale``.

    `ScaledFloat` with granularity ``"tensor"`` (scale ``amax / max``, shape
    ``(1,) * ndim``) or ``"row"`` (one scale per slice along ``fmt.axis``,
    broadcastable to `x`), or `OCPFloat` (scale 1). `codes` are the element values
    in the element's own dtype (e.g. ``float8_e4m3fn``), exact; with the scale
    they equal `quantize` on finite inputs up to the rounding of the product.
    Real FP8 products take the codes (`cpt_jax.providers.block_formats`).

    Example:
      >>> codes, scale = scaled_codes(jnp.array([896., 1.0]), ScaledFloat("e4m3"))
      >>> codes.dtype, codes.astype(jnp.float32).tolist(), scale.tolist()
      (dtype(float8_e4m3fn), [448.0, 0.5], [2.0])
    """
    if isinstance(fmt, OCPFloat):
        spec, scale = fmt.spec, jnp.ones((1,) * jnp.ndim(x), jnp.float32)
        xf = jnp.asarray(x, jnp.float32)
    elif isinstance(fmt, ScaledFloat) and fmt.granularity in ("tensor", "row"):
        spec = fmt.spec
        xf = jnp.asarray(x, jnp.float32)
        view, inner, _ = scaled_groups(xf, fmt)
        scale = fp_scale(masked_absmax(view, inner), spec.largest)
    else:
        raise ValueError(f"scaled_codes needs OCPFloat or ScaledFloat('tensor'/'row'), got {fmt!r}")
    check_rounding(rounding, key)
    elem = float_elements(xf / scale, float(spec.man_bits), float(spec.emin), spec.largest,
                          rounding, key)
    return elem.astype(spec.dtype), scale
