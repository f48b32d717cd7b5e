"""Running activation ranges: CPT's ``QuantMeasure`` for evaluation independent of batching.

With ``QuantConfig(activation_range="batch")`` (the default) an activation is
quantized per tensor on the grid spanning its own finite ``[min, max]``, in
training and in evaluation alike, so an evaluated example's output depends on the
other examples of its batch. CPT (Fu et al. 2021, ``modules/quantize.py``) keeps an
exponential moving average of the training ranges and evaluates with it:

* training (the collection `COLLECTION` is mutable): quantize with the batch's
  range, exactly as ``"batch"``, and update the running range of that operand,
  ``zero_point <- (1 - m) zero_point + m min(x)``, ``range <- (1 - m) range + m
  (max(x) - min(x))``, with ``m = MOMENTUM = 0.1`` on the new value (CPT's
  ``momentum=0.9`` on the old one), starting from zeros as CPT's buffers;
* evaluation (the collection is read-only): quantize on the grid spanning
  ``[zero_point, zero_point + range]``, values outside saturating
  (`cpt_jax.ops.grids.quantize_with_range`). Each example's output is then a function
  of that example alone: results do not depend on the evaluation batch size.

Selected per op by ``QuantConfig(activation_range="running")`` (per-tensor
`AffineInt` or `SymmetricInt` activations): `cpt_jax.providers.default_provider`
then computes the product with `RUNNING_RANGES`, a `FakeQuantProvider` whose
activation operands go through this module. The state of an operand is a
`RunningRange` in the variable ``(COLLECTION, range_variable_name(product, operand))``
of the module computing the product, created at ``init`` (Linen); in an NNX model it
is an ``nnx.Variable`` attribute ``activation_ranges__<name>`` of that module,
created by the first call, updated in train mode and read after ``model.eval()``;
`cpt_jax.training.TrainState` carries the collection (``state.activation_ranges``),
`make_train_step` updates it and `make_eval_step` reads it. A custom loop must pass
``mutable=[COLLECTION, ...]`` when training (otherwise the running ranges are used
and never updated).

Example:
  >>> qmodel = cpt_jax.quantize_model(nn.Sequential([nn.Dense(3)]),
  ...     config=cpt_jax.CPT_CONFIG.replace(activation_range="running"))
  >>> v = qmodel.init(jax.random.key(0), jnp.ones((2, 4)))
  >>> float(v["activation_ranges"]["layers_0"]["lhs"].range)
  0.0
  >>> with cpt_jax.precision(8):
  ...     _, new = qmodel.apply(v, jnp.arange(8.).reshape(2, 4), mutable=["activation_ranges"])
  >>> round(float(new["activation_ranges"]["layers_0"]["lhs"].range), 4)  # 0.9*0 + 0.1*(7-0)
  0.7
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct
from jax import lax

from cpt_jax.interception import ACTIVATION, Operand, Product
from cpt_jax.ops.grids import quantize_with_range
from cpt_jax.providers.fake_quant import FakeQuantProvider, key_for, operand_quant

Array = jax.Array

COLLECTION = "activation_ranges"
"""The Flax variable collection holding the running ranges."""

MOMENTUM = 0.1
"""Weight of the new batch's range in the moving average (CPT's QuantMeasure)."""



@struct.dataclass
class RunningRange:
    """The running range of one activation operand (a pytree of f32 scalars).

    Attributes:
      zero_point: running minimum (CPT's ``running_zero_point``).
      range: running ``max - min`` (CPT's ``running_range``).
    """

    zero_point: Array
    range: Array

    @property
    def bounds(self) -> tuple:
        """``(lo, hi) = (zero_point, zero_point + range)``."""
        return self.zero_point, self.zero_point + self.range


def init_range() -> RunningRange:
    """Zeros, as CPT's buffers: ``RunningRange(0, 0)``."""
    return RunningRange(zero_point=jnp.zeros((), jnp.float32), range=jnp.zeros((), jnp.float32))


def observed_range(x: Array) -> tuple:
    """``(min, max)`` over the finite elements of `x` (0 where none), no gradient."""
    x = lax.stop_gradient(jnp.asarray(x, jnp.float32))
    finite = jnp.isfinite(x)
    lo = jnp.min(jnp.where(finite, x, jnp.inf))
    hi = jnp.max(jnp.where(finite, x, -jnp.inf))
    return jnp.where(jnp.isfinite(lo), lo, 0.0), jnp.where(jnp.isfinite(hi), hi, 0.0)


def update_range(running: RunningRange, lo, hi, momentum: float = MOMENTUM) -> RunningRange:
    """One moving-average step toward the observed range ``[lo, hi]``.

    ``zero_point' = (1 - m) zero_point + m lo``, ``range' = (1 - m) range + m (hi - lo)``.

    Args:
      running: the current `RunningRange`.
      lo, hi: the observed minimum and maximum.
      momentum: ``m``, the weight of the new observation.

    Returns:
      The updated `RunningRange`.

    Example:
      >>> r = update_range(init_range(), -1.0, 3.0)
      >>> [round(float(v), 6) for v in (r.zero_point, r.range)]
      [-0.1, 0.4]
    """
    keep, new = jnp.float32(1.0 - momentum), jnp.float32(momentum)
    lo = jnp.asarray(lo, jnp.float32)
    hi = jnp.asarray(hi, jnp.float32)
    return RunningRange(zero_point=running.zero_point * keep + lo * new,
                        range=running.range * keep + (hi - lo) * new)


def range_variable_name(product: Product, operand: Operand) -> str:
    """The variable of one operand's range: ``lhs`` / ``rhs``, prefixed by the product's
    path below its module (``query_key_lhs`` for an attention product)."""
    side = "lhs" if operand is product.lhs else "rhs"
    below = product.local
    return f"{below.replace('/', '_')}_{side}" if below else side


def uses_running_range(product: Product, operand: Operand) -> bool:
    """Whether `operand` of `product` is an activation with ``activation_range="running"``."""
    cfg = product.config
    return (cfg is not None and getattr(cfg, "activation_range", "batch") == "running"
            and operand.role == ACTIVATION and operand_quant(product, operand) is not None)


def _module_of(product: Product):
    if product.module is None:
        raise ValueError(
            f"activation_range='running' keeps state in the Flax module computing the "
            f"product (a Linen collection entry, an NNX Variable), but product "
            f"{product.path!r} has none (use quantize_model on a Linen or NNX model)")
    return product.module


@dataclasses.dataclass(frozen=True)
class RunningRangeProvider(FakeQuantProvider):
    """`FakeQuantProvider` with running activation ranges (module docstring).

    Attributes:
      momentum: weight of the new batch's range (`MOMENTUM`).
    """

    momentum: float = MOMENTUM

    def prepare(self, product: Product, lhs, rhs) -> None:
        """Create zero ranges for the product's running operands where the collection
        is mutable and they do not exist yet (at ``init``)."""
        for operand in (product.lhs, product.rhs):
            if not uses_running_range(product, operand):
                continue
            module = _module_of(product)
            name = range_variable_name(product, operand)
            if module.is_mutable_collection(COLLECTION) and not module.has_variable(
                    COLLECTION, name):
                module.put_variable(COLLECTION, name, init_range())

    def quantize_operand(self, product: Product, operand: Operand, x: Array, bits,
                         state) -> Array:
        """Training: batch range, running range updated; evaluation: running range."""
        if not uses_running_range(product, operand):
            return super().quantize_operand(product, operand, x, bits, state)
        module = _module_of(product)
        name = range_variable_name(product, operand)
        running = (module.get_variable(COLLECTION, name) if module.has_variable(COLLECTION, name)
                   else init_range())
        if module.is_mutable_collection(COLLECTION):
            lo, hi = observed_range(x)
            module.put_variable(COLLECTION, name, update_range(running, lo, hi, self.momentum))
            return super().quantize_operand(product, operand, x, bits, state)
        tq = operand_quant(product, operand)
        key = key_for(tq, state, f"an operand ({operand.role})")
        lo, hi = running.bounds
        return quantize_with_range(x, lo, hi, bits, tq.fmt, rounding=tq.rounding, key=key)


RUNNING_RANGES = RunningRangeProvider()
"""The provider of ``QuantConfig(activation_range="running")`` products."""

__all__ = ["COLLECTION", "MOMENTUM", "RUNNING_RANGES", "RunningRange",
           "RunningRangeProvider", "init_range", "observed_range",
           "range_variable_name", "update_range", "uses_running_range"]
