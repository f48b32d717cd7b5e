"""Quantizing Linen models: the doors and `quantize_model`, on the interception seam.

1. The Linen idiom: pass the quantized op to the layer,
   ``nn.Dense(..., dot_general_cls=QuantDotGeneral)``,
   ``nn.Conv(..., conv_general_dilated_cls=QuantConvGeneralDilated)`` or the
   attention einsums ``nn.MultiHeadDotProductAttention(...,
   qk_attn_weights_einsum_cls=QuantEinsum, attn_weights_value_einsum_cls=QuantEinsum)``
   (``functools.partial(QuantDotGeneral, config=...)`` for another config). A door
   without a name takes the path of the Linen module calling it.
2. `quantize_model(model, rules)`: any unmodified Linen model becomes quantized, with
   the same `init`/`apply` (any ``method=``) and the same variable tree. Every
   product of the layer types in `LINEN_KINDS` is intercepted
   (`nn.intercept_methods`), named by its module path, and computed by the provider:

   ==========================  ==========================================  =========
   layer                       products (path)                             how
   ==========================  ==========================================  =========
   Dense, DenseGeneral         ``x . W`` (path)                            door
   Conv                        ``conv(x, W)`` (path)                       door
   MultiHeadDotProductAttn.    ``q . k`` (path/query_key), ``weights . v``  door
                               (path/weights_value); its Dense layers too
   Einsum, ConvTranspose,      the layer's product (path)                  operands
   ConvLocal
   Embed                       lookup (path, 0 MACs), ``attend`` (path/attend) operands
   ==========================  ==========================================  =========

   "door": the quantized op is injected for the call; "operands": the layer runs
   as a clone on its quantized input and kernel, its output's error quantized.

With the widths of the enclosing `precision` context (`cpt_jax.providers`):

    y = Q_g^bwd( op(Q_b(x), Q_b(W)) )

Outside a precision context every product is exact fp32 (still recorded for the
cost). `quantized_layers` lists the products with their configs.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import threading
import warnings
from typing import Any, Callable, Optional, Tuple

import flax.linen as nn
import jax

from cpt_jax import context, interception
from cpt_jax.interception import (ACTIVATION, INDEX, LAST_PRODUCT, WEIGHT, ErrorAxes, Operand, Product,
                                  compute_product, conv_op, dot_general_op, einsum_op,
                                  make_product, module_path, normalize_rules, resolve_config,
                                  rule_matches)
from cpt_jax.int8 import INT8, int8_conv, int8_dot_general  # noqa: F401 (re-exported)
from cpt_jax.activation_ranges import RUNNING_RANGES
from cpt_jax.providers import FAKE_QUANT
from cpt_jax.format_providers import provider_for
from cpt_jax.quant_config import CPT_CONFIG, QuantConfig

Array = jax.Array


def default_provider(config: Optional[QuantConfig]):
    """The provider a config asks for: `cpt_jax.int8.INT8` when ``config.int8``,
    `cpt_jax.activation_ranges.RUNNING_RANGES` when ``config.activation_range ==
    "running"``, `cpt_jax.format_providers.provider_for(config)` for FP8 compute and
    block-scaled formats, else CPT's fake quantization (`cpt_jax.providers.FAKE_QUANT`)."""
    if config is not None and config.activation_range == "running":
        return RUNNING_RANGES
    hardware = provider_for(config)
    if hardware is not None:
        return hardware
    return INT8 if config is not None and config.int8 else FAKE_QUANT


def _door_path(kind: str) -> str:
    """The path of the Linen module calling a door (``kind`` outside Linen)."""
    stack = getattr(getattr(nn.module, "_context", None), "module_stack", None) or [None]
    module = stack[-1]
    if module is None or getattr(module, "scope", None) is None:
        return kind
    return module_path(module) or kind


# --------------------------------------------------------------------------- ops

def quantized_dot_general(lhs, rhs, dimension_numbers, precision=None,
                          preferred_element_type=None, *, config: Optional[QuantConfig] = CPT_CONFIG,
                          name: str = "dot_general", provider=None, module=None,
                          kind: str = "dot_general", **kwargs) -> Array:
    """`lax.dot_general` with quantized operands and error: ``Q_g^bwd(Q_b(x) . Q_b(W))``.

    `lhs` is the activation, `rhs` the weight (as in `nn.Dense`). Reads the widths
    from the enclosing `precision` context; exact fp32 outside one or with
    ``config=None``. Records an `OpRecord` for cost accounting.

    Args:
      lhs, rhs, dimension_numbers, precision, preferred_element_type: as
        `lax.dot_general` (an ``out_sharding`` keyword is passed through).
      config: the product's `QuantConfig` (None: fp32).
      name: the product's path in records and rules.
      provider: what computes it (default: `default_provider(config)`).
      module: the Flax module it belongs to, for providers that keep state.
      kind: the record's kind.

    Returns:
      The product.

    Example:
      >>> with cpt_jax.precision(4):
      ...   y = quantized_dot_general(jnp.ones((2, 3)), jnp.ones((3, 4)), (((1,), (0,)), ((), ())))
      >>> y.shape
      (2, 4)
    """
    extra = {k: v for k, v in kwargs.items() if k == "out_sharding" and v is not None}
    op = dot_general_op(dimension_numbers)
    product = make_product(name, kind, config, op, lhs.shape, rhs.shape, module=module)

    def apply(a, b):
        return op.apply(a, b, precision, preferred_element_type, **extra)

    return compute_product(product, lhs, rhs, apply, provider or default_provider(config))


def quantized_conv(lhs, rhs, window_strides, padding, lhs_dilation=None, rhs_dilation=None,
                   dimension_numbers=None, feature_group_count=1, batch_group_count=1,
                   precision=None, preferred_element_type=None, *,
                   config: Optional[QuantConfig] = CPT_CONFIG, name: str = "conv",
                   provider=None, module=None, **kwargs) -> Array:
    """`lax.conv_general_dilated` with quantized input, kernel and error.

    The kernel gets one range per output feature (from `dimension_numbers`) when its
    format is per-channel. Records an `OpRecord` (MACs = |out| * kh kw C_in/groups).
    Arguments as `quantized_dot_general` (the conv's as `lax.conv_general_dilated`).

    Example:
      >>> with cpt_jax.precision(4):
      ...   y = quantized_conv(jnp.ones((1, 5, 5, 3)), jnp.ones((3, 3, 3, 2)), (1, 1),
      ...                      "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
      >>> y.shape
      (1, 5, 5, 2)
    """
    del kwargs
    op = conv_op(lhs.shape, rhs.shape, window_strides, padding, lhs_dilation, rhs_dilation,
                 dimension_numbers, feature_group_count, batch_group_count)
    product = make_product(name, "conv", config, op, lhs.shape, rhs.shape, module=module)

    def apply(a, b):
        return op.apply(a, b, precision, preferred_element_type)

    return compute_product(product, lhs, rhs, apply, provider or default_provider(config))


def quantized_einsum(spec: str, lhs, rhs, precision=None, preferred_element_type=None, *,
                     config: Optional[QuantConfig] = CPT_CONFIG, name: str = "einsum",
                     kind: str = "einsum", roles=(ACTIVATION, WEIGHT), provider=None,
                     module=None) -> Array:
    """``jnp.einsum(spec, lhs, rhs)`` with quantized operands and error.

    `roles` says which operand is an activation and which a weight: ``(activation,
    weight)`` for a layer, ``(activation, activation)`` for attention's ``q . k``
    and ``weights . v``. A weight gets one range per output feature (its last axis
    that appears in the output) with a per-channel format.

    Example:
      >>> with cpt_jax.precision(4):
      ...   y = quantized_einsum("bd,df->bf", jnp.ones((2, 3)), jnp.ones((3, 4)))
      >>> y.shape
      (2, 4)
    """
    op = einsum_op(spec, lhs.ndim, rhs.ndim)
    product = make_product(name, kind, config, op, lhs.shape, rhs.shape, roles, module)

    def apply(a, b):
        return op.apply(a, b, precision, preferred_element_type)

    return compute_product(product, lhs, rhs, apply, provider or default_provider(config))


# --------------------------------------------------------------------------- doors

@dataclasses.dataclass(frozen=True)
class QuantDotGeneral:
    """Drop-in `dot_general` for ``nn.Dense(..., dot_general_cls=QuantDotGeneral)``.

    Flax calls ``dot_general_cls()`` and then the instance like `lax.dot_general`
    (the `out_sharding` keyword NNX passes is accepted). Configure with
    ``functools.partial(QuantDotGeneral, config=QuantConfig(...))``.

    Example:
      >>> layer = nn.Dense(4, dot_general_cls=QuantDotGeneral)
      >>> params = layer.init(jax.random.key(0), jnp.ones((2, 3)))
      >>> with cpt_jax.precision(4):
      ...   y = layer.apply(params, jnp.ones((2, 3)))
    """

    config: Optional[QuantConfig] = CPT_CONFIG
    name: Optional[str] = None
    provider: Any = None
    module: Any = dataclasses.field(default=None, compare=False, hash=False, repr=False)

    def __call__(self, lhs, rhs, dimension_numbers, precision=None,
                 preferred_element_type=None, **kwargs):
        return quantized_dot_general(
            lhs, rhs, dimension_numbers, precision, preferred_element_type,
            config=self.config, name=self.name or _door_path("dot_general"),
            provider=self.provider, module=self.module, **kwargs)


@dataclasses.dataclass(frozen=True)
class QuantConvGeneralDilated:
    """Drop-in conv for ``nn.Conv(..., conv_general_dilated_cls=QuantConvGeneralDilated)``.

    Example:
      >>> layer = nn.Conv(2, (3, 3), conv_general_dilated_cls=QuantConvGeneralDilated)
      >>> v = layer.init(jax.random.key(0), jnp.ones((1, 5, 5, 3)))
      >>> with cpt_jax.precision(4):
      ...   y = layer.apply(v, jnp.ones((1, 5, 5, 3)))
    """

    config: Optional[QuantConfig] = CPT_CONFIG
    name: Optional[str] = None
    provider: Any = None
    module: Any = dataclasses.field(default=None, compare=False, hash=False, repr=False)

    def __call__(self, lhs, rhs, window_strides, padding, lhs_dilation=None,
                 rhs_dilation=None, dimension_numbers=None, feature_group_count=1,
                 batch_group_count=1, precision=None, preferred_element_type=None, **kwargs):
        return quantized_conv(
            lhs, rhs, window_strides, padding, lhs_dilation, rhs_dilation, dimension_numbers,
            feature_group_count, batch_group_count, precision, preferred_element_type,
            config=self.config, name=self.name or _door_path("conv"),
            provider=self.provider, module=self.module, **kwargs)


QuantConv = QuantConvGeneralDilated


@dataclasses.dataclass(frozen=True)
class QuantEinsum:
    """A quantized two-operand einsum: ``op(spec, lhs, rhs, precision=None, **kw)``.

    The einsum door of ``nnx.Einsum(..., einsum_op=QuantEinsum())`` (operands: input,
    kernel) and of Linen attention's ``qk_attn_weights_einsum_cls`` /
    ``attn_weights_value_einsum_cls`` (``roles=(ACTIVATION, ACTIVATION)``).

    Example:
      >>> with cpt_jax.precision(4):
      ...   y = QuantEinsum()("bd,df->bf", jnp.ones((2, 3)), jnp.ones((3, 4)))
      >>> y.shape
      (2, 4)
    """

    config: Optional[QuantConfig] = CPT_CONFIG
    name: Optional[str] = None
    kind: str = "einsum"
    roles: Tuple[str, str] = (ACTIVATION, WEIGHT)
    provider: Any = None
    module: Any = dataclasses.field(default=None, compare=False, hash=False, repr=False)

    def __call__(self, spec: str, lhs, rhs, precision=None, **kwargs):
        kwargs.pop("out_sharding", None)
        preferred = kwargs.pop("preferred_element_type", None)
        kwargs.pop("_dot_general", None)
        return quantized_einsum(spec, lhs, rhs, precision, preferred, config=self.config,
                                name=self.name or _door_path(self.kind), kind=self.kind,
                                roles=self.roles, provider=self.provider, module=self.module)


# --------------------------------------------------------------------------- Linen kinds

@dataclasses.dataclass
class Interception:
    """What one `quantize_model` call intercepts with: rules, default config, provider,
    and the products seen (for the rules-that-match-nothing warning)."""

    rules: tuple
    config: Optional[QuantConfig]
    provider: Any = None
    seen: list = dataclasses.field(default_factory=list)
    last: Optional[str] = None

    def resolve(self, path: str) -> Optional[QuantConfig]:
        self.seen.append(path)
        return resolve_config(path, self.rules, self.config, self.last)

    @property
    def needs_last(self) -> bool:
        return any(pattern == LAST_PRODUCT for pattern, _ in self.rules)

    def provider_for(self, config):
        return self.provider or default_provider(config)


@dataclasses.dataclass(frozen=True)
class LinenKind:
    """A Linen layer type whose products are intercepted (see `cpt_jax.interception`)."""

    module_type: type
    methods: Tuple[str, ...]
    handler: Callable


def _door(cls, path: str, env: Interception, module, **kw):
    cfg = env.resolve(path)
    return functools.partial(cls, config=cfg, name=path, provider=env.provider_for(cfg),
                             module=module, **kw)


def _dense_handler(module, method, args, kwargs, next_fun, env):
    door = _door(QuantDotGeneral, module_path(module), env, module)
    with interception.injected_attributes(module, dot_general_cls=door):
        return next_fun(*args, **kwargs)


def _conv_handler(module, method, args, kwargs, next_fun, env):
    if not module.shared_weights:
        return _opaque_handler(module, method, args, kwargs, next_fun, env)
    door = _door(QuantConvGeneralDilated, module_path(module), env, module)
    with interception.injected_attributes(module, conv_general_dilated_cls=door):
        return next_fun(*args, **kwargs)


def _attention_handler(module, method, args, kwargs, next_fun, env):
    path = module_path(module)
    if getattr(module, "precision", None) is not None:
        warnings.warn(f"{path}: attention products are not quantized when the attention "
                      f"module sets `precision` (Flax forbids both)", stacklevel=2)
        return next_fun(*args, **kwargs)
    roles = (ACTIVATION, ACTIVATION)
    qk = _door(QuantEinsum, f"{path}/query_key", env, module, kind="attention", roles=roles)
    wv = _door(QuantEinsum, f"{path}/weights_value", env, module, kind="attention",
               roles=roles)
    with interception.injected_attributes(module, qk_attn_weights_einsum_cls=qk,
                                          attn_weights_value_einsum_cls=wv):
        return next_fun(*args, **kwargs)


def _opaque_product(module, path, kind, cfg, lhs, rhs, method):
    """The `Product` of a layer without an injection point (axes from its kernel)."""
    spatial = tuple(range(1, lhs.ndim - 1))
    if isinstance(module, nn.Einsum):
        spec = module.einsum_str if method.spec is None else method.spec
        return make_product(path, kind, cfg, einsum_op(spec, lhs.ndim, rhs.ndim),
                            lhs.shape, rhs.shape, module=module)
    if isinstance(module, nn.Embed):
        if method.name == "attend":
            op = dot_general_op((((lhs.ndim - 1,), (1,)), ((), ())))
            return make_product(path, kind, cfg, op, lhs.shape, rhs.shape, module=module)
        return Product(path, kind, cfg, Operand(INDEX, ()), Operand(WEIGHT, (), 0),
                       ErrorAxes((), ()), reduction=0, module=module)
    if isinstance(module, nn.ConvTranspose) and module.transpose_kernel:
        channel, k = rhs.ndim - 2, rhs.shape[:-2] + rhs.shape[-1:]
    else:
        channel, k = rhs.ndim - 1, rhs.shape[:-1]
    local = not getattr(module, "shared_weights", True)
    reduction = int(rhs.shape[-2] if local else math.prod(k))
    return Product(path, kind, cfg, Operand(ACTIVATION, (lhs.ndim - 1,)),
                   Operand(WEIGHT, tuple(d for d in range(rhs.ndim) if d != channel), channel),
                   ErrorAxes((lhs.ndim - 1,), (0,) + spatial), reduction=reduction,
                   module=module)


@dataclasses.dataclass(frozen=True)
class _Method:
    name: str
    spec: Optional[str] = None


def _opaque_handler(module, method, args, kwargs, next_fun, env):
    """Run the layer as a clone on the provider's operands (input, kernel)."""
    weight = "embedding" if isinstance(module, nn.Embed) else "kernel"
    if not module.has_variable("params", weight):
        # Initialization: the float layer creates its parameters; then the provider
        # may create its state (e.g. a history) as it would for a door.
        y = next_fun(*args, **kwargs)
        if module.has_variable("params", weight):
            product, _, provider = _opaque_parts(module, method, args, kwargs, env, weight)
            prepare = getattr(provider, "prepare", None)
            if prepare is not None and product.config is not None:
                prepare(product, args[0], module.variables["params"][weight])
        return y
    product, apply, provider = _opaque_parts(module, method, args, kwargs, env, weight)
    with context.quant_call_guard():
        return compute_product(product, args[0], module.variables["params"][weight], apply,
                               provider)


def _opaque_parts(module, method, args, kwargs, env, weight):
    """``(Product, apply, provider)`` of a layer without an injection point."""
    is_embed, attend = isinstance(module, nn.Embed), method == "attend"
    path = module_path(module) + ("/attend" if attend else "")
    kind = "lookup" if is_embed and not attend else (
        "conv" if not isinstance(module, (nn.Einsum, nn.Embed)) else
        "dot_general" if is_embed else "einsum")
    spec = kwargs.get("einsum_str", args[1] if len(args) > 1 else None) \
        if isinstance(module, nn.Einsum) else None
    variables = module.variables
    cfg = env.resolve(path)
    product = _opaque_product(module, path, kind, cfg, args[0], variables["params"][weight],
                              _Method(method, spec))
    clone = module.clone(parent=None)

    def apply(x, w):
        params = {**variables["params"], weight: w}
        return clone.apply({**variables, "params": params}, x, *args[1:],
                           method=method, **kwargs)

    return product, apply, env.provider_for(cfg)


LINEN_KINDS = (
    LinenKind(nn.Dense, ("__call__",), _dense_handler),
    LinenKind(nn.DenseGeneral, ("__call__",), _dense_handler),
    LinenKind(nn.Conv, ("__call__",), _conv_handler),
    LinenKind(nn.ConvLocal, ("__call__",), _opaque_handler),
    LinenKind(nn.ConvTranspose, ("__call__",), _opaque_handler),
    LinenKind(nn.Einsum, ("__call__",), _opaque_handler),
    LinenKind(nn.Embed, ("__call__", "attend"), _opaque_handler),
    LinenKind(nn.MultiHeadDotProductAttention, ("__call__",), _attention_handler),
)
"""The Linen layer types whose products `quantize_model` intercepts."""


ATTENTION_FIELDS = ("qk_attn_weights_einsum_cls", "attn_weights_value_einsum_cls")
"""A Linen module with these two fields (Flax's convention) has its attention
products intercepted like ``nn.MultiHeadDotProductAttention``'s."""

_FOLLOWS_ATTENTION_CONVENTION = LinenKind(nn.Module, ("__call__",), _attention_handler)


def _kind_of(module, method: str) -> Optional[LinenKind]:
    for kind in LINEN_KINDS:
        if isinstance(module, kind.module_type) and method in kind.methods:
            return kind
    fields = getattr(module, "__dataclass_fields__", {})
    if method == "__call__" and all(f in fields for f in ATTENTION_FIELDS):
        return _FOLLOWS_ATTENTION_CONVENTION
    return None


def _warn_unknown_layer(module, method: str) -> None:
    """Warn when a layer type cpt_jax does not know owns a kernel: its products,
    computed by its own code, are neither quantized nor counted."""
    if method != "__call__" or not module.has_variable("params", "kernel"):
        return
    warnings.warn(f"{module_path(module)}: {type(module).__name__} is not a layer type "
                  f"cpt_jax intercepts (cpt_jax.transform.LINEN_KINDS); its products stay "
                  f"fp32 and are not counted", UserWarning, stacklevel=2)


def make_interceptor(rules=None, config: Optional[QuantConfig] = CPT_CONFIG, provider=None,
                     env: Optional[Interception] = None):
    """A `nn.intercept_methods` interceptor quantizing the products of `LINEN_KINDS`.

    Args:
      rules: as `quantize_model`.
      config: the default `QuantConfig`.
      provider: what computes each product (default: `default_provider(config)`).
      env: an `Interception` to use (its rules/config/provider win), e.g. to read
        the products it saw.

    Returns:
      ``interceptor(next_fun, args, kwargs, context)`` for `nn.intercept_methods`.

    Example:
      >>> with nn.intercept_methods(make_interceptor()):
      ...   v = nn.Dense(2).init(jax.random.key(0), jnp.ones((1, 3)))
    """
    env = env or Interception(normalize_rules(rules), config, provider)

    def interceptor(next_fun, args, kwargs, ctx):
        if context.inside_quant_call() or ctx.module.scope is None:
            return next_fun(*args, **kwargs)
        kind = _kind_of(ctx.module, ctx.method_name)
        if kind is None:
            _warn_unknown_layer(ctx.module, ctx.method_name)
            return next_fun(*args, **kwargs)
        return kind.handler(ctx.module, ctx.method_name, args, kwargs, next_fun, env)

    return interceptor


# --------------------------------------------------------------------------- models

_ACTIVE = threading.local()


class QuantizedModel:
    """Base of the classes `quantize_model` builds: ``Quantized(QuantizedModel, Model)``.

    An instance *is* the user's model (same fields, methods and variable tree), so
    ``apply(..., method="encode")``, ``method=Model.encode`` and attribute access
    (``model.config``) behave as on the float model; `init`, `apply` and
    ``__call__`` run under the interceptor. The quantization settings live in the
    class attribute ``cpt_interception`` (not a dataclass field). With a
    `LAST_PRODUCT` rule, `init`/`apply` first trace the call abstractly (fp32) to
    find the last product.
    """

    cpt_interception: Interception = None

    def _intercepting(self, entry=None, args=(), kwargs=None):
        if getattr(_ACTIVE, "depth", 0):
            return contextlib.nullcontext()
        env = dataclasses.replace(self.cpt_interception, seen=[])
        if env.needs_last and entry is not None:
            env.last = _last_product(entry, args, kwargs or {})
        return _Intercepting(env)

    def init(self, *args, **kwargs):
        with self._intercepting(super().init, args, kwargs):
            return super().init(*args, **kwargs)

    def init_with_output(self, *args, **kwargs):
        with self._intercepting(super().init_with_output, args, kwargs):
            return super().init_with_output(*args, **kwargs)

    def apply(self, *args, **kwargs):
        with self._intercepting(super().apply, args, kwargs):
            return super().apply(*args, **kwargs)

    def __call__(self, *args, **kwargs):
        with self._intercepting():
            return super().__call__(*args, **kwargs)


def _last_product(entry: Callable, args, kwargs) -> Optional[str]:
    """The path of the last product ``entry(*args, **kwargs)`` computes (fp32 side trace)."""
    with context.recording(isolated=True) as records, context.full_precision():
        with _Intercepting(Interception((), None), warn=False):
            jax.eval_shape(lambda: entry(*args, **kwargs))
    return records[-1].name if records else None


class _Intercepting:
    """Enter `nn.intercept_methods` with one `Interception`; warn about dead rules."""

    def __init__(self, env: Interception, warn: bool = True):
        self.env = env
        self.warn = warn
        self._cm = nn.intercept_methods(make_interceptor(env=env))

    def __enter__(self):
        _ACTIVE.depth = getattr(_ACTIVE, "depth", 0) + 1
        return self._cm.__enter__()

    def __exit__(self, *exc):
        _ACTIVE.depth -= 1
        out = self._cm.__exit__(*exc)
        if exc[0] is None and self.warn:
            warn_unmatched_rules(self.env.rules, self.env.seen, self.env.last)
        return out


def warn_unmatched_rules(rules, paths, last: Optional[str] = None) -> None:
    """Warn for every rule whose pattern matched none of the product `paths`."""
    paths = list(dict.fromkeys(paths))
    if not paths:
        return
    for pattern, _ in rules:
        if not rule_matches(pattern, paths, last):
            warnings.warn(f"cpt_jax rule {pattern!r} matches no product; the products are: "
                          f"{paths}", UserWarning, stacklevel=3)


def _quantized_class(model_cls: type, env: Interception) -> type:
    """``class Model(QuantizedModel, Model)`` carrying `env` (named as the model, so
    auto-named submodules keep the float model's names)."""
    return type(model_cls.__name__, (QuantizedModel, model_cls),
                {"__module__": model_cls.__module__, "__qualname__": model_cls.__qualname__,
                 "cpt_interception": env})


def quantize_model(model: nn.Module, rules=None, config: Optional[QuantConfig] = CPT_CONFIG,
                   provider=None) -> nn.Module:
    """Make an unmodified Linen model low-precision; same init/apply and variable tree.

    Args:
      model: any Linen module; the products of its `LINEN_KINDS` layers (Dense,
        DenseGeneral, Conv, ConvTranspose, ConvLocal, Einsum, attention, Embed)
        are quantized.
      rules: ``[(regex, target), ...]`` matched with `re.search` against each
        product's path (e.g. ``"stage1_block1/conv1"``); first match wins. A target is
        a `QuantConfig`, or None / ``"full_precision"`` to keep it in fp32. Products
        no rule matches use `config`. A rule that matches no product warns.
      config: the default `QuantConfig` (CPT's recipe).
      provider: what computes each product (default: `default_provider(config)`).

    Returns:
      A model of a subclass of ``type(model)`` and `QuantizedModel`, with the same
      fields: ``init``, ``apply`` (any ``method=``) and its attributes are the float
      model's.

    Example:
      >>> class MLP(nn.Module):
      ...   @nn.compact
      ...   def __call__(self, x):
      ...     return nn.Dense(2, name="head")(nn.relu(nn.Dense(8, name="hidden")(x)))
      >>> qmodel = quantize_model(MLP(), rules=[("head", None)])
      >>> variables = qmodel.init(jax.random.key(0), jnp.ones((2, 4)))  # MLP's tree
      >>> with cpt_jax.precision(bits=4):
      ...   y = qmodel.apply(variables, jnp.ones((2, 4)))   # hidden at 4 bits, head fp32
    """
    if not isinstance(model, nn.Module):
        raise ValueError(f"quantize_model expects a flax.linen Module, got {type(model).__name__}")
    base = type(model)
    if isinstance(model, QuantizedModel):
        base = next(c for c in base.__mro__[1:] if not issubclass(c, QuantizedModel)
                    and issubclass(c, nn.Module))
    cls = _quantized_class(base, Interception(normalize_rules(rules), config, provider))
    fields = {f.name: getattr(model, f.name) for f in dataclasses.fields(model)
              if f.init and f.name != "parent"}
    return cls(**fields)

@dataclasses.dataclass(frozen=True)
class LayerProduct:
    """One product of a Linen model, as `quantized_layers` lists it."""

    path: str
    kind: str
    macs: int
    config: Optional[QuantConfig]


def quantized_layers(model: nn.Module, variables, *inputs, **apply_kwargs) -> list:
    """Every product ``model.apply(variables, *inputs, **apply_kwargs)`` computes.

    Traced abstractly (nothing computed). A product with ``config=None`` is kept in
    fp32 (still computed and counted for the cost at 32 bits); ``macs`` includes
    scan trip counts. For NNX models see `cpt_jax.nnx.quantized_layers`.

    Args:
      model: a model from `quantize_model` (or any Linen model: its door products).
      variables: its variables (arrays or `jax.ShapeDtypeStruct`s).
      *inputs, **apply_kwargs: as for ``model.apply`` (``method=`` included).

    Returns:
      ``[LayerProduct(path, kind, macs, config), ...]`` in call order.

    Example:
      >>> qmodel = quantize_model(nn.Sequential([nn.Dense(4), nn.Dense(2)]), CPT_RULES)
      >>> v = qmodel.init(jax.random.key(0), jnp.ones((1, 3)))
      >>> [(p.path, p.macs, p.config is None) for p in quantized_layers(qmodel, v, jnp.ones((1, 3)))]
      [('layers_0', 12, False), ('layers_1', 8, True)]
    """
    from cpt_jax.cost import count_ops
    if not isinstance(model, nn.Module):
        raise ValueError(f"quantized_layers expects a flax.linen Module (NNX: "
                         f"cpt_jax.nnx.quantized_layers), got {type(model).__name__}")
    ops = count_ops(model, variables, *inputs, **apply_kwargs)
    env = getattr(model, "cpt_interception", None)
    last = ops[-1].name if ops else None

    def config_of(op):
        if env is None or not op.quantized:
            return None if not op.quantized else CPT_CONFIG
        return resolve_config(op.name, env.rules, env.config, last)

    return [LayerProduct(op.name, op.kind, op.macs, config_of(op)) for op in ops]


FP32_ATTENTION = (r"(query_key|weights_value)$", None)
"""A rule keeping the two attention products (``q . k``, ``weights . v``) in fp32.

Attention products are quantized by default like any other product; low-bit
attention scores can hurt convergence, so put this rule first to keep them fp32:
``quantize_model(model, rules=[FP32_ATTENTION, *CPT_RULES])``."""

CPT_RULES = ((LAST_PRODUCT, None),)
"""CPT's recipe: every product quantized but the last one in call order (the
classifier, whatever it is called), kept in fp32."""
