"""Low-precision optimizers: LP-SGD (QPyTorch's OptimLP), SWALP, and HALP with SVRG.

Three families, one package (every name below is importable from ``cpt_jax.optim``):

* **Quantized optax transformations** (`cpt_jax.optim.lp`, QPyTorch's ``OptimLP``
  semantics). Gradients,
  weights, momentum and an optional high-precision accumulator are each quantized to
  any `cpt_jax` format with nearest or stochastic rounding. `optim_lp` wraps any optax
  optimizer in QPyTorch's exact order::

      g   <- Q_grad(g)                                   # gradient quantize
      a   <- acc if an accumulator is kept else w        # swap in the accumulator
      a'  <- a + inner.update(g, state, params=a)        # optimizer step
      acc <- Q_acc(a')                                   # accumulator quantize
      w'  <- Q_w(acc)   (Q_w(a') without accumulator)    # weight quantize
      m   <- Q_mom(m)   for the momentum leaves of state # momentum quantize

  and returns the optax update ``u = w' - w`` so that ``optax.apply_updates(w, u)``
  gives the quantized weights (see `quantize_weights` for when this is exact).
  `lp_sgd` is SGD (momentum, Nesterov, weight decay) built this way. The PRNG key for
  stochastic rounding lives in the optimizer state; step ``t`` uses
  ``fold_in(key, t)`` and leaf ``i`` ``fold_in(that, i)``: deterministic and jittable.
  Every bit-width may be a number, a traced scalar, or a schedule ``bits(count)``;
  all are compatible with ``optax.inject_hyperparams``.

* **SWALP** (Yang et al. 2019, `cpt_jax.optim.swalp`): `swa` keeps a high-precision
  running mean of the
  iterates every ``swa_freq`` steps from ``swa_start``; `swalp` is `swa` around
  `lp_sgd` with a constant learning rate after ``swa_start``.
  `recompute_batch_stats` recomputes BatchNorm statistics for the averaged weights as
  SWA's ``bn_update`` does.

* **SVRG, LP-SVRG and HALP** (De Sa et al. 2018, `cpt_jax.optim.halp`). These need a
  full-gradient pass
  every epoch, which is not an optax update, so they are epoch functions
  ``epoch(params, data, key) -> params``: `svrg_epoch` (fp32), `lp_svrg_epoch`
  (iterates on a fixed b-bit grid), `halp_epoch` (bit centering), and the jitted
  factories `svrg`, `lp_svrg`, `halp`. The HALP state (`HALPState`: fp32 anchor,
  full gradient, int8/int16 codes of the offset and its scale) is public for custom
  loops: ``state.recenter(full_grad, mu=...)``, ``state.inner_step(...)``,
  ``state.params``.

Shared pieces (`BitsLike`, `LPQuant`, `quantize_tree`) live in `cpt_jax.optim.common`.
"""
from cpt_jax.optim.common import BitsLike, LPQuant, quantize_tree
from cpt_jax.optim.halp import (
                                HALPState,
                                code_dtype,
                                full_gradient,
                                halp,
                                halp_epoch,
                                halp_init,
                                halp_scale,
                                lp_svrg,
                                lp_svrg_epoch,
                                minibatch_indices,
                                quantize_to_codes,
                                svrg,
                                svrg_epoch,
)
from cpt_jax.optim.lp import (
                                MOMENTUM_FIELDS,
                                OptimLPState,
                                QuantizeMomentumState,
                                QuantizeState,
                                QuantizeWeightsState,
                                lp_sgd,
                                optim_lp,
                                quantize_gradients,
                                quantize_momentum,
                                quantize_weights,
)
from cpt_jax.optim.swalp import SWAState, recompute_batch_stats, swa, swa_count, swa_params, swalp

__all__ = [
    "BitsLike", "HALPState", "LPQuant", "MOMENTUM_FIELDS", "OptimLPState", "QuantizeState",
    "QuantizeMomentumState", "QuantizeWeightsState", "SWAState", "code_dtype",
    "full_gradient", "halp", "halp_epoch", "halp_init", "halp_scale", "lp_sgd", "lp_svrg",
    "lp_svrg_epoch", "minibatch_indices", "optim_lp", "quantize_gradients",
    "quantize_momentum", "quantize_to_codes", "quantize_tree", "quantize_weights",
    "recompute_batch_stats", "svrg", "svrg_epoch", "swa", "swa_count", "swa_params",
    "swalp",
]
