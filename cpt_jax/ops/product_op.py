"""`ProductOp`: a static (hashable) description of one product and how to compute it.

A dot_general (its dimension numbers), a convolution (strides, padding, dilations,
groups, resolved layouts), a two-operand einsum, or a ragged dot; ``apply(lhs,
rhs)`` computes it with JAX, so a quantized product can run the same op on
quantized, int8 or float8 operands.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
from jax import lax


def conv_reduction(rhs_shape: Sequence[int], rhs_spec: Sequence[int], feature_group_count: int = 1) -> int:
    """Accumulation length of a conv: ``C_in/groups * prod(kernel spatial)``.

    `rhs_spec` is the kernel layout from `lax.conv_dimension_numbers`
    (out-feature dim, in-feature dim, spatial dims...). The kernel's in-feature
    size is already ``C_in / groups``.
    """
    del feature_group_count
    in_dim = rhs_spec[1]
    spatial = rhs_spec[2:]
    return int(rhs_shape[in_dim] * math.prod(rhs_shape[s] for s in spatial))


@dataclasses.dataclass(frozen=True)
class ProductOp:
    """A static (hashable) description of a dot_general, conv or two-operand einsum.

    ``apply(lhs, rhs)`` computes it; `geometry` reads its contracted axes.
    """

    kind: str
    dimension_numbers: Any = None
    einsum_spec: str | None = None
    window_strides: Any = None
    padding: Any = None
    lhs_dilation: Any = None
    rhs_dilation: Any = None
    feature_group_count: int = 1
    batch_group_count: int = 1

    def apply(self, lhs, rhs, precision=None, preferred_element_type=None, **extra):
        """``lax.dot_general`` / ``lax.conv_general_dilated`` / ``jnp.einsum`` of the op."""
        if self.kind == "ragged_dot":
            raise ValueError("a ragged_dot ProductOp needs its group sizes: compute it "
                             "with the product's own `apply`")
        if self.kind == "dot_general":
            return lax.dot_general(lhs, rhs, self.dimension_numbers, precision=precision,
                                   preferred_element_type=preferred_element_type, **extra)
        if self.kind == "einsum":
            return jnp.einsum(self.einsum_spec, lhs, rhs, precision=precision,
                              preferred_element_type=preferred_element_type, **extra)
        return lax.conv_general_dilated(
            lhs, rhs, self.window_strides, self.padding, lhs_dilation=self.lhs_dilation,
            rhs_dilation=self.rhs_dilation, dimension_numbers=self.dimension_numbers,
            feature_group_count=self.feature_group_count,
            batch_group_count=self.batch_group_count, precision=precision,
            preferred_element_type=preferred_element_type)


def dot_general_op(dimension_numbers) -> ProductOp:
    """The `ProductOp` of ``lax.dot_general(lhs, rhs, dimension_numbers)``."""
    dims = tuple(tuple(tuple(int(d) for d in part) for part in pair)
                 for pair in dimension_numbers)
    return ProductOp("dot_general", dimension_numbers=dims)


def conv_op(lhs_shape, rhs_shape, window_strides, padding, lhs_dilation=None,
            rhs_dilation=None, dimension_numbers=None, feature_group_count=1,
            batch_group_count=1) -> ProductOp:
    """The `ProductOp` of a ``lax.conv_general_dilated`` call (layouts resolved)."""
    dn = lax.conv_dimension_numbers(tuple(lhs_shape), tuple(rhs_shape), dimension_numbers)
    return ProductOp(
        "conv", dimension_numbers=dn, window_strides=tuple(window_strides),
        padding=padding if isinstance(padding, str) else tuple(map(tuple, padding)),
        lhs_dilation=None if lhs_dilation is None else tuple(lhs_dilation),
        rhs_dilation=None if rhs_dilation is None else tuple(rhs_dilation),
        feature_group_count=feature_group_count, batch_group_count=batch_group_count)


def einsum_op(spec: str, lhs_ndim: int, rhs_ndim: int) -> ProductOp:
    """The `ProductOp` of ``jnp.einsum(spec, lhs, rhs)`` (``...`` expanded to letters)."""
    return ProductOp("einsum", einsum_spec=expand_einsum(spec, lhs_ndim, rhs_ndim))


def expand_einsum(spec: str, lhs_ndim: int, rhs_ndim: int) -> str:
    """An explicit two-operand einsum spec with ``...`` replaced by fresh letters.

    Example:
      >>> expand_einsum("...qhd,...khd->...hqk", 5, 5)
      'ABqhd,ABkhd->ABhqk'
    """
    spec = spec.replace(" ", "")
    if "->" not in spec or spec.count(",") != 1:
        raise ValueError(f"einsum spec must be explicit with two operands, got {spec!r}")
    if "..." not in spec:
        return spec
    ins, out = spec.split("->")
    a, b = ins.split(",")
    free = [c for c in "ABCDEFGHIJKLMNOPQRSTUVWXYZ" if c not in spec]
    width = max(lhs_ndim - (len(a) - 3) if "..." in a else 0,
                rhs_ndim - (len(b) - 3) if "..." in b else 0)
    fill = "".join(free[:width])

    def expand(term, ndim):
        if "..." not in term:
            return term
        n = ndim - (len(term) - 3)
        return term.replace("...", fill[width - n:])

    return f"{expand(a, lhs_ndim)},{expand(b, rhs_ndim)}->{out.replace('...', fill)}"


def einsum_dimension_numbers(spec: str) -> tuple[Any, tuple[int, ...]] | None:
    """``(dimension_numbers, out_perm)`` with ``einsum(spec, a, b) ==
    transpose(dot_general(a, b, dimension_numbers), out_perm)``, or None when `spec` is
    not one plain contraction (a letter repeated in a term, or summed in one operand
    only, or broadcast from one operand).

    Batch axes are the letters of both operands kept in the output; contracted ones
    the letters of both operands not kept; the free ones of each operand its own.

    Example:
      >>> einsum_dimension_numbers("btd,dhk->bthk")
      ((((2,), (0,)), ((), ())), (0, 1, 2, 3))
      >>> einsum_dimension_numbers("bqhd,bkhd->bhqk")
      ((((3,), (3,)), ((0, 2), (0, 2))), (0, 1, 2, 3))
      >>> einsum_dimension_numbers("ij,ij->i") is None, einsum_dimension_numbers("ii,ij->j") is None
      (False, True)
    """
    ins, out = spec.split("->")
    a, b = ins.split(",")
    if any(len(set(t)) != len(t) for t in (a, b, out)) or not set(out) <= set(a) | set(b):
        return None
    if any(c not in out and c not in (b if t is a else a) for t in (a, b) for c in t):
        return None  # summed within one operand: not a GEMM
    batch = [c for c in a if c in b and c in out]
    contract = [c for c in a if c in b and c not in out]
    a_free = [c for c in a if c not in b]
    b_free = [c for c in b if c not in a]
    dims = ((tuple(a.index(c) for c in contract), tuple(b.index(c) for c in contract)),
            (tuple(a.index(c) for c in batch), tuple(b.index(c) for c in batch)))
    produced = batch + a_free + b_free
    return dims, tuple(produced.index(c) for c in out)
