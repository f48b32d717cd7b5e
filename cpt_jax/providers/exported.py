"""The provider of an exported model: every product computed from int8 codes where the
export left them (`cpt_jax.export.int8_apply`)."""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp

from cpt_jax.interception import WEIGHT, Product
from cpt_jax.ops.grids import channel_shape
from cpt_jax.ops.integer import INPUT_LEAVES, activation_product, integer_product
from cpt_jax.providers.static_ranges import leaf_key, product_key

Array = jax.Array


def _grids(flat: Mapping[str, Array], product: Product, names) -> dict:
    prefix = product_key(product)
    return {name: flat[leaf_key(prefix, name)] for name in names
            if leaf_key(prefix, name) in flat}


GRID_NAMES = INPUT_LEAVES + tuple(f"{side}_{leaf}" for side in ("lhs", "rhs") for leaf in (
    "scale", "origin", "code_min", "code_max", "code_shift"))


@dataclasses.dataclass(frozen=True, eq=False)
class ExportedModelProvider:
    """Computes every product of an exported model from the exported leaves (`flat`:
    the exported ``params``, flattened with ``/``): `integer_product` when its weight
    has codes, `activation_product` when both operands have static grids, the float
    product elsewhere."""

    flat: Any = None

    def compute(self, product: Product, lhs: Array, rhs: Array, state, apply: Callable) -> Array:
        """The integer product of an exported product, else ``apply(lhs, rhs)``."""
        flat, weight = self.flat, product.rhs.param if product.rhs.role == WEIGHT else None
        if weight is not None and f"{weight}_scale" in flat:
            scale, offset = flat[f"{weight}_scale"], flat[f"{weight}_offset"]
            if product.kind == "lookup":
                shape = channel_shape(rhs.ndim, 0)
                return apply(lhs, rhs.astype(jnp.float32) * scale.reshape(shape)
                             + offset.reshape(shape))
            leaves = {"kernel_scale": scale, "kernel_offset": offset,
                      **_grids(flat, product, INPUT_LEAVES)}
            return integer_product(lhs, rhs, leaves, product.op).astype(lhs.dtype)
        grids = _grids(flat, product, GRID_NAMES)
        if "lhs_scale" in grids:
            return activation_product(lhs, rhs, grids, product.op).astype(lhs.dtype)
        return apply(lhs, rhs)
