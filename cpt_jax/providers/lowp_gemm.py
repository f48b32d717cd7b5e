"""Low-precision GEMMs in all three products of a dot: forward, input and weight gradient.

A product ``y = dot_general(x, W)`` (a Dense ``x (M, K) . W (K, N)``, an attention
einsum, any dot the seam intercepts) is three GEMMs in training. Each one quantizes
its own two operands along its own contraction and runs on their codes:

=================  ===========================  =====================================
GEMM               operands                     blocks / rows along
=================  ===========================  =====================================
forward            ``x``, ``W``                 ``K`` (both)
input gradient     ``dx = g W^T``               ``N``: ``g`` and ``W`` (re-quantized)
weight gradient    ``dW = x^T g``               ``M`` (tokens): ``x`` (re-quantized), ``g``
=================  ===========================  =====================================

So the transpose of a 1x32-blocked tensor is blocked again along its new
contraction, as Transformer Engine does (a per-tensor scale is the same either way;
NVFP4's 16x16 weight blocks quantize ``W`` and ``W^T`` to the same values). Every
GEMM is written as ``(B, X, K) x (B, Y, K) -> (B, X, Y)`` (`matrix_view`) and

    Y[b, x, y] = sum_k  c_a[b, x, k] s_a[b, x, k // blk] . c_b[b, y, k] s_b[b, y, k // blk]
                 * r_a[b, x] r_b[b, y] * t_a t_b

with ``c`` the element codes (float8 / float4), ``s`` the block scales (E8M0 for
MX, E4M3 for NVFP4, fp32 for 1x128 / 128x128 FP8), ``r`` row scales (rowwise
FP8) and ``t`` the tensor scales (per-tensor FP8: ``amax / 448``; NVFP4: ``1 /
s_t``), accumulated in fp32:

* no block scales: ``lax.dot_general`` on the float8 codes with
  ``preferred_element_type=float32`` (cuBLASLt FP8 on Hopper), the scales after;
* block scales: ``jax.nn.scaled_matmul`` (jax >= 0.11 implements it on every
  backend: cuDNN's block-scaled GEMM on Blackwell for MXFP8 / NVFP4, a
  dequantizing fallback elsewhere, so CPU tests run the graph a GPU runs); on jax
  0.10 `scaled_matmul_emulation`, the same numbers (jax 0.11's CPU lowering).

XLA's CPU has no float6 and no float4 ``dot``: float6 codes (MXFP6) travel in
float8_e4m3fn (every e2m3 / e3m2 value is one), as do unblocked float4 codes.

``LowpGemm.compute="fake"`` computes the same quantized operands, dequantized, in
a float32 GEMM (`cpt_jax.formats.quantize` along the same axis): on CPU the real
path equals it to float32 rounding, forward and both gradients (tests).

NVFP4 training recipe (NVIDIA, "Pretraining Large Language Models with NVFP4",
2025), each a switch of ``nvfp4_gemm``: 16x16 weight blocks (``NVFP4(block_2d=
True)``), a random Hadamard transform of size 16 with a fixed seed on both
weight-gradient inputs along the tokens (``LowpGemm.hadamard_size``;
``(H x)^T (H g) = x^T g`` since ``H`` is orthogonal), stochastic rounding of the
errors (``TensorQuant(..., "stochastic")``).

Delayed scaling (``LowpGemm(scaling="delayed")``, per-tensor FP8): the weight and
activation of each product are scaled by ``max(amax history) / 448`` (the
current amax while the history is empty), the history kept in the product's
module (``batch_stats``, carried by `cpt_jax.training.TrainState`); errors stay
current-scaled (their amax is only known in backward, and a train state cannot
carry it out of there).

A width ``>= 32`` (the `precision` context's bits, or grad bits for the errors)
keeps the operands it governs in float32 (a traced width: ``lax.cond``). Products
other than ``dot_general`` (convolutions, ragged dots, lookups) are computed by
`cpt_jax.providers.block_formats.BlockFormatProvider` (fake quantization).
"""
from __future__ import annotations

import dataclasses
import functools
import math
import re
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from cpt_jax import formats
from cpt_jax.context import PrecisionState, effective_bits
from cpt_jax.formats import ELEMENTS, MX, NVFP4, AffineInt, OCPFloat, ScaledFloat, SymmetricInt
from cpt_jax.interception import Product
from cpt_jax.ops.scale_history import ScaleHistory, init_history, predicted_range, update_history
from cpt_jax.providers.block_formats import BlockFormatProvider
from cpt_jax.providers.fake_quant import key_for, operand_quant
from cpt_jax.quant_config import LowpGemm, QuantConfig, TensorQuant

Array = jax.Array
BXK = (((2,), (2,)), ((0,), (0,)))
"""``(B, X, K) x (B, Y, K) -> (B, X, Y)``: the dimension numbers of every GEMM here."""
HISTORY_COLLECTION = "batch_stats"


def jax_version() -> tuple[int, int]:
    """``(major, minor)`` of the installed jax.

    Example:
      >>> jax_version() >= (0, 10)
      True
    """
    return tuple(int(v) for v in re.findall(r"\d+", jax.__version__)[:2])


NATIVE_SCALED_MATMUL = jax_version() >= (0, 11)
"""jax >= 0.11 lowers ``jax.nn.scaled_matmul`` on every backend (0.10: CUDA only)."""


# --------------------------------------------------------------------------- layouts

@dataclasses.dataclass(frozen=True)
class GemmLayout:
    """The axes of ``lax.dot_general(lhs, rhs, dims)``: batch, free and contracted,
    contracted axes paired in the order of `dims`."""

    lhs_batch: tuple[int, ...]
    lhs_free: tuple[int, ...]
    lhs_contract: tuple[int, ...]
    rhs_batch: tuple[int, ...]
    rhs_free: tuple[int, ...]
    rhs_contract: tuple[int, ...]


def gemm_layout(dimension_numbers, lhs_ndim: int, rhs_ndim: int) -> GemmLayout:
    """`GemmLayout` of a dot_general.

    Example:
      >>> gemm_layout((((1,), (0,)), ((), ())), 2, 2)
      GemmLayout(lhs_batch=(), lhs_free=(0,), lhs_contract=(1,), rhs_batch=(), rhs_free=(1,), rhs_contract=(0,))
    """
    (lc, rc), (lb, rb) = dimension_numbers
    lf = tuple(d for d in range(lhs_ndim) if d not in lc and d not in lb)
    rf = tuple(d for d in range(rhs_ndim) if d not in rc and d not in rb)
    return GemmLayout(tuple(lb), lf, tuple(lc), tuple(rb), rf, tuple(rc))


def matrix_view(x: Array, batch, rows, cols) -> Array:
    """`x` as ``(B, R, C)``: axes `batch`, then `rows`, then `cols`, each group flattened.

    Example:
      >>> matrix_view(jnp.zeros((2, 3, 5)), (0,), (2,), (1,)).shape
      (2, 5, 3)
    """
    perm = tuple(batch) + tuple(rows) + tuple(cols)
    sizes = [math.prod(x.shape[d] for d in group) for group in (batch, rows, cols)]
    return jnp.transpose(x, perm).reshape(sizes)


def from_matrix_view(m: Array, shape, batch, rows, cols) -> Array:
    """The inverse of `matrix_view`: ``(B, R, C)`` back to an array of `shape`.

    Example:
      >>> x = jnp.arange(30.0).reshape(2, 3, 5)
      >>> bool(jnp.all(from_matrix_view(matrix_view(x, (0,), (2,), (1,)), x.shape, (0,), (2,), (1,)) == x))
      True
    """
    perm = tuple(batch) + tuple(rows) + tuple(cols)
    y = m.reshape([shape[d] for d in perm])
    return jnp.transpose(y, tuple(int(i) for i in np.argsort(perm)))


def along_contraction(tq: TensorQuant | None) -> TensorQuant | None:
    """`tq` for a ``(B, X, K)`` operand: blocks / rows along ``K`` (axis 2), a 2-D
    block's second axis along ``X`` (axis 1); per-tensor formats unchanged.

    Example:
      >>> along_contraction(TensorQuant(MX("e4m3", axis=-2))).fmt
      MX(element='e4m3', block_size=32, axis=2)
    """
    if tq is None:
        return None
    fmt = tq.fmt
    if isinstance(fmt, MX) or (isinstance(fmt, ScaledFloat) and fmt.granularity in ("row", "tile")):
        fmt = dataclasses.replace(fmt, axis=2)
    elif isinstance(fmt, (NVFP4, ScaledFloat)):
        two_d = fmt.block_2d if isinstance(fmt, NVFP4) else fmt.granularity == "block"
        fmt = dataclasses.replace(fmt, axis=2, other_axis=1 if two_d else fmt.other_axis)
    return dataclasses.replace(tq, fmt=fmt)


# --------------------------------------------------------------------------- codes

@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["codes", "block_scale", "row_scale", "tensor_scale"],
                   meta_fields=[])
@dataclasses.dataclass(frozen=True)
class GemmOperand:
    """One ``(B, X, K)`` operand as a low-precision GEMM takes it (a pytree).

    ``q = codes * block_scale[..., k // block] * row_scale * tensor_scale`` (each
    scale optional); `codes` are ``(B, X, Kp)`` element values in their dtype, ``Kp``
    ``K`` padded to a multiple of the block with zeros.
    """

    codes: Array
    block_scale: Array | None = None
    row_scale: Array | None = None
    tensor_scale: Array | None = None

    @property
    def block(self) -> int | None:
        if self.block_scale is None:
            return None
        return self.codes.shape[-1] // self.block_scale.shape[-1]


def _code_dtype(element: str, blocked: bool):
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


def _block_operand(elem: Array, scale: Array, rows: int, two_d: bool, element: str,
                  scale_dtype, tensor_scale=None) -> GemmOperand:
    """`GemmOperand` from block-view elements and their per-block scales."""
    full = jnp.broadcast_to(scale, elem.shape[:-1] + (1,))
    return GemmOperand(_view_rows(elem, rows, two_d).astype(_code_dtype(element, True)),
                       _view_rows(full, rows, two_d).astype(scale_dtype),
                       tensor_scale=tensor_scale)


def _e8m0(shared: Array) -> Array:
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


def operand_codes(x3: Array, tq: TensorQuant, bits, key=None, amax=None) -> GemmOperand:
    """The codes and scales of one ``(B, X, K)`` operand in `tq` (along K, `along_contraction`).

    Equals `formats.quantize(x3, bits, tq.fmt)` (or the delayed grid at `amax`) as
    ``codes * scales``, with the same rounding noise for the same `key`.

    Example:
      >>> x = jnp.array([[[896.0, 1.0]]])
      >>> op = operand_codes(x, TensorQuant(ScaledFloat("e4m3")), 8)
      >>> op.codes.dtype, op.codes.astype(jnp.float32).tolist(), float(op.tensor_scale)
      (dtype(float8_e4m3fn), [[[448.0, 0.5]]], 2.0)
    """
    fmt, rnd, rows = tq.fmt, tq.rounding, x3.shape[1]
    if amax is not None:
        elem, scale = _fp8_with_amax(x3, fmt.element, amax, rnd, key)
        return GemmOperand(elem.astype(_code_dtype(fmt.element, False)), tensor_scale=scale)
    if isinstance(fmt, OCPFloat):
        spec = fmt.spec
        elem = formats.float_elements(x3, float(spec.man_bits), float(spec.emin), spec.largest,
                                      rnd, key)
        return GemmOperand(elem.astype(_code_dtype(fmt.element, False)))
    if isinstance(fmt, MX):
        elem, shared, _ = formats.mx_parts(x3, bits, fmt, rnd, key)
        return _block_operand(elem, _e8m0(shared), rows, False, fmt.element, jnp.float8_e8m0fnu)
    if isinstance(fmt, NVFP4):
        elem, s_b, s_t, _ = formats.nvfp4_parts(x3, fmt, rnd, key)
        return _block_operand(elem, s_b, rows, fmt.block_2d, "e2m1", jnp.float8_e4m3fn,
                             tensor_scale=1.0 / s_t)
    elem, scale, _ = formats.scaled_float_parts(x3, fmt, rnd, key)
    if fmt.granularity == "tensor":
        return GemmOperand(elem.astype(_code_dtype(fmt.element, False)),
                           tensor_scale=scale.reshape(()))
    if fmt.granularity == "row":
        return GemmOperand(elem.astype(_code_dtype(fmt.element, False)), row_scale=scale)
    return _block_operand(elem, scale, rows, fmt.granularity == "block", fmt.element,
                         jnp.float32)


def fake_operand(x3: Array, tq: TensorQuant | None, bits, key=None, amax=None) -> Array:
    """The dequantized operand the fake path multiplies: `formats.quantize` of `x3`
    (the delayed grid at `amax`), float32; `x3` itself when `tq` is None.

    Example:
      >>> x = jnp.array([[[896.0, 1.0]]])
      >>> fake_operand(x, TensorQuant(ScaledFloat("e4m3")), 8).tolist()
      [[[896.0, 1.0]]]
      >>> fake_operand(x, TensorQuant(ScaledFloat("e4m3")), 8, amax=448.0).tolist()  # saturates
      [[[448.0, 1.0]]]
    """
    if tq is None:
        return x3.astype(jnp.float32)
    if amax is not None:
        elem, scale = _fp8_with_amax(x3, tq.fmt.element, amax, tq.rounding, key)
        q = jnp.where(jnp.isfinite(x3), elem * scale, x3)
        return jnp.where(jnp.asarray(bits) >= 32, x3, q).astype(jnp.float32)
    return formats.quantize(x3.astype(jnp.float32), bits, tq.fmt, rounding=tq.rounding, key=key)


# --------------------------------------------------------------------------- GEMMs

@jax.jit
def scaled_matmul_emulation(lhs, rhs, lhs_scales, rhs_scales) -> Array:
    """``jax.nn.scaled_matmul`` as jax >= 0.11 computes it on CPU (for jax 0.10).

    ``Y[b, m, n] = sum_k a[b, m, k] sa[b, m, k // blk_a] b[b, n, k] sb[b, n, k // blk_b]``,
    every factor converted to float32, accumulated in float32.

    Example:
      >>> a = jnp.ones((1, 2, 32), jnp.float8_e4m3fn); s = jnp.full((1, 2, 1), 2.0)
      >>> scaled_matmul_emulation(a, a, s, s)[0].tolist()
      [[128.0, 128.0], [128.0, 128.0]]
    """
    def scaled(x, s):
        b, m, k = x.shape
        kb = s.shape[-1]
        x = x.astype(jnp.float32).reshape(b, m, kb, k // kb)
        return (x * s.astype(jnp.float32)[..., None]).reshape(b, m, k)

    return lax.dot_general(scaled(lhs, lhs_scales), scaled(rhs, rhs_scales), BXK,
                           preferred_element_type=jnp.float32)


def scaled_matmul(lhs, rhs, lhs_scales, rhs_scales) -> Array:
    """Block-scaled ``(B, M, K) x (B, N, K) -> (B, M, N)`` in fp32: ``jax.nn.scaled_matmul``
    where every backend has it (jax >= 0.11), else `scaled_matmul_emulation`.

    Example:
      >>> a = jnp.ones((1, 2, 32), jnp.float8_e4m3fn); s = jnp.full((1, 2, 1), 0.5)
      >>> scaled_matmul(a, a, s, s)[0, 0].tolist()
      [8.0, 8.0]
    """
    if NATIVE_SCALED_MATMUL:
        return jax.nn.scaled_matmul(lhs, rhs, lhs_scales, rhs_scales,
                                    preferred_element_type=jnp.float32)
    return scaled_matmul_emulation(lhs, rhs, lhs_scales, rhs_scales)


def _paired_blocks(a: GemmOperand, b: GemmOperand) -> tuple:
    """``(codes_a, codes_b, scales_a, scales_b)`` for `scaled_matmul`: the same padded K
    and block count on both sides (ones for an operand without block scales; both
    scales float32 when their dtypes differ)."""
    block = a.block or b.block
    kp = max(a.codes.shape[-1], b.codes.shape[-1])
    kp = -(-kp // block) * block

    def side(op: GemmOperand, other: GemmOperand):
        codes = op.codes
        if codes.shape[-1] < kp:
            codes = jnp.pad(codes, ((0, 0), (0, 0), (0, kp - codes.shape[-1])))
        if op.block_scale is not None:
            return codes, op.block_scale
        ones = jnp.ones(codes.shape[:2] + (kp // block,), other.block_scale.dtype)
        return codes, ones

    (ca, sa), (cb, sb) = side(a, b), side(b, a)
    if sa.dtype != sb.dtype:
        sa, sb = sa.astype(jnp.float32), sb.astype(jnp.float32)
    return ca, cb, sa, sb


def scaled_product(a: GemmOperand, b: GemmOperand) -> Array:
    """``(B, X, Y)`` fp32 product of two `GemmOperand`s (module docstring formula).

    Example:
      >>> x = jax.random.normal(jax.random.key(0), (1, 4, 64))
      >>> tq = TensorQuant(MX("e4m3", axis=2))
      >>> y = scaled_product(operand_codes(x, tq, 8), operand_codes(x, tq, 8))
      >>> q = formats.quantize(x, 8, tq.fmt)
      >>> bool(jnp.allclose(y, q @ q.transpose(0, 2, 1), rtol=1e-6))
      True
    """
    if a.block_scale is None and b.block_scale is None:
        y = lax.dot_general(a.codes, b.codes, BXK, preferred_element_type=jnp.float32)
    else:
        y = scaled_matmul(*_paired_blocks(a, b))
    if a.row_scale is not None:
        y = y * a.row_scale
    if b.row_scale is not None:
        y = y * jnp.swapaxes(b.row_scale, 1, 2)
    for t in (a.tensor_scale, b.tensor_scale):
        if t is not None:
            y = y * jnp.reshape(t, ())
    return y


@dataclasses.dataclass(frozen=True)
class Side:
    """One operand of one GEMM: its `TensorQuant` along K (None: float32), width
    (a traced array or a static float), rounding key and delayed amax (or None)."""

    tq: TensorQuant | None
    width: Any
    key: Array | None = None
    amax: Array | None = None


def static_width(width) -> float | None:
    """`width` as a Python float when it is known at trace time, else None.

    Example:
      >>> static_width(8), bool(jax.jit(lambda b: static_width(b) is None)(8.0))
      (8.0, True)
    """
    if width is None or isinstance(width, jax.core.Tracer):
        return None
    value = np.asarray(width)
    return float(value) if value.size == 1 else None


def _dense_gemm(a3: Array, b3: Array, sa: Side, sb: Side) -> Array:
    """The fake path: `fake_operand` of both, a float32 ``(B, X, Y)`` GEMM."""
    qa = fake_operand(a3, sa.tq, sa.width, sa.key, sa.amax)
    qb = fake_operand(b3, sb.tq, sb.width, sb.key, sb.amax)
    return lax.dot_general(qa, qb, BXK, preferred_element_type=jnp.float32)


def _real_gemm(a3: Array, b3: Array, sa: Side, sb: Side) -> Array:
    """The low-precision path: both operands as codes, `scaled_product`; a non-finite
    operand (no code holds Inf / NaN) makes the output NaN."""
    a = operand_codes(a3, sa.tq, sa.width, sa.key, sa.amax)
    b = operand_codes(b3, sb.tq, sb.width, sb.key, sb.amax)
    finite = jnp.isfinite(jnp.sum(a3.astype(jnp.float32))) & jnp.isfinite(
        jnp.sum(b3.astype(jnp.float32)))
    return scaled_product(a, b) + jnp.where(finite, 0.0, jnp.nan)


def gemm(a3: Array, b3: Array, sa: Side, sb: Side, compute: str = "real") -> Array:
    """One ``(B, X, K) x (B, Y, K) -> (B, X, Y)`` GEMM of two `Side`s, fp32 accumulation.

    Low precision when both sides are quantized at widths below 32 and `compute`
    is ``"real"`` (a traced width: ``lax.cond``), else `_dense_gemm` (the fake path:
    `fake_operand` of both, float32).

    Example:
      >>> x = jax.random.normal(jax.random.key(0), (1, 8, 64))
      >>> side = Side(TensorQuant(MX("e4m3", axis=2)), 8.0)
      >>> real, fake = gemm(x, x, side, side), gemm(x, x, side, side, compute="fake")
      >>> bool(jnp.allclose(real, fake, rtol=1e-6)), real.shape
      (True, (1, 8, 8))
    """
    if sa.tq is None or sb.tq is None or compute == "fake":
        return _dense_gemm(a3, b3, sa, sb)
    wa, wb = static_width(sa.width), static_width(sb.width)
    if wa is not None and wb is not None:
        return _real_gemm(a3, b3, sa, sb) if max(wa, wb) < 32 else _dense_gemm(a3, b3, sa, sb)
    low = (jnp.asarray(sa.width) < 32) & (jnp.asarray(sb.width) < 32)
    return lax.cond(low, lambda a, b: _real_gemm(a, b, sa, sb),
                    lambda a, b: _dense_gemm(a, b, sa, sb), a3, b3)


# --------------------------------------------------------------------------- Hadamard

def hadamard_signs(size: int, seed: int) -> np.ndarray:
    """The random signs ``d`` of the transform ``H_d = H diag(d) / sqrt(size)`` (fixed seed).

    Example:
      >>> hadamard_signs(4, 0).tolist()
      [-1.0, 1.0, 1.0, 1.0]
    """
    rng = np.random.default_rng(seed)
    return np.where(rng.random(size) < 0.5, 1.0, -1.0)


def hadamard_matrix(size: int, seed: int) -> np.ndarray:
    """The orthogonal random Hadamard matrix ``H diag(d) / sqrt(size)`` (Sylvester's ``H``).

    Example:
      >>> h = hadamard_matrix(16, 0)
      >>> bool(np.allclose(h @ h.T, np.eye(16)))
      True
    """
    h = np.ones((1, 1))
    while h.shape[0] < size:
        h = np.block([[h, h], [h, -h]])
    return (h * hadamard_signs(size, seed)[None, :] / np.sqrt(size)).astype(np.float32)


def random_hadamard(x3: Array, size: int, seed: int) -> Array:
    """``H_d`` applied to each run of `size` elements along the last axis (zero-padded
    to a multiple of `size`): ``x[..., j] -> sum_i H_d[j, i] x[..., i]`` per block.

    Applied to both operands of a GEMM it leaves their product unchanged (``H_d`` is
    orthogonal) and spreads outliers over a block before quantization.

    Example:
      >>> a = jax.random.normal(jax.random.key(0), (1, 3, 40))
      >>> b = jax.random.normal(jax.random.key(1), (1, 2, 40))
      >>> ha, hb = random_hadamard(a, 16, 0), random_hadamard(b, 16, 0)
      >>> ha.shape, bool(jnp.allclose(ha @ hb.transpose(0, 2, 1), a @ b.transpose(0, 2, 1), atol=1e-4))
      ((1, 3, 48), True)
    """
    b, x, k = x3.shape
    kp = -(-k // size) * size
    v = jnp.pad(x3.astype(jnp.float32), ((0, 0), (0, 0), (0, kp - k))).reshape(b, x, kp // size,
                                                                             size)
    h = jnp.asarray(hadamard_matrix(size, seed))
    return jnp.einsum("bxni,ji->bxnj", v, h, precision=lax.Precision.HIGHEST).reshape(b, x, kp)


# --------------------------------------------------------------------------- the three GEMMs

@dataclasses.dataclass(frozen=True)
class GemmSpec:
    """What `lowp_dot_general` computes (static): the layout, each tensor's format
    along its contraction (None: float32), the recipe, the static widths (None:
    traced) and the output dtype."""

    layout: GemmLayout
    lhs: TensorQuant | None
    rhs: TensorQuant | None
    error: TensorQuant | None
    recipe: LowpGemm
    bits: float | None = None
    grad_bits: float | None = None
    out_dtype: Any = jnp.float32


def _out_shape(layout: GemmLayout, lhs_shape, rhs_shape) -> tuple:
    """``dot_general``'s output shape: batch, lhs free, rhs free."""
    return (tuple(lhs_shape[d] for d in layout.lhs_batch)
            + tuple(lhs_shape[d] for d in layout.lhs_free)
            + tuple(rhs_shape[d] for d in layout.rhs_free))


def _fold(key, salt: int):
    """``fold_in(key, salt)`` (None stays None): a second draw for a re-quantization."""
    return None if key is None else jax.random.fold_in(key, salt)


def _forward_gemm(spec: GemmSpec, lhs, rhs, bits, keys, amaxes) -> Array:
    """``y = x W``: both operands along K."""
    lay = spec.layout
    a3 = matrix_view(lhs, lay.lhs_batch, lay.lhs_free, lay.lhs_contract)
    b3 = matrix_view(rhs, lay.rhs_batch, lay.rhs_free, lay.rhs_contract)
    w = bits if spec.bits is None else spec.bits
    y3 = gemm(a3, b3, Side(spec.lhs, w, keys[0], amaxes[0]), Side(spec.rhs, w, keys[1], amaxes[1]),
              spec.recipe.compute)
    return y3.reshape(_out_shape(lay, lhs.shape, rhs.shape)).astype(spec.out_dtype)


def _error_side(spec: GemmSpec, grad_bits, key) -> Side:
    """The error's `Side`: its format at the grad width (None: float32 errors)."""
    if spec.error is None or (grad_bits is None and spec.grad_bits is None):
        return Side(None, 32.0)
    return Side(spec.error, grad_bits if spec.grad_bits is None else spec.grad_bits, key)


def _input_gradient(spec: GemmSpec, lhs, rhs, g, bits, grad_bits, keys, amaxes) -> Array:
    """``dx = g W^T``: the error and the weight along N (the weight re-quantized)."""
    lay = spec.layout
    g3 = g.reshape(math.prod(g.shape[:len(lay.lhs_batch)]), -1,
                   math.prod(rhs.shape[d] for d in lay.rhs_free))
    w3 = matrix_view(rhs, lay.rhs_batch, lay.rhs_contract, lay.rhs_free)
    w = bits if spec.bits is None else spec.bits
    d3 = gemm(g3, w3, _error_side(spec, grad_bits, keys[2]),
              Side(spec.rhs, w, _fold(keys[1], 1), amaxes[1]), spec.recipe.compute)
    return from_matrix_view(d3, lhs.shape, lay.lhs_batch, lay.lhs_free, lay.lhs_contract)


def _weight_gradient(spec: GemmSpec, lhs, rhs, g, bits, grad_bits, keys, amaxes) -> Array:
    """``dW = x^T g``: the error and the activation along the tokens M (the activation
    re-quantized), after the recipe's random Hadamard transform of both."""
    lay = spec.layout
    g3 = g.reshape(math.prod(g.shape[:len(lay.lhs_batch)]), -1,
                   math.prod(rhs.shape[d] for d in lay.rhs_free))
    gt = jnp.swapaxes(g3, 1, 2)
    x3 = matrix_view(lhs, lay.lhs_batch, lay.lhs_contract, lay.lhs_free)
    err = _error_side(spec, grad_bits, keys[3])
    size = spec.recipe.hadamard_size
    if size and err.tq is not None and spec.lhs is not None:
        gt = random_hadamard(gt, size, spec.recipe.hadamard_seed)
        x3 = random_hadamard(x3, size, spec.recipe.hadamard_seed)
    w = bits if spec.bits is None else spec.bits
    d3 = gemm(gt, x3, err, Side(spec.lhs, w, _fold(keys[0], 1), amaxes[0]), spec.recipe.compute)
    return from_matrix_view(d3, rhs.shape, lay.rhs_batch, lay.rhs_free, lay.rhs_contract)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def lowp_dot_general(spec: GemmSpec, lhs, rhs, bits, grad_bits, keys, amaxes) -> Array:
    """``dot_general(lhs, rhs)`` with its three GEMMs in low precision (module docstring).

    Args:
      spec: the static `GemmSpec` (layout, formats along each contraction, recipe).
      lhs, rhs: the float operands.
      bits: forward width (traced float32 scalar; `spec.bits` if static).
      grad_bits: error width (traced, or None for float32 errors).
      keys: 4 PRNG keys (or None): lhs, rhs, the error for dx, the error for dW.
      amaxes: ``(amax_lhs, amax_rhs)`` of delayed scaling, or ``(None, None)``.

    Returns:
      ``y`` in ``spec.out_dtype``; its VJP runs the input- and weight-gradient GEMMs.

    Example:
      >>> dims = (((1,), (0,)), ((), ()))
      >>> tq = TensorQuant(ScaledFloat("e4m3"))
      >>> spec = GemmSpec(gemm_layout(dims, 2, 2), tq, tq, TensorQuant(ScaledFloat("e5m2")),
      ...                 LowpGemm(), 8.0, 8.0)
      >>> f = lambda x, w: lowp_dot_general(spec, x, w, 8.0, 8.0, (None,) * 4, (None, None)).sum()
      >>> dx, dw = jax.grad(f, (0, 1))(jnp.ones((4, 8)), jnp.ones((8, 3)))
      >>> dx.shape, dw.shape
      ((4, 8), (8, 3))
    """
    return _forward_gemm(spec, lhs, rhs, bits, keys, amaxes)


def _lowp_fwd(spec, lhs, rhs, bits, grad_bits, keys, amaxes):
    y = _forward_gemm(spec, lhs, rhs, bits, keys, amaxes)
    return y, (lhs, rhs, bits, grad_bits, keys, amaxes)


def _lowp_bwd(spec, residuals, g):
    lhs, rhs, bits, grad_bits, keys, amaxes = residuals
    g = g.astype(jnp.float32)
    dx = _input_gradient(spec, lhs, rhs, g, bits, grad_bits, keys, amaxes).astype(lhs.dtype)
    dw = _weight_gradient(spec, lhs, rhs, g, bits, grad_bits, keys, amaxes).astype(rhs.dtype)
    zero = lambda v: None if v is None else jnp.zeros_like(v)
    return (dx, dw, zero(bits), zero(grad_bits), tuple(None for _ in keys),
            tuple(zero(a) for a in amaxes))


lowp_dot_general.defvjp(_lowp_fwd, _lowp_bwd)


# --------------------------------------------------------------------------- provider

def history_amax(history: ScaleHistory, x: Array, margin: float = 0.0) -> tuple:
    """``(amax used, current amax)``: the history's ``max * 2^margin``, or the current
    amax of `x` while the history is empty (the first step scales dynamically).

    Example:
      >>> x = jnp.array([-3.0, 1.0])
      >>> [float(a) for a in history_amax(init_history(4), x)]
      [3.0, 3.0]
      >>> h = update_history(init_history(4), -5.0, 5.0, False)
      >>> [float(a) for a in history_amax(h, x)]
      [5.0, 3.0]
    """
    _, hi = predicted_range(history, SymmetricInt(), method="delayed", margin=margin)
    lo, top = formats.representable_range(2, AffineInt(), lax.stop_gradient(x))
    current = jnp.maximum(-lo, top).reshape(())
    return jnp.where(history.count > 0, hi, current), current


def _history_name(product: Product) -> str:
    """The variable holding a product's amax histories in its module."""
    below = product.local.replace("/", "_")
    return f"{below}_lowp_gemm_history" if below else "lowp_gemm_history"


def product_spec(product: Product, state: PrecisionState, lhs, rhs) -> tuple:
    """``(GemmSpec, bits, grad_bits)`` of a dot product under the context's widths
    (``bits + config.bits_offset``; static copies in the spec when they are known at
    trace time; ``grad_bits`` None for float32 errors).

    Example:
      >>> from cpt_jax.context import PrecisionState
      >>> from cpt_jax.interception import make_product
      >>> from cpt_jax.ops.product_op import dot_general_op
      >>> from cpt_jax.quant_config import get_preset
      >>> p = make_product("d", "dot_general", get_preset("mxfp8_gemm"),
      ...                  dot_general_op((((1,), (0,)), ((), ()))), (4, 64), (64, 8))
      >>> spec, bits, grad_bits = product_spec(p, PrecisionState(8, None), jnp.ones((4, 64)),
      ...                                      jnp.ones((64, 8)))
      >>> spec.lhs.fmt, spec.bits, spec.error, grad_bits
      (MX(element='e4m3', block_size=32, axis=2), 8.0, None, None)
    """
    cfg = product.config
    bits = effective_bits(state.bits, cfg.bits_offset)
    static = None if static_width(state.bits) is None else float(
        np.clip(static_width(state.bits) + cfg.bits_offset, 1.0, 32.0))
    error = cfg.error if state.grad_bits is not None else None
    grad_bits = static_grad = None
    if error is not None:
        grad_bits = effective_bits(state.grad_bits, cfg.grad_bits_offset)
        if static_width(state.grad_bits) is not None:
            static_grad = float(np.clip(static_width(state.grad_bits) + cfg.grad_bits_offset,
                                        1.0, 32.0))
    spec = GemmSpec(gemm_layout(product.op.dimension_numbers, jnp.ndim(lhs), jnp.ndim(rhs)),
                    along_contraction(operand_quant(product, product.lhs)),
                    along_contraction(operand_quant(product, product.rhs)),
                    along_contraction(error), cfg.gemm, static, static_grad,
                    jnp.result_type(lhs, rhs))
    return spec, bits, grad_bits


@dataclasses.dataclass(frozen=True)
class LowpGemmProvider(BlockFormatProvider):
    """Every dot_general product of a `QuantConfig` with ``gemm`` as three
    low-precision GEMMs (`lowp_dot_general`); other products as `BlockFormatProvider`.

    Attributes:
      collection: where delayed scaling keeps each product's amax histories.
    """

    collection: str = HISTORY_COLLECTION

    def applies(self, product: Product) -> bool:
        cfg = product.config
        return (cfg is not None and cfg.gemm is not None and product.op is not None
                and product.op.kind == "dot_general")

    def delayed(self, product: Product) -> bool:
        return (self.applies(product) and product.config.gemm.scaling == "delayed"
                and product.module is not None)

    def prepare(self, product: Product, lhs, rhs) -> None:
        """Create empty amax histories (delayed scaling) where the collection is mutable."""
        module, name = product.module, _history_name(product)
        if (self.delayed(product) and module.is_mutable_collection(self.collection)
                and not module.has_variable(self.collection, name)):
            length = product.config.gemm.history_length
            module.put_variable(self.collection, name,
                                {"lhs": init_history(length), "rhs": init_history(length)})

    def delayed_amaxes(self, product: Product, lhs, rhs) -> tuple:
        """The amaxes delayed scaling uses; pushes the current ones into the history."""
        module, name = product.module, _history_name(product)
        gemm_cfg = product.config.gemm
        if module.has_variable(self.collection, name):
            hist = module.get_variable(self.collection, name)
        else:
            hist = {"lhs": init_history(gemm_cfg.history_length),
                    "rhs": init_history(gemm_cfg.history_length)}
        used_l, cur_l = history_amax(hist["lhs"], lhs, gemm_cfg.margin)
        used_r, cur_r = history_amax(hist["rhs"], rhs, gemm_cfg.margin)
        if module.is_mutable_collection(self.collection):
            new = {"lhs": update_history(hist["lhs"], -cur_l, cur_l, False),
                   "rhs": update_history(hist["rhs"], -cur_r, cur_r, False)}
            # Stored as it was read (a state cast to bf16 keeps its dtypes: no retrace).
            module.put_variable(self.collection, name, jax.tree.map(
                lambda n, o: jnp.asarray(n, jnp.result_type(o)), new, hist))
        return used_l, used_r

    def compute(self, product: Product, lhs: Array, rhs: Array, state: PrecisionState,
                apply: Callable) -> Array:
        """`lowp_dot_general` of the product at the context's widths."""
        if not self.applies(product):
            return super().compute(product, lhs, rhs, state, apply)
        spec, bits, grad_bits = product_spec(product, state, lhs, rhs)
        keys = (key_for(spec.lhs, state, "an operand (lhs)"),
                key_for(spec.rhs, state, "an operand (rhs)"),
                key_for(spec.error, state, "the error"), key_for(spec.error, state, "the error"))
        amaxes = self.delayed_amaxes(product, lhs, rhs) if self.delayed(product) else (None, None)
        return lowp_dot_general(spec, lhs, rhs, bits, grad_bits, keys, amaxes)


LOWP_GEMM = LowpGemmProvider()
"""The provider of `QuantConfig(gemm=LowpGemm(...))` (the ``*_gemm`` presets)."""


def provider_for(config: QuantConfig | None) -> LowpGemmProvider | None:
    """`LOWP_GEMM` for a config with ``gemm``, else None.

    Example:
      >>> from cpt_jax.quant_config import get_preset
      >>> provider_for(get_preset("mxfp8_gemm")) is LOWP_GEMM, provider_for(get_preset("mxfp8"))
      (True, None)
    """
    if config is not None and getattr(config, "gemm", None) is not None:
        return LOWP_GEMM
    return None


__all__ = ["GemmLayout", "GemmOperand", "GemmSpec", "LOWP_GEMM", "LowpGemmProvider",
           "NATIVE_SCALED_MATMUL", "along_contraction", "gemm", "gemm_layout",
           "hadamard_matrix", "hadamard_signs", "lowp_dot_general", "matrix_view",
           "operand_codes", "provider_for", "random_hadamard", "scaled_matmul",
           "scaled_matmul_emulation", "scaled_product"]
