"""Interception at the operations: every product a quantized model computes.

While a model wrapped by `cpt_jax.quantize_model` runs (Linen ``init`` / ``apply``
with any ``method=``, NNX any method), the JAX functions that compute products are
taken over (`cpt_jax.interception._patching`) and each product goes through the seam
(`cpt_jax.interception.compute_product`) to its provider:

=============================  =====================================================
JAX function                   what it is
=============================  =====================================================
``lax.dot_general``            one product, whoever calls it: ``x @ w``,
                               ``jnp.matmul`` / ``dot`` / ``einsum`` / ``tensordot``
                               / ``inner`` / ``vdot``, Flax's layers, the XLA
                               implementation of ``jax.nn.dot_product_attention``
``lax.conv_general_dilated``   one product (``lax.conv``, ``conv_transpose``,
                               grouped and dilated convolutions, ``nn.Conv*``)
``lax.ragged_dot(_general)``   one product (mixture of experts)
``jnp.take`` in an ``Embed``   the lookup (0 MACs; the table is quantized per row)
=============================  =====================================================

**Only the model's own products.** A product function called from JAX's own
differentiation, transposition, batching or lowering rules (``ragged_dot``'s JVP
rule calls ``ragged_dot_general``; a batching rule calls ``dot_general``) is JAX
computing a derivative of a product already intercepted: it runs as JAX defines
it, on operands the provider has already quantized
(`cpt_jax.interception._jax_internals.called_by_jax_rule`).

**Names.** A product is named by the module that computed it, its full path
through Flax's bridges and ``nn.share_scope`` (`cpt_jax.interception._call_sites`),
plus the op within that module call, ``<module path>/<op>_<i>`` with ``op`` the JAX
function the model called (``einsum``, ``matmul`` for ``@``, ``dot``,
``dot_general``, ``conv``, ``ragged_dot``; ``i`` counts that op within one call of
the module, so names are the same on every call and under ``scan`` / ``remat`` /
``vmap``); a method other than ``__call__`` adds its name
(``encoder/encode/einsum_0``). A module called again in the same model call (a
shared layer) gives its products a call index: ``block/dense``, then
``block/dense@1``; no two products of one call share a name. Flax's own layers keep the names they always had:
the single product of a ``Dense``, ``DenseGeneral``, ``Conv``, ``ConvTranspose``,
``ConvLocal``, ``Einsum`` (NNX: ``Linear``, ``LinearGeneral``, ``Conv``,
``ConvTranspose``, ``Einsum``) is the module path; an ``Embed``'s lookup is its
path and its ``attend`` is ``<path>/attend``; the two activation products of an
attention (Flax's ``dot_product_attention``, ``jax.nn.dot_product_attention``, or
any product of two activations computed by ``MultiHeadDotProductAttention`` /
``nnx.MultiHeadAttention``) are ``<path>/query_key`` and ``<path>/weights_value``.

**Operands.** An operand that is a parameter (or derived from one by single-input
operations) is a weight: quantized with ``config.weight`` per output channel (its
last output axis); any other operand is an activation. A ``dot_general`` that
contracts no dimension (an elementwise scale written as an einsum,
``"...d,d->...d"``) saves no MACs: it is computed as JAX does, neither counted nor
quantized, unless a rule names it.

**Never silent.** A product traced inside a Pallas kernel, inside the user's own
``custom_vjp``/``custom_jvp`` function, or in cuDNN attention
(``jax.nn.dot_product_attention(implementation="cudnn")``) warns once with its
path and stays as it is. ``implementation=None`` runs XLA's attention, whose
products are quantized.

**One compile.** jit caches traces of functions it has seen (a ``jax.jit`` inside
the model, a ``lax.scan`` body function traced before); a cached trace would skip
the interception or reuse another product's widths. JAX's trace caches key on an
epoch of cpt_jax's (a `jax.make_user_context`, created on the first quantized
call): inside a model call it differs from its value outside (None), and a product
traced in such a nested trace advances it, so no trace holding a product is reused
by another product or call; code outside quantized calls keeps its keys.
``jnp.matmul``-style jitted helpers run their Python body instead (their operands
stay the model's own values), ``jnp.einsum`` without its inner jit. The compiled
program is cached by the outer ``jit`` as usual, and eager calls keep JAX's caches.
"""
from __future__ import annotations

import contextlib
import dataclasses
import inspect
import itertools
import re
import sys
import threading
import types
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx

from cpt_jax import context
from cpt_jax.interception import _call_sites as call_sites
from cpt_jax.interception import _patching as patching
from cpt_jax.interception._jax_internals import (
    TARGETS,
    cache_context,
    called_by_jax_rule,
    trace_state,
)
from cpt_jax.interception._product import (
    ACTIVATION,
    INDEX,
    WEIGHT,
    ErrorAxes,
    Operand,
    Product,
    compute_product,
    make_product,
)
from cpt_jax.interception._rules import LAST_PRODUCT, resolve_config
from cpt_jax.ops.product_op import ProductOp, conv_op, dot_general_op
from cpt_jax.quant_config import QuantConfig

ATTENTION_NAMES = ("query_key", "weights_value")
SINGLE_PRODUCT_LAYERS = (nn.Dense, nn.DenseGeneral, nn.Conv, nn.ConvTranspose, nn.ConvLocal,
                         nn.Einsum, nnx.Linear, nnx.LinearGeneral, nnx.Conv, nnx.ConvTranspose,
                         nnx.Einsum)
"""Layers whose one product is named by the module path (and whose right operand is
their kernel)."""
EMBED_LAYERS = (nn.Embed, nnx.Embed)
ATTENTION_LAYERS = (nn.MultiHeadDotProductAttention, nnx.MultiHeadAttention)
ATTENTION_FIELDS = ("qk_attn_weights_einsum_cls", "attn_weights_value_einsum_cls")
"""A Linen module with these fields (Flax's convention) is an attention module too."""
CALL_SEPARATOR = "@"
"""Between a product's name and the call index of its module (``block/dense@1``)."""


# --------------------------------------------------------------------------- sessions

@dataclasses.dataclass
class Interception:
    """What one `quantize_model` intercepts with: rules, default config, provider.

    Attributes:
      rules: normalized ``((regex, QuantConfig | None), ...)``.
      config: the config of products no rule matches.
      provider: what computes every product (None: ``default(config)``).
      default: the provider a config asks for (`cpt_jax.providers.default_provider`,
        set by `cpt_jax.quantize_model`; interception knows no provider itself).
      last: the path of the last product of the current call (`LAST_PRODUCT`).
      warned: ``(path, reason)`` pairs already warned about (warn once).
      lasts: the last product of each kind of call seen, ``{call signature: path}``
        (shared by every call of the model; filled by the calls themselves).
    """

    rules: tuple
    config: QuantConfig | None
    provider: Any = None
    default: Callable | None = None
    last: str | None = None
    warned: set = dataclasses.field(default_factory=set)
    lasts: dict = dataclasses.field(default_factory=dict)

    def resolve(self, path: str) -> QuantConfig | None:
        return resolve_config(path, self.rules, self.config, self.last)

    @property
    def needs_last(self) -> bool:
        return any(pattern == LAST_PRODUCT for pattern, _ in self.rules)

    def named(self, path: str) -> bool:
        """Whether a rule's regex (not `LAST_PRODUCT`) picks `path` for quantization."""
        for pattern, target in self.rules:
            if pattern != LAST_PRODUCT and re.search(pattern, path):
                return target is not None
        return False

    def provider_for(self, config):
        if self.provider is not None:
            return self.provider
        if self.default is None:
            raise ValueError("no provider: pass provider= or a default (quantize_model sets "
                             "cpt_jax.providers.default_provider)")
        return self.default(config)


@dataclasses.dataclass
class _Counts:
    total: int = 0
    by_op: dict[str, int] = dataclasses.field(default_factory=dict)

    def next(self, op: str) -> int:
        i = self.by_op.get(op, 0)
        self.by_op[op] = i + 1
        return i


@dataclasses.dataclass
class Session:
    """One top-level call of a quantized model in one thread.

    Attributes:
      env: the model's `Interception`.
      entry: the door's frame (module frames lie below it on the stack).
      root_name: the root model's class name (products outside any module).
      root: the NNX root module (None for Linen).
      update_state: whether NNX providers may update their state (train mode).
      seen: product paths in call order.
      trace: JAX's trace at the door (products in other traces are nested).
      quantized: how many products a provider computed so far (the others are
        computed as written).
    """

    env: Interception
    entry: Any
    root_name: str
    root: Any = None
    update_state: bool = True
    seen: list[str] = dataclasses.field(default_factory=list)
    trace: Any = None
    _counts: dict[int, tuple[Any, _Counts]] = dataclasses.field(default_factory=dict)
    _indices: dict[int, tuple[Any, dict]] = dataclasses.field(default_factory=dict)
    _values: dict[int, tuple[Any, dict]] = dataclasses.field(default_factory=dict)
    _names: dict[str, Any] = dataclasses.field(default_factory=dict)
    _callers: dict[int, tuple] = dataclasses.field(default_factory=dict)
    paths: dict = dataclasses.field(default_factory=dict)
    attention: list[_Counts] = dataclasses.field(default_factory=list)
    epochs: list = dataclasses.field(default_factory=list)
    quantized: int = 0

    def counts(self, call: Any) -> _Counts:
        """The op counters of one module call (the frame is kept alive meanwhile)."""
        entry = self._counts.get(id(call))
        if entry is None or entry[0] is not call:
            entry = self._counts[id(call)] = (call, _Counts())
        return entry[1]

    def unique_name(self, name: str, call: Any) -> str:
        """`name` for a product of the module call `call`, or ``name@k`` (the first
        ``k`` free) when another call of the same module took `name` already (the
        same call traced again keeps its name: `call_sites.same_call`)."""
        candidate, k = name, 0
        while True:
            taken = self._names.setdefault(candidate, call)
            if taken is call or (isinstance(call, types.FrameType)
                                 and isinstance(taken, types.FrameType)
                                 and call_sites.same_call(self._callers[id(taken)],
                                                          self.callers_of(call))):
                return candidate
            k += 1
            candidate = f"{name}{CALL_SEPARATOR}{k}"

    def callers_of(self, call: Any) -> tuple:
        """The frames from module call `call` out to the door (kept from its first product)."""
        if not isinstance(call, types.FrameType):
            return ()
        found = self._callers.get(id(call))
        if found is None or found[0] is not call:
            found = self._callers[id(call)] = call_sites.callers(call, self.entry)
        return found

    def param_of(self, x: Any, site: call_sites.CallSite) -> str | None:
        """The path of the parameter `x` is or is derived from (traced: through the
        equations; eagerly: a rearrangement of its elements), None for an activation."""
        if site.module is None or not hasattr(x, "shape"):
            return None
        prefix = site.owner if isinstance(site.module, nnx.Module) else site.prefix
        cached = self._indices.get(id(site.module))
        if cached is None or cached[0] is not site.module:
            cached = self._indices[id(site.module)] = (
                site.module, call_sites.param_index(site.module, self.root, prefix))
        path = call_sites.operand_param(x, cached[1])
        if path is not None or not call_sites.is_concrete(x):
            return path
        values = self._values.get(id(site.module))
        if values is None or values[0] is not site.module:
            values = self._values[id(site.module)] = (
                site.module, call_sites.param_values(site.module, self.root, prefix))
        return call_sites.rearranged_param(x, values[1])

    def enter_epoch(self, value: int) -> None:
        """Key JAX's caches on `value` from here to the end of the call (thread-local)."""
        manager = cache_context()(value)
        manager.__enter__()
        self.epochs.append(manager)

    def exit_epochs(self) -> None:
        while self.epochs:
            self.epochs.pop().__exit__(None, None, None)


_EPOCHS = itertools.count(1)


class _Local(threading.local):
    def __init__(self):
        self.sessions: list[Session] = []
        self.labels: list[str] = []
        self.base: int = next(_EPOCHS)


_LOCAL = _Local()


def active_session() -> Session | None:
    """The session products are intercepted for in this thread (None inside a
    provider's computation or outside any quantized model)."""
    if not _LOCAL.sessions or context.inside_quant_call():
        return None
    return _LOCAL.sessions[-1]


def in_session() -> bool:
    """Whether a quantized model is running in this thread (even inside a provider)."""
    return bool(_LOCAL.sessions)


def _advance_epoch(session: Session) -> None:
    """After a product traced in a trace nested inside the model call (an inner jit,
    a scan body...): a fresh epoch, so neither this call nor a later one reuses that
    trace; sessions then start from a fresh base. Products at the model's own level
    are not cached by anything and leave the epoch as it is (eager calls keep JAX's
    caches)."""
    if trace_state() == session.trace:
        return
    session.enter_epoch(next(_EPOCHS))
    _LOCAL.base = next(_EPOCHS)


@contextlib.contextmanager
def intercepting(env: Interception, entry, root_name: str, root: Any = None,
                 update_state: bool = True) -> Iterator[Session]:
    """Route every product computed in the block (this thread) through `env`.

    Args:
      env: the model's `Interception`.
      entry: the caller's frame (``sys._getframe()`` in the door's method).
      root_name: the name of products computed outside any module.
      root: the NNX root module, if any.
      update_state: whether stateful providers update their NNX state.
    """
    session = Session(env, entry, root_name, root, update_state, trace=trace_state())
    with patching.patched(TARGETS), context.model_call():
        # Inside a model call the epoch is the thread's session base, never the value
        # outside: a trace cached outside (without interception) is not reused inside.
        session.enter_epoch(_LOCAL.base)
        _LOCAL.sessions.append(session)
        try:
            yield session
        finally:
            _LOCAL.sessions.pop()
            session.exit_epochs()


@contextlib.contextmanager
def _label(op: str) -> Iterator[None]:
    """Name the products computed inside by the user-facing op (the outermost)."""
    _LOCAL.labels.append(op)
    try:
        yield
    finally:
        _LOCAL.labels.pop()


# --------------------------------------------------------------------------- naming

def _is_attention_module(module: Any) -> bool:
    if isinstance(module, ATTENTION_LAYERS):
        return True
    fields = getattr(module, "__dataclass_fields__", {})
    return isinstance(module, nn.Module) and all(f in fields for f in ATTENTION_FIELDS)


def _attention_index(session: Session, site, counts: _Counts, family: str,
                     roles) -> int | None:
    """The product's index among attention products: inside an attention function
    (its own counter), or a product of two activations of an attention module."""
    if family == "lookup":
        return None
    if session.attention:
        return session.attention[-1].next("attention")
    if WEIGHT not in roles and _is_attention_module(site.module):
        return counts.next("attention")
    return None


def _local_name(session: Session, site, family: str, roles) -> tuple[str, str]:
    """``(kind, local)``: the product's name below its module (module docstring)."""
    counts = session.counts(site.call if site.module is not None else session)
    first, op = counts.total == 0, (_LOCAL.labels[0] if _LOCAL.labels else family)
    counts.total += 1
    i = _attention_index(session, site, counts, family, roles)
    if i is not None:
        return "attention", ATTENTION_NAMES[i] if i < len(ATTENTION_NAMES) else f"attention_{i}"
    if first and site.method == "__call__":
        if family == "lookup" and isinstance(site.module, EMBED_LAYERS):
            return family, ""
        if family != "lookup" and isinstance(site.module, SINGLE_PRODUCT_LAYERS):
            return family, ""
    if first and site.method == "attend" and isinstance(site.module, EMBED_LAYERS):
        return family, "attend"
    method = "" if site.method == "__call__" else f"{site.method}/"
    op = {"conv_general_dilated": "conv", "lookup": "take"}.get(op, op)
    return family, f"{method}{op}_{counts.next(op)}"


def product_name(session: Session, site, family: str, roles) -> tuple[str, str, str]:
    """``(path, kind, local)`` of the next product of `site`'s module call (module
    docstring); ``local`` is the path below the module (``""`` for a layer's own)."""
    base = site.path if site.module is not None else session.root_name
    kind, local = _local_name(session, site, family, roles)
    call = site.call if site.module is not None else session
    session.callers_of(call)  # while the call runs
    return session.unique_name(call_sites.join(base, local), call), kind, local


def _operands(session: Session, site, family: str, lhs, rhs) -> tuple[tuple, tuple]:
    """``((lhs role, rhs role), (lhs param, rhs param))``: parameters are weights.
    Without a traced link to one (eager execution), the first product of a Flax
    layer with a kernel takes its right operand as that kernel."""
    params = (session.param_of(lhs, site) if family != "conv" else None,
              session.param_of(rhs, site))
    roles = tuple(ACTIVATION if p is None else WEIGHT for p in params)
    if (roles == (ACTIVATION, ACTIVATION) and not session.attention
            and isinstance(site.module, SINGLE_PRODUCT_LAYERS + EMBED_LAYERS)
            and session.counts(site.call).total == 0):
        weight = "embedding" if isinstance(site.module, EMBED_LAYERS) else "kernel"
        roles, params = (ACTIVATION, WEIGHT), (None, call_sites.join(site.owner, weight))
    return roles, params


# --------------------------------------------------------------------------- products

def _site(session: Session) -> call_sites.CallSite:
    # Frames: the handlers, `_dispatch`, patching's stub(s); start above them.
    frame = sys._getframe(1)
    while frame is not None and (frame.f_code.co_filename in _OWN_FILES):
        frame = frame.f_back
    return call_sites.locate(frame, session.entry, session.paths)


def _warn_once(session: Session, path: str, reason: str, message: str) -> None:
    if (path, reason) in session.env.warned:
        return
    session.env.warned.add((path, reason))
    warnings.warn(f"{path}: {message}", UserWarning, stacklevel=3)


_UNREACHABLE = {
    "pallas": ("a product inside a Pallas kernel cannot be quantized by cpt_jax: it "
               "keeps the kernel's precision and is not counted in the cost"),
    "custom_vjp": ("a product inside a custom_vjp/custom_jvp function has the "
                   "function's own backward rule, which cpt_jax cannot quantize: it "
                   "stays fp32 (counted at 32 bits)"),
}


@dataclasses.dataclass(frozen=True)
class ProductCall:
    """One call of a JAX product function, as a handler read it.

    Attributes:
      family: ``"dot_general"``, ``"conv"``, ``"ragged_dot"`` or ``"lookup"``.
      lhs, rhs: the operands as called (a lookup: indices, table).
      apply: ``apply(lhs, rhs) -> y``, the call itself on any operands.
      describe: ``describe(path, kind, local, config, roles, params, module, owner) ->
        Product``.
      roles: fixed operand roles (None: parameters are weights, `_operands`).
      contracts: False for a product without contraction (no MACs: not a product
        unless a rule names it).
      exact: the call as written, where `apply` lays it out otherwise (computed when
        the product is not quantized: `compute_product`); None: `apply`.
    """

    family: str
    lhs: Any
    rhs: Any
    apply: Callable
    describe: Callable[..., Product]
    roles: tuple | None = None
    contracts: bool = True
    exact: Callable | None = None


def _product(session: Session, call: ProductCall, site=None):
    """The one path of every product: name, rules, unreachable warnings, record and
    compute through the provider (module docstring)."""
    site = site or _site(session)
    if site.unreachable == "shape":
        return call.apply(call.lhs, call.rhs)
    if call.roles is None:
        roles, params = _operands(session, site, call.family, call.lhs, call.rhs)
    else:
        roles = call.roles
        params = tuple(session.param_of(x, site) if r == WEIGHT else None
                       for x, r in zip((call.lhs, call.rhs), roles))
    name, kind, local = product_name(session, site, call.family, roles)
    if not call.contracts and not session.env.named(name):
        return call.apply(call.lhs, call.rhs)
    if site.unreachable is not None:
        _warn_once(session, name, site.unreachable, _UNREACHABLE[site.unreachable])
        if site.unreachable == "pallas":
            return call.apply(call.lhs, call.rhs)
    cfg = None if site.unreachable else session.env.resolve(name)
    session.seen.append(name)
    session.quantized += cfg is not None and context.current_precision() is not None
    product = call.describe(name, kind, local, cfg, roles, params,
                            state_module(site.module, session), site.owner)
    try:
        with jax.disable_jit(False):
            return compute_product(product, call.lhs, call.rhs, call.apply,
                                   session.env.provider_for(cfg), exact=call.exact)
    finally:
        _advance_epoch(session)


def _describe_op(op: ProductOp, lhs, rhs, reduction_divisor: int = 1) -> Callable[..., Product]:
    def describe(path, kind, local, cfg, roles, params, module, owner):
        product = make_product(path, kind, cfg, op, jnp.shape(lhs), jnp.shape(rhs), roles,
                               module, params, owner, local)
        if reduction_divisor > 1:
            product = dataclasses.replace(product,
                                          reduction=product.reduction // reduction_divisor)
        return product
    return describe


# --------------------------------------------------------------------------- handlers

_SIGNATURES: dict[str, inspect.Signature] = {}


def _arguments(name: str, args, kwargs) -> dict:
    """The call's arguments by parameter name (defaults applied)."""
    sig = _SIGNATURES.get(name)
    if sig is None:
        sig = _SIGNATURES[name] = inspect.signature(patching.original(name))
    bound = sig.bind(*args, **kwargs)
    bound.apply_defaults()
    return dict(bound.arguments)


def _flattens(dims, x, y) -> bool:
    """Whether a quantized ``dot_general(x, y, dims)`` is computed as one 2-D GEMM: on
    CPU, for ``(..., K) x (K, N)`` over several leading axes (x's last axis against
    y's first, y 2-D, no batch axes). XLA CPU then reads the weight gradient's error
    as it is, where for the 3-D product it writes a transposed copy (the Transformer
    block's step, `benchmarks/overhead.py`'s ``fp32_cpt``). Not on GPU/TPU, whose
    GEMMs take transposed operands as they are, and where merging a sharded sequence
    axis into the batch could make GSPMD regather it. A product that is not quantized
    is computed as written (`ProductCall.exact`): eagerly, XLA sums a 4-D product in
    another order than its 2-D GEMM, and the model would not be the model."""
    (lc, rc), (lb, rb) = dims
    return (getattr(x, "ndim", 0) > 2 and getattr(y, "ndim", 0) == 2 and not lb and not rb
            and tuple(lc) in ((x.ndim - 1,), (-1,)) and tuple(rc) == (0,)
            and jax.default_backend() == "cpu")


def _on_dot_general(session, name, args, kwargs):
    a = _arguments(name, args, kwargs)
    lhs, rhs, dims = a.pop("lhs"), a.pop("rhs"), a.pop("dimension_numbers")
    fn = patching.original(name)

    def apply(x, y):
        if _flattens(dims, x, y):  # (..., K) x (K, N): one (M, K) x (K, N) GEMM
            out = fn(x.reshape(-1, x.shape[-1]), y, (((1,), (0,)), ((), ())), **a)
            return out.reshape(*x.shape[:-1], y.shape[1])
        return fn(x, y, dims, **a)

    (lc, _), _ = dims
    op = dot_general_op(dims)
    return _product(session, ProductCall("dot_general", lhs, rhs, apply,
                                         _describe_op(op, lhs, rhs), contracts=bool(lc),
                                         exact=lambda x, y: fn(x, y, dims, **a)))


def _on_conv(session, name, args, kwargs):
    a = _arguments(name, args, kwargs)
    lhs, rhs = a.pop("lhs"), a.pop("rhs")
    op = conv_op(jnp.shape(lhs), jnp.shape(rhs), a["window_strides"], a["padding"],
                 a["lhs_dilation"], a["rhs_dilation"], a["dimension_numbers"],
                 a["feature_group_count"], a["batch_group_count"])
    fn = patching.original(name)

    def apply(x, y):
        return fn(x, y, **a)

    return _product(session, ProductCall("conv", lhs, rhs, apply, _describe_op(op, lhs, rhs)))


def _on_ragged_dot(session, name, args, kwargs):
    a = _arguments(name, args, kwargs)
    lhs, rhs, group_sizes = a.pop("lhs"), a.pop("rhs"), a.pop("group_sizes")
    dims = a["ragged_dot_dimension_numbers"]
    fn = patching.original(name)

    def apply(x, y):
        return fn(x, y, group_sizes, **a)

    (lc, _), _ = dims.dot_dimension_numbers
    contracted_ragged = any(d in lc for d in dims.lhs_ragged_dimensions)
    groups = jnp.shape(group_sizes)[-1] if contracted_ragged else 1
    op = ProductOp("ragged_dot", dimension_numbers=dims)
    return _product(session, ProductCall("ragged_dot", lhs, rhs, apply,
                                         _describe_op(op, lhs, rhs, groups)))


def _on_conv_local(session, name, args, kwargs):
    """An unshared convolution (``nn.ConvLocal``) is one product: its input is
    quantized before the patches are extracted (the padding stays exact zeros, as in
    a convolution), its kernel ``(..., K, features)`` per output feature."""
    a = _arguments(name, args, kwargs)
    lhs, rhs = a.pop("lhs"), a.pop("rhs")
    fn = patching.original(name)

    def apply(x, y):
        return fn(x, y, **a)

    def describe(path, kind, local, cfg, roles, params, module, owner):
        lhs_nd, rhs_nd = jnp.ndim(lhs), jnp.ndim(rhs)
        spatial = tuple(range(1, lhs_nd - 1))
        return Product(path, "conv", cfg, Operand(ACTIVATION, (lhs_nd - 1,)),
                       Operand(WEIGHT, tuple(range(rhs_nd - 1)), rhs_nd - 1, params[1]),
                       ErrorAxes((lhs_nd - 1,), (0,) + spatial),
                       reduction=int(jnp.shape(rhs)[-2]), owner=owner, local=local,
                       module=module)

    return _product(session, ProductCall("conv", lhs, rhs, apply, describe,
                                         roles=(ACTIVATION, WEIGHT)))


def _on_take(session, name, args, kwargs):
    """A lookup in an embedding table (``Embed.__call__``): one product of 0 MACs
    whose table is quantized (per row); any other ``jnp.take`` is not a product."""
    fn = patching.original(name)
    site = _site(session)
    if not (isinstance(site.module, EMBED_LAYERS) and site.method == "__call__"):
        return fn(*args, **kwargs)
    a = _arguments(name, args, kwargs)
    table, indices = a.pop("a"), a.pop("indices")
    if a.get("axis") != 0 or (session.param_of(table, site) is None and jnp.ndim(table) != 2):
        return fn(*args, **kwargs)

    def apply(ix, t):
        return fn(t, ix, **a)

    def describe(path, kind, local, cfg, roles, params, module, owner):
        return Product(path, "lookup", cfg, Operand(INDEX, ()), Operand(WEIGHT, (), 0, params[1]),
                       ErrorAxes((), ()), reduction=0, owner=owner, local=local, module=module)

    return _product(session, ProductCall("lookup", indices, table, apply, describe,
                                         roles=(INDEX, WEIGHT)), site)


def _as_written_unless_quantized(session, name, args, kwargs, intercepted: Callable):
    """``intercepted()``: a jitted jnp function run op by op, so that its products are
    intercepted; run eagerly with none of them quantized, the function as written.

    Eagerly, XLA sums a product compiled alone in another order than inside the
    jitted function, so a model outside a `precision` context would not compute
    what it computes outside cpt_jax; the op-by-op values are then dropped, and the
    second call is not intercepted (`quant_call_guard`). Under a trace both are the
    same program to XLA, and the op-by-op values are kept (no dead copy in the jaxpr).
    """
    before = session.quantized
    out = intercepted()
    if session.quantized != before or not all(map(call_sites.is_concrete, jax.tree.leaves(out))):
        return out   # quantized, or traced (values not computed here)
    with context.quant_call_guard():
        return patching.original(name)(*args, **kwargs)


def _on_jitted(session, name, args, kwargs):
    """A jitted jnp product (``jnp.matmul``, ``@``...): its Python body, outside jit,
    so the operands seen by ``lax.dot_general`` are the model's own values."""
    def intercepted():
        with _label(name):
            return patching.python_implementation(name)(*args, **kwargs)
    return _as_written_unless_quantized(session, name, args, kwargs, intercepted)


def _on_einsum(session, name, args, kwargs):
    def intercepted():
        with _label(name), jax.disable_jit():
            return patching.original(name)(*args, **kwargs)
    return _as_written_unless_quantized(session, name, args, kwargs, intercepted)


def _on_labelled(session, name, args, kwargs):
    with _label(name):
        return patching.original(name)(*args, **kwargs)


def _on_data_movement(session, name, args, kwargs):
    """Patch extraction (``conv_general_dilated_patches``, ``nn.ConvLocal``): a
    convolution with a one-hot kernel, data movement rather than a product."""
    with context.quant_call_guard():
        return patching.original(name)(*args, **kwargs)


@contextlib.contextmanager
def _attention_scope(session: Session) -> Iterator[None]:
    if session.attention:  # nested attention functions: one scope
        yield
        return
    session.attention.append(_Counts())
    try:
        yield
    finally:
        session.attention.pop()


def _on_attention(session, name, args, kwargs):
    fn = patching.original(name)
    if name == "jax_attention":
        a = _arguments(name, args, kwargs)
        if a.get("implementation") not in (None, "xla"):
            site = _site(session)
            path = f"{site.path if site.module is not None else session.root_name}/query_key"
            _warn_once(session, path, "cudnn", "attention computed by cuDNN "
                       "(implementation='cudnn') cannot be quantized by cpt_jax: it stays "
                       "as it is; implementation=None runs XLA's attention, quantized")
            return fn(*args, **kwargs)
        a["implementation"] = "xla"
        with _attention_scope(session):
            return fn(**a)
    with _attention_scope(session):
        return fn(*args, **kwargs)


_HANDLERS = {
    "dot_general": _on_dot_general,
    "conv_general_dilated": _on_conv,
    "ragged_dot_general": _on_ragged_dot,
    "einsum": _on_einsum,
    "tensordot": _on_labelled,
    "matmul": _on_jitted, "dot": _on_jitted, "inner": _on_jitted, "vdot": _on_jitted,
    "matvec": _on_jitted, "vecmat": _on_jitted,
    "take": _on_take,
    "conv_general_dilated_patches": _on_data_movement,
    "conv_general_dilated_local": _on_conv_local,
    "jax_attention": _on_attention, "linen_attention": _on_attention,
    "linen_attention_weights": _on_attention, "nnx_attention": _on_attention,
    "nnx_attention_weights": _on_attention,
}


def _dispatch(name: str, args: tuple, kwargs: dict):
    """A call of a taken-over function: the model's own product goes through its
    handler; outside a quantized call, inside a provider, or from JAX's own rules
    (a derivative, a batched or lowered product) it runs as JAX defines it."""
    session = active_session()
    if session is None or called_by_jax_rule(sys._getframe(1)):
        return patching.original(name)(*args, **kwargs)
    return _HANDLERS[name](session, name, args, kwargs)


patching.set_dispatcher(_dispatch)
_OWN_FILES = frozenset({__file__, patching.__file__})


# --------------------------------------------------------------------------- state

@dataclasses.dataclass(eq=False)
class NNXModuleState:
    """The Linen-style state API providers use, on an NNX module.

    A variable ``(collection, name)`` is the attribute ``<collection>__<name>`` of the
    module, an ``nnx.Variable`` of the collection's type
    (``nnx.variable_type_from_name``: ``batch_stats`` -> ``nnx.BatchStat``, others
    registered by name), so ``nnx.state(model, type)`` and checkpoints carry it.
    Collections are mutable while the model is in train mode (``model.train()``,
    the default), read-only after ``model.eval()``.
    """

    module: nnx.Module
    mutable: bool = True

    @staticmethod
    def attribute(collection: str, name: str) -> str:
        return f"{collection}__{name}"

    def has_variable(self, collection: str, name: str) -> bool:
        return isinstance(getattr(self.module, self.attribute(collection, name), None),
                          nnx.Variable)

    def get_variable(self, collection: str, name: str):
        return getattr(self.module, self.attribute(collection, name)).get_value()

    def put_variable(self, collection: str, name: str, value) -> None:
        attr = self.attribute(collection, name)
        if self.has_variable(collection, name):
            getattr(self.module, attr).set_value(value)
        else:
            kind = nnx.variable_type_from_name(collection, allow_register=True)
            setattr(self.module, attr, kind(value))

    def is_mutable_collection(self, collection: str) -> bool:
        del collection
        return self.mutable

    def sow(self, collection: str, name: str, value) -> None:
        kind = nnx.variable_type_from_name(collection, allow_register=True)
        self.module.sow(kind, name, value)

    @property
    def path(self):
        return tuple(p for p in call_sites.module_path(self.module).split("/") if p)

    @property
    def variables(self) -> dict:
        return {}


def state_module(module: Any, session: Session) -> Any:
    """What a provider keeps state in: the bound Linen module, an `NNXModuleState`."""
    if isinstance(module, nnx.Module):
        return NNXModuleState(module, session.update_state)
    return module


__all__ = ["ATTENTION_NAMES", "Interception", "NNXModuleState", "Session", "TARGETS",
           "active_session", "in_session", "intercepting", "product_name", "state_module"]
