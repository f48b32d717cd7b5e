"""Int8 forward products: ``y`` on int8 codes with int32 accumulation when ``bits <= 8``,
a straight-through float32 backward.

`Int8Provider` (`INT8_FORWARD`) plugs `cpt_jax.ops.int8` into the interception seam
for products whose `ProductOp` is a dot_general or a conv with a weight: ``lax.cond(bits
<= 8, int8 product, float product of the fake-quantized operands)``; a dot_general with
the weight on the left (JAX's einsum lowers ``"btd,dhk->bhtk"`` so) runs swapped and
transposed back; others fall back to fake quantization. The integer provider
(`cpt_jax.providers.integer`, ``QuantConfig(compute="int")``) computes with it the
products its three integer GEMMs do not take: `SymmetricInt` grids tiled along the
contraction (one int32 partial sum per tile) and convolutions (on CPU in float32 on
the same codes: XLA's CPU int8 convolution is 40x slower). `int8_forward_applies` says
which.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from cpt_jax.context import PrecisionState, effective_bits
from cpt_jax.formats import format_traits
from cpt_jax.interception import ACTIVATION, WEIGHT, Product
from cpt_jax.ops.fake_quant import fake_quant
from cpt_jax.ops.int8 import Int8Spec, int8_product
from cpt_jax.ops.product_op import dot_general_op
from cpt_jax.providers.fake_quant import FakeQuantProvider, key_for, operand_quant
from cpt_jax.quant_config import QuantConfig

Array = jax.Array


def check_int8_config(config: QuantConfig) -> None:
    """ValueError unless the activation format is per-tensor or per-token `SymmetricInt`,
    or tiled like the weight (the same 1-D tile along the contraction)."""
    act = config.activation
    fmt = getattr(act, "fmt", None)
    tile = getattr(fmt, "tile", None)
    weight_tile = getattr(getattr(config.weight, "fmt", None), "tile", None)
    if (act is None or getattr(fmt, "channel_axis", None) is not None
            or (tile is not None and (tile != weight_tile or isinstance(tile, tuple)))):
        raise ValueError(
            "an int8 forward product needs a per-tensor or per-token activation format "
            "(SymmetricInt() or SymmetricInt(scale_axes=(-1,))), or one tiled as the "
            f"weight (the same int tile), got {act!r} with weight {config.weight!r}")


def _int8_spec(product: Product, out_ndim: int):
    op = product.op
    if op is None or op.kind not in ("dot_general", "conv") or product.rhs.channel_axis is None:
        return None
    lhs_fmt = getattr(operand_quant(product, product.lhs), "fmt", None)
    lhs_axes = getattr(lhs_fmt, "scale_axes", None)
    if lhs_axes is not None and op.kind != "dot_general":
        return None  # a conv's window mixes tokens: fake quant with per-token scales
    tile = getattr(lhs_fmt, "tile", None)
    if tile is not None and not (isinstance(tile, int) and len(product.lhs.contracting) == 1
                                 and len(product.rhs.contracting) == 1):
        return None  # tiles over several contracted axes: fake quant
    out_channel = op.dimension_numbers.out_spec[1] if op.kind == "conv" else out_ndim - 1
    return Int8Spec(op, product.rhs.channel_axis, out_channel, lhs_axes, tile)


def int8_forward_applies(product: Product) -> bool:
    """Whether `Int8Provider` computes `product` on int8 codes (not fake quantization):
    `SymmetricInt` weight and activation accepted by `check_int8_config`, and a
    dot_general or conv with a weight (either side of a dot).

    Example:
      >>> from cpt_jax.interception import make_product
      >>> from cpt_jax.ops.product_op import dot_general_op
      >>> op = dot_general_op((((1,), (0,)), ((), ())))
      >>> tiles = cpt_jax.get_preset("int8_tile128")
      >>> int8_forward_applies(make_product("d", "dot_general", tiles, op, (8, 256), (256, 3)))
      True
    """
    cfg = product.config
    if cfg is None or product.op is None:
        return False
    if weight_first(product):
        product = swapped(product, product.op.dimension_numbers, cfg)
    fmts = [getattr(getattr(cfg, f), "fmt", None) for f in ("weight", "activation")]
    if any(format_traits(f).family != "symmetric_int" for f in fmts):
        return False
    try:
        check_int8_config(cfg)
    except ValueError:
        return False
    return _int8_spec(product, 2) is not None


def weight_first(product: Product) -> bool:
    """Whether `product` is a dot_general with the weight as its lhs and an activation
    as its rhs (JAX's einsum lowers ``"btd,dhk->bhtk"`` so, kernel first)."""
    op = product.op
    return (op is not None and op.kind == "dot_general" and product.lhs.role == WEIGHT
            and product.rhs.role == ACTIVATION and product.lhs.channel_axis is not None)


def swapped(product: Product, dimension_numbers, config: QuantConfig) -> Product:
    """The dot_general `product` (of these dimension numbers) with its operands
    swapped, ``dot(x, w)`` for ``dot(w, x)`` (its output the original's transposed by
    `swapped_to_original`), under `config`."""
    (lc, rc), (lb, rb) = dimension_numbers
    return dataclasses.replace(product, lhs=product.rhs, rhs=product.lhs, config=config,
                               op=dot_general_op(((rc, lc), (rb, lb))))


def swapped_to_original(dimension_numbers, lhs_ndim: int, rhs_ndim: int) -> tuple[int, ...]:
    """The transpose taking ``dot(rhs, lhs)``'s output ``(batch, rhs free, lhs free)``
    to ``dot(lhs, rhs)``'s ``(batch, lhs free, rhs free)``.

    Example:
      >>> swapped_to_original((((0,), (2,)), ((), ())), 3, 3)   # (K, H, D) . (B, T, K)
      (2, 3, 0, 1)
    """
    (lc, rc), (lb, _) = dimension_numbers
    nb = len(lb)
    n_lhs, n_rhs = lhs_ndim - len(lc) - nb, rhs_ndim - len(rc) - nb
    return (*range(nb), *range(nb + n_rhs, nb + n_rhs + n_lhs), *range(nb, nb + n_rhs))


@dataclasses.dataclass(frozen=True)
class Int8Provider(FakeQuantProvider):
    """Products on int8 codes when ``bits <= 8`` (module docstring), else fake quant.

    On CPU a convolution runs on the fake-quantized operands (XLA's CPU backend
    has no fast int8 convolution and runs convolutions inside a conditional's
    branches slowly, measured 18x on ResNet-20); GPU/TPU run the int8 one.
    """

    def compute(self, product: Product, lhs: Array, rhs: Array, state: PrecisionState,
                apply: Callable) -> Array:
        if weight_first(product):
            return self._weight_first(product, lhs, rhs, state, apply)
        cfg = product.config
        out_ndim = len(jax.eval_shape(apply, lhs, rhs).shape)
        spec = _int8_spec(product, out_ndim)
        if spec is None:
            return super().compute(product, lhs, rhs, state, apply)
        check_int8_config(cfg)
        bits = effective_bits(state.bits, cfg.bits_offset)
        keys = (key_for(cfg.activation, state, "an operand (activation)"),
                key_for(operand_quant(product, product.rhs), state, "an operand (weight)"))
        y = _int8_or_float(product, lhs, rhs, bits, keys, spec, apply)
        return self.quantize_error(product, y, state)

    def _weight_first(self, product: Product, lhs: Array, rhs: Array, state: PrecisionState,
                      apply: Callable) -> Array:
        """``dot(w, x) = T(dot(x, w))``: the int8 product of the swapped operands,
        transposed back, its error quantized in the original layout."""
        op, cfg = product.op, product.config
        if op is None or cfg is None:
            raise ValueError(f"{product.path}: a weight-first int8 product needs its op and config")
        to_original = swapped_to_original(op.dimension_numbers, lhs.ndim, rhs.ndim)
        to_swapped = tuple(int(a) for a in np.argsort(to_original))
        inner = swapped(product, op.dimension_numbers, cfg.replace(error=None))
        y = self.compute(inner, rhs, lhs, state,
                         lambda x, w: jnp.transpose(apply(w, x), to_swapped))
        return self.quantize_error(product, jnp.transpose(y, to_original), state)


def _int8_or_float(product, lhs, rhs, bits, keys, spec: Int8Spec, apply):
    """``lax.cond(bits <= 8, int8 product, float product of fake-quantized operands)``."""
    def fake(x, operand, key):
        tq = operand_quant(product, operand)
        return fake_quant(x, bits, tq.fmt, rounding=tq.rounding, key=key)

    def float_product(a, b):
        return apply(fake(a, product.lhs, keys[0]), fake(b, product.rhs, keys[1])).astype(lhs.dtype)

    def int8_or_float(a, b):
        return lax.cond(bits <= 8, lambda a, b: int8_product(a, b, bits, keys, spec),
                        float_product, a, b)

    if spec.op.kind == "conv":
        return lax.platform_dependent(lhs, rhs, cpu=float_product, default=int8_or_float)
    return int8_or_float(lhs, rhs)


INT8_FORWARD = Int8Provider()
"""Int8 forward products (tiles, convolutions) for the integer provider."""
