"""The explicit doors: a quantized op handed to one layer (``nn.Dense(dot_general_cls=
QuantDotGeneral)``, ``nnx.Einsum(einsum_op=QuantEinsum())``), outside `quantize_model`.

Each computes its product through `cpt_jax.interception.compute_product` with the
provider of its config; it is named by the module calling it.
"""
from __future__ import annotations

import dataclasses
import sys
from typing import Any

import flax.linen as nn
import jax

from cpt_jax.formats import AffineInt
from cpt_jax.interception import (
    ACTIVATION,
    WEIGHT,
    as_config,
    compute_product,
    locate,
    make_product,
)
from cpt_jax.ops.product_op import conv_op, dot_general_op, einsum_op
from cpt_jax.ops.scale_history import HISTORY_LENGTH, check_history, init_history
from cpt_jax.providers import default_provider
from cpt_jax.providers.delayed_scaling import DEFAULT_COLLECTION, DelayedScalingProvider
from cpt_jax.quant_config import CPT_CONFIG, QuantConfig

Array = jax.Array


def _door_path(kind: str) -> str:
    """The path of the (Linen or NNX) module calling an explicit door (``kind``
    outside any module)."""
    site = locate(sys._getframe(1), None)
    return site.path if site.module is not None else kind


def quantized_dot_general(lhs, rhs, dimension_numbers, precision=None,
                          preferred_element_type=None, *, config: QuantConfig | None = CPT_CONFIG,
                          name: str = "dot_general", provider=None, module=None,
                          kind: str = "dot_general", **kwargs) -> Array:
    """`lax.dot_general` with quantized operands and error: ``Q_g^bwd(Q_b(x) @ Q_b(W))``.

    `lhs` is the activation, `rhs` the weight (as in `nn.Dense`). Reads the widths
    from the enclosing `precision` context; exact fp32 outside one or with
    ``config=None``. Records an `OpRecord` for cost accounting.

    Args:
      lhs, rhs, dimension_numbers, precision, preferred_element_type: as
        `lax.dot_general` (an ``out_sharding`` keyword is passed through).
      config: the product's `QuantConfig` or a preset name (None: fp32).
      name: the product's path in records and rules.
      provider: what computes it (default: `default_provider(config)`).
      module: the Flax module it belongs to, for providers that keep state.
      kind: the record's kind.

    Returns:
      The product.

    Example:
      >>> with cpt_jax.precision(4):
      ...   y = quantized_dot_general(jnp.ones((2, 3)), jnp.ones((3, 4)), (((1,), (0,)), ((), ())))
      >>> y.shape
      (2, 4)
    """
    config = as_config(config, "quantized_dot_general config")
    extra = {k: v for k, v in kwargs.items() if k == "out_sharding" and v is not None}
    op = dot_general_op(dimension_numbers)
    product = make_product(name, kind, config, op, lhs.shape, rhs.shape, module=module)

    def apply(a, b):
        return op.apply(a, b, precision, preferred_element_type, **extra)

    return compute_product(product, lhs, rhs, apply, provider or default_provider(config))


def quantized_conv(lhs, rhs, window_strides, padding, lhs_dilation=None, rhs_dilation=None,
                   dimension_numbers=None, feature_group_count=1, batch_group_count=1,
                   precision=None, preferred_element_type=None, *,
                   config: QuantConfig | None = CPT_CONFIG, name: str = "conv",
                   provider=None, module=None, **kwargs) -> Array:
    """`lax.conv_general_dilated` with quantized input, kernel and error.

    The kernel gets one range per output feature (from `dimension_numbers`) when its
    format is per-channel. Records an `OpRecord` (MACs = ``|out| * kh kw C_in/groups``).
    Arguments as `quantized_dot_general` (the conv's as `lax.conv_general_dilated`).

    Example:
      >>> with cpt_jax.precision(4):
      ...   y = quantized_conv(jnp.ones((1, 5, 5, 3)), jnp.ones((3, 3, 3, 2)), (1, 1),
      ...                      "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
      >>> y.shape
      (1, 5, 5, 2)
    """
    config = as_config(config, "quantized_conv config")
    del kwargs
    op = conv_op(lhs.shape, rhs.shape, window_strides, padding, lhs_dilation, rhs_dilation,
                 dimension_numbers, feature_group_count, batch_group_count)
    product = make_product(name, "conv", config, op, lhs.shape, rhs.shape, module=module)

    def apply(a, b):
        return op.apply(a, b, precision, preferred_element_type)

    return compute_product(product, lhs, rhs, apply, provider or default_provider(config))


def quantized_einsum(spec: str, lhs, rhs, precision=None, preferred_element_type=None, *,
                     config: QuantConfig | None = CPT_CONFIG, name: str = "einsum",
                     kind: str = "einsum", roles=(ACTIVATION, WEIGHT), provider=None,
                     module=None) -> Array:
    """``jnp.einsum(spec, lhs, rhs)`` with quantized operands and error.

    `roles` says which operand is an activation and which a weight: ``(activation,
    weight)`` for a layer, ``(activation, activation)`` for attention's ``q . k``
    and ``weights . v``. A weight gets one range per output feature (its last axis
    that appears in the output) with a per-channel format.

    Example:
      >>> with cpt_jax.precision(4):
      ...   y = quantized_einsum("bd,df->bf", jnp.ones((2, 3)), jnp.ones((3, 4)))
      >>> y.shape
      (2, 4)
    """
    config = as_config(config, "quantized_einsum config")
    op = einsum_op(spec, lhs.ndim, rhs.ndim)
    product = make_product(name, kind, config, op, lhs.shape, rhs.shape, roles, module)

    def apply(a, b):
        return op.apply(a, b, precision, preferred_element_type)

    return compute_product(product, lhs, rhs, apply, provider or default_provider(config))


@dataclasses.dataclass(frozen=True)
class QuantDotGeneral:
    """Drop-in `dot_general` for ``nn.Dense(..., dot_general_cls=QuantDotGeneral)``.

    Flax calls ``dot_general_cls()`` and then the instance like `lax.dot_general`
    (the `out_sharding` keyword NNX passes is accepted). Configure with
    ``functools.partial(QuantDotGeneral, config=QuantConfig(...))`` (or a preset
    name, ``config="mxfp8"``).

    Example:
      >>> layer = nn.Dense(4, dot_general_cls=QuantDotGeneral)
      >>> params = layer.init(jax.random.key(0), jnp.ones((2, 3)))
      >>> with cpt_jax.precision(4):
      ...   y = layer.apply(params, jnp.ones((2, 3)))
    """

    config: QuantConfig | None = CPT_CONFIG
    name: str | None = None
    provider: Any = None
    module: Any = dataclasses.field(default=None, compare=False, hash=False, repr=False)

    def __post_init__(self):
        object.__setattr__(self, "config", as_config(self.config, "QuantDotGeneral config"))

    def __call__(self, lhs, rhs, dimension_numbers, precision=None,
                 preferred_element_type=None, **kwargs):
        return quantized_dot_general(
            lhs, rhs, dimension_numbers, precision, preferred_element_type,
            config=self.config, name=self.name or _door_path("dot_general"),
            provider=self.provider, module=self.module, **kwargs)


@dataclasses.dataclass(frozen=True)
class QuantConvGeneralDilated:
    """Drop-in conv for ``nn.Conv(..., conv_general_dilated_cls=QuantConvGeneralDilated)``.

    Example:
      >>> layer = nn.Conv(2, (3, 3), conv_general_dilated_cls=QuantConvGeneralDilated)
      >>> v = layer.init(jax.random.key(0), jnp.ones((1, 5, 5, 3)))
      >>> with cpt_jax.precision(4):
      ...   y = layer.apply(v, jnp.ones((1, 5, 5, 3)))
    """

    config: QuantConfig | None = CPT_CONFIG
    name: str | None = None
    provider: Any = None
    module: Any = dataclasses.field(default=None, compare=False, hash=False, repr=False)

    def __post_init__(self):
        object.__setattr__(self, "config", as_config(self.config, "QuantConvGeneralDilated config"))

    def __call__(self, lhs, rhs, window_strides, padding, lhs_dilation=None,
                 rhs_dilation=None, dimension_numbers=None, feature_group_count=1,
                 batch_group_count=1, precision=None, preferred_element_type=None, **kwargs):
        return quantized_conv(
            lhs, rhs, window_strides, padding, lhs_dilation, rhs_dilation, dimension_numbers,
            feature_group_count, batch_group_count, precision, preferred_element_type,
            config=self.config, name=self.name or _door_path("conv"),
            provider=self.provider, module=self.module, **kwargs)



@dataclasses.dataclass(frozen=True)
class QuantEinsum:
    """A quantized two-operand einsum: ``op(spec, lhs, rhs, precision=None, **kw)``.

    The einsum door of ``nnx.Einsum(..., einsum_op=QuantEinsum())`` (operands: input,
    kernel) and of Linen attention's ``qk_attn_weights_einsum_cls`` /
    ``attn_weights_value_einsum_cls`` (``roles=(ACTIVATION, ACTIVATION)``).

    Example:
      >>> with cpt_jax.precision(4):
      ...   y = QuantEinsum()("bd,df->bf", jnp.ones((2, 3)), jnp.ones((3, 4)))
      >>> y.shape
      (2, 4)
    """

    config: QuantConfig | None = CPT_CONFIG
    name: str | None = None
    kind: str = "einsum"
    roles: tuple[str, str] = (ACTIVATION, WEIGHT)
    provider: Any = None
    module: Any = dataclasses.field(default=None, compare=False, hash=False, repr=False)

    def __post_init__(self):
        object.__setattr__(self, "config", as_config(self.config, "QuantEinsum config"))

    def __call__(self, spec: str, lhs, rhs, precision=None, **kwargs):
        kwargs.pop("out_sharding", None)
        preferred = kwargs.pop("preferred_element_type", None)
        kwargs.pop("_dot_general", None)
        return quantized_einsum(spec, lhs, rhs, precision, preferred, config=self.config,
                                name=self.name or _door_path(self.kind), kind=self.kind,
                                roles=self.roles, provider=self.provider, module=self.module)


class DelayedQuantDotGeneral(nn.Module):
    """``nn.Dense(..., dot_general_cls=DelayedQuantDotGeneral)``: input scaled from history.

    The input (activation) is quantized by `delayed_scale_quantize` with its
    `ScaleHistory` in the variable ``(collection, "input_history")``; the kernel
    and the error as `config` says (dynamic); widths from the `precision`
    context (full precision outside one, where the history is not touched).

    Example:
      >>> layer = nn.Dense(4, dot_general_cls=DelayedQuantDotGeneral)
      >>> v = layer.init(jax.random.key(0), jnp.ones((2, 3)))
      >>> with cpt_jax.precision(8):
      ...   y, upd = layer.apply(v, jnp.ones((2, 3)), mutable=["batch_stats"])
      >>> int(upd["batch_stats"]["DelayedQuantDotGeneral_0"]["input_history"].count)
      1
    """

    config: QuantConfig | None = CPT_CONFIG
    fmt: Any = AffineInt()
    method: str = "delayed"
    history_length: int = HISTORY_LENGTH
    collection: str = DEFAULT_COLLECTION
    margin: float = 0.0
    kappa: float = 100.0
    op_name: str | None = None

    def _provider(self) -> DelayedScalingProvider:
        check_history(self.fmt, self.method)
        # The history variable exists from init on, in this module's own scope.
        self.variable(self.collection, "input_history", init_history, self.history_length)
        return DelayedScalingProvider(self.fmt, self.method, self.history_length,
                                      self.collection, self.margin, self.kappa,
                                      location=("input_history",))

    def _name(self) -> str:
        return self.op_name or "/".join(str(p) for p in self.path)

    @nn.compact
    def __call__(self, lhs, rhs, dimension_numbers, precision=None,
                 preferred_element_type=None, **kwargs):
        return quantized_dot_general(
            lhs, rhs, dimension_numbers, precision, preferred_element_type,
            config=without_int8(self.config), name=self._name(), provider=self._provider(),
            module=self, **kwargs)


class DelayedQuantConv(DelayedQuantDotGeneral):
    """``nn.Conv(..., conv_general_dilated_cls=DelayedQuantConv)``: input from history."""

    @nn.compact
    def __call__(self, lhs, rhs, window_strides, padding, lhs_dilation=None,
                 rhs_dilation=None, dimension_numbers=None, feature_group_count=1,
                 batch_group_count=1, precision=None, preferred_element_type=None, **kwargs):
        return quantized_conv(
            lhs, rhs, window_strides, padding, lhs_dilation, rhs_dilation, dimension_numbers,
            feature_group_count, batch_group_count, precision, preferred_element_type,
            config=without_int8(self.config), name=self._name(), provider=self._provider(),
            module=self, **kwargs)


def without_int8(config: QuantConfig | str | None) -> QuantConfig | None:
    """`config` (a preset name resolved) computed by the provider given with it (its
    ``compute`` name set to ``"auto"``: a delayed-scaling provider fake-quantizes
    whatever the preset named)."""
    resolved: QuantConfig | None = as_config(config)
    if resolved is None or resolved.compute == "auto":
        return resolved
    return resolved.replace(compute="auto")
