"""The delayed-scaling provider: each product's activation quantized from its history.

`DelayedScalingProvider` quantizes the activation (lhs) of every dot_general / conv
product with a weight by `cpt_jax.ops.scale_history.delayed_scale_quantize` (delayed
scaling or Flexpoint's Autoflex), its `ScaleHistory` kept in the module computing
the product: the variable ``(collection, "delayed_quant")[<name>input_history]``
(``"batch_stats"`` by default, the state `cpt_jax.training.TrainState` already
carries and updates, so `make_train_step`, evaluation and checkpoints work
unchanged). Weights and errors use the product's `QuantConfig` (dynamic). The
history is updated only where the collection is mutable (training), read-only in
evaluation. `cpt_jax.doors.delayed_scaling_model` wraps a model with it.

`DelayedFP8Provider` is Transformer Engine's delayed scaling on the OCP grid of the
product's own per-tensor `ScaledFloat` activation format (the ``fp8_delayed`` preset
of the main job): the activation's scale is ``max(amax history) / largest`` (E4M3:
448), the current amax pushed into the history for the next step.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from cpt_jax.formats import AffineInt, is_per_tensor_scaled
from cpt_jax.formats.codes import fake_operand
from cpt_jax.interception import ACTIVATION, Operand, Product
from cpt_jax.ops.scale_history import (
    HISTORY_LENGTH,
    ScaleHistory,
    delayed_scale_quantize,
    init_history,
    update_history,
)
from cpt_jax.providers.fake_quant import FakeQuantProvider, key_for

Array = jax.Array

DEFAULT_COLLECTION = "batch_stats"


# --------------------------------------------------------------------------- Flax

_CHILD = "delayed_quant"
"""Where a layer of `delayed_scaling_model` keeps its history: ``<layer>/delayed_quant``."""


@dataclasses.dataclass(frozen=True)
class DelayedScalingProvider(FakeQuantProvider):
    """A provider (`cpt_jax.interception`) quantizing each layer's input from history.

    The activation (lhs) of a dot_general / conv with a weight is quantized by
    `delayed_scale_quantize`, its `ScaleHistory` kept in ``product.module``'s
    variable ``(collection, *location)``; weights and errors as the product's
    config says (dynamic, as `FakeQuantProvider`). The history is created where
    the collection is mutable (``prepare``, also at init), updated only there.

    Attributes:
      fmt, method, history_length, margin, kappa: see the module docstring.
      collection: the variable collection holding the histories.
      location: the variable's path inside the module: ``("delayed_quant",
        "input_history")`` for models, ``("input_history",)`` for the doors.
    """

    fmt: Any = AffineInt()
    method: str = "delayed"
    history_length: int = HISTORY_LENGTH
    collection: str = DEFAULT_COLLECTION
    margin: float = 0.0
    kappa: float = 100.0
    location: tuple[str, ...] = (_CHILD, "input_history")

    def _applies(self, product: Product) -> bool:
        cfg = product.config
        return (product.module is not None and cfg is not None and cfg.activation is not None
                and product.kind in ("dot_general", "conv") and product.rhs.role != ACTIVATION)

    def _location(self, product: Product) -> tuple[str, ...]:
        """`location`, its last name prefixed by the product's path below its module
        when the module computes several products (``einsum_1_input_history``)."""
        below = product.local
        if not below:
            return self.location
        return self.location[:-1] + (f"{below.replace('/', '_')}_{self.location[-1]}",)

    def _read(self, product: Product) -> ScaleHistory:
        module = product.module
        head, *rest = self._location(product)
        if not module.has_variable(self.collection, head):
            return init_history(self.history_length)
        value = module.get_variable(self.collection, head)
        for name in rest:
            if name not in value:
                return init_history(self.history_length)
            value = value[name]
        return value

    def _write(self, product: Product, history: ScaleHistory) -> None:
        module = product.module
        head, *rest = self._location(product)
        value = history
        for name in reversed(rest):
            value = {name: value}
        if rest and module.has_variable(self.collection, head):
            value = {**module.get_variable(self.collection, head), **value}
        module.put_variable(self.collection, head, value)

    def _has(self, product: Product) -> bool:
        module = product.module
        head, *rest = self._location(product)
        if not module.has_variable(self.collection, head):
            return False
        value = module.get_variable(self.collection, head)
        return not rest or rest[0] in value

    def prepare(self, product: Product, lhs, rhs) -> None:
        """Create the (empty) history where the collection is mutable."""
        module = product.module
        if (self._applies(product) and module.is_mutable_collection(self.collection)
                and not self._has(product)):
            self._write(product, init_history(self.history_length))

    def quantize_operand(self, product: Product, operand: Operand, x, bits, state):
        if operand is not product.lhs or not self._applies(product):
            return super().quantize_operand(product, operand, x, bits, state)
        tq = product.config.activation
        key = key_for(tq, state, "an operand (activation)")
        q, new_history, overflow = delayed_scale_quantize(
            x, bits, self._read(product), self.fmt, method=self.method,
            rounding=tq.rounding, key=key, margin=self.margin, kappa=self.kappa)
        if product.module.is_mutable_collection(self.collection):
            self._write(product, new_history)
        product.module.sow("intermediates", "_".join(self.location[:-1] + ("overflow",)),
                           overflow)
        return q


@dataclasses.dataclass(frozen=True)
class DelayedFP8Provider(DelayedScalingProvider):
    """Transformer Engine's delayed scaling of each product's activation (FP8).

    The activation (lhs) of a dot_general / conv with a weight, whose config's
    activation is a per-tensor `ScaledFloat` (``fp8_delayed``: E4M3), is quantized
    as ``s * cast(x / s)`` (saturating) with ``s = amax_used / largest`` and
    ``amax_used = max(history) * 2^margin`` (TE's ``"max"`` algorithm; the current
    amax while the history is empty, i.e. the first step is current-scaled). The
    current amax is pushed into the history (``(collection, *location)``) where the
    collection is mutable (training). Straight-through gradient; ``bits >= 32`` is
    identity. Weights and errors as the product's config says (current scaling).
    `fmt` and `method` are not used (the grid is the config's).

    Example:
      >>> from cpt_jax.quant_config import get_preset
      >>> qmodel = cpt_jax.quantize_model(nn.Dense(3), config=get_preset("fp8_delayed"),
      ...                                 provider=DelayedFP8Provider())
      >>> v = qmodel.init(jax.random.key(0), jnp.ones((2, 4)))
      >>> int(v["batch_stats"]["delayed_quant"]["input_history"].count)
      0
    """

    def _applies(self, product: Product) -> bool:
        if not super()._applies(product):
            return False
        tq = product.config.activation if product.config is not None else None
        fmt = getattr(tq, "fmt", None)
        return is_per_tensor_scaled(fmt)

    def quantize_operand(self, product: Product, operand: Operand, x, bits, state):
        if operand is not product.lhs or not self._applies(product):
            return FakeQuantProvider.quantize_operand(self, product, operand, x, bits, state)
        from cpt_jax.providers.lowp_gemm import history_amax

        tq = product.config.activation if product.config is not None else None
        assert tq is not None  # _applies checked it
        key = key_for(tq, state, "an operand (activation)")
        history = self._read(product)
        used, current = history_amax(history, x, self.margin)
        q = fake_operand(x, tq, bits, key, amax=lax.stop_gradient(used)).astype(x.dtype)
        if product.module.is_mutable_collection(self.collection):
            new = update_history(history, -current, current, False)
            self._write(product, jax.tree.map(lambda n, o: jnp.asarray(n, jnp.result_type(o)),
                                              new, history))
        return x + lax.stop_gradient(q - x)  # straight-through
