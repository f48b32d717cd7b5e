"""`quantize_model`: any Flax model, Linen or NNX, low-precision in every product.

One door for both Flax APIs. ``quantize_model(model, rules, config, provider)``
takes

* a Linen module, and returns a Linen module of a subclass of its class with the
  same fields, ``init`` / ``apply`` (any ``method=``) and variable tree;
* an NNX module, and returns it (the same object, its class made a quantized
  subclass) with its state untouched; every public method and ``__call__`` run
  quantized.

While the returned model runs, every product it computes -- ``lax.dot_general``,
``jnp.einsum``, ``@``, ``jnp.dot``, convolutions, ``lax.ragged_dot``, attention,
embedding lookups -- is intercepted at the operation (`cpt_jax.op_interception`),
named by its module path plus the op within the module (``decoder/attn/einsum_1``;
Flax layers keep their module path, attention ``.../query_key`` and
``.../weights_value``, ``embed/attend``), resolved against the rules and computed by
the provider. With the widths of the enclosing `precision` context
(`cpt_jax.providers`):

    y = Q_g^bwd( op(Q_b(x), Q_b(W)) )

Outside a precision context every product is exact fp32 (still recorded for the
cost). `quantized_layers` lists the products with their configs.

The explicit doors stay for a single layer outside `quantize_model`:
``nn.Dense(..., dot_general_cls=QuantDotGeneral)``,
``nn.Conv(..., conv_general_dilated_cls=QuantConvGeneralDilated)``,
``nnx.Linear(..., dot_general=QuantDotGeneral())``,
``nnx.Einsum(..., einsum_op=QuantEinsum())``.
"""
from __future__ import annotations

import dataclasses
import functools
import sys
import warnings
from typing import Any, Callable, Optional, Tuple

import flax.linen as nn
import jax
from flax import nnx

from cpt_jax import call_sites, context, op_interception
from cpt_jax.interception import (ACTIVATION, LAST_PRODUCT, WEIGHT, compute_product, conv_op,
                                  dot_general_op, einsum_op, make_product, normalize_rules,
                                  resolve_config, rule_matches)
from cpt_jax.int8 import INT8, int8_conv, int8_dot_general  # noqa: F401 (re-exported)
from cpt_jax.op_interception import Interception, default_provider
from cpt_jax.quant_config import CPT_CONFIG, QuantConfig

Array = jax.Array


# --------------------------------------------------------------------------- ops

def _door_path(kind: str) -> str:
    """The path of the (Linen or NNX) module calling an explicit door (``kind``
    outside any module)."""
    site = call_sites.locate(sys._getframe(1), None)
    return site.path if site.module is not None else kind


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


# --------------------------------------------------------------------------- sessions

def warn_unmatched_rules(rules, paths, last: Optional[str] = None) -> None:
    """Warn for every rule whose pattern matched none of the product `paths`."""
    paths = list(dict.fromkeys(paths))
    if not paths:
        return
    for pattern, _ in rules:
        if not rule_matches(pattern, paths, last):
            warnings.warn(f"cpt_jax rule {pattern!r} matches no product; the products are: "
                          f"{paths}", UserWarning, stacklevel=4)


class _Door:
    """One top-level call: an `op_interception` session; dead rules warned at exit."""

    def __init__(self, env: Interception, entry, root_name: str, root=None,
                 update_state: bool = True, warn: bool = True):
        self.env, self.warn = env, warn
        self._cm = op_interception.intercepting(env, entry, root_name, root, update_state)

    def __enter__(self):
        self.session = self._cm.__enter__()
        return self.session

    def __exit__(self, *exc):
        out = self._cm.__exit__(*exc)
        if exc[0] is None and self.warn:
            warn_unmatched_rules(self.env.rules, self.session.seen, self.env.last)
        return out


def _last_product(run: Callable, root_name: str) -> Optional[str]:
    """The path of the last product ``run()`` computes (an fp32 abstract side trace)."""
    def side():
        with _Door(Interception((), None), sys._getframe(), root_name, warn=False):
            return run()

    with context.recording(isolated=True) as records, context.full_precision():
        jax.eval_shape(side)
    return records[-1].name if records else None


def _call_env(env: Interception, run: Optional[Callable], root_name: str) -> Interception:
    """The model's `Interception` for one call (with the last product when a rule needs it)."""
    if not env.needs_last or run is None:
        return env
    return dataclasses.replace(env, last=_last_product(run, root_name))


# --------------------------------------------------------------------------- Linen

class QuantizedModel:
    """Base of the Linen classes `quantize_model` builds: ``Quantized(QuantizedModel, Model)``.

    An instance *is* the user's model (same fields, methods and variable tree), so
    ``apply(..., method="encode")``, ``method=Model.encode`` and attribute access
    (``model.config``) behave as on the float model; `init`, `apply` and
    ``__call__`` run with every product intercepted. The quantization settings
    live in the class attribute ``cpt_interception`` (not a dataclass field).
    """

    cpt_interception: Interception = None

    def _door(self, entry, run: Optional[Callable] = None):
        if op_interception.in_session():
            return _NULL
        name = type(self).__name__
        return _Door(_call_env(self.cpt_interception, run, name), entry, name)

    def init(self, *args, **kwargs):
        with self._door(sys._getframe(), lambda: super(QuantizedModel, self).init(*args, **kwargs)):
            return super().init(*args, **kwargs)

    def init_with_output(self, *args, **kwargs):
        with self._door(sys._getframe(),
                        lambda: super(QuantizedModel, self).init_with_output(*args, **kwargs)):
            return super().init_with_output(*args, **kwargs)

    def apply(self, *args, **kwargs):
        with self._door(sys._getframe(), lambda: super(QuantizedModel, self).apply(*args, **kwargs)):
            return super().apply(*args, **kwargs)

    def __call__(self, *args, **kwargs):
        with self._door(sys._getframe()):
            return super().__call__(*args, **kwargs)


class _NullDoor:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


_NULL = _NullDoor()


def _linen_base(model: nn.Module) -> type:
    base = type(model)
    if isinstance(model, QuantizedModel):
        base = next(c for c in base.__mro__[1:] if not issubclass(c, QuantizedModel)
                    and issubclass(c, nn.Module))
    return base


def _quantize_linen(model: nn.Module, env: Interception) -> nn.Module:
    """``class Model(QuantizedModel, Model)`` carrying `env` (named as the model, so
    auto-named submodules keep the float model's names), with the model's fields."""
    base = _linen_base(model)
    cls = type(base.__name__, (QuantizedModel, base),
               {"__module__": base.__module__, "__qualname__": base.__qualname__,
                "cpt_interception": env})
    fields = {f.name: getattr(model, f.name) for f in dataclasses.fields(model)
              if f.init and f.name != "parent"}
    return cls(**fields)


# --------------------------------------------------------------------------- NNX

class QuantizedNNXModel:
    """Marker base of the NNX classes `quantize_model` builds, ``class
    Model(Model, QuantizedNNXModel)``: every public method and ``__call__`` of the
    model's classes run with every product intercepted.

    ``model.eval()`` freezes the providers' state (e.g. running activation ranges
    are used, not updated), ``model.train()`` (the default) updates it.
    """

    __slots__ = ()
    cpt_interception: Interception = None
    _cpt_jax_frozen: bool = False


def _mode_setter(name: str, frozen: bool) -> Callable:
    def set_mode(self, **attributes):
        self._cpt_jax_frozen = frozen
        return getattr(super(type(self), self), name)(**attributes)

    set_mode.__name__ = name
    return set_mode


def _nnx_door(method: Callable) -> Callable:
    """`method` of an NNX model, run as one intercepted call."""
    @functools.wraps(method)
    def door(self, *args, **kwargs):
        if op_interception.in_session():
            return method(self, *args, **kwargs)
        name = _nnx_base(type(self)).__name__
        run = functools.partial(_nnx_side_call, self, method, args, kwargs)
        env = _call_env(type(self).cpt_interception, run, name)
        with _Door(env, sys._getframe(), name, root=self,
                   update_state=not getattr(self, "_cpt_jax_frozen", False)):
            return method(self, *args, **kwargs)

    return door


def _nnx_side_call(model, method, args, kwargs):
    """``method(copy of model, ...)`` on a split/merged copy (for abstract traces)."""
    graphdef, state = nnx.split(model)
    return method(nnx.merge(graphdef, state), *args, **kwargs)


def _nnx_base(cls: type) -> type:
    return next(c for c in cls.__mro__ if not issubclass(c, QuantizedNNXModel))


_NNX_BASES = frozenset(nnx.Module.__mro__)


def _is_method(value: Any) -> bool:
    return callable(value) and not isinstance(value, (type, staticmethod, classmethod, property))


def _nnx_methods(base: type) -> dict:
    """The public methods (and ``__call__``) of the model's classes, ``nnx.Module``'s
    own (``train``, ``iter_modules``, ...) left out."""
    methods = {}
    for cls in reversed(base.__mro__):
        if cls in _NNX_BASES:
            continue
        for name, value in vars(cls).items():
            if _is_method(value) and (name == "__call__" or not name.startswith("_")):
                methods[name] = value
    return methods


def _quantize_nnx(model: nnx.Module, env: Interception) -> nnx.Module:
    for path, module in nnx.iter_modules(model):
        setattr(module, call_sites.NNX_PATH_ATTRIBUTE, "/".join(str(p) for p in path))
    base = _nnx_base(type(model))
    wrapped = {name: _nnx_door(fn) for name, fn in _nnx_methods(base).items()}
    # (base, marker): NNX objects only take a class whose layout starts with theirs.
    cls = type(base.__name__, (base, QuantizedNNXModel),
               {"__module__": base.__module__, "__qualname__": base.__qualname__,
                "cpt_interception": env, "train": _mode_setter("train", False),
                "eval": _mode_setter("eval", True), **wrapped})
    model.__class__ = cls
    return model


# --------------------------------------------------------------------------- one door

def quantize_model(model, rules=None, config: Optional[QuantConfig] = CPT_CONFIG,
                   provider=None):
    """Make an unmodified Flax model, Linen or NNX, low-precision in every product.

    Args:
      model: a Linen module (a quantized copy is returned: same ``init``/``apply``,
        any ``method=``, same variable tree) or an NNX module (quantized in place and
        returned: its state untouched).
      rules: ``[(regex, target), ...]`` matched with `re.search` against each
        product's path (e.g. ``"stage1_block1/conv1"``, ``"decoder/attn/einsum_1"``);
        first match wins. A target is a `QuantConfig`, or None / ``"full_precision"``
        to keep it in fp32. `LAST_PRODUCT` matches the last product in call order.
        Products no rule matches use `config`. A rule that matches no product warns.
      config: the default `QuantConfig` (CPT's recipe).
      provider: what computes each product (default: `default_provider(config)`).

    Returns:
      The quantized model.

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
    env = Interception(normalize_rules(rules), config, provider)
    if isinstance(model, nnx.Module):
        return _quantize_nnx(model, env)
    if isinstance(model, nn.Module):
        return _quantize_linen(model, env)
    raise ValueError(f"quantize_model expects a flax.linen or flax.nnx Module, got "
                     f"{type(model).__name__}")


def interception_of(model) -> Optional[Interception]:
    """The `Interception` of a model from `quantize_model` (None for another model)."""
    return getattr(type(model), "cpt_interception", None)


@dataclasses.dataclass(frozen=True)
class LayerProduct:
    """One product of a model, as `quantized_layers` lists it."""

    path: str
    kind: str
    macs: int
    config: Optional[QuantConfig]


def quantized_layers(model, *args, **kwargs) -> list:
    """Every product the model computes on these inputs, with its config.

    ``quantized_layers(linen_model, variables, *inputs, **apply_kwargs)`` (``method=``
    included) or ``quantized_layers(nnx_model, *inputs, **call_kwargs)``. Traced
    abstractly (nothing computed). A product with ``config=None`` is kept in fp32
    (still counted for the cost at 32 bits); ``macs`` includes scan trip counts.

    Returns:
      ``[LayerProduct(path, kind, macs, config), ...]`` in call order.

    Example:
      >>> qmodel = quantize_model(nn.Sequential([nn.Dense(4), nn.Dense(2)]), CPT_RULES)
      >>> v = qmodel.init(jax.random.key(0), jnp.ones((1, 3)))
      >>> [(p.path, p.macs, p.config is None) for p in quantized_layers(qmodel, v, jnp.ones((1, 3)))]
      [('layers_0', 12, False), ('layers_1', 8, True)]
    """
    from cpt_jax.cost import count_ops
    if not isinstance(model, (nn.Module, nnx.Module)):
        raise ValueError(f"quantized_layers expects a flax.linen or flax.nnx Module, got "
                         f"{type(model).__name__}")
    ops = count_ops(model, *args, **kwargs)
    env = interception_of(model)
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
