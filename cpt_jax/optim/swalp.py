"""SWALP (Yang et al. 2019): stochastic weight averaging around a low-precision SGD.

`swa` keeps a float32 running mean of the iterates every ``swa_freq`` steps from
``swa_start`` (``avg <- avg + (w - avg) / (n + 1)``); `swalp` is `swa` around
`lp_sgd` with a constant learning rate after ``swa_start``. `recompute_batch_stats`
recomputes BatchNorm statistics for the averaged weights as SWA's ``bn_update`` does.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from cpt_jax.formats import BlockFloat, Format
from cpt_jax.optim.common import Array, BitsLike, Params, apply_updates, check_int, check_positive
from cpt_jax.optim.lp import lp_sgd


class SWAState(NamedTuple):
    """State of `swa`: step count, number averaged, the fp32 average, inner state."""

    count: Array
    n_averaged: Array
    average: Params
    inner_state: Any


def swa(inner: optax.GradientTransformation, *, swa_start: int, swa_freq: int = 1
        ) -> optax.GradientTransformation:
    """Stochastic weight averaging of the iterates of `inner`, kept in float32.

    After step ``t`` (1-based: the params after ``t`` updates), when ``t >= swa_start``
    and ``(t - swa_start) % swa_freq == 0``::

        n <- n + 1,   avg <- avg + (w_t - avg) / n

    so ``avg`` is the mean of the averaged iterates. The updates of `inner` pass
    through unchanged; read the average with `swa_params`. Needs ``params``.

    Args:
      inner: the optimizer whose iterates are averaged (e.g. `lp_sgd`).
      swa_start: the first step averaged (>= 0).
      swa_freq: average every `swa_freq` steps from `swa_start` (>= 1).

    Returns:
      An optax transformation whose state (`SWAState`) holds the fp32 average.

    Example:
      >>> params = {"w": jnp.array([1.0, -2.0])}; grads = {"w": jnp.array([1.0, 1.0])}
      >>> opt = swa(optax.sgd(0.1), swa_start=1, swa_freq=1)
      >>> state = opt.init(params)
      >>> for _ in range(3):
      ...     updates, state = opt.update(grads, state, params)
      ...     params = optax.apply_updates(params, updates)
      >>> [round(float(v), 3) for v in swa_params(state)["w"]]  # mean of steps 1-3
      [0.8, -2.2]
    """
    check_int(swa_start, "swa_start", 0)
    check_int(swa_freq, "swa_freq", 1)

    def init_fn(params):
        avg = jax.tree_util.tree_map(lambda p: jnp.zeros(jnp.shape(p), jnp.float32), params)
        return SWAState(jnp.zeros([], jnp.int32), jnp.zeros([], jnp.int32), avg,
                        inner.init(params))

    def update_fn(updates, state, params=None):
        if params is None:
            raise ValueError("swa needs params: call update(updates, state, params)")
        updates, inner_state = inner.update(updates, state.inner_state, params)
        count = optax.safe_int32_increment(state.count)
        take = (count >= swa_start) & ((count - swa_start) % swa_freq == 0)
        n = state.n_averaged + take.astype(jnp.int32)
        new_params = apply_updates(params, updates)
        avg = jax.tree_util.tree_map(
            lambda a, w: jnp.where(take, a + (jnp.asarray(w, jnp.float32) - a)
                                   / jnp.maximum(n, 1).astype(jnp.float32), a),
            state.average, new_params)
        return updates, SWAState(count, n, avg, inner_state)

    return optax.GradientTransformation(init_fn, update_fn)


def swa_params(opt_state: Any) -> Params:
    """The averaged weights held by the (first) `SWAState` inside ``opt_state``.

    Example:
      >>> params = {"w": jnp.array([1.0, -2.0])}; grads = {"w": jnp.array([1.0, 1.0])}
      >>> opt = swa(optax.sgd(0.1), swa_start=2, swa_freq=1)
      >>> state = opt.init(params)
      >>> for _ in range(2):
      ...     updates, state = opt.update(grads, state, params)
      ...     params = optax.apply_updates(params, updates)
      >>> [round(float(v), 3) for v in swa_params(state)["w"]]  # step 2 alone
      [0.8, -2.2]
    """
    found = [s for s in jax.tree_util.tree_leaves(
        opt_state, is_leaf=lambda x: isinstance(x, SWAState)) if isinstance(s, SWAState)]
    if not found:
        raise ValueError("opt_state holds no SWAState: build the optimizer with swa/swalp")
    return found[0].average


def swa_count(opt_state: Any) -> Array:
    """How many iterates the `SWAState` inside ``opt_state`` has averaged."""
    found = [s for s in jax.tree_util.tree_leaves(
        opt_state, is_leaf=lambda x: isinstance(x, SWAState)) if isinstance(s, SWAState)]
    if not found:
        raise ValueError("opt_state holds no SWAState: build the optimizer with swa/swalp")
    return found[0].n_averaged


def swalp(learning_rate: float | optax.Schedule, momentum: float = 0.9, *,
          swa_start: int, swa_freq: int, swa_lr: float | None = None,
          weight_decay: float = 0.0, bits: BitsLike = 8, fmt: Format = BlockFloat(),
          rounding: str = "stochastic", seed: Any = 0, **lp_kwargs: Any
          ) -> optax.GradientTransformation:
    """SWALP: low-precision SGD, then an fp32 average of its iterates.

    ``lp_sgd`` with weights, gradients and momentum at `bits` in `fmt` (8-bit block
    float, stochastic rounding: SWALP's recipe), learning rate `learning_rate` until
    ``swa_start`` and the constant ``swa_lr`` from then on (when given), averaged by
    `swa` every ``swa_freq`` steps (SWALP: once per epoch) from ``swa_start``.
    Extra keyword arguments go to `lp_sgd` (e.g. ``acc_bits=32``, ``weight_fmt``).
    Before evaluating ``swa_params(state)`` on a BatchNorm model, recompute its
    statistics with `recompute_batch_stats`.

    Args:
      learning_rate: the SGD learning rate (a number or an optax schedule).
      momentum: SGD momentum.
      swa_start: the step where averaging (and ``swa_lr``) starts.
      swa_freq: average every `swa_freq` steps (SWALP: the steps of one epoch).
      swa_lr: the constant learning rate from `swa_start` on (None: keep `learning_rate`).
      weight_decay: L2 weight decay (PyTorch SGD semantics).
      bits: width of weights, gradients and momentum.
      fmt: their number format (default 8-bit `BlockFloat`).
      rounding: ``"stochastic"`` or ``"nearest"``.
      seed: PRNG seed (int or key) of the stochastic rounding.
      **lp_kwargs: more `lp_sgd` arguments (``acc_bits``, ``weight_fmt``, ...).

    Returns:
      An optax transformation; `swa_params` of its state is the averaged model.

    Example:
      >>> params = {"w": jnp.array([1.0, -2.0])}; grads = {"w": jnp.array([1.0, 1.0])}
      >>> opt = swalp(0.05, 0.9, swa_start=2, swa_freq=1, swa_lr=0.01)
      >>> state = opt.init(params)
      >>> for _ in range(4):
      ...     updates, state = opt.update(grads, state, params)
      ...     params = optax.apply_updates(params, updates)
      >>> int(swa_count(state))            # steps 2, 3 and 4 averaged
      3
    """
    check_int(swa_start, "swa_start", 0)
    lr = learning_rate
    if swa_lr is not None:
        check_positive(swa_lr, "swa_lr", allow_zero=True)
        first = learning_rate if callable(learning_rate) else optax.constant_schedule(
            learning_rate)
        lr = optax.join_schedules([first, optax.constant_schedule(swa_lr)], [swa_start])
    kw = dict(weight_bits=bits, grad_bits=bits, momentum_bits=bits, weight_fmt=fmt,
              grad_fmt=fmt, momentum_fmt=fmt, rounding=rounding, seed=seed)
    kw.update(lp_kwargs)
    return swa(lp_sgd(lr, momentum, weight_decay=weight_decay, **kw),
               swa_start=swa_start, swa_freq=swa_freq)


def recompute_batch_stats(model_apply: Callable[[Any, Any], Any], variables: Any,
                          batches: Iterable[Any], *, stats_key: str = "batch_stats") -> Any:
    """BatchNorm statistics of `variables` recomputed on `batches` (SWA's bn_update).

    ``model_apply(variables, batch)`` must run a train-mode forward pass and return
    the updated statistics collection, e.g.::

        lambda v, x: model.apply(v, x, train=True, mutable=["batch_stats"])[1]["batch_stats"]

    Each running statistic is assumed to follow ``r <- m r + (1 - m) s_batch`` (flax
    ``nn.BatchNorm``, any momentum ``m``). Running the forward from ``r = 0`` and from
    ``r = 1`` gives ``m`` and the batch statistic ``s_batch = r(0) / (1 - m)``; the
    result is the batch-size weighted mean of ``s_batch`` over `batches` (the mean of
    the batch means and of the batch variances), which is what SWA's ``bn_update``
    computes with its cumulative momentum ``b / (n + b)``. Statistics the forward
    does not update keep their value. Runs ``len(batches) + 1`` forward passes.

    Args:
      model_apply: ``(variables, batch) -> new statistics`` (jitted here).
      variables: the model variables with the (averaged) ``params`` and a
        ``stats_key`` collection whose values are replaced.
      batches: an iterable of batches (a batch is any pytree with leading batch dim).
      stats_key: name of the statistics collection.

    Returns:
      The recomputed ``stats_key`` collection (same structure as the old one).

    Example:
      >>> model = nn.Sequential([nn.Dense(2), nn.BatchNorm(use_running_average=False)])
      >>> x = jax.random.normal(jax.random.key(0), (16, 3))
      >>> variables = model.init(jax.random.key(1), x)   # e.g. params <- swa_params(...)
      >>> apply = lambda v, xb: model.apply(v, xb, mutable=["batch_stats"])[1]["batch_stats"]
      >>> stats = recompute_batch_stats(apply, variables, [x[:8], x[8:]])
      >>> hidden = nn.Dense(2).apply({"params": variables["params"]["layers_0"]}, x)
      >>> bool(jnp.allclose(stats["layers_1"]["mean"], hidden.mean(0), atol=1e-5))
      True
    """
    if stats_key not in variables:
        raise ValueError(f"variables must hold a {stats_key!r} collection, got keys "
                         f"{list(variables)}")
    stats = variables[stats_key]
    zeros = jax.tree_util.tree_map(jnp.zeros_like, stats)
    ones = jax.tree_util.tree_map(jnp.ones_like, stats)

    @jax.jit
    def run(old, batch):
        return model_apply({**variables, stats_key: old}, batch)

    total, count, momentum = None, 0, None
    for batch in batches:
        size = int(jnp.shape(jax.tree_util.tree_leaves(batch)[0])[0])
        from_zero = run(zeros, batch)
        if momentum is None:
            momentum = jax.tree_util.tree_map(lambda a, b: a - b, run(ones, batch), from_zero)
        stat = jax.tree_util.tree_map(
            lambda r0, m: r0 / jnp.where(1.0 - m > 1e-6, 1.0 - m, 1.0), from_zero, momentum)
        weighted = jax.tree_util.tree_map(lambda s, size=size: s * size, stat)
        total = weighted if total is None else jax.tree_util.tree_map(jnp.add, total, weighted)
        count += size
    if total is None:
        raise ValueError("batches is empty: recompute_batch_stats needs at least one batch")
    return jax.tree_util.tree_map(
        lambda t, m, old: jnp.where(1.0 - m > 1e-6, t / count, old).astype(old.dtype),
        total, momentum, stats)
