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

**Names.** A product is named by the module that computed it (`cpt_jax.interception._call_sites`)
plus the op within that module call, ``<module path>/<op>_<i>`` with ``op`` the JAX
function the model called (``einsum``, ``matmul`` for ``@``, ``dot``,
``dot_general``, ``conv``, ``ragged_dot``; ``i`` counts that op within one call of
the module, so names are the same on every call and under ``scan`` / ``remat`` /
``vmap``); a method other than ``__call__`` adds its name
(``encoder/encode/einsum_0``). Flax's own layers keep the names they always had:
the single product of a ``Dense``, ``DenseGeneral``, ``Conv``, ``ConvTranspose``,
``ConvLocal``, ``Einsum`` (NNX: ``Linear``, ``LinearGeneral``, ``Conv``,
``ConvTranspose``, ``Einsum``) is the module path; an ``Embed``'s lookup is its
path and its ``attend`` is ``<path>/attend``; the two activation products of an
attention (Flax's ``dot_product_attention``, ``jax.nn.dot_product_attention``, or
any product of two activations computed by ``MultiHeadDotProductAttention`` /
``nnx.MultiHeadAttention``) are ``<path>/query_key`` and ``<path>/weights_value``.

**Operands.** An operand that is a parameter (or derived from one by single-input
operations) is a weight: quantized with ``config.weight`` per output channel (its
last output axis); any other operand is an activation.

**Never silent.** A product traced inside a Pallas kernel, inside the user's own
``custom_vjp``/``custom_jvp`` function, or in cuDNN attention
(``jax.nn.dot_product_attention(implementation="cudnn")``) warns once with its
path and stays as it is. ``implementation=None`` runs XLA's attention, whose
products are quantized.

**One compile.** jit caches traces of functions it has seen (a ``jax.jit`` inside
the model, a ``lax.scan`` body function traced before); a cached trace would skip
the interception or reuse another product's widths. JAX's trace caches key on a
config state of cpt_jax's (an epoch in the trace context): inside a model call it
differs from its value outside, and a product traced in such a nested trace
advances it, so no trace holding a product is reused by another product or call.
``jnp.matmul``-style jitted helpers run their Python body instead (their operands
stay the model's own values), ``jnp.einsum`` without its inner jit. The compiled
program is cached by the outer ``jit`` as usual, and eager calls keep JAX's caches.
"""
from __future__ import annotations

import contextlib
import dataclasses
import inspect
import itertools
import sys
import threading
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx
from jax._src import config as jax_config
from jax.extend.core import get_opaque_trace_state

from cpt_jax import context
from cpt_jax.interception import _call_sites as call_sites
from cpt_jax.interception import _patching as patching
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

T = patching.Target
TARGETS = (
    T("dot_general", "jax._src.lax.lax", "dot_general"),
    T("conv_general_dilated", "jax._src.lax.convolution", "conv_general_dilated"),
    T("ragged_dot_general", "jax._src.lax.lax", "ragged_dot_general"),
    T("einsum", "jax._src.numpy.einsum", "einsum"),
    T("tensordot", "jax._src.numpy.tensor_contractions", "tensordot"),
    T("matmul", "jax._src.numpy.tensor_contractions", "matmul"),
    T("dot", "jax._src.numpy.tensor_contractions", "dot"),
    T("inner", "jax._src.numpy.tensor_contractions", "inner"),
    T("vdot", "jax._src.numpy.tensor_contractions", "vdot"),
    T("matvec", "jax._src.numpy.tensor_contractions", "matvec"),
    T("vecmat", "jax._src.numpy.tensor_contractions", "vecmat"),
    T("take", "jax._src.numpy.indexing", "take"),
    T("conv_general_dilated_patches", "jax._src.lax.other", "conv_general_dilated_patches"),
    T("conv_general_dilated_local", "jax._src.lax.other", "conv_general_dilated_local"),
    T("jax_attention", "jax._src.nn.functions", "dot_product_attention"),
    T("linen_attention", "flax.linen.attention", "dot_product_attention"),
    T("linen_attention_weights", "flax.linen.attention", "dot_product_attention_weights"),
    T("nnx_attention", "flax.nnx.nn.attention", "dot_product_attention"),
    T("nnx_attention_weights", "flax.nnx.nn.attention", "dot_product_attention_weights"),
)
"""The JAX and Flax functions taken over while a quantized model runs."""

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
    """

    rules: tuple
    config: QuantConfig | None
    provider: Any = None
    default: Callable | None = None
    last: str | None = None
    warned: set = dataclasses.field(default_factory=set)

    def resolve(self, path: str) -> QuantConfig | None:
        return resolve_config(path, self.rules, self.config, self.last)

    @property
    def needs_last(self) -> bool:
        return any(pattern == LAST_PRODUCT for pattern, _ in self.rules)

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
    attention: list[_Counts] = dataclasses.field(default_factory=list)

    def counts(self, call: Any) -> _Counts:
        """The op counters of one module call (the frame is kept alive meanwhile)."""
        entry = self._counts.get(id(call))
        if entry is None or entry[0] is not call:
            entry = self._counts[id(call)] = (call, _Counts())
        return entry[1]

    def param_of(self, x: Any, site: call_sites.CallSite) -> str | None:
        if site.module is None or not hasattr(x, "shape"):
            return None
        cached = self._indices.get(id(site.module))
        if cached is None or cached[0] is not site.module:
            cached = self._indices[id(site.module)] = (
                site.module, call_sites.param_index(site.module, self.root))
        return call_sites.operand_param(x, cached[1])


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


def _make_epoch_state():
    name = "cpt_jax_interception_epoch"
    holders = getattr(jax.config, "_value_holders", {})
    if name in holders:
        return holders[name]
    try:
        return jax_config.int_state(name, 0, "cpt_jax: one value per intercepted product, "
                                    "so that no trace is cached across products",
                                    include_in_trace_context=True, include_in_jit_key=True)
    except Exception:  # pragma: no cover - a JAX without config states
        return None


_EPOCH = _make_epoch_state()


def _trace_state():
    return get_opaque_trace_state(convention="cpt_jax")


def _advance_epoch(session: Session) -> None:
    """After a product traced in a trace nested inside the model call (an inner jit,
    a scan body...): a fresh epoch, so neither this call nor a later one reuses that
    trace; sessions then start from a fresh base. Products at the model's own level
    are not cached by anything and leave the epoch as it is (eager calls keep JAX's
    caches)."""
    if _EPOCH is None or _trace_state() == session.trace:
        return
    _EPOCH.set_local(next(_EPOCHS))
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
    session = Session(env, entry, root_name, root, update_state, trace=_trace_state())
    # Inside a model call the epoch is the thread's session base, never the value
    # outside: a trace cached outside (without interception) is not reused inside.
    saved = _EPOCH.swap_local(_LOCAL.base) if _EPOCH is not None else None
    _LOCAL.sessions.append(session)
    try:
        with patching.patched(TARGETS):
            yield session
    finally:
        _LOCAL.sessions.pop()
        if _EPOCH is not None:
            _EPOCH.set_local(saved)


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


def _attention_index(session: Session, site, counts: _Counts, roles) -> int | None:
    """The product's index among attention products: inside an attention function
    (its own counter), or a product of two activations of an attention module."""
    if session.attention:
        return session.attention[-1].next("attention")
    if WEIGHT not in roles and _is_attention_module(site.module):
        return counts.next("attention")
    return None


def product_name(session: Session, site, family: str, roles) -> tuple[str, str, str]:
    """``(path, kind, local)`` of the next product of `site`'s module call (module
    docstring); ``local`` is the path below the module (``""`` for a layer's own)."""
    counts = session.counts(site.call if site.module is not None else session)
    base = site.path if site.module is not None else session.root_name
    first, op = counts.total == 0, (_LOCAL.labels[0] if _LOCAL.labels else family)
    counts.total += 1
    i = _attention_index(session, site, counts, roles)
    if i is not None:
        local = ATTENTION_NAMES[i] if i < len(ATTENTION_NAMES) else f"attention_{i}"
        return f"{base}/{local}", "attention", local
    if first and site.method == "__call__" and isinstance(site.module, SINGLE_PRODUCT_LAYERS):
        return base, family, ""
    if first and site.method == "attend" and isinstance(site.module, EMBED_LAYERS):
        return f"{base}/attend", family, "attend"
    method = "" if site.method == "__call__" else f"{site.method}/"
    op = "conv" if op == "conv_general_dilated" else op
    local = f"{method}{op}_{counts.next(op)}"
    return f"{base}/{local}", family, local


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
        owner = call_sites.absolute_path(site.module)
        roles, params = (ACTIVATION, WEIGHT), (None, f"{owner}/{weight}" if owner else weight)
    return roles, params


# --------------------------------------------------------------------------- products

def _site(session: Session) -> call_sites.CallSite:
    # Frames: this function, the handler, `_dispatch`, patching's stub(s); start above them.
    frame = sys._getframe(1)
    while frame is not None and (frame.f_code.co_filename in _OWN_FILES):
        frame = frame.f_back
    return call_sites.locate(frame, session.entry)


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


def _product(session: Session, family: str, op: ProductOp, lhs, rhs, apply: Callable,
             reduction_divisor: int = 1):
    """Name, resolve and compute one product (module docstring)."""
    site = _site(session)
    if site.unreachable == "shape":
        return apply(lhs, rhs)
    roles, params = _operands(session, site, family, lhs, rhs)
    name, kind, local = product_name(session, site, family, roles)
    if site.unreachable is not None:
        _warn_once(session, name, site.unreachable, _UNREACHABLE[site.unreachable])
        if site.unreachable == "pallas":
            return apply(lhs, rhs)
    cfg = None if site.unreachable else session.env.resolve(name)
    session.seen.append(name)
    product = make_product(name, kind, cfg, op, jnp.shape(lhs), jnp.shape(rhs), roles,
                           state_module(site.module, session), params,
                           call_sites.absolute_path(site.module), local)
    if reduction_divisor > 1:
        product = dataclasses.replace(product, reduction=product.reduction // reduction_divisor)
    try:
        with jax.disable_jit(False):
            return compute_product(product, lhs, rhs, apply, session.env.provider_for(cfg))
    finally:
        _advance_epoch(session)


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


def _on_dot_general(session, name, args, kwargs):
    a = _arguments(name, args, kwargs)
    lhs, rhs, dims = a.pop("lhs"), a.pop("rhs"), a.pop("dimension_numbers")
    fn = patching.original(name)

    def apply(x, y):
        return fn(x, y, dims, **a)

    return _product(session, "dot_general", dot_general_op(dims), lhs, rhs, apply)


def _on_conv(session, name, args, kwargs):
    a = _arguments(name, args, kwargs)
    lhs, rhs = a.pop("lhs"), a.pop("rhs")
    op = conv_op(jnp.shape(lhs), jnp.shape(rhs), a["window_strides"], a["padding"],
                 a["lhs_dilation"], a["rhs_dilation"], a["dimension_numbers"],
                 a["feature_group_count"], a["batch_group_count"])
    fn = patching.original(name)

    def apply(x, y):
        return fn(x, y, **a)

    return _product(session, "conv", op, lhs, rhs, apply)


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
    return _product(session, "ragged_dot", op, lhs, rhs, apply, reduction_divisor=groups)


def _on_jitted(session, name, args, kwargs):
    """A jitted jnp product (``jnp.matmul``, ``@``...): its Python body, outside jit,
    so the operands seen by ``lax.dot_general`` are the model's own values."""
    with _label(name):
        return patching.python_implementation(name)(*args, **kwargs)


def _on_einsum(session, name, args, kwargs):
    with _label(name), jax.disable_jit():
        return patching.original(name)(*args, **kwargs)


def _on_labelled(session, name, args, kwargs):
    with _label(name):
        return patching.original(name)(*args, **kwargs)


def _on_conv_local(session, name, args, kwargs):
    """An unshared convolution (``nn.ConvLocal``) is one product: its input is
    quantized before the patches are extracted (the padding stays exact zeros, as in
    a convolution), its kernel ``(..., K, features)`` per output feature."""
    a = _arguments(name, args, kwargs)
    lhs, rhs = a.pop("lhs"), a.pop("rhs")
    fn = patching.original(name)

    def apply(x, y):
        return fn(x, y, **a)

    site = _site(session)
    if site.unreachable == "shape":
        return apply(lhs, rhs)
    spatial = tuple(range(1, jnp.ndim(lhs) - 1))
    rhs_ndim = jnp.ndim(rhs)
    roles = (ACTIVATION, WEIGHT)
    name_, _, local = product_name(session, site, "conv", roles)
    cfg = session.env.resolve(name_)
    session.seen.append(name_)
    product = Product(name_, "conv", cfg, Operand(ACTIVATION, (jnp.ndim(lhs) - 1,)),
                      Operand(WEIGHT, tuple(range(rhs_ndim - 1)), rhs_ndim - 1,
                              session.param_of(rhs, site)),
                      ErrorAxes((jnp.ndim(lhs) - 1,), (0,) + spatial),
                      reduction=int(jnp.shape(rhs)[-2]), owner=call_sites.absolute_path(site.module),
                      local=local, module=state_module(site.module, session))
    try:
        return compute_product(product, lhs, rhs, apply, session.env.provider_for(cfg))
    finally:
        _advance_epoch(session)


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


def _on_take(session, name, args, kwargs):
    fn = patching.original(name)
    site = _site(session)
    if not (isinstance(site.module, EMBED_LAYERS) and site.method == "__call__"):
        return fn(*args, **kwargs)
    a = _arguments(name, args, kwargs)
    table, indices = a.pop("a"), a.pop("indices")
    param = session.param_of(table, site)
    if a.get("axis") != 0 or (param is None and jnp.ndim(table) != 2):
        return fn(*args, **kwargs)
    counts = session.counts(site.call)
    local = "" if counts.total == 0 else f"take_{counts.next('take')}"
    path = f"{site.path}/{local}" if local else site.path
    counts.total += 1
    cfg = session.env.resolve(path)
    session.seen.append(path)
    product = Product(path, "lookup", cfg, Operand(INDEX, ()), Operand(WEIGHT, (), 0, param),
                      ErrorAxes((), ()), reduction=0, owner=call_sites.absolute_path(site.module),
                      local=local, module=state_module(site.module, session))

    def apply(ix, t):
        return fn(t, ix, **a)

    try:
        return compute_product(product, indices, table, apply, session.env.provider_for(cfg))
    finally:
        _advance_epoch(session)


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
    session = active_session()
    if session is None:
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
