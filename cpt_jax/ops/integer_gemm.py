"""Integer arithmetic in all three GEMMs of a dot: int8 codes, int32 accumulation.

A product ``y = dot_general(x, W)`` is three GEMMs in training: the forward ``y = x W``,
the input gradient ``dx = g W^T`` and the weight gradient ``dW = x^T g``. At widths
``b <= 8`` every operand of an `AffineInt` / `SymmetricInt` grid is an integer code
``c`` with a step ``s`` and an origin ``o``: ``v = s c + o`` (symmetric: ``o = 0``;
affine codes ``0 .. 2^b - 1`` are shifted by ``2^(b-1)`` to signed codes, so every
code fits int8 whatever the traced width: the grid changes, the container does not).
With both operands' steps and origins constant along the contraction ``k``
(gemmlowp's zero-point correction):

    sum_k (s_A c_A + o_A)(s_B c_B + o_B)
        = s_A s_B acc + s_A o_B R_A + o_A s_B R_B + K o_A o_B

``acc = sum_k c_A c_B`` is int8 x int8 accumulated in int32 (exact), ``R_A = sum_k c_A``
and ``R_B = sum_k c_B`` are the codes' row sums. The forward and the weight gradient
use the codes fake quantization uses (`cpt_jax.formats.encode` of the same tensors,
widths and keys), so they equal fake quantization up to float32 summation rounding.

**Scales along the contraction** (a weight's per-output-channel step is on the
contracted axis of ``dx = g W^T``; a per-token activation step on the contracted
tokens of ``dW = x^T g``) cannot leave the sum. They are folded into the error before
its rounding (the scheme of AQT's backward, "the transposed scale"):

    dx[m, k] = sum_n g[m, n] (s_W[n] c_W[k, n] + o_W[n])
             ~ sum_n Q(g s_W)[m, n] c_W[k, n] + sum_n g[m, n] o_W[n]

``Q(g s_W)`` is the error quantized in its own format (per tensor) after scaling each
column by the weight's step, so the GEMM runs on integer codes again; the origin term
is a float32 GEMV (``M N`` MACs beside the GEMM's ``M N K``). With stochastic errors
both are unbiased, ``E[dx] = g W_q^T`` as in fake quantization; the values differ from
it (another grid, another draw: ``fold_in(key, 1)``). A per-tensor weight needs no
fold: both backward GEMMs share one quantized error.

**Layouts.** Every GEMM runs as ``(B, X, K) x (B, K, Y)`` or ``(B, X, K) x (B, Y, K)``
(`matrix_view`; B = 1 is a 2-D GEMM). XLA CPU's int8 kernel (YNNPACK) takes a left
operand whose contraction is its minor axis only: a transposed operand is folded into
the dot's layout and runs a slow loop (the weight gradient, ``x^T g``: 250 ms against
73 ms for 2048 x 1024 x 1024 here). The one operand that needs it (``x^T``, int8) is
materialized transposed with a layout constraint on CPU (`row_major`); GPU and TPU
lay out their GEMM operands themselves.

**Widths.** ``b <= 8`` (both forward widths, and the error's for the backward) runs
the integer GEMMs; wider widths run fake quantization (`cpt_jax.ops.fake_quant`'s
values: quantized operands, the error quantized once, float32 GEMMs) inside the same
compiled program (``lax.cond`` on a traced width: its branches return the product only,
so they agree under ``shard_map``), and ``b >= 32`` is float32.
The ranges include every element (`formats.plain_min_max`): on a finite tensor the
same grid as fake quantization's, and a non-finite input makes its scale group's step
non-finite, so the outputs it touches are too and a non-finite step is still detected.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from cpt_jax import formats
from cpt_jax.formats import AffineInt, SymmetricInt
from cpt_jax.formats.codes import OperandQuant
from cpt_jax.ops.lowp_gemm import GemmLayout, from_matrix_view, gemm_layout, matrix_view
from cpt_jax.ops.varying import vary_like

Array = jax.Array

INT_WIDTH = 8
"""The widest grid whose codes fit the int8 container (``b <= 8``)."""

FORMS = ("bky", "byk")
"""How the right operand of an integer GEMM is laid out: ``(B, K, Y)`` or ``(B, Y, K)``."""


# --------------------------------------------------------------------------- grids

@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["codes", "step", "origin", "sums"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class IntView:
    """One GEMM operand as signed integer codes in a matrix view (a pytree).

    Attributes:
      codes: int8 codes ``(B, X, K)`` (or ``(B, K, Y)`` for a right operand laid so).
      step: the grid's step, broadcastable to the view with size 1 along ``K``
        (None: 1, codes that carry their own scale).
      origin: the value of code 0, as `step` (None: 0, a symmetric grid).
      sums: ``R = sum_k codes`` (size 1 along ``K``), exact integers in float32.
    """

    codes: Array
    step: Array | None
    origin: Array | None
    sums: Array


def signed_codes(x: Array, bits, quant: OperandQuant, key: Array | None
                 ) -> tuple[Array, Array, Array | None]:
    """``(codes, step, origin)`` with ``quantize(x) ~= step * codes + origin``, signed codes
    (float32 integers) at ``b <= 8`` in the int8 range.

    The codes of `cpt_jax.formats.encode` (the same rounding, the same noise for the
    same key) on the range of every element (`formats.plain_min_max` /
    `formats.plain_absmax`): equal on a finite tensor, and a non-finite input makes its
    scale group's step non-finite, so every output the group touches is too (no int8
    code holds NaN or Inf). Symmetric grids keep their codes (``|c| <= 2^(b-1) - 1``,
    origin None); affine codes ``c in [0, 2^b - 1]`` become ``c - 2^(b-1)``, their origin
    ``lo + s 2^(b-1)``.

    Example:
      >>> from cpt_jax.quant_config import TensorQuant
      >>> c, s, o = signed_codes(jnp.array([0.0, 1.0, 3.0]), 2.0, TensorQuant(AffineInt()), None)
      >>> c.tolist(), s.tolist(), o.tolist()
      ([-2.0, -1.0, 1.0], [1.0], [2.0])
    """
    fmt: Any = quant.fmt  # an AffineInt or SymmetricInt (`check_int_quant`)
    b = jnp.maximum(jnp.asarray(bits, jnp.float32), 1.0)
    x = x.astype(jnp.float32)
    if isinstance(fmt, SymmetricInt):
        grid = formats.encode_symmetric(x, b, fmt, quant.rounding, key, formats.plain_absmax)
        return grid.codes, grid.step(), None
    grid = formats.encode_affine(x, b, fmt, quant.rounding, key, formats.plain_min_max)
    half = formats.pow2(b - 1.0)
    step = grid.step()
    return grid.codes - half, step, grid.origin() + step * half


def scale_view(scale: Array | None, shape, batch, rows, cols) -> Array | None:
    """A step or origin of keepdims `scale` (of a tensor of `shape`) in the matrix view
    ``(B, R, C)`` of `matrix_view`: broadcast where it is 1, size 1 where it is 1 along
    every axis of a group.

    Example:
      >>> scale_view(jnp.ones((1, 4)), (3, 4), (), (0,), (1,)).shape   # per column
      (1, 1, 4)
      >>> scale_view(jnp.ones((1, 1, 4)), (2, 3, 4), (), (2,), (0, 1)).shape   # permuted
      (1, 4, 1)
    """
    if scale is None:
        return None
    scale = jnp.reshape(scale, (1,) * (len(shape) - scale.ndim) + tuple(scale.shape))
    groups = (tuple(batch), tuple(rows), tuple(cols))
    sizes = [math.prod(shape[d] for d in g) if any(scale.shape[d] > 1 for d in g) else 1
             for g in groups]
    full = [1] * len(shape)   # in the tensor's own axis order, which the view permutes
    for i, g in enumerate(groups):
        for d in g:
            full[d] = shape[d] if sizes[i] > 1 else 1
    return matrix_view(jnp.broadcast_to(scale, full), *groups).reshape(sizes)


def varies_along(scale: Array | None, axis: int) -> bool:
    """Whether a viewed step or origin takes more than one value along `axis`."""
    return scale is not None and scale.shape[axis] > 1


# --------------------------------------------------------------------------- one GEMM

def row_major(x: Array) -> Array:
    """`x` materialized in row-major order on CPU (XLA would fold a transpose into the
    integer dot's layout there and run a slow loop); as it is elsewhere."""
    from jax.experimental.layout import Layout, with_layout_constraint  # noqa: PLC0415

    def cpu(x):
        return with_layout_constraint(x, Layout(major_to_minor=tuple(range(x.ndim))))

    return lax.platform_dependent(x, cpu=cpu, default=lambda x: x)


def int_matmul(a: Array, b: Array, form: str) -> Array:
    """``(B, X, K) x (B, K, Y)`` (``form="bky"``) or ``x (B, Y, K)`` (``"byk"``) of int8
    codes, accumulated in int32: ``(B, X, Y)``. ``B = 1`` runs as a 2-D GEMM.

    Example:
      >>> a, b = jnp.ones((1, 2, 3), jnp.int8), jnp.ones((1, 3, 4), jnp.int8)
      >>> int_matmul(a, b, "bky").dtype, int_matmul(a, b, "bky")[0, 0, 0].item()
      (dtype('int32'), 3)
    """
    if form not in FORMS:
        raise ValueError(f"form must be one of {FORMS}, got {form!r}")
    kb = 1 if form == "bky" else 2
    if a.shape[0] == 1:
        acc = lax.dot_general(a[0], b[0], (((1,), (kb - 1,)), ((), ())),
                              preferred_element_type=jnp.int32)
        return acc[None]
    return lax.dot_general(a, b, (((2,), (kb,)), ((0,), (0,))),
                           preferred_element_type=jnp.int32)


def _times(a, b):
    """``a * b`` where None is 1."""
    if a is None:
        return b
    return a if b is None else a * b


def combine(acc: Array, lhs: IntView, rhs: IntView, k: int) -> Array:
    """``sum_k A B`` from the int32 ``acc`` of two `IntView`s (rows ``(B, X, 1)`` and
    ``(B, 1, Y)``): ``s_A s_B acc + s_A o_B R_A + o_A s_B R_B + K o_A o_B`` (a
    non-finite step or origin, from a non-finite input, makes what it scales
    non-finite).

    Example:
      >>> one = jnp.ones((1, 1, 1))
      >>> lhs = IntView(None, 2 * one, None, 3 * one)           # A = 2 c_A, sum_k c_A = 3
      >>> rhs = IntView(None, one, 5 * one, 4 * one)            # B = c_B + 5
      >>> combine(jnp.full((1, 1, 1), 7, jnp.int32), lhs, rhs, 2).item()   # 2*7 + 2*5*3
      44.0
    """
    y = acc.astype(jnp.float32)
    scale = _times(lhs.step, rhs.step)
    if scale is not None:
        y = y * scale
    if rhs.origin is not None:
        y = y + _times(lhs.step, rhs.origin) * lhs.sums
    if lhs.origin is not None:
        y = y + _times(lhs.origin, rhs.step) * rhs.sums
        if rhs.origin is not None:
            y = y + float(k) * lhs.origin * rhs.origin
    return y


def int_view(codes: Array, step, origin, k_axis: int) -> IntView:
    """An `IntView` of float signed codes: int8 codes and their sums along `k_axis`
    (int32, from the int8 codes: a quarter of a float read)."""
    c8 = codes.astype(jnp.int8)
    return IntView(c8, step, origin, _sums(c8, k_axis))


def _sums(codes8: Array, axis: int) -> Array:
    return jnp.sum(codes8, axis=axis, keepdims=True, dtype=jnp.int32).astype(jnp.float32)


def gemm(lhs: IntView, rhs: IntView, form: str) -> Array:
    """One integer GEMM of two views (`int_matmul`, then `combine`): float32 ``(B, X, Y)``.

    Example:
      >>> c = jnp.ones((1, 2, 3))
      >>> a = int_view(c, jnp.full((1, 2, 1), 0.5), None, 2)
      >>> b = int_view(c, None, None, 2)
      >>> gemm(a, b, "byk")[0].tolist()
      [[1.5, 1.5], [1.5, 1.5]]
    """
    acc = int_matmul(lhs.codes, rhs.codes, form)
    k = lhs.codes.shape[2]
    if form == "byk":
        rhs = IntView(rhs.codes, _swap(rhs.step), _swap(rhs.origin), _swap(rhs.sums))
    return combine(acc, lhs, rhs, k)


def _swap(v):
    return None if v is None else jnp.swapaxes(v, 1, 2)


# --------------------------------------------------------------------------- the spec

@dataclasses.dataclass(frozen=True)
class IntGemmSpec:
    """What `int_dot_general` computes (static): the dot's dimension numbers, the
    formats of its operands and error (None: the error stays float32) and the output
    dtype."""

    dimension_numbers: Any
    lhs: OperandQuant
    rhs: OperandQuant
    error: OperandQuant | None
    out_dtype: Any = jnp.float32

    def layout(self, lhs_ndim: int, rhs_ndim: int) -> GemmLayout:
        return gemm_layout(self.dimension_numbers, lhs_ndim, rhs_ndim)


def check_int_quant(quant: OperandQuant, ndim: int, contracting, what: str = "operand") -> None:
    """ValueError unless `quant`'s grid is constant along the contracted axes: an
    `AffineInt` / `SymmetricInt` per tensor, per channel on a free axis, or per group
    of ``scale_axes`` that covers every contracted axis (per token), untiled."""
    fmt = quant.fmt
    if not isinstance(fmt, (AffineInt, SymmetricInt)) or formats.tile_sizes(fmt):
        raise ValueError(f"integer GEMMs need an untiled AffineInt or SymmetricInt {what}, "
                         f"got {fmt!r}")
    reduced = formats.scale_reduction_axes(ndim, fmt)
    if reduced is not None and not set(a % ndim for a in contracting) <= set(reduced):
        raise ValueError(f"integer GEMMs need one {what} scale along the contraction "
                         f"(axes {tuple(contracting)}), got {fmt!r}")


def is_per_tensor(quant: OperandQuant | None) -> bool:
    """Whether an error grid has one scale (what the backward integer GEMMs take)."""
    return (quant is not None and isinstance(quant.fmt, (AffineInt, SymmetricInt))
            and quant.fmt.channel_axis is None and quant.fmt.scale_axes is None)


def static_width(bits) -> float | None:
    """`bits` as a Python float when it is known at trace time, else None."""
    if bits is None or isinstance(bits, jax.core.Tracer):
        return None
    value = np.asarray(bits)
    return float(value) if value.size == 1 else None


def _cond(low, int_fn, fake_fn, *args):
    """``int_fn(*args)`` where `low` holds, else ``fake_fn(*args)``: a Python choice for a
    static `low`, ``lax.cond`` for a traced one."""
    if isinstance(low, (bool, np.bool_)):
        return int_fn(*args) if low else fake_fn(*args)
    return lax.cond(low, int_fn, fake_fn, *args)


def _narrow(*widths):
    """``all(w <= INT_WIDTH)``: a Python bool when every width is static."""
    static = [static_width(w) for w in widths]
    if all(s is not None for s in static):
        return all(s <= INT_WIDTH for s in static)
    low = jnp.asarray(True)
    for w in widths:
        low = low & (jnp.asarray(w, jnp.float32) <= INT_WIDTH)
    return low


# --------------------------------------------------------------------------- forward

def _views(spec: IntGemmSpec, lhs: Array, rhs: Array, bits, keys):
    """The forward's two operands as `IntView`s: ``x`` as ``(B, M, K)``, ``W`` as
    ``(B, K, N)`` (each row-major on CPU when its view is a transpose)."""
    lay = spec.layout(lhs.ndim, rhs.ndim)
    x_groups = (lay.lhs_batch, lay.lhs_free, lay.lhs_contract)
    w_groups = (lay.rhs_batch, lay.rhs_contract, lay.rhs_free)
    return (_operand_view(lhs, bits, spec.lhs, keys[0], x_groups, 2),
            _operand_view(rhs, bits, spec.rhs, keys[1], w_groups, 1))


def _operand_view(x, bits, quant, key, groups, k_axis) -> IntView:
    codes, step, origin = signed_codes(x, bits, quant, key)
    view = matrix_view(codes, *groups)
    if tuple(d for g in groups for d in g) != tuple(range(x.ndim)):
        view = row_major(view)
    return int_view(view, scale_view(step, x.shape, *groups), scale_view(origin, x.shape, *groups),
                    k_axis)


def _out_shape(lay: GemmLayout, lhs_shape, rhs_shape) -> tuple:
    return (tuple(lhs_shape[d] for d in lay.lhs_batch) + tuple(lhs_shape[d] for d in lay.lhs_free)
            + tuple(rhs_shape[d] for d in lay.rhs_free))


def _int_forward(spec: IntGemmSpec, lhs_shape, rhs_shape, views) -> Array:
    """``y`` from the forward's two `IntView`s (one integer GEMM)."""
    xv, wv = views
    y3 = gemm(xv, wv, "bky")
    y = y3.reshape(_out_shape(spec.layout(len(lhs_shape), len(rhs_shape)), lhs_shape, rhs_shape))
    return y.astype(spec.out_dtype)


def _fake_operands(spec: IntGemmSpec, lhs, rhs, bits, keys):
    """Both operands fake-quantized (`cpt_jax.formats.quantize`: the values of fake quant)."""
    def q(x, quant, key):
        return formats.quantize(x, bits, quant.fmt, rounding=quant.rounding, key=key)

    return q(lhs, spec.lhs, keys[0]), q(rhs, spec.rhs, keys[1])


def _fake_forward(spec: IntGemmSpec, lhs, rhs, bits, keys):
    xq, wq = _fake_operands(spec, lhs, rhs, bits, keys)
    y = lax.dot_general(xq, wq, spec.dimension_numbers)
    return y.astype(spec.out_dtype)


def _forward(spec: IntGemmSpec, lhs, rhs, bits, keys):
    """``(y, views)``: the operands' codes (computed at any width, read only at ``b <=
    8``), then the integer GEMM at ``bits <= 8``, else fake quantization.

    The codes are the residuals of the backward whatever the width, so the two branches
    of the width's ``lax.cond`` return ``y`` alone (the same type from the same inputs,
    under ``shard_map`` too)."""
    views = _views(spec, lhs, rhs, bits, keys)

    def as_int(lhs, rhs, bits, keys, views):
        return _int_forward(spec, lhs.shape, rhs.shape, views)

    def as_fake(lhs, rhs, bits, keys, views):
        return _fake_forward(spec, lhs, rhs, bits, keys)

    return _cond(_narrow(bits), as_int, as_fake, lhs, rhs, bits, keys, views), views


# --------------------------------------------------------------------------- backward

def _fold(key, salt: int):
    return None if key is None else jax.random.fold_in(key, salt)


def _error_view(g3, grad_bits, quant: OperandQuant, key, k_axis, scale=None) -> IntView:
    """The error ``(B, M, N)`` (times a folded `scale`) on its grid, summed along `k_axis`."""
    codes, step, origin = signed_codes(g3 if scale is None else g3 * scale, grad_bits, quant, key)
    return int_view(codes, step, origin, k_axis)


def _codes_view(codes: Array, k_axis: int) -> IntView:
    """Int8 codes with no step or origin (folded into the other operand), summed along `k_axis`."""
    return IntView(codes, None, None, _sums(codes, k_axis))


def _weight_gradient(xv: IntView, g3, grad_bits, quant, key, shared: IntView | None):
    """``dW = x^T g`` as ``(B, K, N)``: ``x^T`` codes row-major, the error along the tokens
    (its step times the activation's per-token step when that varies, with the origin
    term ``o_x^T g`` in float32)."""
    xt = row_major(jnp.swapaxes(xv.codes, 1, 2))
    per_token = varies_along(xv.step, 1) or varies_along(xv.origin, 1)
    if not per_token:
        ev = shared if shared is not None else _error_view(g3, grad_bits, quant, key, 1)
        return gemm(IntView(xt, _swap(xv.step), _swap(xv.origin), _sums(xt, 2)), ev, "bky")
    ev = _error_view(g3, grad_bits, quant, key, 1, scale=xv.step)
    d = gemm(_codes_view(xt, 2), ev, "bky")
    if xv.origin is not None:
        d = d + jnp.einsum("bmo,bmn->bon", jnp.broadcast_to(xv.origin, g3.shape[:2] + (1,)), g3)
    return d


def _input_gradient(wv: IntView, g3, grad_bits, quant, key, shared: IntView | None):
    """``dx = g W^T`` as ``(B, M, K)``: the weight's codes as they are (``(B, K, N)``, N
    contracted, its minor axis), the error times the weight's per-channel step when that
    varies (with the origin term ``g o_W`` in float32)."""
    per_channel = varies_along(wv.step, 2) or varies_along(wv.origin, 2)
    if not per_channel:
        ev = shared if shared is not None else _error_view(g3, grad_bits, quant, key, 2)
        rhs = IntView(wv.codes, _swap(wv.step), _swap(wv.origin), _codes_view(wv.codes, 2).sums)
        return gemm(ev, rhs, "byk")
    ev = _error_view(g3, grad_bits, quant, key, 2, scale=wv.step)
    d = gemm(ev, _codes_view(wv.codes, 2), "byk")
    if wv.origin is not None:
        d = d + jnp.einsum("bmn,bon->bmo", g3, jnp.broadcast_to(wv.origin, (1, 1, g3.shape[2])))
    return d


def _int_backward(spec: IntGemmSpec, lhs, rhs, g, grad_bits, key, res):
    """``(dx, dW)`` on int8 codes (module docstring): one quantized error shared by both
    GEMMs when no step varies along a backward contraction, else one per fold."""
    xv, wv = res
    lay = spec.layout(lhs.ndim, rhs.ndim)
    if spec.error is None:
        raise ValueError("an integer backward needs an error format")
    g3 = g.reshape(xv.codes.shape[0], xv.codes.shape[1], wv.codes.shape[2]).astype(jnp.float32)
    per_token = varies_along(xv.step, 1) or varies_along(xv.origin, 1)
    per_channel = varies_along(wv.step, 2) or varies_along(wv.origin, 2)
    shared_for_dw = shared_for_dx = None
    if not per_token and not per_channel:  # one error, two sums
        codes, step, origin = signed_codes(g3, grad_bits, spec.error, key)
        shared_for_dw = int_view(codes, step, origin, 1)
        shared_for_dx = IntView(shared_for_dw.codes, step, origin, _sums(shared_for_dw.codes, 2))
    dw3 = _weight_gradient(xv, g3, grad_bits, spec.error, key, shared_for_dw)
    dx3 = _input_gradient(wv, g3, grad_bits, spec.error,
                          _fold(key, 1) if per_token or per_channel else key, shared_for_dx)
    dx = from_matrix_view(dx3, lhs.shape, lay.lhs_batch, lay.lhs_free, lay.lhs_contract)
    dw = from_matrix_view(dw3, rhs.shape, lay.rhs_batch, lay.rhs_contract, lay.rhs_free)
    return dx, dw


def _fake_backward(spec: IntGemmSpec, lhs, rhs, g, bits, grad_bits, keys):
    """Fake quantization's backward: the error quantized once (float32 when it has no
    format or width), the float GEMMs of the fake-quantized operands (straight-through)."""
    xq, wq = _fake_operands(spec, lhs, rhs, bits, keys)
    if spec.error is not None and grad_bits is not None:
        g = formats.quantize(g, grad_bits, spec.error.fmt, rounding=spec.error.rounding,
                             key=keys[2])
    _, vjp = jax.vjp(lambda a, b: lax.dot_general(a, b, spec.dimension_numbers), xq, wq)
    return vjp(g.astype(jnp.result_type(xq, wq)))


# --------------------------------------------------------------------------- the product

def int_dot_general(spec: IntGemmSpec, lhs, rhs, bits, grad_bits, keys) -> Array:
    """``dot_general(lhs, rhs)`` with its three GEMMs on int8 codes at widths ``<= 8``.

    Forward ``y = x_q W_q`` (int32 accumulation, zero points corrected); backward
    ``dx ~= g_q W_q^T`` and ``dW = x_q^T g_q`` on the error's codes (scales along a
    backward contraction folded into the error: module docstring). Wider widths run
    fake quantization inside the same program.

    Args:
      spec: the static `IntGemmSpec` (dimension numbers, formats, output dtype).
      lhs, rhs: the float operands (activation, weight).
      bits: forward width (a number or a traced float32 scalar).
      grad_bits: the error's width (traced), or None (float32 errors).
      keys: ``(lhs, rhs, error)`` PRNG keys of stochastic rounding, or None each.

    Returns:
      ``y`` in ``spec.out_dtype``.

    Example:
      >>> from cpt_jax.quant_config import TensorQuant
      >>> spec = IntGemmSpec((((1,), (0,)), ((), ())), TensorQuant(AffineInt()),
      ...                    TensorQuant(AffineInt(channel_axis=-1)),
      ...                    TensorQuant(AffineInt(), "stochastic"))
      >>> x, w = jnp.ones((4, 8)), jnp.full((8, 3), 0.5)
      >>> f = lambda x, w: int_dot_general(spec, x, w, 8.0, 8.0, (None, None, jax.random.key(0))).sum()
      >>> float(int_dot_general(spec, x, w, 8.0, 8.0, (None, None, None))[0, 0])
      4.0
      >>> [d.shape for d in jax.grad(f, (0, 1))(x, w)]
      [(4, 8), (8, 3)]

    Under ``jax.shard_map`` both operands first vary over every mesh axis any input
    varies over (`cpt_jax.ops.varying.vary_like`): the cotangent of a replicated weight
    times a per-device activation is then summed over the devices by JAX's transpose of
    that cast, as for a plain ``dot_general``, and the width's ``cond`` branches agree.
    """
    lhs, rhs = vary_like((lhs, rhs), bits, grad_bits, keys)
    return _int_dot_general(spec, lhs, rhs, bits, grad_bits, keys)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _int_dot_general(spec: IntGemmSpec, lhs, rhs, bits, grad_bits, keys) -> Array:
    return _forward(spec, lhs, rhs, bits, keys)[0]


def _vjp_fwd(spec, lhs, rhs, bits, grad_bits, keys):
    y, res = _forward(spec, lhs, rhs, bits, keys)
    return y, (lhs, rhs, bits, grad_bits, keys, res)


def _vjp_bwd(spec, residuals, g):
    lhs, rhs, bits, grad_bits, keys, res = residuals
    g = g.astype(jnp.float32)

    def as_fake(lhs, rhs, g, res):
        return _fake_backward(spec, lhs, rhs, g, bits, grad_bits, keys)

    if grad_bits is None or not is_per_tensor(spec.error):
        dx, dw = as_fake(lhs, rhs, g, res)
    else:
        def as_int(lhs, rhs, g, res):
            return _int_backward(spec, lhs, rhs, g, grad_bits, keys[2], res)

        dx, dw = _cond(_narrow(bits, grad_bits), as_int, as_fake, lhs, rhs, g, res)
    zero = lambda v: None if v is None else jnp.zeros_like(v)
    return (dx.astype(lhs.dtype), dw.astype(rhs.dtype), zero(bits), zero(grad_bits),
            tuple(None for _ in keys))


_int_dot_general.defvjp(_vjp_fwd, _vjp_bwd)


__all__ = ["FORMS", "INT_WIDTH", "IntGemmSpec", "IntView", "check_int_quant",
           "combine", "gemm", "int_dot_general", "int_matmul", "int_view", "is_per_tensor",
           "row_major", "scale_view", "signed_codes", "static_width", "varies_along"]
