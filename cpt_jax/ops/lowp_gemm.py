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
GEMM is written as ``(B, X, K) x (B, Y, K) -> (B, X, Y)`` (`matrix_view`), its
operands as codes plus scales (`cpt_jax.formats.codes.operand_codes`) and their
product accumulated in fp32 (`cpt_jax.ops.scaled_matmul.scaled_product`, its
formula there).

``compute="fake"`` (`gemm`) computes the same quantized operands, dequantized, in
a float32 GEMM (`cpt_jax.formats.codes.fake_operand`): on CPU the real path equals
it to float32 rounding, forward and both gradients.

NVFP4 training recipe (NVIDIA, "Pretraining Large Language Models with NVFP4",
2025): a random Hadamard transform of size ``recipe.hadamard_size`` with a fixed
seed on both weight-gradient inputs along the tokens (``(H x)^T (H g) = x^T g``
since ``H`` is orthogonal, `cpt_jax.ops.scaled_matmul.random_hadamard`).

A width ``>= 32`` keeps the operands it governs in float32 (a traced width:
``lax.cond``). Pure JAX: which format each operand takes is the provider's choice
(`cpt_jax.providers.lowp_gemm`).
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from cpt_jax.formats.codes import OperandQuant, fake_operand, operand_codes
from cpt_jax.ops.scaled_matmul import BXK, random_hadamard, scaled_product
from cpt_jax.ops.varying import vary_like

Array = jax.Array


class GemmRecipe(Protocol):
    """What the three GEMMs read of a recipe (`cpt_jax.quant_config.LowpGemm` is one):
    ``"real"`` or ``"fake"`` compute, and the weight-gradient Hadamard transform's size
    (0: none) and seed."""

    @property
    def compute(self) -> str: ...

    @property
    def hadamard_size(self) -> int: ...

    @property
    def hadamard_seed(self) -> int: ...


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


# --------------------------------------------------------------------------- one GEMM

@dataclasses.dataclass(frozen=True)
class Side:
    """One operand of one GEMM: its quantization along K (a `TensorQuant`; None:
    float32), width (a traced array or a static float), rounding key and delayed
    amax (or None)."""

    tq: OperandQuant | None
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
      >>> from cpt_jax.formats import MX
      >>> from cpt_jax.quant_config import TensorQuant
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


# --------------------------------------------------------------------------- the three GEMMs

@dataclasses.dataclass(frozen=True)
class GemmSpec:
    """What `lowp_dot_general` computes (static): the layout, each tensor's format
    along its contraction (None: float32), the recipe, the static widths (None:
    traced) and the output dtype."""

    layout: GemmLayout
    lhs: OperandQuant | None
    rhs: OperandQuant | None
    error: OperandQuant | None
    recipe: GemmRecipe
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


def lowp_dot_general(spec: GemmSpec, lhs, rhs, bits, grad_bits, keys, amaxes) -> Array:
    """``dot_general(lhs, rhs)`` with its three GEMMs in low precision (module docstring).

    Under ``jax.shard_map`` both operands are first cast to vary over every mesh axis
    any input varies over (`cpt_jax.ops.varying.vary_like`): the weight gradient of a
    replicated weight times a per-device activation is then summed over the devices
    by JAX's transpose of that cast, as for a plain ``dot_general``.

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
      >>> from cpt_jax.formats import ScaledFloat
      >>> from cpt_jax.quant_config import LowpGemm, TensorQuant
      >>> dims = (((1,), (0,)), ((), ()))
      >>> tq = TensorQuant(ScaledFloat("e4m3"))
      >>> spec = GemmSpec(gemm_layout(dims, 2, 2), tq, tq, TensorQuant(ScaledFloat("e5m2")),
      ...                 LowpGemm(), 8.0, 8.0)
      >>> f = lambda x, w: lowp_dot_general(spec, x, w, 8.0, 8.0, (None,) * 4, (None, None)).sum()
      >>> dx, dw = jax.grad(f, (0, 1))(jnp.ones((4, 8)), jnp.ones((8, 3)))
      >>> dx.shape, dw.shape
      ((4, 8), (8, 3))
    """
    lhs, rhs = vary_like((lhs, rhs), bits, grad_bits, keys, amaxes)
    return _lowp_dot_general(spec, lhs, rhs, bits, grad_bits, keys, amaxes)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _lowp_dot_general(spec: GemmSpec, lhs, rhs, bits, grad_bits, keys, amaxes) -> Array:
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


_lowp_dot_general.defvjp(_lowp_fwd, _lowp_bwd)


__all__ = ["GemmLayout", "GemmRecipe", "GemmSpec", "Side", "from_matrix_view", "gemm",
           "gemm_layout", "lowp_dot_general", "matrix_view", "static_width"]
