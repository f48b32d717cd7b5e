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

from cpt_jax import context, formats
from cpt_jax.quant_config import CPT_CONFIG, FULL_PRECISION, QuantConfig, TensorQuant
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


def _fake_quant_with_key(x, bits, tq: Optional[TensorQuant], key) -> Array:
    if tq is None:
        return x
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

@dataclasses.dataclass(frozen=True)
class _Int8Op:
    """Static description of one int8 product: a dot_general or a conv (hashable)."""

    kind: str                      # "dot" or "conv"
    dimension_numbers: Any
    rhs_channel_axis: int          # the weight's output-channel axis (its own scale)
    out_channel_axis: int          # where that channel lands in the output
    window_strides: Any = None
    padding: Any = None
    lhs_dilation: Any = None
    rhs_dilation: Any = None
    feature_group_count: int = 1
    batch_group_count: int = 1

    def apply(self, lhs, rhs, preferred_element_type=None):
        if self.kind == "dot":
            return lax.dot_general(lhs, rhs, self.dimension_numbers,
                                   preferred_element_type=preferred_element_type)
        return lax.conv_general_dilated(
            lhs, rhs, self.window_strides, self.padding, lhs_dilation=self.lhs_dilation,
            rhs_dilation=self.rhs_dilation, dimension_numbers=self.dimension_numbers,
            feature_group_count=self.feature_group_count,
            batch_group_count=self.batch_group_count,
            preferred_element_type=preferred_element_type)


def _int8_codes(lhs, rhs, bits, op: _Int8Op, keys):
    """Symmetric codes (int8) and scales of both operands, computed once from them."""
    lkey, rkey = keys
    lc, ls = formats.symmetric_codes(lhs, bits, SymmetricInt(),
                                     rounding="nearest" if lkey is None else "stochastic",
                                     key=lkey)
    rc, rs = formats.symmetric_codes(rhs, bits, SymmetricInt(channel_axis=op.rhs_channel_axis),
                                     rounding="nearest" if rkey is None else "stochastic",
                                     key=rkey)
    return lc.astype(jnp.int8), ls, rc.astype(jnp.int8), rs


def _int8_accumulate(lc, rc, op: _Int8Op):
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


def _int8_product_fwd(lhs, rhs, bits, keys, op: _Int8Op):
    lc, ls, rc, rs = _int8_codes(lhs, rhs, bits, op, keys)
    acc = _int8_accumulate(lc, rc, op)
    # One scale per output channel: s_x * s_w[c], broadcast along the output channel.
    shape = [1] * acc.ndim
    shape[op.out_channel_axis] = -1
    out_scale = ls.reshape(()) * rs.reshape(shape)
    y = acc * out_scale
    # NaN/Inf in the activation have no int8 code: keep them visible in the output
    # (as the fake-quant path does) so non-finite steps are still detected.
    y = y + jnp.where(jnp.isfinite(jnp.sum(lhs.astype(jnp.float32))), 0.0, jnp.nan)
    # Zero-size arrays carry the operand dtypes to the backward pass.
    dtypes = (jnp.zeros((0,), lhs.dtype), jnp.zeros((0,), rhs.dtype))
    return y.astype(lhs.dtype), (lc, ls, rc, rs, dtypes)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _int8_product(lhs, rhs, bits, keys, op: _Int8Op):
    return _int8_product_fwd(lhs, rhs, bits, keys, op)[0]


def _int8_product_bwd(op: _Int8Op, residuals, g):
    lc, ls, rc, rs, (ldt, rdt) = residuals
    ldtype, rdtype = ldt.dtype, rdt.dtype
    # Straight-through: the products of the dequantized operands (codes * scale),
    # rebuilt from the int8 residuals (4x smaller than saving float operands).
    lhs_q = (lc.astype(jnp.float32) * ls).astype(ldtype)
    rhs_q = (rc.astype(jnp.float32) * rs).astype(rdtype)
    _, vjp = jax.vjp(lambda a, b: op.apply(a, b), lhs_q, rhs_q)
    da, db = vjp(g.astype(ldtype))
    return da, db, None, None


def _int8_product_fwd_rule(lhs, rhs, bits, keys, op):
    y, res = _int8_product_fwd(lhs, rhs, bits, keys, op)
    return y, res


_int8_product.defvjp(_int8_product_fwd_rule, _int8_product_bwd)


def _int8_keys(config: QuantConfig, state):
    def key_for(tq):
        if tq is None or tq.rounding != "stochastic":
            return None
        key = state.next_key()
        if key is None:
            raise ValueError(
                "stochastic rounding of an operand needs `rng` in cpt_jax.precision(...)")
        return key
    return key_for(config.activation), key_for(config.weight)


def _check_int8_config(config: QuantConfig) -> None:
    act = config.activation
    if act is None or getattr(act.fmt, "channel_axis", None) is not None:
        raise ValueError(
            "QuantConfig(int8=True) needs a per-tensor activation format "
            f"(SymmetricInt(channel_axis=None)), got {act!r}")


def _int8_or_float(lhs, rhs, bits, keys, op: _Int8Op, float_fn):
    """``lax.cond(bits <= 8, int8 product, float product of fake-quantized operands)``."""
    def int8_branch(a, b):
        return _int8_product(a, b, bits, keys, op)

    def float_branch(a, b):
        return float_fn(a, b).astype(a.dtype)

    return lax.cond(bits <= 8, int8_branch, float_branch, lhs, rhs)


def int8_dot_general(lhs, rhs, dimension_numbers, bits, *, keys=(None, None)) -> Array:
    """``y = s_x s_w (int8(x/s_x) . int8(W/s_w))`` accumulated in int32.

    The codes are `SymmetricInt`'s at `bits` (<= 8; traced: the levels change, the
    int8 container does not), computed once from the operands; the activation
    `lhs` has one scale, the weight `rhs` one per output channel (its last
    non-contracting dim). Equal to the product of the fake-quantized operands up to
    the float rounding of the rescale. Backward: straight-through (the float
    products of the dequantized operands, rebuilt from the int8 codes).

    Example:
      >>> x, w = jnp.ones((2, 3)), jnp.ones((3, 4))
      >>> int8_dot_general(x, w, (((1,), (0,)), ((), ())), 8).shape
      (2, 4)
    """
    (lc, rc), (lb, rb) = dimension_numbers
    r_keep = [d for d in range(rhs.ndim) if d not in rc and d not in rb]
    if not r_keep:
        raise ValueError("int8_dot_general needs a weight (rhs) with an output dimension")
    op = _Int8Op("dot", _hashable_dims(dimension_numbers), r_keep[-1],
                 out_channel_axis=-1)
    return _int8_product(lhs, rhs, jnp.asarray(bits, jnp.float32), keys, op)


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
    dn = lax.conv_dimension_numbers(lhs.shape, rhs.shape, dimension_numbers)
    op = _Int8Op("conv", dn, dn.rhs_spec[0], dn.out_spec[1],
                 window_strides=tuple(window_strides),
                 padding=padding if isinstance(padding, str) else tuple(map(tuple, padding)),
                 lhs_dilation=None if lhs_dilation is None else tuple(lhs_dilation),
                 rhs_dilation=None if rhs_dilation is None else tuple(rhs_dilation),
                 feature_group_count=feature_group_count, batch_group_count=batch_group_count)
    return _int8_product(lhs, rhs, jnp.asarray(bits, jnp.float32), keys, op)


def _hashable_dims(dimension_numbers):
    return tuple(tuple(tuple(int(d) for d in part) for part in pair)
                 for pair in dimension_numbers)


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
    if config.int8 and r_keep:
        _check_int8_config(config)
        keys = _int8_keys(config, state)
        op = _Int8Op("dot", _hashable_dims(dimension_numbers), r_keep[-1], out_channel_axis=-1)

        def float_dot(a, b):
            a = _fake_quant_with_key(a, bits, config.activation, keys[0])
            b = _fake_quant_with_key(b, bits, weight_tq, keys[1])
            return lax.dot_general(a, b, dimension_numbers, precision=precision)

        y = _int8_or_float(lhs, rhs, bits, keys, op, float_dot)
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
    if config.int8:
        _check_int8_config(config)
        keys = _int8_keys(config, state)
        op = _Int8Op("conv", dn, dn.rhs_spec[0], dn.out_spec[1],
                     window_strides=tuple(window_strides),
                     padding=padding if isinstance(padding, str) else tuple(map(tuple, padding)),
                     lhs_dilation=None if lhs_dilation is None else tuple(lhs_dilation),
                     rhs_dilation=None if rhs_dilation is None else tuple(rhs_dilation),
                     feature_group_count=feature_group_count,
                     batch_group_count=batch_group_count)

        def float_conv(a, b):
            a = _fake_quant_with_key(a, bits, config.activation, keys[0])
            b = _fake_quant_with_key(b, bits, weight_tq, keys[1])
            return conv(a, b, None).astype(a.dtype)

        def int8_or_float(a, b):
            return _int8_or_float(a, b, bits, keys, op, float_conv)

        # XLA's CPU backend has no fast int8 convolution, and runs convolutions
        # inside a conditional's branches slowly (measured 18x on ResNet-20): on CPU
        # the conv runs on the fake-quantized operands (the same grid values, equal
        # up to float rounding); GPU/TPU run the int8 convolution.
        y = lax.platform_dependent(lhs, rhs, cpu=float_conv, default=int8_or_float)
        return _quantize_error(y, state, config)
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
