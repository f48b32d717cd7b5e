"""`Product`: one product of a model as a provider sees it, its geometry, its cost
record, and `compute_product`, the one data path (see `cpt_jax.interception`)."""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any, Protocol

import jax

from cpt_jax import context
from cpt_jax.ops.product_op import ProductOp, conv_reduction
from cpt_jax.quant_config import QuantConfig

Array = jax.Array

ACTIVATION = "activation"
WEIGHT = "weight"
INDEX = "index"


# --------------------------------------------------------------------------- records

@dataclasses.dataclass(frozen=True)
class OpRecord:
    """One quantizable op as traced: where it is, its shapes and its MACs.

    Attributes:
      name: module path (e.g. ``"stage1_block1/conv1"``) or a generated name.
      kind: ``"dot_general"``, ``"conv"`` or ``"einsum"``.
      macs: multiply-accumulates of one forward call (exact, from shapes).
      reduction: accumulation length K (contracted elements per output).
      lhs_shape, rhs_shape, out_shape: shapes of input, weight and output.
      quantized: False when a rule keeps the op in full precision.
      bits_offset: the op's forward bits offset (per-layer allocation).
      grad_bits_offset: the op's backward bits offset.
      calls: how many times one forward pass runs it (the trip counts of the
        scans and the sizes of the vmaps around it; `macs` already includes it).
      scope: the named scope tagging its equations while `trace_ops` traces.
      product: the `cpt_jax.interception.Product` it records (its operands, op and
        config; without its module), for tools that need more than the cost
        (`cpt_jax.export`).
    """

    name: str
    kind: str
    macs: int
    reduction: int
    lhs_shape: tuple
    rhs_shape: tuple
    out_shape: tuple
    quantized: bool = True
    bits_offset: float = 0.0
    grad_bits_offset: float = 0.0
    calls: int = 1
    scope: str = dataclasses.field(default="", compare=False, repr=False)
    product: Any = dataclasses.field(default=None, compare=False, repr=False)

    @property
    def weight_reuse(self) -> float:
        """MACs each weight element enters: ``macs / |W|`` (usage frequency)."""
        return self.macs / max(1, math.prod(self.rhs_shape))

    @property
    def activation_reuse(self) -> float:
        """MACs each input element enters: ``macs / |x|`` (usage frequency)."""
        return self.macs / max(1, math.prod(self.lhs_shape))


# --------------------------------------------------------------------------- products

@dataclasses.dataclass(frozen=True)
class Operand:
    """One operand of a product, as its quantizer needs to know it.

    Attributes:
      role: ``"activation"`` (quantized with ``config.activation``), ``"weight"``
        (``config.weight``) or ``"index"`` (integer indices, never quantized).
      contracting: the axes of this operand the forward product sums over, listed
        in pairs with the other operand's (``lhs.contracting[i]`` meets
        ``rhs.contracting[i]``; for a conv: the feature axis, then the kernel's
        window axes for the weight).
      channel_axis: a weight's output-channel axis (per-channel scales), else None.
      param: a weight's parameter path (``"decoder/attn/wq"``), when known.
    """

    role: str
    contracting: tuple[int, ...]
    channel_axis: int | None = None
    param: str | None = None


@dataclasses.dataclass(frozen=True)
class ErrorAxes:
    """The axes of the output (= of the error) each backward product contracts."""

    for_lhs_grad: tuple[int, ...]
    for_rhs_grad: tuple[int, ...]


def _einsum_geometry(spec: str, roles):
    (a, b), out = spec.split("->")[0].split(","), spec.split("->")[1]
    lhs_c = tuple(i for i, c in enumerate(a) if c in b and c not in out)
    rhs_c = tuple(b.index(a[i]) for i in lhs_c)  # paired with lhs_c, as a dot_general's
    lhs_free = [i for i, c in enumerate(a) if c in out and c not in b]
    rhs_free = [i for i, c in enumerate(b) if c in out and c not in a]
    errors = ErrorAxes(tuple(i for i, c in enumerate(out) if c in b and c not in a),
                       tuple(i for i, c in enumerate(out) if c in a and c not in b))
    return lhs_c, rhs_c, (_weight_channel(lhs_free, roles[0]),
                          _weight_channel(rhs_free, roles[1])), errors


def _weight_channel(free, role) -> int | None:
    """A weight's per-channel axis: its last free (output) axis."""
    return free[-1] if free and role == WEIGHT else None


def _dot_geometry(dims, lhs_ndim: int, rhs_ndim: int, roles):
    (lc, rc), (lb, rb) = dims
    lhs_free = [d for d in range(lhs_ndim) if d not in lc and d not in lb]
    rhs_free = [d for d in range(rhs_ndim) if d not in rc and d not in rb]
    start = len(lb) + len(lhs_free)
    errors = ErrorAxes(tuple(range(start, start + len(rhs_free))),
                       tuple(range(len(lb), start)))
    channels = (_weight_channel(lhs_free, roles[0]), _weight_channel(rhs_free, roles[1]))
    return tuple(lc), tuple(rc), channels, errors


def _ragged_geometry(ragged_dims, lhs_ndim: int, rhs_ndim: int, roles):
    """A ragged dot: the dot_general's axes, the rhs group axis left out of its free axes."""
    dims = ragged_dims.dot_dimension_numbers
    (lc, rc), (lb, rb) = dims
    groups = tuple(ragged_dims.rhs_group_dimensions)
    lhs_free = [d for d in range(lhs_ndim) if d not in lc and d not in lb]
    rhs_free = [d for d in range(rhs_ndim) if d not in rc and d not in rb and d not in groups]
    out_lead = 1 if any(d in lc for d in ragged_dims.lhs_ragged_dimensions) else 0
    start = out_lead + len(lb) + len(lhs_free)
    errors = ErrorAxes(tuple(range(start, start + len(rhs_free))),
                       tuple(range(out_lead + len(lb), start)))
    channels = (_weight_channel(lhs_free, roles[0]), _weight_channel(rhs_free, roles[1]))
    return tuple(lc), tuple(rc), channels, errors


def _conv_geometry(dn, roles):
    rhs_c = (dn.rhs_spec[1],) + tuple(dn.rhs_spec[2:])
    channel = dn.rhs_spec[0] if roles[1] == WEIGHT else None
    errors = ErrorAxes((dn.out_spec[1],), (dn.out_spec[0],) + tuple(dn.out_spec[2:]))
    return (dn.lhs_spec[1],), rhs_c, (None, channel), errors


def geometry(op: ProductOp, lhs_shape, rhs_shape, roles=(ACTIVATION, WEIGHT),
             params=(None, None)):
    """``(lhs Operand, rhs Operand, ErrorAxes, reduction K)`` of `op` on these shapes.

    ``K`` is the accumulation length of one output: the contracted sizes (a conv:
    ``C_in/groups * prod(window)``); MACs = ``|out| * K`` (a ragged dot whose
    ragged axis is contracted has ``|out| * K / groups``). A weight operand (on
    either side of a dot) gets its last output axis as its channel axis.

    Example:
      >>> from cpt_jax.ops.product_op import dot_general_op
      >>> lhs, rhs, err, k = geometry(dot_general_op((((1,), (0,)), ((), ()))), (8, 3), (3, 4))
      >>> lhs.contracting, rhs.contracting, rhs.channel_axis, err.for_lhs_grad, k
      ((1,), (0,), 1, (1,), 3)
    """
    if op.kind == "dot_general":
        lc, rc, channels, errors = _dot_geometry(op.dimension_numbers, len(lhs_shape),
                                                 len(rhs_shape), roles)
        k = math.prod(lhs_shape[d] for d in lc)
    elif op.kind == "ragged_dot":
        lc, rc, channels, errors = _ragged_geometry(op.dimension_numbers, len(lhs_shape),
                                                    len(rhs_shape), roles)
        k = math.prod(lhs_shape[d] for d in lc)
    elif op.kind == "conv":
        lc, rc, channels, errors = _conv_geometry(op.dimension_numbers, roles)
        k = conv_reduction(rhs_shape, op.dimension_numbers.rhs_spec, op.feature_group_count)
    else:
        lc, rc, channels, errors = _einsum_geometry(op.einsum_spec, roles)
        k = math.prod(lhs_shape[d] for d in lc)
    return (Operand(roles[0], lc, channels[0], params[0]),
            Operand(roles[1], rc, channels[1], params[1]), errors, int(k))


@dataclasses.dataclass(frozen=True)
class Product:
    """One product of a model, as a provider sees it (see the module docstring)."""

    path: str
    kind: str
    config: QuantConfig | None
    lhs: Operand
    rhs: Operand
    error_axes: ErrorAxes
    reduction: int
    op: ProductOp | None = None
    owner: str = ""
    local: str = ""
    module: Any = dataclasses.field(default=None, compare=False, hash=False, repr=False)


def make_product(path: str, kind: str, config: QuantConfig | None, op: ProductOp,
                 lhs_shape, rhs_shape, roles=(ACTIVATION, WEIGHT), module=None,
                 params=(None, None), owner: str = "", local: str = "") -> Product:
    """A `Product` of `op` on operands of these shapes (axes read by `geometry`)."""
    lhs, rhs, errors, k = geometry(op, lhs_shape, rhs_shape, roles, params)
    return Product(path=path, kind=kind, config=config, lhs=lhs, rhs=rhs,
                   error_axes=errors, reduction=k, op=op, owner=owner, local=local,
                   module=module)


class Provider(Protocol):
    """What computes a quantized product (see the module docstring)."""

    def compute(self, product: Product, lhs: Array, rhs: Array,
                state: context.PrecisionState, apply: Callable) -> Array:
        """The product at the widths of `state`; ``apply(a, b)`` is its float op."""


def record_product(product: Product, lhs, rhs, out_shape, scope: str = "") -> None:
    """Append the product's `OpRecord` (MACs = ``|out| * reduction``) to the recorders."""
    cfg = product.config
    context.record(OpRecord(scope=scope,
        name=product.path, kind=product.kind,
        macs=int(math.prod(out_shape)) * product.reduction, reduction=product.reduction,
        lhs_shape=tuple(lhs.shape), rhs_shape=tuple(rhs.shape), out_shape=tuple(out_shape),
        quantized=cfg is not None, bits_offset=0.0 if cfg is None else cfg.bits_offset,
        grad_bits_offset=0.0 if cfg is None else cfg.grad_bits_offset,
        product=dataclasses.replace(product, module=None)))


def compute_product(product: Product, lhs, rhs, apply: Callable, provider: Provider,
                    out_shape=None, *, exact: Callable | None = None) -> Array:
    """Record `product`, then compute it: fp32 ``exact(lhs, rhs)`` or the provider's.

    Args:
      product: what is computed (path, config, axes).
      lhs, rhs: the float operands.
      apply: ``apply(lhs, rhs) -> y``, the float product of any operands, as the
        provider computes it (possibly laid out otherwise, e.g. as one 2-D GEMM).
      provider: computes the product when a `precision` context is active and
        ``product.config`` is not None.
      out_shape: the output shape if known (else read with `jax.eval_shape`).
      exact: the product as the model wrote it, computed when it is not quantized
        (no `precision` context, or ``product.config`` None): the same values as the
        model outside cpt_jax, bit for bit, eagerly too. Default: `apply`.

    Returns:
      The product's output. Everything the provider computes runs under
      `context.quant_call_guard`: its own products are not intercepted again.
    """
    tag = context.recording_tag()
    with context.quant_call_guard():
        if tag is None:
            return _compute(product, lhs, rhs, apply, provider, out_shape, "", exact)
        with jax.named_scope(tag):  # lets `cost.trace_ops` find it inside loops
            return _compute(product, lhs, rhs, apply, provider, out_shape, tag, exact)


def _compute(product, lhs, rhs, apply, provider, out_shape, tag, exact):
    context.prepare_cache_key()
    if out_shape is None:
        out_shape = jax.eval_shape(apply, lhs, rhs).shape
    record_product(product, lhs, rhs, out_shape, tag)
    prepare = getattr(provider, "prepare", None)
    if prepare is not None and product.config is not None:
        prepare(product, lhs, rhs)
    state = context.current_precision()
    if product.config is None or state is None:
        return (exact or apply)(lhs, rhs)
    context.check_traced_precision(state, product.path)
    outer_salt, state.salt = state.salt, context.loop_salt(state, lhs)
    try:
        return provider.compute(product, lhs, rhs, state, apply)
    finally:
        state.salt = outer_salt
