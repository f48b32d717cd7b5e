"""Cyclic precision for Flax NNX models: the same quantized ops, the same context.

NNX layers take their product op as an attribute, so the Linen doors have NNX twins:

1. Per layer: ``nnx.Linear(..., dot_general=QuantDotGeneral())``,
   ``nnx.Conv(..., conv_general_dilated=QuantConvGeneralDilated())`` (NNX passes an
   ``out_sharding`` keyword; both accept it), ``nnx.Einsum(..., einsum_op=QuantEinsum())``.
2. Whole model: `quantize_nnx(model, rules)` walks an existing NNX model
   (`nnx.iter_modules`) and sets the op of every matching ``Linear``,
   ``LinearGeneral``, ``Conv`` and ``Einsum`` to the quantized one, named by the
   layer's path (``"blocks/0/linear"``). Rules are ``(regex, target)`` pairs matched
   with `re.search` on that path, first match wins; a target of None keeps the layer
   in fp32. The parameters are untouched.

The widths come from the same ``cpt_jax.precision(bits, grad_bits, rng)`` context,
entered inside the jitted function, so a traced schedule drives an NNX model with one
compilation for the whole run:

    y = Q_g^bwd( op(Q_b(x), Q_b(W)) )     (as in `cpt_jax.transform`)

Example:
  >>> model = quantize_nnx(MyNNXModel(rngs=nnx.Rngs(0)), rules=[("head", None)])
  >>> @nnx.jit
  ... def logits(model, x, bits):
  ...   with cpt_jax.precision(bits):
  ...     return model(x)
  >>> logits(model, x, jnp.float32(4))      # bits traced: no recompile per width
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Iterator, Optional, Tuple

import jax
import jax.numpy as jnp
from flax import nnx

from cpt_jax import context
from cpt_jax import cost as cost_lib
from cpt_jax.quant_config import CPT_CONFIG, QuantConfig
from cpt_jax.cost import OpRecord
from cpt_jax.transform import (QuantConvGeneralDilated, QuantDotGeneral, _effective_bits,
                               _normalize_rules, _quantize_error, _quantize_operand,
                               _with_channel_axis, resolve_config)

__all__ = ["QuantEinsum", "quantize_nnx", "quantized_layers", "count_ops_nnx", "path_name"]

_DOT_LAYERS = (nnx.Linear, nnx.LinearGeneral)
_CONV_LAYERS = (nnx.Conv,)
_EINSUM_LAYERS = (nnx.Einsum,)


@dataclasses.dataclass(frozen=True)
class QuantEinsum:
    """A quantized ``einsum_op`` for ``nnx.Einsum``: ``Q_g^bwd(einsum(Q_b(x), Q_b(W)))``.

    Called as ``op(einsum_str, inputs, kernel, precision=None, **kwargs)`` (how
    ``nnx.Einsum`` calls its op). The kernel gets one range per output feature (its
    last axis that appears in the output) with a per-channel format.

    Example:
      >>> layer = nnx.Einsum("bd,df->bf", (3, 4), einsum_op=QuantEinsum(),
      ...                    rngs=nnx.Rngs(0))
      >>> with cpt_jax.precision(4):
      ...   y = layer(jnp.ones((2, 3)))
    """

    config: Optional[QuantConfig] = CPT_CONFIG
    name: Optional[str] = None

    def __call__(self, einsum_str: str, inputs, kernel, precision=None, **kwargs):
        kwargs.pop("out_sharding", None)
        preferred = kwargs.pop("preferred_element_type", None)
        spec = einsum_str.replace(" ", "")
        ins, out_spec = spec.split("->")
        a_spec, b_spec = ins.split(",")
        contracted = [c for c in a_spec if c in b_spec and c not in out_spec]
        reduction = int(math.prod(inputs.shape[a_spec.index(c)] for c in contracted))

        def einsum(a, b):
            return jnp.einsum(spec, a, b, precision=precision, preferred_element_type=preferred)

        out_shape = jax.eval_shape(einsum, inputs, kernel).shape
        cfg = self.config
        context.record(OpRecord(
            name=self.name or "einsum", kind="einsum",
            macs=int(math.prod(out_shape)) * reduction, reduction=reduction,
            lhs_shape=tuple(inputs.shape), rhs_shape=tuple(kernel.shape),
            out_shape=tuple(out_shape), quantized=cfg is not None,
            bits_offset=0.0 if cfg is None else cfg.bits_offset,
            grad_bits_offset=0.0 if cfg is None else cfg.grad_bits_offset))
        state = context.current_precision()
        if cfg is None or state is None:
            return einsum(inputs, kernel)
        bits = _effective_bits(state.bits, cfg.bits_offset)
        out_axes = [i for i, c in enumerate(b_spec) if c in out_spec]
        weight_tq = cfg.weight
        if weight_tq is not None and out_axes:
            weight_tq = _with_channel_axis(weight_tq, out_axes[-1])
        x = _quantize_operand(inputs, bits, cfg.activation, state)
        w = _quantize_operand(kernel, bits, weight_tq, state)
        return _quantize_error(einsum(x, w), state, cfg)


def path_name(path: Tuple[Any, ...]) -> str:
    """An NNX module path as the rule-matching name: ``("blocks", 0, "linear")`` ->
    ``"blocks/0/linear"``."""
    return "/".join(str(p) for p in path)


def _layers(model: nnx.Module) -> Iterator[Tuple[str, nnx.Module]]:
    for path, module in nnx.iter_modules(model):
        if isinstance(module, _DOT_LAYERS + _CONV_LAYERS + _EINSUM_LAYERS):
            yield path_name(path), module


def quantize_nnx(model: nnx.Module, rules=None,
                 config: Optional[QuantConfig] = CPT_CONFIG) -> nnx.Module:
    """Make an existing NNX model low-precision, in place; returns the same `model`.

    Every ``nnx.Linear`` / ``nnx.LinearGeneral`` gets ``dot_general =
    QuantDotGeneral(cfg, name=path)``, every ``nnx.Conv`` gets
    ``conv_general_dilated = QuantConvGeneralDilated(cfg, name=path)`` and every
    ``nnx.Einsum`` gets ``einsum_op = QuantEinsum(cfg, name=path)``, where ``cfg`` is
    the target of the first rule whose regex `re.search`es the layer's path, else
    `config`. A None target (or ``"full_precision"``) keeps the layer in fp32 (its ops
    are still counted for the cost). Variables are not touched; calling it again
    re-applies the (new) rules.

    Args:
      model: an ``nnx.Module``.
      rules: ``[(regex, QuantConfig | None), ...]`` or a dict, as for `quantize_model`.
      config: the `QuantConfig` of layers no rule matches (CPT's recipe).

    Example:
      >>> model = quantize_nnx(model, rules=[("head", None)])
      >>> dict(quantized_layers(model))["head"] is None
      True
    """
    if not isinstance(model, nnx.Module):
        raise ValueError(f"quantize_nnx expects a flax.nnx Module, got {type(model).__name__}")
    rules = _normalize_rules(rules)
    for name, layer in list(_layers(model)):
        cfg = resolve_config(name, rules, config)
        if isinstance(layer, _DOT_LAYERS):
            layer.dot_general = QuantDotGeneral(config=cfg, name=name)
            if isinstance(layer, nnx.LinearGeneral):
                layer.dot_general_cls = None  # it would take precedence
        elif isinstance(layer, _CONV_LAYERS):
            layer.conv_general_dilated = QuantConvGeneralDilated(config=cfg, name=name)
        else:
            layer.einsum_op = QuantEinsum(config=cfg, name=name)
    return model


def quantized_layers(model: nnx.Module) -> list:
    """``[(path, QuantConfig | None), ...]`` of the layers carrying a cpt_jax op
    (None: kept in fp32). Layers with their stock op are not listed."""
    out = []
    for name, layer in _layers(model):
        op = getattr(layer, "dot_general", None) if isinstance(layer, _DOT_LAYERS) else (
            layer.conv_general_dilated if isinstance(layer, _CONV_LAYERS) else layer.einsum_op)
        if isinstance(op, (QuantDotGeneral, QuantConvGeneralDilated, QuantEinsum)):
            out.append((name, op.config))
    return out


def count_ops_nnx(model: nnx.Module, *inputs, **call_kwargs) -> list:
    """The `OpRecord`s of ``model(*inputs, **call_kwargs)``, traced abstractly.

    Nothing is computed or mutated (the model is split and merged inside
    `jax.eval_shape`). Feed them to `cpt_jax.relative_cost_per_step` / `run_cost`.

    Example:
      >>> ops = count_ops_nnx(model, jnp.zeros((1, 28, 28, 1)))
      >>> cpt_jax.total_macs(ops)
    """
    graphdef, state = nnx.split(model)

    def run(state, *xs):
        return nnx.merge(graphdef, state)(*xs, **call_kwargs)

    return cost_lib.trace_ops(run, state, *inputs)
