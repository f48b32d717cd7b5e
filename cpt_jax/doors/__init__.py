"""The doors: any Flax model, Linen or NNX, low-precision in every product.

One door for both Flax APIs. ``quantize_model(model, rules, config, provider)``
takes

* a Linen module, and returns a Linen module of a subclass of its class with the
  same fields, ``init`` / ``apply`` (any ``method=``) and variable tree;
* an NNX module, and returns it (the same object, its class made a quantized
  subclass) with its state untouched; every public method and ``__call__`` run
  quantized.

While the returned model runs, every product it computes -- ``lax.dot_general``,
``jnp.einsum``, ``@``, ``jnp.dot``, convolutions, ``lax.ragged_dot``, attention,
embedding lookups -- is intercepted at the operation (`cpt_jax.interception`),
named by its module path plus the op within the module (``decoder/attn/einsum_1``;
Flax layers keep their module path, attention ``.../query_key`` and
``.../weights_value``, ``embed/attend``), resolved against the rules and computed by
the provider. With the widths of the enclosing `precision` context
(`cpt_jax.providers`):

    y = Q_g^bwd( op(Q_b(x), Q_b(W)) )

Outside a precision context every product is exact fp32 (still recorded for the
cost). `quantized_layers` lists the products with their configs.

The explicit doors stay for a single layer outside `quantize_model`:
``nn.Dense(..., dot_general_cls=QuantDotGeneral)``,
``nn.Conv(..., conv_general_dilated_cls=QuantConvGeneralDilated)``,
``nnx.Linear(..., dot_general=QuantDotGeneral())``,
``nnx.Einsum(..., einsum_op=QuantEinsum())``.
"""
from cpt_jax.doors._layers import (
    DelayedQuantConv,
    DelayedQuantDotGeneral,
    QuantConvGeneralDilated,
    QuantDotGeneral,
    QuantEinsum,
    quantized_conv,
    quantized_dot_general,
    quantized_einsum,
)
from cpt_jax.doors._linen import QuantizedModel
from cpt_jax.doors._model import (
    CPT_RULES,
    FP32_ATTENTION,
    LayerProduct,
    delayed_scaling_model,
    interception_of,
    quantize_model,
    quantized_layers,
)
from cpt_jax.doors._nnx import QuantizedNNXModel
from cpt_jax.doors._session import UnmatchedRuleWarning, warn_unmatched_rules
from cpt_jax.interception import LAST_PRODUCT

__all__ = (
    "CPT_RULES",
    "DelayedQuantConv",
    "DelayedQuantDotGeneral",
    "FP32_ATTENTION",
    "LAST_PRODUCT",
    "LayerProduct",
    "QuantConvGeneralDilated",
    "QuantDotGeneral",
    "QuantEinsum",
    "QuantizedModel",
    "QuantizedNNXModel",
    "UnmatchedRuleWarning",
    "delayed_scaling_model",
    "interception_of",
    "quantize_model",
    "quantized_conv",
    "quantized_dot_general",
    "quantized_einsum",
    "quantized_layers",
    "warn_unmatched_rules",
)
