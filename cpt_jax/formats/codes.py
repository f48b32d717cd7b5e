"""Codes plus scales: the integer formats' `IntCodes`, and a GEMM operand's `GemmOperand`.

`IntCodes` (`encode`, `IntCodes.decode`) holds a tensor of `AffineInt` /
`SymmetricInt` as integer codes and its scales, at every scaling of the formats (per
tensor, channel, ``scale_axes`` group, tile):

    affine:     c = clip(round((f x - lo_f) / s), 0, 2^b - 1),  q = min(c s + lo_f, cap) / f
    symmetric:  c = clip(round(f x / s_f), -L, L),               q = c s

(``f = 1``, ``cap = +inf`` unless a range is >= 2^64 steps; ``L = 2^(b-1) - 1``).
Fake quantization is its decode (`cpt_jax.formats.quantize` runs ``encode(...).decode()``
for both formats, bit for bit), the export stores its codes
(`cpt_jax.ops.grids.kernel_codes`) and `IntCodes.bits_per_element` counts its scale bits
as `cpt_jax.formats.bits_per_element` does.

    >>> c = encode(jnp.array([-1.0, 0.2, 0.7]), 2, formats.SymmetricInt())
    >>> c.codes.tolist(), c.scale.tolist(), c.decode().tolist()
    ([-1.0, 0.0, 1.0], [1.0], [-1.0, 0.0, 1.0])

`GemmOperand` is the codes-plus-scales representation of a float-coded operand, as
a low-precision GEMM takes it: element codes in their own dtype, optional per-block, per-row and per-tensor scales,
and the block geometry read from their shapes. Its value is

    q[b, x, k] = c[b, x, k] * s[b, x, k // blk] * r[b, x] * t

(`GemmOperand.decode`), with ``c`` the element codes (float8 / float4; float6 and
unblocked float4 travel in float8_e4m3fn, every e2m3 / e3m2 / e2m1 value being one),
``s`` the block scales (E8M0 for MX, E4M3 for NVFP4, fp32 for 1x128 / 128x128 FP8),
``r`` the row scales (rowwise FP8) and ``t`` the tensor scale (per-tensor FP8:
``amax / 448``; NVFP4: ``1 / s_t``).

`operand_codes` builds one from a float operand (blocks / rows along ``K``, axis 2);
`fake_operand` is the same quantization dequantized (`cpt_jax.formats.quantize`),
what a fake-quant GEMM multiplies. The GEMMs on these operands are
`cpt_jax.ops.scaled_matmul` and `cpt_jax.ops.lowp_gemm`.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Protocol

import jax
import jax.numpy as jnp
from jax import lax

from cpt_jax import formats
from cpt_jax.formats import ELEMENTS, Format, IntCodes, encode

Array = jax.Array


class OperandQuant(Protocol):
    """How one operand is quantized: a format and a rounding mode
    (`cpt_jax.quant_config.TensorQuant` is one)."""

    @property
    def fmt(self) -> Format: ...

    @property
    def rounding(self) -> str: ...


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["codes", "block_scale", "row_scale", "tensor_scale"],
                   meta_fields=[])
@dataclasses.dataclass(frozen=True)
class GemmOperand:
    """One quantized ``(B, X, K)`` operand as codes plus scales (a pytree).

    The one codes-plus-scales representation of the low-precision GEMMs:
    ``q = codes * block_scale[..., k // block] * row_scale * tensor_scale`` (each
    scale optional, `decode`).

    Attributes:
      codes: ``(B, X, Kp)`` element values in their dtype (float8 / float4), ``Kp``
        ``K`` padded with zeros to a multiple of the block.
      block_scale: ``(B, X, Kp // block)`` per-block scales (E8M0, E4M3 or fp32), or None.
      row_scale: ``(B, X, 1)`` fp32 per-row scales, or None.
      tensor_scale: a scalar fp32 scale, or None.

    Example:
      >>> op = GemmOperand(jnp.ones((1, 2, 4), jnp.float8_e4m3fn),
      ...                  block_scale=jnp.array([[[2.0, 4.0], [1.0, 0.5]]]), tensor_scale=3.0)
      >>> op.block, op.decode().tolist()
      (2, [[[6.0, 6.0, 12.0, 12.0], [3.0, 3.0, 1.5, 1.5]]])
    """

    codes: Array
    block_scale: Array | None = None
    row_scale: Array | None = None
    tensor_scale: Array | None = None

    @property
    def block(self) -> int | None:
        """Elements per block along K (None: no block scales)."""
        if self.block_scale is None:
            return None
        return self.codes.shape[-1] // self.block_scale.shape[-1]

    def decode(self, size: int | None = None) -> Array:
        """The operand's values in float32: ``codes * block_scale[..., k // block] *
        row_scale * tensor_scale``, ``(B, X, Kp)`` (the first `size` along K if given).

        Example:
          >>> GemmOperand(jnp.full((1, 1, 3), 2.0, jnp.float8_e4m3fn), tensor_scale=0.25).decode(2)
          Array([[[0.5, 0.5]]], dtype=float32)
        """
        q = self.codes.astype(jnp.float32)
        if self.block_scale is not None:
            b, x, kp = q.shape
            blocks = q.reshape(b, x, self.block_scale.shape[-1], -1)
            q = (blocks * self.block_scale.astype(jnp.float32)[..., None]).reshape(b, x, kp)
        if self.row_scale is not None:
            q = q * self.row_scale
        if self.tensor_scale is not None:
            q = q * jnp.reshape(self.tensor_scale, ())
        return q if size is None else q[..., :size]


def code_dtype(element: str, blocked: bool):
    """The dtype the codes of `element` travel in: float8 as themselves, e2m1 as
    float4_e2m1fn in a block-scaled GEMM, float6 (and unblocked e2m1) in float8_e4m3fn."""
    if element in ("e4m3", "e5m2"):
        return ELEMENTS[element].dtype
    if element == "e2m1" and blocked:
        return jnp.dtype(jnp.float4_e2m1fn)
    return jnp.dtype(jnp.float8_e4m3fn)


def _view_rows(v: Array, rows: int, two_d: bool) -> Array:
    """A `formats.block_view` of a ``(B, X, K)`` array (blocks along K, or 2-D over
    X and K) as ``(B, X, Kp)``; a scale view (size-1 block dims) gives ``(B, X, Kb)``."""
    if two_d:
        b, xb, t, kb, s = v.shape
        return v.reshape(b, xb * t, kb * s)[:, :rows]
    b, x, kb, s = v.shape
    return v.reshape(b, x, kb * s)


def block_operand(elem: Array, scale: Array, rows: int, two_d: bool, element: str,
                  scale_dtype, tensor_scale=None) -> GemmOperand:
    """`GemmOperand` from block-view elements and their per-block scales."""
    full = jnp.broadcast_to(scale, elem.shape[:-1] + (1,))
    return GemmOperand(_view_rows(elem, rows, two_d).astype(code_dtype(element, True)),
                       _view_rows(full, rows, two_d).astype(scale_dtype),
                       tensor_scale=tensor_scale)


def e8m0(shared: Array) -> Array:
    """E8M0 scales ``2^shared`` (``shared`` integer-valued in [-127, 127]), bit exact."""
    codes = (jnp.clip(shared, -127.0, 127.0) + 127.0).astype(jnp.uint8)
    return lax.bitcast_convert_type(codes, jnp.float8_e8m0fnu)


def _fp8_with_amax(x3: Array, element: str, amax, rounding: str = "nearest", key=None):
    """``(elements, scale)`` of a per-tensor scaled float at a given amax (delayed
    scaling): ``s = max(amax / largest, 2^-126)``, ``e = cast(x / s)`` (saturating)."""
    spec = ELEMENTS[element]
    scale = formats.fp_scale(jnp.asarray(amax, jnp.float32), spec.largest)
    elem = formats.float_elements(x3 / scale, float(spec.man_bits), float(spec.emin),
                                  spec.largest, rounding, key)
    return elem, scale


def operand_codes(x3: Array, tq: OperandQuant, bits, key=None, amax=None) -> GemmOperand:
    """The codes and scales of one ``(B, X, K)`` operand in `tq` (blocks / rows along K).

    Equals `formats.quantize(x3, bits, tq.fmt)` (or the delayed grid at `amax`) as
    ``codes * scales`` (`GemmOperand.decode`), with the same rounding noise for the
    same `key`.

    Args:
      x3: the float ``(B, X, K)`` operand.
      tq: its format and rounding (`cpt_jax.quant_config.TensorQuant`), blocks / rows
        along axis 2.
      bits: the width (read by formats with a width).
      key: PRNG key of stochastic rounding, or None.
      amax: the amax of delayed per-tensor scaling, or None (current scaling).

    Returns:
      The `GemmOperand`.

    Example:
      >>> from cpt_jax.formats import ScaledFloat
      >>> from cpt_jax.quant_config import TensorQuant
      >>> x = jnp.array([[[896.0, 1.0]]])
      >>> op = operand_codes(x, TensorQuant(ScaledFloat("e4m3")), 8)
      >>> op.codes.dtype, op.codes.astype(jnp.float32).tolist(), float(op.tensor_scale)
      (dtype(float8_e4m3fn), [[[448.0, 0.5]]], 2.0)
    """
    fmt: Any = tq.fmt  # the delayed path reads an FP8 element; the rest asks the format
    rnd = tq.rounding
    if amax is not None:
        elem, scale = _fp8_with_amax(x3, fmt.element, amax, rnd, key)
        return GemmOperand(elem.astype(code_dtype(fmt.element, False)), tensor_scale=scale)
    method = getattr(fmt, "gemm_operand", None)
    if method is None:
        raise ValueError(f"operand_codes: {fmt!r} has no codes a low-precision GEMM takes "
                         f"(OCPFloat, ScaledFloat, MX with a float element or NVFP4)")
    return method(x3, bits, rnd, key)


def fake_operand(x3: Array, tq: OperandQuant | None, bits, key=None, amax=None) -> Array:
    """The dequantized operand a fake-quant GEMM multiplies: `formats.quantize` of `x3`
    (the delayed grid at `amax`), float32; `x3` itself when `tq` is None.

    Delayed: ``q = cast(x / s) * s`` with ``s = max(amax / largest, 2^-126)``
    (non-finite ``x`` kept, `x3` itself at ``bits >= 32``).

    Example:
      >>> from cpt_jax.formats import ScaledFloat
      >>> from cpt_jax.quant_config import TensorQuant
      >>> x = jnp.array([[[896.0, 1.0]]])
      >>> fake_operand(x, TensorQuant(ScaledFloat("e4m3")), 8).tolist()
      [[[896.0, 1.0]]]
      >>> fake_operand(x, TensorQuant(ScaledFloat("e4m3")), 8, amax=448.0).tolist()  # saturates
      [[[448.0, 1.0]]]
    """
    if tq is None:
        return x3.astype(jnp.float32)
    if amax is not None:
        element: Any = getattr(tq.fmt, "element", None)
        elem, scale = _fp8_with_amax(x3, element, amax, tq.rounding, key)
        q = jnp.where(jnp.isfinite(x3), elem * scale, x3)
        return jnp.where(jnp.asarray(bits) >= 32, x3, q).astype(jnp.float32)
    return formats.quantize(x3.astype(jnp.float32), bits, tq.fmt, rounding=tq.rounding, key=key)


__all__ = ["GemmOperand", "IntCodes", "OperandQuant", "block_operand", "code_dtype", "e8m0",
           "encode", "fake_operand", "operand_codes"]
