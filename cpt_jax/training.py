"""Training with traced precision: a `TrainState` and jitted, buffer-donating steps.

The precision schedule is evaluated on the traced ``state.step`` inside the step, on
device, so the bit-width changes every step without a host sync or a recompile:

    b_t = schedule(t),  g_t = grad_schedule(t)
    (loss, aux), grads = value_and_grad(loss of model.apply under precision(b_t, g_t))
    params <- optimizer(params, grads)            (skipped if non-finite, see below)

Numerical safety: low precision can overflow. The step checks that the loss and all
gradients are finite; with ``nonfinite="skip"`` (default) a non-finite step leaves
the state unchanged but the step counter and counts it in ``state.skipped_steps``;
``nonfinite="ignore"`` applies the update regardless; ``nonfinite="stop"`` skips like
"skip" and also returns one finiteness flag per gradient leaf
(``metrics["grads_finite"]``, in ``tree_leaves(params)`` order) so the caller can
stop and name the layer (`nonfinite_layers`; the runner does this).

With a `cpt_jax.controllers.PrecisionController` (``make_train_step(...,
controller=c)``) the bits come from the run's own statistics instead: the step calls
``bits, s = c.update(state.controller.state, state.controller.stats, state.step)``,
trains at ``bits``, measures the step's `cpt_jax.controllers.StepStats` and stores
them with the new controller state and the count of the bits used in
``state.controller`` (a `cpt_jax.controllers.ControllerCarry`): still one compile.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Mapping
from typing import Any

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from cpt_jax import controllers as ctl
from cpt_jax import cost as cost_lib
from cpt_jax.context import precision
from cpt_jax.doors import QuantizedModel
from cpt_jax.providers.running_ranges import COLLECTION as RANGES_COLLECTION
from cpt_jax.schedules import PrecisionSchedule

Array = jax.Array
Batch = dict[str, Any]
LossFn = Callable[[Any, Batch], tuple[Array, dict[str, Array]]]

NONFINITE_POLICIES = ("skip", "ignore", "stop")


@flax.struct.dataclass
class TrainState:
    """Everything a run needs to continue exactly: step, variables, optimizer, rng.

    `skipped_steps` counts steps whose loss or gradients were non-finite;
    `activation_ranges` holds the running activation ranges
    (`cpt_jax.providers.running_ranges`; empty unless a layer uses them);
    `controller` the `cpt_jax.controllers.ControllerCarry` of a run whose bits a
    controller sets (empty otherwise).
    """

    step: Array
    params: Any
    batch_stats: Any
    opt_state: Any
    rng: Array
    skipped_steps: Array
    activation_ranges: Any = flax.struct.field(default_factory=dict)
    controller: Any = flax.struct.field(default_factory=dict)

    def carried(self) -> dict[str, Any]:
        """The non-empty collections training updates: ``batch_stats``, ``activation_ranges``."""
        pairs = (("batch_stats", self.batch_stats), (RANGES_COLLECTION, self.activation_ranges))
        return {name: value for name, value in pairs if value}

    def variables(self) -> dict[str, Any]:
        """The Flax variables dict ``{'params': ..., 'batch_stats': ..., ...}``."""
        return {"params": self.params, **self.carried()}


def create_train_state(model: nn.Module, optimizer: optax.GradientTransformation,
                       rng: Array, sample_inputs: Any, *,
                       controller: ctl.PrecisionController | None = None,
                       **init_kwargs) -> TrainState:
    """Initialize the model's variables and the optimizer on `sample_inputs`.

    Args:
      model: the Flax model (quantized or not).
      optimizer: the optax optimizer.
      rng: PRNG key; split into the init key and the state's key (dropout, stochastic
        rounding: step t uses ``fold_in(state.rng, t)``).
      sample_inputs: a batch of inputs of the training shape.
      controller: the run's precision controller, if any (its carry starts the state's
        ``controller`` field, `cpt_jax.controllers.init_carry`).
      **init_kwargs: passed to ``model.init`` (e.g. ``train=False``).

    Returns:
      A `TrainState` at step 0.

    Example:
      >>> from cpt_jax.models import MLP
      >>> state = create_train_state(MLP(hidden=(8,), num_classes=3), optax.sgd(0.1),
      ...                            jax.random.key(0), jnp.ones((2, 5)))
      >>> int(state.step), state.params["dense1"]["kernel"].shape
      (0, (5, 8))
    """
    init_rng, state_rng = jax.random.split(rng)
    variables = model.init({"params": init_rng, "dropout": init_rng}, sample_inputs, **init_kwargs)
    params = variables["params"]
    batch_stats = variables.get("batch_stats", {})
    return TrainState(step=jnp.zeros((), jnp.int32), params=params, batch_stats=batch_stats,
                      opt_state=optimizer.init(params), rng=state_rng,
                      skipped_steps=jnp.zeros((), jnp.int32),
                      activation_ranges=variables.get(RANGES_COLLECTION, {}),
                      controller={} if controller is None else ctl.init_carry(controller))


# --------------------------------------------------------------------------- batches

BATCH_FORM = ("a dict {'inputs': x, 'labels': y} ('inputs' go to the model, the rest to "
              "loss_fn: classification_loss reads 'labels' and an optional 'mask')")
"""What `make_train_step`'s and `make_eval_step`'s steps take as a batch."""


def check_batch(batch: Any, keys: tuple[str, ...] = ("inputs",)) -> None:
    """Check, when a step is traced, that `batch` is a mapping holding `keys`.

    Raises:
      TypeError: `batch` is not a mapping (a tuple ``(x, y)`` is ``{"inputs": x,
        "labels": y}``); the message says what a batch is (`BATCH_FORM`).
      ValueError: a key is missing; the message names it and the keys there are.

    Example:
      >>> check_batch({"inputs": 1, "labels": 2}, ("inputs", "labels"))
      >>> check_batch({"inputs": 1}, ("inputs", "labels"))  # doctest: +ELLIPSIS
      Traceback (most recent call last):
      ...
      ValueError: the batch has no 'labels' (its keys: ['inputs']); a batch is a dict {...
    """
    if not isinstance(batch, Mapping):
        tip = (" (for a tuple (x, y): {'inputs': x, 'labels': y})"
               if isinstance(batch, (tuple, list)) else "")
        raise TypeError(f"a batch is {BATCH_FORM}, got a {type(batch).__name__}{tip}")
    for key in keys:
        if key not in batch:
            raise ValueError(f"the batch has no {key!r} (its keys: {sorted(batch)}); a batch "
                             f"is {BATCH_FORM}")


# --------------------------------------------------------------------------- losses

def classification_loss(logits: Array, batch: Batch) -> tuple[Array, dict[str, Array]]:
    """Mean softmax cross-entropy over (optionally masked) examples, and accuracy.

    ``loss = sum_i m_i CE(logits_i, y_i) / sum_i m_i`` with mask ``m`` = ``batch['mask']``
    (all ones by default). Works for (B, C) and (B, T, C) logits (language models).
    A batch without ``'labels'`` is a ValueError naming what a batch is (`check_batch`):
    pass a `loss_fn` of your own for other targets.
    """
    check_batch(batch, ("labels",))
    labels = batch["labels"]
    mask = batch.get("mask")
    ce = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), labels)
    correct = (jnp.argmax(logits, -1) == labels).astype(jnp.float32)
    if mask is None:
        mask = jnp.ones_like(ce)
    mask = mask.astype(jnp.float32)
    denom = jnp.maximum(mask.sum(), 1.0)
    loss = (ce * mask).sum() / denom
    return loss, {"loss": loss, "accuracy": (correct * mask).sum() / denom,
                  "count": mask.sum(), "loss_sum": (ce * mask).sum(),
                  "correct": (correct * mask).sum()}


# --------------------------------------------------------------------------- steps

def _leaf_finite(tree) -> Array:
    """One bool per leaf of `tree` (tree_leaves order): all its elements are finite."""
    leaves = jax.tree_util.tree_leaves(tree)
    if not leaves:
        return jnp.ones((0,), bool)
    return jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves])


def _all_finite(tree) -> Array:
    return jnp.all(_leaf_finite(tree))


def nonfinite_layers(params, grads_finite) -> list:
    """Paths (``"dense1/kernel"``) of the parameters whose gradient was non-finite.

    `grads_finite` is ``metrics["grads_finite"]`` of a ``nonfinite="stop"`` step: one
    flag per leaf of `params` in ``tree_leaves`` order.

    Example:
      >>> w = jnp.ones((2, 2))
      >>> nonfinite_layers({"a": {"kernel": w}, "b": {"kernel": w}}, [True, False])
      ['b/kernel']
    """
    flags = [bool(f) for f in jax.device_get(grads_finite)]
    paths = jax.tree_util.tree_flatten_with_path(params)[0]
    if len(paths) != len(flags):
        raise ValueError(
            f"grads_finite has {len(flags)} flags but params has {len(paths)} leaves")
    return [path_str(path) for (path, _), ok in zip(paths, flags) if not ok]


def path_str(path) -> str:
    """A pytree key path as ``"a/b/0"`` (dict keys, attribute names, sequence indices)."""
    parts = []
    for k in path:
        for attr in ("key", "name", "idx"):
            if hasattr(k, attr):
                parts.append(str(getattr(k, attr)))
                break
        else:
            parts.append(str(k))
    return "/".join(parts)


_APPLY_OWN = frozenset({"method", "capture_intermediates"})
"""``apply``'s own keywords a step's `apply_kwargs` may set (it sets ``rngs`` and
``mutable`` itself)."""


def _model_method(model: nn.Module, method: Any) -> Callable | None:
    """The function ``model.apply(..., method=method)`` runs (the user's, under the
    class `quantize_model` builds), or None where it cannot be found."""
    if callable(method) and not isinstance(method, str):
        return method
    base = next(c for c in type(model).__mro__ if not issubclass(c, QuantizedModel))
    return getattr(base, method or "__call__", None)


def model_parameters(model: nn.Module, apply_kwargs: dict | None = None) -> frozenset | None:
    """The keyword parameters of the method a step applies (``__call__``, or
    ``apply_kwargs["method"]``), or None when it takes ``**kwargs`` (anything goes)
    or cannot be inspected.

    Example:
      >>> class Net(nn.Module):
      ...   @nn.compact
      ...   def __call__(self, x, *, train: bool = False):
      ...     return nn.Dense(2)(x)
      >>> sorted(model_parameters(cpt_jax.quantize_model(Net())))
      ['train', 'x']
    """
    fn = _model_method(model, (apply_kwargs or {}).get("method"))
    if fn is None:
        return None
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return None
    if any(p.kind == p.VAR_KEYWORD for p in params):
        return None
    return frozenset(p.name for p in params if p.name != "self"
                     and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))


def check_apply_kwargs(model: nn.Module, apply_kwargs: dict | None, where: str) -> None:
    """Raise ValueError, when the step is built, for an `apply_kwargs` key the model's
    method does not take (``TypeError: unexpected keyword`` at the first step
    otherwise)."""
    accepted = model_parameters(model, apply_kwargs)
    unknown = sorted(set(apply_kwargs or {}) - _APPLY_OWN - (accepted or set()))
    if accepted is not None and unknown:
        raise ValueError(
            f"{where}: apply_kwargs {unknown} are not parameters of "
            f"{type(model).__name__}'s method (it takes {sorted(accepted)}); remove them "
            f"from apply_kwargs")


def call_kwargs(model: nn.Module, apply_kwargs: dict, train: bool) -> dict:
    """`apply_kwargs` plus ``train=train`` where the model's method takes a ``train``
    parameter (or ``**kwargs``) and `apply_kwargs` does not set it: a model with no
    ``train`` argument (the quickstart's MLP) is called without one.

    Example:
      >>> class MLP(nn.Module):
      ...   @nn.compact
      ...   def __call__(self, x):
      ...     return nn.Dense(2)(x)
      >>> call_kwargs(MLP(), {}, True), call_kwargs(cpt_jax.models.MLP(), {}, True)
      ({}, {'train': True})
    """
    kwargs = dict(apply_kwargs)
    accepted = model_parameters(model, apply_kwargs)
    if accepted is None or "train" in accepted:
        kwargs.setdefault("train", train)
    return kwargs


def _apply_model(model, state: TrainState, params, inputs, bits, grad_bits, rng, train: bool,
                 apply_kwargs):
    carried = state.carried()
    variables = {"params": params, **carried}
    quant_rng, dropout_rng = jax.random.split(rng)
    mutable = list(carried) if (train and carried) else False
    kwargs = call_kwargs(model, apply_kwargs, train)

    def run():
        return model.apply(variables, inputs, rngs={"dropout": dropout_rng}, mutable=mutable,
                           **kwargs)

    if bits is None:
        out = run()
    else:
        with precision(bits, grad_bits, rng=quant_rng):
            out = run()
    if mutable:
        outputs, updates = out
        return outputs, {name: updates.get(name, value) for name, value in carried.items()}
    return out, carried


def train_step_body(model, optimizer, loss_fn, state: TrainState, batch: Batch, bits, grad_bits,
                    nonfinite: str, ops, apply_kwargs, trace_counter, *, stats: bool = False,
                    measure_every: int = 0):
    """One training step at given (traced) bits, unjitted: the body `make_train_step`
    compiles and `cpt_jax.distributed.gossip` runs per peer inside ``shard_map``.

    ``loss, grads = value_and_grad(loss_fn(model(params; bits, grad_bits), batch))``,
    then the optimizer update; with ``nonfinite`` "skip"/"stop" a step whose loss or
    gradients are non-finite keeps the old state (the step counter advances and
    ``skipped_steps`` counts it). `trace_counter` (a one-element list) counts traces.
    With `stats` the metrics hold the step's `cpt_jax.controllers.StepStats`
    (``metrics["stats"]``), its ``quant_effect`` measured every `measure_every` steps
    (0: never; `step_quant_effect`), and with a model quantized with
    ``provider=cpt_jax.controllers.measure_products()`` each product's relative
    quantization error (``metrics["quant_error"]``).

    Returns:
      ``(new_state, metrics)``.
    """
    trace_counter[0] += 1
    check_batch(batch)
    rng = jax.random.fold_in(state.rng, state.step)

    def loss_of(params):
        collect = ctl.product_errors() if stats else contextlib.nullcontext({})
        with collect as errors:
            outputs, new_stats = _apply_model(model, state, params, batch["inputs"], bits,
                                              grad_bits, rng, True, apply_kwargs)
        loss, metrics = loss_fn(outputs, batch)
        return loss, (metrics, new_stats, dict(errors))

    (loss, (metrics, new_stats, errors)), grads = jax.value_and_grad(loss_of, has_aux=True)(
        state.params)
    updates, new_opt_state = optimizer.update(grads, state.opt_state, state.params)
    new_params = optax.apply_updates(state.params, updates)
    leaf_finite = _leaf_finite(grads)
    finite = jnp.isfinite(loss) & jnp.all(leaf_finite)
    if nonfinite in ("skip", "stop"):
        keep = lambda new, old: jax.tree_util.tree_map(
            lambda n, o: jnp.where(finite, n, o), new, old)
        new_params = keep(new_params, state.params)
        new_opt_state = keep(new_opt_state, state.opt_state)
        new_stats = keep(new_stats, state.carried())
    new_state = state.replace(
        step=state.step + 1, params=new_params, opt_state=new_opt_state,
        batch_stats=new_stats.get("batch_stats", state.batch_stats),
        activation_ranges=new_stats.get(RANGES_COLLECTION, state.activation_ranges),
        skipped_steps=state.skipped_steps + (~finite).astype(jnp.int32))
    metrics = dict(metrics)
    metrics["finite"] = finite
    if stats:
        effect = (step_quant_effect(model, loss_fn, state, batch, loss, rng, apply_kwargs,
                                    measure_every) if measure_every else None)
        metrics["stats"] = ctl.stats_of(loss, grads, effect, errors)
        if errors:
            metrics["quant_error"] = errors
    if nonfinite == "stop":
        metrics["grads_finite"] = leaf_finite
    if bits is not None:
        metrics["bits"] = jnp.asarray(bits, jnp.float32)
        metrics["bits_clamped"] = clamped_widths(bits, grad_bits)
        if grad_bits is not None:
            metrics["grad_bits"] = jnp.asarray(grad_bits, jnp.float32)
        if ops:
            metrics["relative_cost_fp32"] = cost_lib.relative_cost_per_step(ops, bits, grad_bits)
    return new_state, metrics


def clamped_widths(bits, grad_bits=None) -> Array:
    """1.0 when a width of the step is below 1 bit, else 0.0 (``metrics["bits_clamped"]``).

    A traced width cannot be checked when the step is built: below 1 the products
    compute at 1 bit (`cpt_jax.context.effective_bits`), and this flag counts such
    steps (sum it over the run) instead of leaving them silent.

    Example:
      >>> float(clamped_widths(0.0, 8.0)), float(clamped_widths(3.0))
      (1.0, 0.0)
    """
    low = jnp.asarray(bits, jnp.float32) < 1.0
    if grad_bits is not None:
        low = low | (jnp.asarray(grad_bits, jnp.float32) < 1.0)
    return low.astype(jnp.float32)


def step_quant_effect(model, loss_fn, state: TrainState, batch: Batch, loss, rng, apply_kwargs,
                      measure_every: int) -> Array:
    """The quantization's relative effect on the step's loss, every `measure_every` steps.

    ``(L_q - L_32) / |L_32|``: `loss` (computed under the step's precision) against one
    full-precision forward pass on the same batch, parameters and dropout mask (the
    same `rng`), at steps with ``step % measure_every == 0`` (``lax.cond``); NaN at
    the others.
    """
    loss = jnp.asarray(loss, jnp.float32)

    def measure(loss):
        outputs, _ = _apply_model(model, state, state.params, batch["inputs"], None, None, rng,
                                  True, apply_kwargs)
        full, _ = loss_fn(outputs, batch)
        full = jnp.asarray(full, jnp.float32)
        effect = (loss - full) / jnp.maximum(jnp.abs(full), 1e-12)
        return effect.astype(jnp.float32)

    # NaN of the loss's type: under jax.shard_map it varies where the loss does, as
    # `measure`'s output (a bare jnp.float32(nan) varies nowhere: the cond refused it).
    return jax.lax.cond(state.step % int(measure_every) == 0, measure,
                        lambda loss: jnp.full_like(loss, jnp.nan), loss)


def controlled_step_body(controller: ctl.PrecisionController, model, optimizer, loss_fn,
                         state: TrainState, batch: Batch, nonfinite: str, ops, apply_kwargs,
                         trace_counter):
    """One training step at the bits of `controller` (unjitted, see `make_train_step`).

    ``bits, s = controller.update(carry.state, carry.stats, t)``, the step at
    ``bits.forward`` / ``bits.error``, then ``state.controller`` <- `s`, the step's
    `cpt_jax.controllers.StepStats` and the count of `bits`
    (`cpt_jax.controllers.advance_carry`), whatever the non-finite policy did.
    """
    carry = state.controller
    bits, inner = controller.update(carry.state, carry.stats, state.step)
    new_state, metrics = train_step_body(model, optimizer, loss_fn, state, batch, bits.forward,
                                         bits.error, nonfinite, ops, apply_kwargs, trace_counter,
                                         stats=True, measure_every=controller.measure_every)
    carry = ctl.advance_carry(carry, inner, metrics["stats"], bits)
    return new_state.replace(controller=carry), metrics


class _Step:
    """A jitted step that counts its own compilations (`num_compiles`)."""

    def __init__(self, fn, donate: bool):
        self._trace_counter = [0]
        self._fn = jax.jit(functools.partial(fn, trace_counter=self._trace_counter),
                           donate_argnums=(0,) if donate else ())

    def __call__(self, *args):
        return self._fn(*args)

    @property
    def num_compiles(self) -> int:
        """How many times the step was traced (= compiled) so far."""
        return self._trace_counter[0]

    def lower(self, *args):
        return self._fn.lower(*args)

    def trace(self, *args):
        """``jax.jit(...).trace(*args)``: e.g. ``.lower(lowering_platforms=("cuda",))``."""
        return self._fn.trace(*args)


def _check_policy(nonfinite: str) -> None:
    if nonfinite not in NONFINITE_POLICIES:
        raise ValueError(f"nonfinite must be one of {NONFINITE_POLICIES}, got {nonfinite!r}")


def make_train_step(model: nn.Module, optimizer: optax.GradientTransformation,
                    precision_schedule: PrecisionSchedule | None = None,
                    grad_schedule: PrecisionSchedule | None = None, *,
                    loss_fn: LossFn = classification_loss, nonfinite: str = "skip",
                    ops=None, donate: bool = True, apply_kwargs: dict | None = None,
                    controller: ctl.PrecisionController | None = None):
    """A jitted ``step(state, batch) -> (state, metrics)`` with the schedule on device.

    ``bits = precision_schedule(state.step)`` and ``grad_bits = grad_schedule(state.step)``
    are computed from the traced step inside the compiled function; the model is
    applied under ``precision(bits, grad_bits, rng)``. With ``precision_schedule=None``
    the step is full precision. `ops` (from `cost.count_ops`) adds the step's
    ``relative_cost_fp32`` to the metrics; ``metrics["bits_clamped"]`` is 1 at a step
    whose scheduled width is below 1 bit (computed at 1 bit, `clamped_widths`). The
    state buffers are donated.

    `batch` is a dict with ``"inputs"`` (passed to the model) and whatever `loss_fn`
    reads (``"labels"``, optional ``"mask"``). The returned object counts its
    compilations in ``.num_compiles``: one for a whole cyclic run.

    With a `controller` (`cpt_jax.controllers`; no schedules then) the bits of each
    step come from ``controller.update`` on the statistics of the step before
    (`controlled_step_body`); the state must carry its carry
    (``create_train_state(..., controller=controller)``); ``metrics["stats"]`` holds
    the step's statistics. Still one compile.

    Args:
      model: the (quantized) Flax model; called as ``model.apply(variables, inputs,
        train=True, **apply_kwargs)``, ``train=`` only where its method takes a
        ``train`` parameter (`call_kwargs`: a model without one is called without it).
      optimizer: the optax optimizer.
      precision_schedule: forward bits per step (None: full precision).
      grad_schedule: backward (error) bits per step (None: fp32 errors).
      loss_fn: ``loss_fn(outputs, batch) -> (loss, metrics)``.
      nonfinite: ``"skip"`` (keep the state, count the step), ``"ignore"`` or
        ``"stop"`` (also report which gradients were non-finite).
      ops: the op inventory (`cost.count_ops`) to add the step's relative cost.
      donate: donate the state's buffers.
      apply_kwargs: extra keyword arguments of the model's apply (a key its method
        does not take is a ValueError here, not a TypeError at the first step).
      controller: a `cpt_jax.controllers.PrecisionController` setting the bits (then
        `precision_schedule` and `grad_schedule` must be None).

    Returns:
      ``step(state, batch) -> (state, metrics)``, jitted, with ``.num_compiles``.

    Example:
      >>> from cpt_jax import quantize_model
      >>> from cpt_jax.models import MLP
      >>> from cpt_jax.schedules import constant, cyclic
      >>> qmodel = quantize_model(MLP(hidden=(16,), num_classes=3))
      >>> x, y = jnp.ones((8, 4)), jnp.zeros((8,), jnp.int32)
      >>> state = create_train_state(qmodel, optax.sgd(0.1), jax.random.key(0), x)
      >>> step = make_train_step(qmodel, optax.sgd(0.1), cyclic("cos_growth",
      ...     min_bits=3, max_bits=8, num_cycles=4, total_steps=400), constant(8))
      >>> for _ in range(3):
      ...     state, metrics = step(state, {"inputs": x, "labels": y})
      >>> int(state.step), float(metrics["grad_bits"]), step.num_compiles
      (3, 8.0, 1)
    """
    _check_policy(nonfinite)
    check_apply_kwargs(model, apply_kwargs, "make_train_step")
    apply_kwargs = dict(apply_kwargs or {})
    if controller is not None:
        if precision_schedule is not None or grad_schedule is not None:
            raise ValueError("make_train_step takes a controller or schedules, not both: the "
                             "controller wraps the schedules (cpt_jax.controllers)")
        return _Step(functools.partial(controlled_step_body, controller, model, optimizer,
                                       loss_fn, nonfinite=nonfinite, ops=ops,
                                       apply_kwargs=apply_kwargs), donate)

    def fn(state, batch, trace_counter):
        bits = None if precision_schedule is None else precision_schedule(state.step)
        grad_bits = None if (grad_schedule is None or bits is None) else grad_schedule(state.step)
        return train_step_body(model, optimizer, loss_fn, state, batch, bits, grad_bits,
                               nonfinite, ops, apply_kwargs, trace_counter)

    return _Step(fn, donate)


def make_train_step_with_bits(model: nn.Module, optimizer: optax.GradientTransformation, *,
                              loss_fn: LossFn = classification_loss, nonfinite: str = "skip",
                              ops=None, donate: bool = True, apply_kwargs: dict | None = None,
                              stats: bool = False, measure_every: int = 0):
    """A jitted ``step(state, batch, bits, grad_bits) -> (state, metrics)``.

    For users who drive the bit-widths themselves: `bits` and `grad_bits` are traced
    scalars (pass ``jnp.float32`` values), so changing them never recompiles;
    ``grad_bits`` may be ``jnp.float32(32)`` to keep errors in full precision.
    With `stats` the metrics hold the step's `cpt_jax.controllers.StepStats`
    (``metrics["stats"]``, ``quant_effect`` every `measure_every` steps), what a
    controller driven by hand reads::

        bits, c_state = controller.update(c_state, stats, t)
        state, metrics = step(state, batch, bits.forward, bits.error)
        stats = metrics["stats"]

    Args: as `make_train_step`, without the schedules.

    Returns:
      ``step(state, batch, bits, grad_bits) -> (state, metrics)``, jitted, with
      ``.num_compiles``.
    """
    _check_policy(nonfinite)
    check_apply_kwargs(model, apply_kwargs, "make_train_step_with_bits")
    apply_kwargs = dict(apply_kwargs or {})

    def fn(state, batch, bits, grad_bits, trace_counter):
        return train_step_body(model, optimizer, loss_fn, state, batch, bits, grad_bits,
                               nonfinite, ops, apply_kwargs, trace_counter, stats=stats,
                               measure_every=measure_every)

    return _Step(fn, donate)


def make_eval_step(model: nn.Module, *, loss_fn: LossFn = classification_loss,
                   apply_kwargs: dict | None = None):
    """A jitted ``eval_step(state, batch, bits) -> metrics`` in inference mode.

    ``bits`` is a traced scalar: the forward pass runs under ``precision(bits)``
    (``bits >= 32`` is full precision, so one compiled function serves both).

    Args:
      model: the (quantized) Flax model, applied with ``train=False`` where its
        method takes a ``train`` parameter.
      loss_fn: ``loss_fn(outputs, batch) -> (loss, metrics)``.
      apply_kwargs: extra keyword arguments of the model's apply.

    Returns:
      ``eval_step(state, batch, bits) -> sums`` (``loss_sum``, ``correct``, ``count``),
      jitted; `aggregate` turns a list of sums into means.
    """
    check_apply_kwargs(model, apply_kwargs, "make_eval_step")
    apply_kwargs = dict(apply_kwargs or {})

    @jax.jit
    def eval_step(state: TrainState, batch: Batch, bits):
        check_batch(batch)
        outputs, _ = _apply_model(model, state, state.params, batch["inputs"], bits, None,
                                  jax.random.key(0), False, apply_kwargs)
        _, metrics = loss_fn(outputs, batch)
        return {k: metrics[k] for k in ("loss_sum", "correct", "count") if k in metrics}

    return eval_step


def aggregate(metric_sums) -> dict[str, float]:
    """Turn summed eval metrics into ``{'loss', 'accuracy', 'perplexity', 'count'}``."""
    totals: dict[str, float] = {}
    for m in metric_sums:
        for k, v in m.items():
            totals[k] = totals.get(k, 0.0) + float(v)
    count = max(totals.get("count", 0.0), 1.0)
    loss = totals.get("loss_sum", 0.0) / count
    out = {"loss": loss, "count": totals.get("count", 0.0),
           "perplexity": float(jnp.exp(jnp.minimum(loss, 80.0)))}
    if "correct" in totals:
        out["accuracy"] = totals["correct"] / count
    return out
