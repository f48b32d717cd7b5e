"""The block-scaled product of two `GemmOperand`s, and the random Hadamard transform.

Every GEMM here is ``(B, X, K) x (B, Y, K) -> (B, X, Y)`` (dimension numbers `BXK`)
on two operands as codes plus scales (`cpt_jax.formats.codes.GemmOperand`):

    Y[b, x, y] = sum_k  c_a[b, x, k] s_a[b, x, k // blk] . c_b[b, y, k] s_b[b, y, k // blk]
                 * r_a[b, x] r_b[b, y] * t_a t_b

accumulated in fp32 (`scaled_product`):

* no block scales: ``lax.dot_general`` on the float8 codes with
  ``preferred_element_type=float32`` (cuBLASLt FP8 on Hopper), the scales after;
* block scales: ``jax.nn.scaled_matmul`` (jax >= 0.11 implements it on every
  backend: cuDNN's block-scaled GEMM on Blackwell for MXFP8 / NVFP4, a
  dequantizing fallback elsewhere, so CPU tests run the graph a GPU runs); on jax
  0.10 `scaled_matmul_emulation`, the same numbers (jax 0.11's CPU lowering).

`random_hadamard` is the NVFP4 recipe's transform of both weight-gradient inputs:
``H_d = H diag(d) / sqrt(size)`` per run of `size` elements, orthogonal, so
``(H_d a) . (H_d b) = a . b``.
"""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from cpt_jax.formats.codes import GemmOperand

Array = jax.Array
BXK = (((2,), (2,)), ((0,), (0,)))
"""``(B, X, K) x (B, Y, K) -> (B, X, Y)``: the dimension numbers of every GEMM here."""


def jax_version() -> tuple[int, int]:
    """``(major, minor)`` of the installed jax.

    Example:
      >>> jax_version() >= (0, 10)
      True
    """
    return tuple(int(v) for v in re.findall(r"\d+", jax.__version__)[:2])


NATIVE_SCALED_MATMUL = jax_version() >= (0, 11)
"""jax >= 0.11 lowers ``jax.nn.scaled_matmul`` on every backend (0.10: CUDA only)."""


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
      >>> from cpt_jax.formats import MX, quantize
      >>> from cpt_jax.formats.codes import operand_codes
      >>> from cpt_jax.quant_config import TensorQuant
      >>> x = jax.random.normal(jax.random.key(0), (1, 4, 64))
      >>> tq = TensorQuant(MX("e4m3", axis=2))
      >>> y = scaled_product(operand_codes(x, tq, 8), operand_codes(x, tq, 8))
      >>> q = quantize(x, 8, tq.fmt)
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


__all__ = ["BXK", "NATIVE_SCALED_MATMUL", "hadamard_matrix", "hadamard_signs", "jax_version",
           "random_hadamard", "scaled_matmul", "scaled_matmul_emulation", "scaled_product"]
