"""`quantize_model`: the one door for Linen and NNX models, and `quantized_layers`."""
from __future__ import annotations

import dataclasses

import flax.linen as nn
from flax import nnx

from cpt_jax import context
from cpt_jax.doors._layers import without_int8
from cpt_jax.doors._linen import quantized_linen_model
from cpt_jax.doors._nnx import quantized_nnx_model, submodule_env
from cpt_jax.formats import AffineInt
from cpt_jax.interception import (
    LAST_PRODUCT,
    Interception,
    as_config,
    normalize_rules,
    resolve_config,
)
from cpt_jax.ops.scale_history import HISTORY_LENGTH, check_history
from cpt_jax.providers import default_provider
from cpt_jax.providers.delayed_scaling import DEFAULT_COLLECTION, DelayedScalingProvider
from cpt_jax.quant_config import CPT_CONFIG, QuantConfig

# --------------------------------------------------------------------------- one door

def quantize_model(model, rules=None, config: QuantConfig | None = CPT_CONFIG,
                   provider=None):
    """Make an unmodified Flax model, Linen or NNX, low-precision in every product.

    Args:
      model: a Linen module (a quantized copy is returned: same ``init``/``apply``,
        any ``method=``, same variable tree) or an NNX module (quantized in place and
        returned: its state untouched).
      rules: ``[(regex, target), ...]`` matched with `re.search` against each
        product's path (e.g. ``"stage1_block1/conv1"``, ``"decoder/attn/einsum_1"``);
        first match wins. A target is a `QuantConfig` or a preset name (``"mxfp8"``,
        `cpt_jax.PRESETS`), or None / ``"full_precision"`` to keep it in fp32.
        `LAST_PRODUCT` matches the last product in call order. Products no rule
        matches use `config`. A rule that matches no product of a call warns
        (`UnmatchedRuleWarning`, once per model and pattern).
      config: the default `QuantConfig` (CPT's recipe), or a preset name
        (``quantize_model(model, config="mxfp8")``; an unknown name is a ValueError
        listing the known ones).
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
    config = as_config(config, "quantize_model config")
    context.prepare_cache_key()  # before the model's first trace (`cpt_jax.context`)
    env = Interception(normalize_rules(rules), config, provider, default=default_provider)
    if isinstance(model, nnx.Module):
        return quantized_nnx_model(model, env)
    if isinstance(model, nn.Module):
        return quantized_linen_model(model, env)
    raise ValueError(f"quantize_model expects a flax.linen or flax.nnx Module, got "
                     f"{type(model).__name__}")


def interception_of(model) -> Interception | None:
    """The `Interception` of a model from `quantize_model` (None for another model)."""
    return getattr(type(model), "cpt_interception", None)


@dataclasses.dataclass(frozen=True)
class LayerProduct:
    """One product of a model, as `quantized_layers` lists it."""

    path: str
    kind: str
    macs: int
    config: QuantConfig | None


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
    from cpt_jax.cost import check_linen_arguments, count_ops
    if not isinstance(model, (nn.Module, nnx.Module)):
        raise ValueError(f"quantized_layers expects a flax.linen or flax.nnx Module, got "
                         f"{type(model).__name__}")
    if isinstance(model, nn.Module):
        check_linen_arguments("quantized_layers", model, args)
    ops = count_ops(model, *args, **kwargs)
    env = interception_of(model)
    last = ops[-1].name if ops else None
    if env is not None and not getattr(type(model), "cpt_root", True):
        last = submodule_env(env).last  # a submodule: the model's last product

    def config_of(op):
        if env is None or not op.quantized:
            return None if not op.quantized else CPT_CONFIG
        return resolve_config(op.name, env.rules, env.config, last)

    return [LayerProduct(op.name, op.kind, op.macs, config_of(op)) for op in ops]


FP32_ATTENTION = (r"(query_key|weights_value)(@\d+)?$", None)
"""A rule keeping the two attention products (``q . k``, ``weights . v``) in fp32.

Attention products are quantized by default like any other product; low-bit
attention scores can hurt convergence, so put this rule first to keep them fp32:
``quantize_model(model, rules=[FP32_ATTENTION, *CPT_RULES])``."""

CPT_RULES = ((LAST_PRODUCT, None),)
"""CPT's recipe: every product quantized but the last one in call order (the
classifier, whatever it is called), kept in fp32."""


def delayed_scaling_model(model: nn.Module, rules=None, config: QuantConfig | None = CPT_CONFIG,
                          *, fmt=AffineInt(), method: str = "delayed",
                          history_length: int = HISTORY_LENGTH,
                          collection: str = DEFAULT_COLLECTION, margin: float = 0.0,
                          kappa: float = 100.0) -> nn.Module:
    """`quantize_model` with each layer's input scaled from its history.

    ``quantize_model(model, rules, config, provider=DelayedScalingProvider(...))``:
    the history of a layer lives at ``(collection, <layer path>/delayed_quant/
    input_history)``.

    Args:
      model: an unmodified Linen model (the input of each dot_general / conv layer
        with a weight is scaled from history; other products as `quantize_model`).
      rules, config: as `cpt_jax.quantize_model` (weights and errors per `config`,
        dynamic; a rule target None keeps a layer in fp32).
      fmt: the input grid: `AffineInt()` (CPT's, default), `SymmetricInt()`,
        `Float(e)`.
      method: ``"delayed"`` or ``"autoflex"``.
      history_length, margin, kappa: see the module docstring.
      collection: where the histories live (``"batch_stats"``: carried and updated
        by `make_train_step` like BatchNorm statistics).

    Returns:
      The quantized model (see `cpt_jax.quantize_model`).

    Example:
      >>> qmodel = delayed_scaling_model(nn.Dense(3))
      >>> v = qmodel.init(jax.random.key(0), jnp.ones((2, 4)))
      >>> int(v["batch_stats"]["delayed_quant"]["input_history"].count)
      0
    """
    check_history(fmt, method)
    config = as_config(config, "delayed_scaling_model config")
    if not isinstance(model, nn.Module):
        raise ValueError(f"delayed_scaling_model expects a flax.linen Module, got "
                         f"{type(model).__name__}")
    provider = DelayedScalingProvider(fmt, method, history_length, collection, margin, kappa)
    return quantize_model(model, rules, without_int8(config), provider=provider)
