"""Quantizing Flax models: two doors, one mechanism.

1. The Linen idiom: pass the quantized op to the layer,
   ``nn.Dense(..., dot_general_cls=QuantDotGeneral)`` or
   ``nn.Conv(..., conv_general_dilated_cls=QuantConvGeneralDilated)``
   (use ``functools.partial(QuantDotGeneral, config=...)`` for another config).
2. `quantize_model(model, rules)`: any unmodified Linen model (plain `nn.Dense`,
   `nn.DenseGeneral`, `nn.Conv`, `nn.Einsum`) becomes quantized, with the same
   `init`/`apply` signature and the same variable tree. Its layer calls are
   intercepted (`nn.intercept_methods`) and re-run with the quantized op injected.

Both run `quantized_dot_general` / `quantized_conv`: with the widths of the
enclosing `precision` context,

    y = Q_g^bwd( op(Q_b(x), Q_b(W)) )

where ``Q_b`` is the forward fake quantizer (straight-through) at ``b = bits +
offset`` and ``Q_g^bwd`` quantizes the output's cotangent at ``g = grad_bits +
offset`` (identity forward). Outside a precision context the op is exact fp32.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import re
from typing import Any, Optional, Sequence, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax

from cpt_jax import context
from cpt_jax.config import CPT_CONFIG, FULL_PRECISION, QuantConfig, TensorQuant
from cpt_jax.cost import OpRecord, conv_reduction
from cpt_jax.fake_quant import fake_quant, quantize_grad
from cpt_jax.formats import SymmetricInt

Array = jax.Array

_counter = {"dot_general": 0, "conv": 0}


def _auto_name(kind: str) -> str:
    _counter[kind] += 1
    return f"{kind}_{_counter[kind]}"


def _effective_bits(base, offset: float):
    return jnp.clip(jnp.asarray(base, jnp.float32) + offset, 1.0, 32.0)


def _with_channel_axis(tq: TensorQuant, axis: int) -> TensorQuant:
    fmt = tq.fmt
    if getattr(fmt, "channel_axis", None) is None:
        return tq
    return dataclasses.replace(tq, fmt=dataclasses.replace(fmt, channel_axis=axis))


def _quantize_operand(x, bits, tq: Optional[TensorQuant], state) -> Array:
    if tq is None:
        return x
    key = state.next_key() if tq.rounding == "stochastic" else None
    if tq.rounding == "stochastic" and key is None:
        raise ValueError(
            "stochastic rounding of an operand needs `rng` in cpt_jax.precision(...)")
    return fake_quant(x, bits, tq.fmt, rounding=tq.rounding, key=key)


def _quantize_error(y, state, config: QuantConfig) -> Array:
    if config.error is None or state.grad_bits is None:
        return y
    g = _effective_bits(state.grad_bits, config.grad_bits_offset)
    key = state.next_key() if config.error.rounding == "stochastic" else None
    if config.error.rounding == "stochastic" and key is None:
        raise ValueError(
            "error quantization with stochastic rounding needs `rng` in "
            "cpt_jax.precision(bits, grad_bits, rng=...)")
    return quantize_grad(y, g, config.error.fmt, rounding=config.error.rounding, key=key)


# --------------------------------------------------------------------------- int8 path

def _symmetric_codes(x, bits, fmt: SymmetricInt, reduce_axes):
    """Codes ``round(x/s)`` as int8 and the scale ``s`` (max-abs, per tensor/channel)."""
    amax = jnp.max(jnp.abs(x), axis=reduce_axes, keepdims=True)
    top = jnp.maximum(jnp.exp2(jnp.round(bits) - 1.0) - 1.0, 1.0)
    scale = jnp.maximum(amax / top, 1e-8)
    codes = jnp.clip(jnp.round(x / scale), -top, top).astype(jnp.int8)
    return codes, scale


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _int8_dot(lhs_q, rhs_q, bits, dimension_numbers):
    return _int8_dot_fwd(lhs_q, rhs_q, bits, dimension_numbers)[0]


def _int8_dot_fwd(lhs_q, rhs_q, bits, dimension_numbers):
    (lc, rc), (lb, rb) = dimension_numbers
    l_red = tuple(range(lhs_q.ndim))  # per-tensor activation scale
    r_keep = [d for d in range(rhs_q.ndim) if d not in rc and d not in rb]
    r_red = tuple(d for d in range(rhs_q.ndim) if d not in r_keep[-1:])
    lc_codes, ls = _symmetric_codes(lhs_q, bits, SymmetricInt(), l_red)
    rc_codes, rs = _symmetric_codes(rhs_q, bits, SymmetricInt(), r_red)
    acc = lax.dot_general(lc_codes, rc_codes, dimension_numbers,
                          preferred_element_type=jnp.int32)
    out_scale = ls.reshape(()) * rs.reshape(-1)  # broadcast along the last output dim
    y = acc.astype(jnp.float32) * out_scale
    return y.astype(lhs_q.dtype), (lhs_q, rhs_q)


def _int8_dot_bwd(dimension_numbers, residuals, g):
    lhs_q, rhs_q = residuals
    _, vjp = jax.vjp(lambda a, b: lax.dot_general(a, b, dimension_numbers), lhs_q, rhs_q)
    da, db = vjp(g)
    return da, db, jnp.zeros((), jnp.float32)


_int8_dot.defvjp(_int8_dot_fwd, _int8_dot_bwd)


def int8_dot_general(lhs, rhs, dimension_numbers, bits) -> Array:
    """``y = s_x s_w (int8(x/s_x) . int8(W/s_w))`` accumulated in int32.

    The operands are symmetric integer codes at `bits` (<= 8, traced: the levels
    change, the int8 container does not); the weight has one scale per output
    channel (its last non-contracting dim). Backward: straight-through, the
    products of the dequantized operands.
    """
    return _int8_dot(lhs, rhs, jnp.asarray(bits, jnp.float32), dimension_numbers)


# --------------------------------------------------------------------------- ops

def quantized_dot_general(lhs, rhs, dimension_numbers, precision=None,
                          preferred_element_type=None, *, config: Optional[QuantConfig] = CPT_CONFIG,
                          name: str = "dot_general", **kwargs) -> Array:
    """`lax.dot_general` with quantized operands and error: ``Q_g^bwd(Q_b(x) . Q_b(W))``.

    `lhs` is the activation, `rhs` the weight (as in `nn.Dense`). Reads the widths
    from the enclosing `precision` context; exact fp32 outside one or with
    ``config=None``. Records an `OpRecord` for cost accounting.
    """
    out_sharding = kwargs.pop("out_sharding", None)
    extra = {} if out_sharding is None else {"out_sharding": out_sharding}
    (lc, rc), (lb, rb) = dimension_numbers
    reduction = int(math.prod(lhs.shape[d] for d in lc))
    out_shape = jax.eval_shape(
        lambda a, b: lax.dot_general(a, b, dimension_numbers), lhs, rhs).shape
    context.record(OpRecord(
        name=name, kind="dot_general", macs=int(math.prod(out_shape)) * reduction,
        reduction=reduction, lhs_shape=tuple(lhs.shape), rhs_shape=tuple(rhs.shape),
        out_shape=tuple(out_shape), quantized=config is not None,
        bits_offset=0.0 if config is None else config.bits_offset,
        grad_bits_offset=0.0 if config is None else config.grad_bits_offset))
    state = context.current_precision()
    if config is None or state is None:
        return lax.dot_general(lhs, rhs, dimension_numbers, precision=precision,
                               preferred_element_type=preferred_element_type, **extra)
    bits = _effective_bits(state.bits, config.bits_offset)
    r_keep = [d for d in range(rhs.ndim) if d not in rc and d not in rb]
    weight_tq = config.weight
    if weight_tq is not None and r_keep:
        weight_tq = _with_channel_axis(weight_tq, r_keep[-1])
    if config.int8:
        lhs_q = _quantize_operand(lhs, bits, config.activation, state)
        rhs_q = _quantize_operand(rhs, bits, weight_tq, state)
        y = lax.cond(
            bits <= 8,
            lambda a, b: int8_dot_general(a, b, dimension_numbers, bits).astype(a.dtype),
            lambda a, b: lax.dot_general(a, b, dimension_numbers, precision=precision).astype(a.dtype),
            lhs_q, rhs_q)
    else:
        lhs_q = _quantize_operand(lhs, bits, config.activation, state)
        rhs_q = _quantize_operand(rhs, bits, weight_tq, state)
        y = lax.dot_general(lhs_q, rhs_q, dimension_numbers, precision=precision,
                            preferred_element_type=preferred_element_type, **extra)
    return _quantize_error(y, state, config)


def quantized_conv(lhs, rhs, window_strides, padding, lhs_dilation=None, rhs_dilation=None,
                   dimension_numbers=None, feature_group_count=1, batch_group_count=1,
                   precision=None, preferred_element_type=None, *,
                   config: Optional[QuantConfig] = CPT_CONFIG, name: str = "conv",
                   **kwargs) -> Array:
    """`lax.conv_general_dilated` with quantized input, kernel and error.

    The kernel gets one range per output feature (from `dimension_numbers`) when its
    format is per-channel. Records an `OpRecord` (MACs = |out| * kh kw C_in/groups).
    """
    def conv(a, b, prec=precision):
        return lax.conv_general_dilated(
            a, b, window_strides, padding, lhs_dilation=lhs_dilation,
            rhs_dilation=rhs_dilation, dimension_numbers=dimension_numbers,
            feature_group_count=feature_group_count, batch_group_count=batch_group_count,
            precision=prec, preferred_element_type=preferred_element_type)

    dn = lax.conv_dimension_numbers(lhs.shape, rhs.shape, dimension_numbers)
    reduction = conv_reduction(rhs.shape, dn.rhs_spec, feature_group_count)
    out_shape = jax.eval_shape(conv, lhs, rhs).shape
    context.record(OpRecord(
        name=name, kind="conv", macs=int(math.prod(out_shape)) * reduction,
        reduction=reduction, lhs_shape=tuple(lhs.shape), rhs_shape=tuple(rhs.shape),
        out_shape=tuple(out_shape), quantized=config is not None,
        bits_offset=0.0 if config is None else config.bits_offset,
        grad_bits_offset=0.0 if config is None else config.grad_bits_offset))
    state = context.current_precision()
    if config is None or state is None:
        return conv(lhs, rhs)
    bits = _effective_bits(state.bits, config.bits_offset)
    weight_tq = config.weight
    if weight_tq is not None:
        weight_tq = _with_channel_axis(weight_tq, dn.rhs_spec[0])
    lhs_q = _quantize_operand(lhs, bits, config.activation, state)
    rhs_q = _quantize_operand(rhs, bits, weight_tq, state)
    return _quantize_error(conv(lhs_q, rhs_q), state, config)


@dataclasses.dataclass(frozen=True)
class QuantDotGeneral:
    """Drop-in `dot_general` for ``nn.Dense(..., dot_general_cls=QuantDotGeneral)``.

    Flax calls ``dot_general_cls()`` and then the instance like `lax.dot_general`
    (the `out_sharding` keyword NNX passes is accepted). Configure with
    ``functools.partial(QuantDotGeneral, config=QuantConfig(...))``.

    Example:
      >>> layer = nn.Dense(4, dot_general_cls=QuantDotGeneral)
      >>> params = layer.init(jax.random.key(0), jnp.ones((2, 3)))
      >>> with precision(4):
      ...   y = layer.apply(params, jnp.ones((2, 3)))
    """

    config: Optional[QuantConfig] = CPT_CONFIG
    name: Optional[str] = None

    def __call__(self, lhs, rhs, dimension_numbers, precision=None,
                 preferred_element_type=None, **kwargs):
        return quantized_dot_general(
            lhs, rhs, dimension_numbers, precision, preferred_element_type,
            config=self.config, name=self.name or _auto_name("dot_general"), **kwargs)


@dataclasses.dataclass(frozen=True)
class QuantConvGeneralDilated:
    """Drop-in conv for ``nn.Conv(..., conv_general_dilated_cls=QuantConvGeneralDilated)``."""

    config: Optional[QuantConfig] = CPT_CONFIG
    name: Optional[str] = None

    def __call__(self, lhs, rhs, window_strides, padding, lhs_dilation=None,
                 rhs_dilation=None, dimension_numbers=None, feature_group_count=1,
                 batch_group_count=1, precision=None, preferred_element_type=None, **kwargs):
        return quantized_conv(
            lhs, rhs, window_strides, padding, lhs_dilation, rhs_dilation, dimension_numbers,
            feature_group_count, batch_group_count, precision, preferred_element_type,
            config=self.config, name=self.name or _auto_name("conv"), **kwargs)


QuantConv = QuantConvGeneralDilated


# --------------------------------------------------------------------------- rules

Rule = Tuple[str, Any]


def _normalize_rules(rules) -> tuple:
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


def resolve_config(path: str, rules: Sequence[Rule], default: Optional[QuantConfig]):
    """The config of the module at `path`: the first rule whose regex `re.search`es it."""
    for pattern, target in rules:
        if re.search(pattern, path):
            return target
    return default


def _module_path(module: nn.Module) -> str:
    try:
        return "/".join(str(p) for p in module.path)
    except Exception:  # pragma: no cover - unbound module
        return module.name or type(module).__name__


_DOT_MODULES = (nn.Dense, nn.DenseGeneral)
_CONV_MODULES = (nn.Conv,)


def _einsum_call(module: nn.Einsum, args, kwargs, cfg, path):
    """nn.Einsum has no injection point: quantize its input and kernel, then its error."""
    inputs = args[0]
    variables = module.variables
    kernel = variables["params"]["kernel"]
    einsum_str = kwargs.get("einsum_str", args[1] if len(args) > 1 else None) or module.einsum_str
    spec = einsum_str.replace(" ", "")
    ins, out_spec = spec.split("->")
    a_spec, b_spec = ins.split(",")
    contracted = [c for c in a_spec if c in b_spec and c not in out_spec]
    reduction = int(math.prod(inputs.shape[a_spec.index(c)] for c in contracted))
    clone = module.clone(parent=None)
    out_shape = jax.eval_shape(lambda v, x: clone.apply(v, x, *args[1:], **kwargs),
                               variables, inputs).shape
    context.record(OpRecord(
        name=path, kind="einsum", macs=int(math.prod(out_shape)) * reduction,
        reduction=reduction, lhs_shape=tuple(inputs.shape), rhs_shape=tuple(kernel.shape),
        out_shape=tuple(out_shape), quantized=cfg is not None,
        bits_offset=0.0 if cfg is None else cfg.bits_offset,
        grad_bits_offset=0.0 if cfg is None else cfg.grad_bits_offset))
    state = context.current_precision()
    if cfg is None or state is None:
        return clone.apply(variables, *args, **kwargs)
    bits = _effective_bits(state.bits, cfg.bits_offset)
    out_axes = [i for i, c in enumerate(b_spec) if c in out_spec]
    weight_tq = cfg.weight
    if weight_tq is not None and out_axes:
        weight_tq = _with_channel_axis(weight_tq, out_axes[-1])
    params = dict(variables["params"])
    params["kernel"] = _quantize_operand(kernel, bits, weight_tq, state)
    x = _quantize_operand(inputs, bits, cfg.activation, state)
    y = clone.apply({**variables, "params": params}, x, *args[1:], **kwargs)
    return _quantize_error(y, state, cfg)


def make_interceptor(rules=None, config: Optional[QuantConfig] = CPT_CONFIG):
    """A `nn.intercept_methods` interceptor quantizing Dense/DenseGeneral/Conv/Einsum calls.

    Matching modules are re-run as a clone with `QuantDotGeneral` /
    `QuantConvGeneralDilated` injected (their variables unchanged), so the variable
    tree is exactly the float model's.
    """
    rules = _normalize_rules(rules)

    def interceptor(next_fun, args, kwargs, ctx):
        module = ctx.module
        if (ctx.method_name != "__call__" or context._inside_quant_call()
                or not isinstance(module, _DOT_MODULES + _CONV_MODULES + (nn.Einsum,))
                or module.scope is None or not module.has_variable("params", "kernel")):
            return next_fun(*args, **kwargs)
        path = _module_path(module)
        cfg = resolve_config(path, rules, config)
        with context._quant_call_guard():
            if isinstance(module, nn.Einsum):
                return _einsum_call(module, args, kwargs, cfg, path)
            if isinstance(module, _DOT_MODULES):
                clone = module.clone(parent=None, dot_general_cls=functools.partial(
                    QuantDotGeneral, config=cfg, name=path))
            else:
                clone = module.clone(parent=None, conv_general_dilated_cls=functools.partial(
                    QuantConvGeneralDilated, config=cfg, name=path))
            return clone.apply(module.variables, *args, **kwargs)

    return interceptor


class QuantizedModel(nn.Module):
    """A Linen model whose Dense/Conv/Einsum calls are quantized per `rules`.

    Built by `quantize_model`; shares its scope with the wrapped model, so the
    variable tree is the float model's and checkpoints interchange.
    """

    model: nn.Module
    rules: tuple = ()
    config: Optional[QuantConfig] = CPT_CONFIG

    def setup(self):
        nn.share_scope(self, self.model)

    def __call__(self, *args, **kwargs):
        with nn.intercept_methods(make_interceptor(self.rules, self.config)):
            return self.model(*args, **kwargs)


def quantize_model(model: nn.Module, rules=None,
                   config: Optional[QuantConfig] = CPT_CONFIG) -> QuantizedModel:
    """Make an unmodified Linen model low-precision; same init/apply and variable tree.

    Args:
      model: any Linen module using `nn.Dense`, `nn.DenseGeneral`, `nn.Conv` or
        `nn.Einsum` for its products.
      rules: ``[(regex, target), ...]`` matched with `re.search` against each layer's
        path (e.g. ``"stage1_block1/conv1"``); first match wins. A target is a
        `QuantConfig`, or None / ``"full_precision"`` to keep the layer in fp32.
        Layers no rule matches use `config`.
      config: the default `QuantConfig` (CPT's recipe).

    Example:
      >>> qmodel = quantize_model(MyResNet(), rules=[("classifier", None)])
      >>> variables = qmodel.init(key, x)          # the same tree as MyResNet's
      >>> with precision(bits=4, grad_bits=8, rng=key):
      ...   logits = qmodel.apply(variables, x)     # inside jit, bits may be traced
    """
    if not isinstance(model, nn.Module):
        raise ValueError(f"quantize_model expects a flax.linen Module, got {type(model).__name__}")
    return QuantizedModel(model=model, rules=_normalize_rules(rules), config=config)


CPT_RULES = (("classifier", None),)
"""CPT's CIFAR recipe: every conv quantized, the final classifier kept in fp32."""
