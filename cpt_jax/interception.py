"""The interception seam: which products a model computes, and who computes them.

Quantizing a model is two questions kept apart here, as Qwix keeps them apart:

* **interception** (this module, fed by `cpt_jax.op_interception`): describe every
  product a model computes, give it a stable path, resolve the rules for that
  path, record it for the cost, and guard against re-entry. It knows nothing
  about number formats.
* **providers** (`cpt_jax.providers` and others): given one `Product` and the
  `PrecisionState` in force, compute it (fake quant, int8, scaling from history...).

One product is described by a frozen `Product`:

============  ============================================================
field         meaning
============  ============================================================
path          stable name: module path plus the op in it (``"attn/einsum_1"``)
kind          ``dot_general``, ``conv``, ``ragged_dot``, ``attention``,
              ``lookup`` (``einsum`` from the explicit einsum door)
config        the resolved `QuantConfig` (None: kept in fp32, still counted)
lhs, rhs      `Operand`: role (activation/weight), contracted axes, channel axis
error_axes    output axes contracted by the two backward products:
              ``dL/dlhs = g x rhs`` contracts ``error_axes.for_lhs_grad``,
              ``dL/drhs = lhs x g`` contracts ``error_axes.for_rhs_grad``
op            a `ProductOp` (static dot/conv/ragged/einsum description) or
              None (an embedding lookup, an unshared convolution)
owner, local  the path of the module that computed it in the variable tree
              (``""``: the root) and the product's name below that module
              (``""`` for a layer's own product, ``"einsum_1"``, ``"query_key"``)
module        where a provider keeps state: the bound Linen module, an
              `cpt_jax.op_interception.NNXModuleState`, or None
============  ============================================================

`compute_product(product, lhs, rhs, apply, provider)` is the one data path:
record an `OpRecord`, let the provider ``prepare(product, lhs, rhs)`` (optional;
called even in fp32, e.g. at init, to create state), then ``apply(lhs, rhs)`` in
fp32 when there is no `precision` context or no config, else
``provider.compute(product, lhs, rhs, state, apply)``. ``apply`` computes the
float product of whatever operands the provider hands it, so a provider never
needs to know which layer it serves. Stochastic-rounding keys come from
``state.next_key()`` (inside a loop body they also fold in a per-iteration salt).

State in a provider: ``product.module`` is the module that computed the product
(a bound Linen module, or an NNX module behind the same methods). Inside the call, use
``module.has_variable`` / ``get_variable`` / ``put_variable`` (and ``sow``) on a
collection of your own, written only where ``module.is_mutable_collection(col)``;
create it in ``prepare`` so that ``init`` returns it (see
`cpt_jax.scaling.DelayedScalingProvider`).

How a provider plugs in
  Write an object with ``compute(product, lhs, rhs, state, apply) -> y`` (the
  `Provider` protocol); subclass `cpt_jax.providers.FakeQuantProvider` to change
  one piece: ``quantize_operand(product, operand, x, bits, state)`` (an operand,
  e.g. running activation ranges: ``product.module`` is the Flax module, where a
  variable collection can hold state; ``operand.contracting`` tells a block
  format which axes the product sums) or ``quantize_error(product, y, state)``
  (the error; ``product.error_axes`` tells the blocks of each backward product).
  Pass it as ``quantize_model(model, rules, provider=...)`` or to the doors
  (``QuantDotGeneral(provider=...)``); a provider that only handles some products
  (``product.op`` None, or a kind it does not know) falls back to its parent.

Where products come from
  `cpt_jax.op_interception` finds every product a model computes, at the JAX
  operations (``lax.dot_general``, convolutions, ``ragged_dot``, embedding
  lookups), names it by its module and builds its `Product`; the explicit doors
  (`cpt_jax.transform.QuantDotGeneral` ...) build theirs for one layer. Both call
  `compute_product`.
"""
from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, Callable, Optional, Protocol, Sequence, Tuple

import jax
from jax import lax
import jax.numpy as jnp

from cpt_jax import context
from cpt_jax.cost import OpRecord, conv_reduction
from cpt_jax.quant_config import FULL_PRECISION, QuantConfig

Array = jax.Array

ACTIVATION = "activation"
WEIGHT = "weight"
INDEX = "index"


# --------------------------------------------------------------------------- products

@dataclasses.dataclass(frozen=True)
class Operand:
    """One operand of a product, as its quantizer needs to know it.

    Attributes:
      role: ``"activation"`` (quantized with ``config.activation``), ``"weight"``
        (``config.weight``) or ``"index"`` (integer indices, never quantized).
      contracting: the axes of this operand the forward product sums over (for a
        conv: the feature axis, then the kernel's window axes for the weight).
      channel_axis: a weight's output-channel axis (per-channel scales), else None.
      param: a weight's parameter path (``"decoder/attn/wq"``), when known.
    """

    role: str
    contracting: Tuple[int, ...]
    channel_axis: Optional[int] = None
    param: Optional[str] = None


@dataclasses.dataclass(frozen=True)
class ErrorAxes:
    """The axes of the output (= of the error) each backward product contracts."""

    for_lhs_grad: Tuple[int, ...]
    for_rhs_grad: Tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class ProductOp:
    """A static (hashable) description of a dot_general, conv or two-operand einsum.

    ``apply(lhs, rhs)`` computes it; `geometry` reads its contracted axes.
    """

    kind: str
    dimension_numbers: Any = None
    einsum_spec: Optional[str] = None
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


def _einsum_geometry(spec: str, roles):
    (a, b), out = spec.split("->")[0].split(","), spec.split("->")[1]
    lhs_c = tuple(i for i, c in enumerate(a) if c in b and c not in out)
    rhs_c = tuple(i for i, c in enumerate(b) if c in a and c not in out)
    lhs_free = [i for i, c in enumerate(a) if c in out and c not in b]
    rhs_free = [i for i, c in enumerate(b) if c in out and c not in a]
    errors = ErrorAxes(tuple(i for i, c in enumerate(out) if c in b and c not in a),
                       tuple(i for i, c in enumerate(out) if c in a and c not in b))
    return lhs_c, rhs_c, (_weight_channel(lhs_free, roles[0]),
                          _weight_channel(rhs_free, roles[1])), errors


def _weight_channel(free, role) -> Optional[int]:
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
    config: Optional[QuantConfig]
    lhs: Operand
    rhs: Operand
    error_axes: ErrorAxes
    reduction: int
    op: Optional[ProductOp] = None
    owner: str = ""
    local: str = ""
    module: Any = dataclasses.field(default=None, compare=False, hash=False, repr=False)


def make_product(path: str, kind: str, config: Optional[QuantConfig], op: ProductOp,
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
                    out_shape=None) -> Array:
    """Record `product`, then compute it: fp32 ``apply(lhs, rhs)`` or the provider's.

    Args:
      product: what is computed (path, config, axes).
      lhs, rhs: the float operands.
      apply: ``apply(lhs, rhs) -> y``, the float product of any operands.
      provider: computes the product when a `precision` context is active and
        ``product.config`` is not None.
      out_shape: the output shape if known (else read with `jax.eval_shape`).

    Returns:
      The product's output. Everything the provider computes runs under
      `context.quant_call_guard`: its own products are not intercepted again.
    """
    tag = context.recording_tag()
    with context.quant_call_guard():
        if tag is None:
            return _compute(product, lhs, rhs, apply, provider, out_shape, "")
        with jax.named_scope(tag):  # lets `cost.trace_ops` find it inside loops
            return _compute(product, lhs, rhs, apply, provider, out_shape, tag)


def _compute(product, lhs, rhs, apply, provider, out_shape, tag):
    if out_shape is None:
        out_shape = jax.eval_shape(apply, lhs, rhs).shape
    record_product(product, lhs, rhs, out_shape, tag)
    prepare = getattr(provider, "prepare", None)
    if prepare is not None and product.config is not None:
        prepare(product, lhs, rhs)
    state = context.current_precision()
    if product.config is None or state is None:
        return apply(lhs, rhs)
    context.check_traced_precision(state, product.path)
    outer_salt, state.salt = state.salt, context.loop_salt(state, lhs)
    try:
        return provider.compute(product, lhs, rhs, state, apply)
    finally:
        state.salt = outer_salt


# --------------------------------------------------------------------------- rules

Rule = Tuple[str, Any]


def normalize_rules(rules) -> tuple:
    """``((regex, QuantConfig | None), ...)`` from a list or dict of rules, validated.

    A target ``"full_precision"`` becomes None. Raises ValueError naming the bad rule.
    """
    if rules is None:
        return ()
    if isinstance(rules, dict):
        rules = tuple(rules.items())
    out = []
    for i, rule in enumerate(rules):
        if not (isinstance(rule, (tuple, list)) and len(rule) == 2 and isinstance(rule[0], str)):
            raise ValueError(f"rules[{i}] must be a (regex, target) pair, got {rule!r}")
        pattern, target = rule
        try:
            re.compile(pattern)
        except re.error as exc:
            raise ValueError(f"rules[{i}] has an invalid regex {pattern!r}: {exc}") from exc
        if target is not None and target != FULL_PRECISION and not isinstance(target, QuantConfig):
            raise ValueError(
                f"rules[{i}] target must be a QuantConfig, None or {FULL_PRECISION!r}, got {target!r}")
        out.append((pattern, None if target == FULL_PRECISION else target))
    return tuple(out)


LAST_PRODUCT = "<last product>"
"""Rule pattern matching the last product in call order (the head, whatever its name)."""


def resolve_config(path: str, rules: Sequence[Rule], default: Optional[QuantConfig],
                   last: Optional[str] = None):
    """The config of the product at `path`: the first rule whose regex `re.search`es it.

    The pattern `LAST_PRODUCT` matches the product whose path is `last` (the last
    product of the model's call, found by a trace).

    Example:
      >>> resolve_config("head", [("head", None)], cpt_jax.CPT_CONFIG) is None
      True
      >>> resolve_config("Dense_1", [(LAST_PRODUCT, None)], cpt_jax.CPT_CONFIG,
      ...                last="Dense_1") is None
      True
    """
    for pattern, target in rules:
        if pattern == LAST_PRODUCT:
            if path == last:
                return target
        elif re.search(pattern, path):
            return target
    return default


def rule_matches(pattern: str, paths: Sequence[str], last: Optional[str] = None) -> bool:
    """Whether a rule's pattern matches any of `paths` (`LAST_PRODUCT`: `last` in them)."""
    if pattern == LAST_PRODUCT:
        return last is not None and last in paths
    return any(re.search(pattern, p) for p in paths)


def module_path(module) -> str:
    """The ``/``-joined path of a bound Linen module (``"encoder/layer_0/attn"``); the
    root module (empty path) is named by its class (``"Dense"``)."""
    try:
        path = "/".join(str(p) for p in module.path)
    except Exception:  # pragma: no cover - unbound module
        path = module.name or ""
    return path or type(module).__name__
