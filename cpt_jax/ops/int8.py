"""Real int8 products: ``y = s_x s_w (int8(x/s_x) . int8(W/s_w))`` with int32 accumulation.

The codes are `SymmetricInt`'s at a traced width ``bits <= 8`` (the levels change,
the int8 container does not), computed once from the operands; the activation has
one scale (or, in a ``dot_general``, one per token: ``y[t, c] = s_x[t] s_w[c]
acc[t, c]``, the scales factor out of the sum), the weight one per output channel;
or both one per tile of the contraction (`tiled_int8_dot`: an int32 partial sum per
tile, rescaled, then summed). Backward: straight-through (the float
products of the dequantized operands, rebuilt from the int8 codes, 4x smaller
residuals than float operands).
(`cpt_jax.providers.int8` computes a model's products with them.)
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from cpt_jax import formats
from cpt_jax.formats import SymmetricInt
from cpt_jax.ops.product_op import ProductOp, conv_op, dot_general_op
from cpt_jax.ops.varying import vary_like

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class Int8Spec:
    """A product on int8 codes: the op, the weight's channel axis, where it lands."""

    op: ProductOp
    rhs_channel_axis: int
    out_channel_axis: int
    lhs_scale_axes: tuple[int, ...] | None = None  # per token: the contracted axes
    tile: int | None = None  # one scale per `tile` contracted elements, both operands


def operand_formats(spec: Int8Spec) -> tuple[SymmetricInt, SymmetricInt]:
    """The `SymmetricInt` of the activation and of the weight of an int8 product."""
    if spec.tile is not None:
        (lc, rc), _ = spec.op.dimension_numbers
        return (SymmetricInt(scale_axes=tuple(lc), tile=spec.tile),
                SymmetricInt(scale_axes=tuple(rc), tile=spec.tile))
    return (SymmetricInt(scale_axes=spec.lhs_scale_axes),
            SymmetricInt(channel_axis=spec.rhs_channel_axis))


def _codes(lhs, rhs, bits, spec: Int8Spec, keys):
    """Symmetric codes (int8) and scales of both operands, computed once from them."""
    lkey, rkey = keys
    lfmt, rfmt = operand_formats(spec)
    lc, ls = formats.symmetric_codes(lhs, bits, lfmt,
                                     rounding="nearest" if lkey is None else "stochastic",
                                     key=lkey)
    rc, rs = formats.symmetric_codes(rhs, bits, rfmt,
                                     rounding="nearest" if rkey is None else "stochastic",
                                     key=rkey)
    return lc.astype(jnp.int8), ls, rc.astype(jnp.int8), rs


def _split_tiles(codes: Array, scale: Array, axis: int, tile: int) -> tuple[Array, Array]:
    """`axis` split into ``(blocks, tile)`` (codes zero-padded, they add nothing), and
    one scale per block (the tile's first element's: all of a tile's are equal)."""
    blocks = -(-codes.shape[axis] // tile)
    pad = [(0, 0)] * codes.ndim
    pad[axis] = (0, blocks * tile - codes.shape[axis])
    shape = codes.shape[:axis] + (blocks, tile) + codes.shape[axis + 1:]
    codes = jnp.pad(codes, pad).reshape(shape)
    scale = jnp.pad(scale, pad, mode="edge").reshape(shape)  # a tiled scale: x's shape
    return codes, jnp.take(scale, 0, axis=axis + 1)


def tiled_int8_dot(lc, ls, rc, rs, dimension_numbers, tile: int) -> Array:
    """``y = sum_b s_x[.., b] s_w[b, ..] (int8 codes of block b . each other)``: one int32
    partial sum per block of `tile` contracted elements, rescaled by both blocks'
    scales, then summed (one contracted axis per operand).

    Example:
      >>> lc, rc = jnp.ones((2, 5), jnp.int8), jnp.ones((5, 3), jnp.int8)
      >>> ls, rs = jnp.full((2, 5), 0.5), jnp.full((5, 3), 2.0)
      >>> tiled_int8_dot(lc, ls, rc, rs, (((1,), (0,)), ((), ())), 2)[0, 0].item()
      5.0
    """
    (lcon, rcon), (lb, rb) = dimension_numbers
    (kl,), (kr,) = lcon, rcon
    lc2, lsb = _split_tiles(lc, ls, kl, tile)
    rc2, rsb = _split_tiles(rc, rs, kr, tile)

    def after(d, k):  # an axis' index once axis k became (blocks, tile)
        return d + 1 if d > k else d

    batch = ((*(after(d, kl) for d in lb), kl), (*(after(d, kr) for d in rb), kr))
    acc = lax.dot_general(lc2, rc2, (((kl + 1,), (kr + 1,)), batch),
                          preferred_element_type=jnp.int32).astype(jnp.float32)
    lfree = [d for d in range(lc.ndim) if d not in lcon and d not in lb]
    rfree = [d for d in range(rc.ndim) if d not in rcon and d not in rb]
    l_out = jnp.transpose(lsb, [*lb, kl, *lfree])
    l_out = l_out.reshape(l_out.shape + (1,) * len(rfree))
    r_out = jnp.transpose(rsb, [*rb, kr, *rfree])
    n = len(rb) + 1
    r_out = r_out.reshape(r_out.shape[:n] + (1,) * len(lfree) + r_out.shape[n:])
    return jnp.sum(acc * (l_out * r_out), axis=len(lb))


def accumulate_codes(lc, rc, op: ProductOp):
    """``op(lc, rc)`` of int8 codes accumulated in int32, as float32.

    XLA's CPU backend has a fast int8 dot but no fast int8 convolution (a naive loop,
    measured 40x slower than the float one on ResNet-20), so on CPU a convolution
    runs on the same integer codes held in float32: every product and partial sum
    is an integer below 2^24 while ``K * 127^2 < 2^24`` (``K`` = kh kw C_in, up to
    1040), so the result is the int32 one exactly there.
    """
    def int8(lc, rc):
        return op.apply(lc, rc, preferred_element_type=jnp.int32).astype(jnp.float32)

    if op.kind != "conv":
        return int8(lc, rc)

    def codes_in_float(lc, rc):
        return op.apply(lc.astype(jnp.float32), rc.astype(jnp.float32))

    return lax.platform_dependent(lc, rc, cpu=codes_in_float, default=int8)


def token_scales_in_output(ls: Array, dimension_numbers, out_ndim: int) -> Array:
    """A per-token activation scale (keepdims over the contracted axes) laid out as
    the ``dot_general`` output: ``(batch..., lhs free..., 1 per rhs free axis)``.

    Example:
      >>> ls = jnp.ones((2, 3, 1))          # (B, T, K) activation, one scale per token
      >>> token_scales_in_output(ls, (((2,), (0,)), ((), ())), 3).shape
      (2, 3, 1)
    """
    (contract, _), (batch, _) = dimension_numbers
    kept = [d for d in range(ls.ndim) if d not in contract]
    free = [d for d in kept if d not in batch]
    order = [kept.index(d) for d in batch] + [kept.index(d) for d in free]
    s = jnp.transpose(ls.reshape([ls.shape[d] for d in kept]), order)
    return s.reshape(s.shape + (1,) * (out_ndim - s.ndim))


def _product_fwd(lhs, rhs, bits, keys, spec: Int8Spec):
    lc, ls, rc, rs = _codes(lhs, rhs, bits, spec, keys)
    if spec.tile is not None:
        y = tiled_int8_dot(lc, ls, rc, rs, spec.op.dimension_numbers, spec.tile)
        return _finish(y, lhs, rhs, (lc, ls, rc, rs))
    acc = accumulate_codes(lc, rc, spec.op)
    # One scale per output channel: s_x * s_w[c], broadcast along the output channel
    # (s_x one per tensor, or one per token laid out as the output's rows).
    shape = [1] * acc.ndim
    shape[spec.out_channel_axis] = -1
    lhs_scale = ls.reshape(()) if spec.lhs_scale_axes is None else token_scales_in_output(
        ls, spec.op.dimension_numbers, acc.ndim)
    y = acc * (lhs_scale * rs.reshape(shape))
    return _finish(y, lhs, rhs, (lc, ls, rc, rs))


def _finish(y, lhs, rhs, codes):
    # NaN/Inf in the activation have no int8 code: keep them visible in the output
    # (as the fake-quant path does) so non-finite steps are still detected.
    y = y + jnp.where(jnp.isfinite(jnp.sum(lhs.astype(jnp.float32))), 0.0, jnp.nan)
    # Zero-size arrays carry the operand dtypes to the backward pass.
    dtypes = (jnp.zeros((0,), lhs.dtype), jnp.zeros((0,), rhs.dtype))
    return y.astype(lhs.dtype), (*codes, dtypes)


def int8_product(lhs, rhs, bits, keys, spec: Int8Spec):
    """``s_x s_w[o] op(int8 codes)`` (see the module docstring); straight-through VJP.

    Under ``jax.shard_map`` both operands first vary over every mesh axis any input
    varies over (`cpt_jax.ops.varying.vary_like`), so a replicated operand's cotangent
    is summed over the devices.
    """
    lhs, rhs = vary_like((lhs, rhs), bits, keys)
    return _int8_product(lhs, rhs, bits, keys, spec)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _int8_product(lhs, rhs, bits, keys, spec: Int8Spec):
    return _product_fwd(lhs, rhs, bits, keys, spec)[0]


def _product_bwd(spec: Int8Spec, residuals, g):
    lc, ls, rc, rs, (ldt, rdt) = residuals
    # Straight-through: the products of the dequantized operands (codes * scale).
    lhs_q = (lc.astype(jnp.float32) * ls).astype(ldt.dtype)
    rhs_q = (rc.astype(jnp.float32) * rs).astype(rdt.dtype)
    _, vjp = jax.vjp(lambda a, b: spec.op.apply(a, b), lhs_q, rhs_q)
    da, db = vjp(g.astype(ldt.dtype))
    return da, db, None, None


_int8_product.defvjp(_product_fwd, _product_bwd)


def int8_dot_general(lhs, rhs, dimension_numbers, bits, *, keys=(None, None)) -> Array:
    """``y = s_x s_w (int8(x/s_x) @ int8(W/s_w))`` accumulated in int32.

    The activation `lhs` has one scale, the weight `rhs` one per output channel
    (its last non-contracting dim). Equal to the product of the fake-quantized
    operands up to the float rounding of the rescale.

    Args:
      lhs, rhs: activation and weight.
      dimension_numbers: as `lax.dot_general`'s.
      bits: width <= 8 (may be traced).
      keys: PRNG keys for stochastic rounding of (lhs, rhs), or None (nearest).

    Returns:
      The rescaled product, in `lhs`'s dtype.

    Example:
      >>> x, w = jnp.ones((2, 3)), jnp.ones((3, 4))
      >>> int8_dot_general(x, w, (((1,), (0,)), ((), ())), 8).shape
      (2, 4)
    """
    op = dot_general_op(dimension_numbers)
    (_, rc), (_, rb) = op.dimension_numbers
    r_keep = [d for d in range(rhs.ndim) if d not in rc and d not in rb]
    if not r_keep:
        raise ValueError("int8_dot_general needs a weight (rhs) with an output dimension")
    spec = Int8Spec(op, r_keep[-1], -1)
    return int8_product(lhs, rhs, jnp.asarray(bits, jnp.float32), keys, spec)


def int8_conv(lhs, rhs, window_strides, padding, lhs_dilation=None, rhs_dilation=None,
              dimension_numbers=None, feature_group_count=1, batch_group_count=1, *,
              bits, keys=(None, None)) -> Array:
    """`lax.conv_general_dilated` on int8 codes with int32 accumulation, rescaled.

    ``y = s_x s_w[o] conv(int8(x/s_x), int8(W/s_w))``: one activation scale, one
    kernel scale per output feature `o` (``SymmetricInt`` codes at `bits` <= 8).
    Backward: straight-through, as `int8_dot_general`. On CPU, where XLA has no
    fast int8 convolution, the same codes are convolved in float32 (exact while
    ``kh kw C_in * 127^2 < 2^24``); GPU/TPU run the int8 convolution.

    Example:
      >>> x, w = jnp.ones((1, 8, 8, 3)), jnp.ones((3, 3, 3, 4))
      >>> int8_conv(x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"),
      ...           bits=8).shape
      (1, 8, 8, 4)
    """
    op = conv_op(lhs.shape, rhs.shape, window_strides, padding, lhs_dilation, rhs_dilation,
                 dimension_numbers, feature_group_count, batch_group_count)
    dn = op.dimension_numbers
    spec = Int8Spec(op, dn.rhs_spec[0], dn.out_spec[1])
    return int8_product(lhs, rhs, jnp.asarray(bits, jnp.float32), keys, spec)
