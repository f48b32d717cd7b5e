"""Static activation ranges: calibration (min/max per product over batches) and fake
quantization on a given grid per product (`cpt_jax.export`'s providers).

A product's range is keyed by `range_key`: its module's path in the variable tree
plus its name below the module (`product_key`), ``":rhs"`` added for a right-hand
activation (attention).
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from cpt_jax.interception import ACTIVATION, Operand, Product
from cpt_jax.ops.grids import finite_min_max, quantize_with_range
from cpt_jax.providers.fake_quant import FakeQuantProvider, operand_quant
from cpt_jax.providers.running_ranges import range_variable_name

Array = jax.Array


def product_key(product: Product) -> str:
    """Where a product's grids and ranges live: its module's path in the variable tree
    plus its name below the module (``"conv1"``, ``"attn/query_key"``, ``"einsum_0"``
    for a product of the root module)."""
    return leaf_key(product.owner, product.local.replace("/", "_"))


def range_key(product: Product, operand: Operand) -> str:
    """The key of an activation operand's range: `product_key` for its left operand,
    ``+ ":rhs"`` for a right activation (the attention products)."""
    key = product_key(product)
    return key if operand is product.lhs else f"{key}:rhs"


CALIBRATION_COLLECTION = "export_calibration"
"""The variable collection where `calibrate` accumulates ``[min, max]`` per activation."""


def _merge_range(module, name: str, lo: Array, hi: Array) -> None:
    if module.has_variable(CALIBRATION_COLLECTION, name):
        old = module.get_variable(CALIBRATION_COLLECTION, name)
        lo, hi = jnp.minimum(old[0], lo), jnp.maximum(old[1], hi)
    module.put_variable(CALIBRATION_COLLECTION, name, jnp.stack([lo, hi]))


@dataclasses.dataclass(frozen=True, eq=False)
class CalibrationProvider(FakeQuantProvider):
    """CPT's fake quantization that accumulates each activation operand's finite
    ``[min, max]`` in the product's module (collection `CALIBRATION_COLLECTION`, named
    as `cpt_jax.providers.running_ranges.range_variable_name`; carried through ``nn.scan``)."""

    def prepare(self, product: Product, lhs, rhs) -> None:
        """At ``init``: an empty range ``[inf, -inf]`` per activation, so that the
        collection has its final structure before any ``nn.scan`` carries it."""
        module = product.module
        if module is None or not module.is_mutable_collection(CALIBRATION_COLLECTION):
            return
        for operand in (product.lhs, product.rhs):
            name = range_variable_name(product, operand)
            if (operand.role == ACTIVATION and operand_quant(product, operand) is not None
                    and not module.has_variable(CALIBRATION_COLLECTION, name)):
                module.put_variable(CALIBRATION_COLLECTION, name,
                                    jnp.array([jnp.inf, -jnp.inf], jnp.float32))

    def quantize_operand(self, product: Product, operand: Operand, x: Array, bits, state):
        """Accumulate ``(min, max)`` of an activation, then `fake_quant` it."""
        if (operand.role == ACTIVATION and operand_quant(product, operand) is not None
                and product.module is not None):
            lo, hi = finite_min_max(lax.stop_gradient(jnp.asarray(x, jnp.float32)), None)
            _merge_range(product.module, range_variable_name(product, operand), lo, hi)
        return super().quantize_operand(product, operand, x, bits, state)


CALIBRATION = CalibrationProvider()
"""The provider of `calibrate`."""


def range_key_of_variable(key: str) -> str | None:
    """The `range_key` of a range variable at flat path `key` (its module's path and
    `cpt_jax.providers.running_ranges.range_variable_name`), None for another leaf.

    Example:
      >>> range_key_of_variable("conv1/lhs"), range_key_of_variable("attn/query_key_rhs")
      ('conv1', 'attn/query_key:rhs')
    """
    module, _, name = key.rpartition("/")
    if name not in ("lhs", "rhs") and not name.endswith(("_lhs", "_rhs")):
        return None
    below, side = name[:-4] if len(name) > 3 else "", name[-3:]
    path = "/".join(p for p in (module, below) if p)
    return path if side == "lhs" else f"{path}:rhs"


@dataclasses.dataclass(frozen=True, eq=False)
class StaticRangeProvider(FakeQuantProvider):
    """CPT's fake quantization with each activation on the grid of a given range
    (`cpt_jax.ops.grids.quantize_with_range`, as the running-range evaluation)."""

    ranges: Any = None

    def quantize_operand(self, product: Product, operand: Operand, x: Array, bits, state):
        """Activations on the static grid of ``ranges[product.path]``; weights as CPT."""
        tq = operand_quant(product, operand)
        if operand.role != ACTIVATION or tq is None:
            return super().quantize_operand(product, operand, x, bits, state)
        key = range_key(product, operand)
        if key not in self.ranges:
            raise ValueError(f"no activation range for product {key!r}; calibrate first")
        lo, hi = self.ranges[key]
        return quantize_with_range(x, lo, hi, bits, tq.fmt)


def leaf_key(path: str, name: str) -> str:
    return "/".join(p for p in (path, name) if p)
