"""`IntegerProvider`: a product's three GEMMs on int8 codes with int32 accumulation.

``QuantConfig(compute="int")`` (the ``int8*`` presets), and ``compute="auto"`` (the
default) on the platforms of `cpt_jax.providers.integer_gemm_platforms`, compute every
product they can with `cpt_jax.ops.integer_gemm.int_dot_general`:

=================================  ====================================================
product                            computed
=================================  ====================================================
dot_general, a plain einsum        forward, input and weight gradient on int8 codes at
(Dense, attention, ``x @ w``)      widths <= 8 (fake quantization above, one program)
  with both operands' grids        `AffineInt` / `SymmetricInt`, per tensor, per
  constant along the contraction   channel (a free axis) or per token, untiled
tiled grids, convolutions          ``compute="int"`` with `SymmetricInt`: the int8
                                   forward product (`cpt_jax.providers.int8`; a conv on
                                   CPU in float32, where XLA has no fast int8 conv),
                                   straight-through backward; else fake quantization
anything else (ragged dots, ...)   fake quantization
=================================  ====================================================

With ``compute="auto"`` only the first row runs on integers, and only on the
platforms where they are faster (``lax.platform_dependent``: the compiled program
takes the branch of its platform); everything else is fake quantization, bit for bit
what `FAKE_QUANT` computes (the same keys in the same order: activation, weight,
error). `integer_path` says which path a product takes (the run's summary counts them).
"""
from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

from cpt_jax.context import PrecisionState, effective_bits
from cpt_jax.formats import format_traits
from cpt_jax.interception import INDEX, Product
from cpt_jax.ops.fake_quant import fake_quant, quantize_grad
from cpt_jax.ops.integer_gemm import IntGemmSpec, check_int_quant, int_dot_general
from cpt_jax.ops.product_op import einsum_dimension_numbers
from cpt_jax.providers.fake_quant import FAKE_QUANT, FakeQuantProvider, key_for, operand_quant
from cpt_jax.providers.int8 import INT8_FORWARD, int8_forward_applies
from cpt_jax.providers.int_platforms import integer_gemm_platforms
from cpt_jax.quant_config import AUTO, QuantConfig

Array = jax.Array

INT_FAMILIES = ("affine_int", "symmetric_int")


class IntegerFallbackWarning(UserWarning):
    """A product of a ``compute="int"`` config that runs fake quantization instead."""


def gemm_plan(product: Product, lhs_ndim: int, rhs_ndim: int
              ) -> tuple[tuple, tuple[int, ...] | None] | None:
    """``(dimension_numbers, out_perm)`` when `product` runs its three GEMMs on int8 codes
    (a dot_general, or an einsum that is one contraction, whose two operands' grids are
    constant along the contraction), else None.

    Example:
      >>> from cpt_jax.interception import make_product
      >>> from cpt_jax.ops.product_op import dot_general_op
      >>> op = dot_general_op((((1,), (0,)), ((), ())))
      >>> p = make_product("dense", "dot_general", cpt_jax.get_preset("cpt"), op, (8, 4), (4, 3))
      >>> gemm_plan(p, 2, 2)
      ((((1,), (0,)), ((), ())), None)
      >>> tiles = cpt_jax.get_preset("symmetric_tile128")
      >>> gemm_plan(dataclasses.replace(p, config=tiles), 2, 2) is None
      True
    """
    op = product.op
    if op is None or product.config is None:
        return None
    if op.kind == "dot_general":
        dims, perm = op.dimension_numbers, None
    elif op.kind == "einsum" and op.einsum_spec is not None:
        converted = einsum_dimension_numbers(op.einsum_spec)
        if converted is None:
            return None
        dims, perm = converted
        perm = None if perm == tuple(range(len(perm))) else perm
    else:
        return None
    for operand, ndim, contracting in ((product.lhs, lhs_ndim, dims[0][0]),
                                       (product.rhs, rhs_ndim, dims[0][1])):
        tq = operand_quant(product, operand)
        if tq is None or not _int_grid_along(tq, ndim, contracting):
            return None
    return dims, perm


def fallback_reason(product: Product) -> str:
    """Why `gemm_plan` gives no integer GEMMs for `product` (the fallback warning's words).

    Example:
      >>> from cpt_jax.interception import make_product
      >>> from cpt_jax.ops.product_op import dot_general_op
      >>> op = dot_general_op((((1,), (0,)), ((), ())))
      >>> p = make_product("dense", "dot_general", cpt_jax.get_preset("symmetric_tile128"), op,
      ...                  (8, 4), (4, 3))
      >>> fallback_reason(p)[:38]
      'its grids are not integer GEMM operand'
    """
    op = product.op
    if op is None or op.kind not in ("dot_general", "einsum"):
        kind = product.kind if op is None else op.kind
        return (f"the integer path computes dot_general and einsum products; a {kind} "
                f"keeps fake quantization")
    if op.kind == "einsum" and (op.einsum_spec is None
                                or einsum_dimension_numbers(op.einsum_spec) is None):
        return "an einsum that is not one contraction of two operands"
    return ("its grids are not integer GEMM operands: an untiled AffineInt / SymmetricInt "
            "constant along the contraction, or a SymmetricInt conv / tile")


def _quant(product: Product, operand):
    tq = operand_quant(product, operand)
    if tq is None:
        raise ValueError(f"{product.path}: an integer GEMM needs both operands quantized")
    return tq


def _int_grid_along(tq, ndim: int, contracting) -> bool:
    try:
        check_int_quant(tq, ndim, contracting)
    except ValueError:
        return False
    return True


def integer_path(product: Product, lhs_ndim: int, rhs_ndim: int,
                 platforms: tuple[str, ...] | None = None, platform: str = "cpu") -> str:
    """Which arithmetic `product` runs under the integer provider on `platform`:
    ``"int"`` (three integer GEMMs), ``"int8_forward"`` (the int8 forward product),
    ``"fake"``.

    `platforms`: where ``compute="auto"`` takes integers (default: this host's,
    `integer_gemm_platforms`).

    Example:
      >>> from cpt_jax.interception import make_product
      >>> from cpt_jax.ops.product_op import dot_general_op
      >>> op = dot_general_op((((1,), (0,)), ((), ())))
      >>> p = make_product("dense", "dot_general", cpt_jax.get_preset("int8"), op, (8, 4), (4, 3))
      >>> integer_path(p, 2, 2), integer_path(dataclasses.replace(
      ...     p, config=cpt_jax.get_preset("cpt")), 2, 2, platforms=())
      ('int', 'fake')
    """
    cfg = product.config
    if cfg is None:
        return "fake"
    auto = getattr(cfg, "compute", AUTO) == AUTO
    if auto and platform not in (integer_gemm_platforms() if platforms is None else platforms):
        return "fake"
    if gemm_plan(product, lhs_ndim, rhs_ndim) is not None:
        return "int"
    if not auto and int8_forward_applies(product):
        return "int8_forward"
    return "fake"


def integer_capable(config) -> bool:
    """Whether `config`'s weight and activation are `AffineInt` / `SymmetricInt` grids
    with batch ranges (``compute="auto"`` may then take integers).

    Example:
      >>> integer_capable(cpt_jax.get_preset("cpt")), integer_capable(cpt_jax.get_preset("mxfp8"))
      (True, False)
    """
    if not isinstance(config, QuantConfig) or getattr(config, "activation_range", "") != "batch":
        return False
    return all(tq is not None and formats_family(tq) in INT_FAMILIES
               for tq in (config.weight, config.activation))


def formats_family(tq) -> str:
    """The `cpt_jax.formats.format_traits` family of a `TensorQuant`'s format."""
    return str(format_traits(tq.fmt).family)


def auto_integer(config) -> bool:
    """The ``compute="auto"`` predicate: integer-capable formats and a platform of
    `integer_gemm_platforms` (none: fake quantization everywhere, as `FAKE_QUANT`)."""
    return (getattr(config, "compute", AUTO) == AUTO and integer_capable(config)
            and bool(integer_gemm_platforms()))


@dataclasses.dataclass(frozen=True)
class IntegerProvider(FakeQuantProvider):
    """Three integer GEMMs per product where it can (module docstring)."""

    def compute(self, product: Product, lhs: Array, rhs: Array, state: PrecisionState,
                apply: Callable) -> Array:
        cfg = product.config
        auto = getattr(cfg, "compute", AUTO) == AUTO
        plan = gemm_plan(product, lhs.ndim, rhs.ndim)
        if plan is None:
            if not auto and int8_forward_applies(product):
                return INT8_FORWARD.compute(product, lhs, rhs, state, apply)
            if not auto and product.lhs.role != INDEX:  # a lookup is no GEMM: no warning
                warnings.warn(f"{product.path}: compute='int' runs fake quantization for this "
                              f"{product.kind} ({fallback_reason(product)})",
                              IntegerFallbackWarning, stacklevel=2)
            return FAKE_QUANT.compute(product, lhs, rhs, state, apply)
        bits, grad_bits, keys = widths_and_keys(product, state)
        out_dtype = jax.eval_shape(apply, lhs, rhs).dtype

        def integer(a, b):
            spec = IntGemmSpec(plan[0], _quant(product, product.lhs),
                               _quant(product, product.rhs), _config(product).error, out_dtype)
            y = int_dot_general(spec, a, b, bits, grad_bits, keys)
            return y if plan[1] is None else jnp.transpose(y, plan[1])

        def fake(a, b):
            return fake_product(product, a, b, bits, grad_bits, keys, apply)

        if not auto:
            return integer(lhs, rhs)
        platforms = integer_gemm_platforms()
        if not platforms:
            return fake(lhs, rhs)
        return lax.platform_dependent(lhs, rhs, default=fake, **{p: integer for p in platforms})


def widths_and_keys(product: Product, state: PrecisionState):
    """``(bits, grad_bits, keys)`` of a product: its forward width, its error's width
    (None: float32 errors) and the stochastic-rounding keys drawn as `FAKE_QUANT` draws
    them (activation, weight, error; None where a tensor rounds to nearest)."""
    cfg = _config(product)
    bits = effective_bits(state.bits, cfg.bits_offset)
    grad_bits = None
    if cfg.error is not None and state.grad_bits is not None:
        grad_bits = effective_bits(state.grad_bits, cfg.grad_bits_offset)
    keys = (key_for(operand_quant(product, product.lhs), state, "an operand (activation)"),
            key_for(operand_quant(product, product.rhs), state, "an operand (weight)"),
            None if grad_bits is None else key_for(cfg.error, state, "the error"))
    return bits, grad_bits, keys


def fake_product(product: Product, lhs, rhs, bits, grad_bits, keys, apply) -> Array:
    """`FAKE_QUANT`'s product with the given keys: ``Q_g^bwd(apply(Q_b(lhs), Q_b(rhs)))``."""
    def q(x, operand, key):
        tq = operand_quant(product, operand)
        return x if tq is None else fake_quant(x, bits, tq.fmt, rounding=tq.rounding, key=key)

    y = apply(q(lhs, product.lhs, keys[0]), q(rhs, product.rhs, keys[1]))
    err = _config(product).error
    if grad_bits is None or err is None:
        return y
    return quantize_grad(y, grad_bits, err.fmt, rounding=err.rounding, key=keys[2])


def _config(product: Product) -> QuantConfig:
    if product.config is None:
        raise ValueError(f"{product.path}: an integer product needs a QuantConfig")
    return product.config


INTEGER = IntegerProvider()
"""The integer provider (``compute="int"``, and ``"auto"`` where integers are faster)."""

__all__ = ["INTEGER", "IntegerFallbackWarning", "IntegerProvider", "auto_integer", "fake_product", "gemm_plan",
           "integer_capable", "integer_path", "widths_and_keys"]
