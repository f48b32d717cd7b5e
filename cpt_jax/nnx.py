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

Inside ``nnx.scan`` a layer's products count once per iteration in
`count_ops_nnx`, and their stochastic rounding draws a key per iteration
(`cpt_jax.context.loop_salt`).

Example:
  >>> from flax import nnx
  >>> class MLP(nnx.Module):
  ...   def __init__(self, rngs):
  ...     self.hidden = nnx.Linear(3, 8, rngs=rngs)
  ...     self.head = nnx.Linear(8, 2, rngs=rngs)
  ...   def __call__(self, x):
  ...     return self.head(nnx.relu(self.hidden(x)))
  >>> model = quantize_nnx(MLP(nnx.Rngs(0)), rules=[("head", None)])
  >>> @nnx.jit
  ... def logits(model, x, bits):
  ...   with cpt_jax.precision(bits):
  ...     return model(x)
  >>> logits(model, jnp.ones((4, 3)), jnp.float32(4)).shape   # bits traced: one compile
  (4, 2)
  >>> [op.macs for op in count_ops_nnx(model, jnp.ones((4, 3)))]
  [96, 64]
"""
from __future__ import annotations

from typing import Any, Iterator, Optional, Tuple

from flax import nnx

from cpt_jax import cost as cost_lib
from cpt_jax.quant_config import CPT_CONFIG, QuantConfig
from cpt_jax.interception import LAST_PRODUCT, normalize_rules, resolve_config
from cpt_jax.transform import (QuantConvGeneralDilated, QuantDotGeneral, QuantEinsum,
                               warn_unmatched_rules)

__all__ = ["QuantEinsum", "quantize_nnx", "quantized_layers", "count_ops_nnx", "path_name"]

_DOT_LAYERS = (nnx.Linear, nnx.LinearGeneral)
_CONV_LAYERS = (nnx.Conv,)
_EINSUM_LAYERS = (nnx.Einsum,)


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
      >>> from flax import nnx
      >>> class Net(nnx.Module):
      ...   def __init__(self, rngs):
      ...     self.body, self.head = nnx.Linear(3, 4, rngs=rngs), nnx.Linear(4, 2, rngs=rngs)
      >>> model = quantize_nnx(Net(nnx.Rngs(0)), rules=[("head", None)])
      >>> dict(quantized_layers(model))["head"] is None
      True
    """
    if not isinstance(model, nnx.Module):
        raise ValueError(f"quantize_nnx expects a flax.nnx Module, got {type(model).__name__}")
    rules = normalize_rules(rules)
    if any(pattern == LAST_PRODUCT for pattern, _ in rules):
        raise ValueError("quantize_nnx resolves rules without a traced call, so "
                         "LAST_PRODUCT (CPT_RULES) cannot be used: name the head, e.g. "
                         "rules=[('head', None)]")
    layers = list(_layers(model))
    warn_unmatched_rules(rules, [name for name, _ in layers])
    for name, layer in layers:
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
      >>> from flax import nnx
      >>> ops = count_ops_nnx(quantize_nnx(nnx.Linear(3, 4, rngs=nnx.Rngs(0))), jnp.ones((2, 3)))
      >>> cpt_jax.total_macs(ops)
      24
    """
    graphdef, state = nnx.split(model)

    def run(state, *xs):
        return nnx.merge(graphdef, state)(*xs, **call_kwargs)

    return cost_lib.trace_ops(run, state, *inputs)
