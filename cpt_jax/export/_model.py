"""`export_model`: the quantized products of a trained model as int8 weight codes and
static activation grids; `int8_apply` runs them, `fake_quant_apply` is its reference."""
from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import serialization, struct, traverse_util

from cpt_jax.context import precision
from cpt_jax.doors import QuantizedModel, quantize_model
from cpt_jax.export._calibration import with_provider
from cpt_jax.export._checks import (
    FP32_LAYER_MODES,
    Ranges,
    check_export_bits,
    check_quantized_model,
    grid_kind,
    layer_bits,
)
from cpt_jax.interception import WEIGHT, Product
from cpt_jax.ops.grids import code_bounds, grid_from_range, kernel_codes, param_channel_axes
from cpt_jax.providers.exported import ExportedModelProvider
from cpt_jax.providers.running_ranges import COLLECTION as RANGES_COLLECTION
from cpt_jax.providers.static_ranges import StaticRangeProvider, leaf_key, product_key
from cpt_jax.quant_config import QuantConfig

Array = jax.Array


# --------------------------------------------------------------------------- checks


# --------------------------------------------------------------------------- grids


# --------------------------------------------------------------------------- products
#
# Everything below plugs into the interception seam (`cpt_jax.interception`): a
# provider computes one `Product` (its path, config, `ProductOp` and Linen module).

SUPPORTED_OPS = ("dot_general", "conv")
"""Products exported with integer weights: dot_generals (any ``@``, einsum, Dense,
attend...) without batch dimensions and convolutions whose right operand is a
weight; embedding lookups (int8 table rows, dequantized); products of two
activations (attention) on two static grids."""


# --------------------------------------------------------------------------- calibration


# --------------------------------------------------------------------------- export

@struct.dataclass
class ExportedModel:
    """A model with integer kernels: the Linen `model` (float or quantized: only its
    class and fields are used), its exported `variables` and the export width `bits`.
    A pytree (variables are its leaves), so ``jax.jit(int8_apply)(exported, x)`` works.

    In ``variables["params"]`` each exported layer's ``kernel`` holds int8 codes, beside
    ``kernel_scale``/``kernel_offset`` (per output channel) and, unless its activations
    stay float, the ``input_*`` scalars of its static activation grid.
    """

    variables: Any
    model: nn.Module = struct.field(pytree_node=False)
    bits: int = struct.field(pytree_node=False)

    def layers(self) -> tuple[str, ...]:
        """The exported products' keys (static activation grids) and the modules
        holding int8 weights (``"conv1"``, ``"attn/query_key"``)."""
        flat = traverse_util.flatten_dict(dict(self.variables.get("params", {})), sep="/")
        keys = set()
        for key in flat:
            owner, _, leaf = key.rpartition("/")
            if leaf in ("input_scale", "lhs_scale") or (
                    leaf.endswith("_scale") and f"{key[:-len('_scale')]}_offset" in flat):
                keys.add(owner)
        return tuple(sorted(k for k in keys if k))


def _grid_leaves(prefix: str, side: str, fmt, bits: int, lo: float, hi: float) -> dict:
    """The static grid of one activation: ``<prefix>/<side>_scale``, ``_origin``, code
    bounds and shift (``side`` ``input`` for a weight product's activation)."""
    kind = grid_kind(fmt, f"activation of {prefix!r}")
    origin, scale = grid_from_range(kind, bits, lo, hi)
    code_min, code_max, shift = code_bounds(kind, bits)
    values = {"scale": scale, "origin": origin, "code_min": jnp.float32(code_min),
              "code_max": jnp.float32(code_max), "code_shift": jnp.float32(shift)}
    return {leaf_key(prefix, f"{side}_{name}"): v for name, v in values.items()}


def _range(ranges: Ranges, key: str) -> tuple[float, float]:
    if key not in ranges:
        raise ValueError(f"no activation range for product {key!r}; calibrate first")
    return ranges[key]


def _weight_leaves(record, flat, cfg: QuantConfig, bits: int) -> dict:
    """The weight of a product as int8 codes, with its per-channel scale and offset."""
    product = record.product
    param = product.rhs.param
    if cfg.weight is None:
        raise ValueError(f"product {product.path!r} has no weight quantizer; export needs one")
    kind = grid_kind(cfg.weight.fmt, f"weight of product {product.path!r}")
    axes = None
    if getattr(cfg.weight.fmt, "channel_axis", None) is not None:
        axes = param_channel_axes(record.rhs_shape, product.rhs.channel_axis, flat[param].shape)
        if axes is None:
            raise ValueError(f"product {product.path!r}: cannot map its weight's channel axis "
                             f"onto parameter {param!r}; keep it in fp32 with a rule")
    codes, scale, offset = kernel_codes(flat[param], bits, kind, axes)
    return {param: codes, f"{param}_scale": scale, f"{param}_offset": offset}


def _check_exportable(product: Product) -> None:
    if product.lhs.role == WEIGHT and product.rhs.role != WEIGHT:
        raise ValueError(f"product {product.path!r} has its weight on the left; export "
                         "expects it on the right (x @ w), or keep it in fp32 with a rule")
    if product.kind == "lookup":
        return
    if product.op is None or product.op.kind not in SUPPORTED_OPS:
        raise ValueError(f"product {product.path!r} ({product.kind}) is quantized; export "
                         f"handles {SUPPORTED_OPS} products and embedding lookups (keep it "
                         "in fp32 with a rule)")


def _product_leaves(record, flat, bits: int, ranges: Ranges, fp32_layers: str) -> dict:
    """The exported leaves of one product (none when it stays as it is)."""
    product, cfg = record.product, record.product.config
    has_weight = product.rhs.role == WEIGHT and product.rhs.param in flat
    if cfg is None:
        if fp32_layers == "keep" or not has_weight or product.kind == "lookup":
            return {}
        _check_exportable(product)
        return _weight_leaves(record, flat, QuantConfig(activation=None), 8)
    _check_exportable(product)
    width, prefix = layer_bits(bits, cfg, product.path), product_key(product)
    if not has_weight:
        if cfg.activation is None:
            raise ValueError(f"product {product.path!r} of two activations needs an "
                             "activation quantizer")
        return {**_grid_leaves(prefix, "lhs", cfg.activation.fmt, width,
                               *_range(ranges, prefix)),
                **_grid_leaves(prefix, "rhs", cfg.activation.fmt, width,
                               *_range(ranges, f"{prefix}:rhs"))}
    leaves = _weight_leaves(record, flat, cfg, width)
    if cfg.activation is not None and product.kind != "lookup":
        leaves.update(_grid_leaves(prefix, "input", cfg.activation.fmt, width,
                                   *_range(ranges, prefix)))
    return leaves


def export_model(qmodel: QuantizedModel, variables: Mapping, bits, ranges: Ranges,
                 sample_inputs: Any, *, fp32_layers: str = "keep", **apply_kwargs
                 ) -> ExportedModel:
    """The integer model: int8 weight codes + per-channel scales + static input grids.

    Every quantized product whose right operand is a weight (a parameter, or its
    transpose/reshape: ``nn.Dense``, ``nn.Conv``, ``x @ w``, ``jnp.einsum`` on
    ``self.param``s, a tied ``attend``) at ``b = bits + bits_offset`` gets its
    parameter ``w`` replaced by int8 codes, ``w_q = codes * w_scale + w_offset``
    (``<param>_scale``/``_offset`` beside it, per output channel), and its activation
    the static grid of ``ranges[product_key]`` (``input_*`` leaves under the product's
    key); a product of two activations (attention) gets both grids (``lhs_*``,
    ``rhs_*``); an embedding lookup stores its table as codes. Products kept in
    fp32 stay fp32 (`fp32_layers` ``"keep"``) or get int8 weight codes (8-bit
    affine, per channel) with float activations (``"int8_weights"``). A parameter
    shared by several products (a tied embedding) gets the codes of the first.
    Every other variable (biases, BatchNorm) is unchanged; the running
    ``activation_ranges`` collection, now in the input grids, is dropped.

    Args:
      qmodel: the model from `cpt_jax.quantize_model`.
      variables: its trained variables.
      bits: the export width, 2..8 (ValueError otherwise).
      ranges: from `calibrate` or `running_ranges`.
      sample_inputs: inputs of the model (shapes only: its products are traced).
      fp32_layers: ``"keep"`` or ``"int8_weights"``.
      **apply_kwargs: passed to ``apply`` (e.g. ``train=False``).

    Returns:
      An `ExportedModel`; run it with `int8_apply`.
    """
    from cpt_jax.cost import count_ops
    qmodel = check_quantized_model(qmodel)
    bits = check_export_bits(bits)
    if fp32_layers not in FP32_LAYER_MODES:
        raise ValueError(f"fp32_layers must be one of {FP32_LAYER_MODES}, got {fp32_layers!r}")
    flat = traverse_util.flatten_dict(serialization.to_state_dict(dict(variables["params"])),
                                      sep="/")
    out, written = dict(flat), set()
    for record in count_ops(qmodel, variables, sample_inputs, **apply_kwargs):
        for key, value in _product_leaves(record, flat, bits, ranges, fp32_layers).items():
            if key not in written:  # a shared parameter keeps its first product's codes
                out[key] = value
                written.add(key)
    # The running ranges live on in the input grids: the collection is not exported.
    exported = {k: v for k, v in dict(variables).items() if k != RANGES_COLLECTION}
    exported["params"] = traverse_util.unflatten_dict(out, sep="/")
    return ExportedModel(variables=exported, model=qmodel, bits=bits)


def int8_apply(exported: ExportedModel, inputs: Any, **apply_kwargs) -> Any:
    """Run the exported model: integer products (`integer_product`) in every exported
    layer, the model's float ops elsewhere.

    Equal to `fake_quant_apply` with the ranges it was exported from, up to float
    rounding. Jittable: ``jax.jit(int8_apply)(exported, x)``.

    Args:
      exported: from `export_model` or `restore_exported`.
      inputs: the model's inputs.
      **apply_kwargs: passed to ``apply`` (e.g. ``train=False``).

    Returns:
      The model's outputs.
    """
    if not any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree_util.tree_leaves(
            (exported, inputs))):   # weights are found through their traced producers
        return jax.jit(functools.partial(int8_apply, **apply_kwargs))(exported, inputs)
    flat = traverse_util.flatten_dict(serialization.to_state_dict(
        dict(exported.variables.get("params", {}))), sep="/")
    model = quantize_model(exported.model, rules=(), config=QuantConfig(),
                           provider=ExportedModelProvider(flat))
    with precision(exported.bits):
        return model.apply(exported.variables, inputs, **apply_kwargs)


def fake_quant_apply(qmodel: QuantizedModel, variables: Mapping, inputs: Any, *, bits,
                     ranges: Ranges, **apply_kwargs) -> Any:
    """The trained fake-quant model at `bits` with static activation grids.

    Every quantized product computes ``op(Q_[lo,hi](x), Q_b(W))``: the weight through
    `cpt_jax.ops.fake_quant` (the training's quantizer), the activation on the grid of
    ``ranges[path]`` (`cpt_jax.ops.grids.quantize_with_range`, as the running-range
    evaluation does). The reference of `int8_apply`.

    Args:
      qmodel: the model from `cpt_jax.quantize_model`.
      variables: its trained variables.
      inputs: the model's inputs.
      bits: the width, 2..8.
      ranges: from `calibrate` or `running_ranges` (values may be traced).
      **apply_kwargs: passed to ``apply``.

    Returns:
      The model's outputs.
    """
    bits = check_export_bits(bits)
    model = with_provider(qmodel, StaticRangeProvider(ranges=ranges))
    with precision(bits):
        return model.apply(variables, inputs, **apply_kwargs)


# --------------------------------------------------------------------------- storage
