"""The interception seam: which products a model computes, and who computes them.

Quantizing a model is two questions kept apart here, as Qwix keeps them apart:

* **interception** (this package): find every product a model computes, at the JAX
  operations, describe it, give it a stable path, resolve the rules for that path,
  record it for the cost, and guard against re-entry. It knows nothing about
  number formats.
* **providers** (`cpt_jax.providers` and others): given one `Product` and the
  `PrecisionState` in force, compute it (fake quant, int8, scaling from history...).

One product is described by a frozen `Product`:

============  ============================================================
field         meaning
============  ============================================================
path          stable name: module path plus the op in it (``"attn/einsum_1"``)
kind          ``dot_general``, ``conv``, ``ragged_dot``, ``attention``,
              ``lookup`` (``einsum`` from the explicit einsum door)
config        the resolved `QuantConfig` (None: kept in fp32, still counted)
lhs, rhs      `Operand`: role (activation/weight), contracted axes, channel axis
error_axes    output axes contracted by the two backward products:
              ``dL/dlhs = g x rhs`` contracts ``error_axes.for_lhs_grad``,
              ``dL/drhs = lhs x g`` contracts ``error_axes.for_rhs_grad``
op            a `ProductOp` (static dot/conv/ragged/einsum description) or
              None (an embedding lookup, an unshared convolution)
owner, local  the path of the module that computed it in the variable tree
              (``""``: the root) and the product's name below that module
              (``""`` for a layer's own product, ``"einsum_1"``, ``"query_key"``)
module        where a provider keeps state: the bound Linen module, an
              `cpt_jax.interception._operations.NNXModuleState`, or None
============  ============================================================

`compute_product(product, lhs, rhs, apply, provider)` is the one data path:
record an `OpRecord`, let the provider ``prepare(product, lhs, rhs)`` (optional;
called even in fp32, e.g. at init, to create state), then ``apply(lhs, rhs)`` in
fp32 when there is no `precision` context or no config, else
``provider.compute(product, lhs, rhs, state, apply)``. ``apply`` computes the
float product of whatever operands the provider hands it, so a provider never
needs to know which layer it serves. Stochastic-rounding keys come from
``state.next_key()`` (inside a loop body they also fold in a per-iteration salt).

State in a provider: ``product.module`` is the module that computed the product
(a bound Linen module, or an NNX module behind the same methods). Inside the call, use
``module.has_variable`` / ``get_variable`` / ``put_variable`` (and ``sow``) on a
collection of your own, written only where ``module.is_mutable_collection(col)``;
create it in ``prepare`` so that ``init`` returns it (see
`cpt_jax.providers.delayed_scaling.DelayedScalingProvider`).

How a provider plugs in
  Write an object with ``compute(product, lhs, rhs, state, apply) -> y`` (the
  `Provider` protocol); subclass `cpt_jax.providers.FakeQuantProvider` to change
  one piece: ``quantize_operand(product, operand, x, bits, state)`` (an operand,
  e.g. running activation ranges: ``product.module`` is the Flax module, where a
  variable collection can hold state; ``operand.contracting`` tells a block
  format which axes the product sums) or ``quantize_error(product, y, state)``
  (the error; ``product.error_axes`` tells the blocks of each backward product).
  Pass it as ``quantize_model(model, rules, provider=...)`` or to the doors
  (``QuantDotGeneral(provider=...)``); a provider that only handles some products
  (``product.op`` None, or a kind it does not know) falls back to its parent.

Where products come from
  `cpt_jax.interception._operations` finds every product a model computes, at the JAX
  operations (``lax.dot_general``, convolutions, ``ragged_dot``, embedding
  lookups), names it by its module and builds its `Product`; the explicit doors
  (`cpt_jax.doors.QuantDotGeneral` ...) build theirs for one layer. Both call
  `compute_product`.

The package, one stage of the data path (step -> schedule -> precision context ->
**interception** -> provider -> quantized product -> cost):

==================  ===========================================================
module              what
==================  ===========================================================
``_product``        `Product`, `Operand`, `geometry`, `OpRecord`,
                    `compute_product`
``_rules``          `normalize_rules`, `resolve_config`, `LAST_PRODUCT`
``_jax_internals``  every JAX/Flax internal the interception relies on, checked
``_patching``       taking over JAX's product functions while a model runs
                    (all targets or none)
``_call_sites``     the module computing a product, its full path, its weights
``_isolated``       an NNX call a side trace can run without touching the model
``_operations``     each JAX product operation as a `Product`, named and resolved
                    (`intercepting`, `Interception`, `NNXModuleState`)
==================  ===========================================================

It knows no number format and no provider: `cpt_jax.providers` computes products,
`cpt_jax.doors` makes a model go through here.
"""
from cpt_jax.interception._call_sites import (
    NNX_PATH_ATTRIBUTE,
    CallSite,
    absolute_path,
    locate,
    module_path,
)
from cpt_jax.interception._isolated import isolated_call
from cpt_jax.interception._jax_internals import TARGETS
from cpt_jax.interception._operations import (
    ATTENTION_NAMES,
    CALL_SEPARATOR,
    Interception,
    NNXModuleState,
    Session,
    active_session,
    in_session,
    intercepting,
    state_module,
)
from cpt_jax.interception._product import (
    ACTIVATION,
    INDEX,
    WEIGHT,
    ErrorAxes,
    Operand,
    OpRecord,
    Product,
    Provider,
    compute_product,
    geometry,
    make_product,
    record_product,
)
from cpt_jax.interception._rules import (
    LAST_PRODUCT,
    as_config,
    normalize_rules,
    resolve_config,
    rule_matches,
)

__all__ = (
    "ACTIVATION",
    "NNX_PATH_ATTRIBUTE",
    "ATTENTION_NAMES",
    "CALL_SEPARATOR",
    "CallSite",
    "ErrorAxes",
    "INDEX",
    "Interception",
    "LAST_PRODUCT",
    "NNXModuleState",
    "OpRecord",
    "Operand",
    "Product",
    "Provider",
    "Session",
    "TARGETS",
    "WEIGHT",
    "absolute_path",
    "active_session",
    "as_config",
    "compute_product",
    "geometry",
    "in_session",
    "intercepting",
    "isolated_call",
    "locate",
    "make_product",
    "module_path",
    "normalize_rules",
    "record_product",
    "resolve_config",
    "rule_matches",
    "state_module",
)
