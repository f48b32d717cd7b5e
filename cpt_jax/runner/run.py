"""The run: what `build_run` makes from the config, fixed for the whole run.

`build_run` builds the task, the quantized model, the schedules, the optimizer (each
from its config subtree by `cpt_jax.runner.builders`), the op inventory (counted on the
variables' shapes, before the state), the controller (its builder reads the ops and
their cost table), the initial state, the schedules' per-step cost (`RunCost`, from
`cpt_jax.cost`) and the compiled train/eval steps; `with_segments` rebuilds the forward schedule of a run
extended to a new length (``--extend``).
"""
from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
import optax

from cpt_jax import cost as cost_lib
from cpt_jax import schedules as sched_lib
from cpt_jax.controllers import cost_table, get_controller
from cpt_jax.distributed import mesh as parallel
from cpt_jax.doors import UnmatchedRuleWarning, quantize_model
from cpt_jax.runner.builders import (
    controller_from_config,
    eval_bits_from_config,
    grad_schedule_from_config,
    optimizer_from_config,
    precision_schedule_from_config,
    provider_from_config,
    quant_config_from_config,
    rules_from_config,
)
from cpt_jax.runner.resume import Segments
from cpt_jax.runner.tasks import Task, build_task
from cpt_jax.runner.validation import check_rules_match
from cpt_jax.training import TrainState, create_train_state, make_eval_step, make_train_step


@dataclasses.dataclass(frozen=True)
class RunCost:
    """The run's compute cost from its schedules (exact, host side, no device sync).

    Attributes:
      per_step: relative BitOps of each step vs fp32, shape ``(total_steps,)``
        (`cost.relative_step_costs`).
      cumulative: ``cumsum(per_step) / total_steps`` (the logged running cost).
      totals: `cost.run_cost`'s dict (``relative_cost_fp32``, ``relative_cost_static8``,
        ``mean_bits``, ``mean_grad_bits``, ``total_bitops``).
    """

    per_step: np.ndarray
    cumulative: np.ndarray
    totals: dict[str, float]


def run_costs(ops, fwd_schedule, grad_schedule, total_steps: int,
              quant_config=None) -> RunCost:
    """`RunCost` of a run: ``per_step[t] = cost(bits(t), grad_bits(t)) / cost(32, 32)``.

    Both the per-step costs (`cost.relative_step_costs`) and the totals
    (`cost.run_cost`) are `cpt_jax.cost`'s.

    Args:
      ops: the op inventory (`cost.count_ops`).
      fwd_schedule: the forward schedule (None: full precision, cost 1 every step).
      grad_schedule: the backward schedule (None: fp32 errors).
      total_steps: the run's length.
      quant_config: the quantized ops' `QuantConfig`: block scales count in their
        stored bits (e.g. 8 + 8/32 per MXFP8 element); None: the plain widths.

    Returns:
      The per-step, cumulative and total costs.
    """
    per_step = cost_lib.relative_step_costs(fwd_schedule, grad_schedule, total_steps, ops,
                                            config=quant_config)
    totals = cost_lib.run_cost(fwd_schedule, grad_schedule, total_steps, ops,
                               config=quant_config)
    return RunCost(per_step=per_step, cumulative=np.cumsum(per_step) / total_steps,
                   totals=totals)


@dataclasses.dataclass(frozen=True)
class Run:
    """What `build_run` makes from the config: fixed for the whole run.

    Attributes: the `config`, the `task`, the quantized model `qmodel`, the forward and
    backward schedules, the optax `optimizer`, the op inventory `ops`, the device
    `mesh` (None: one device), the data key `data_rng`, the compiled `train_step` and
    `eval_step`, the evaluation bits `eval_bits` and the schedules' `cost`; with
    ``config.precision.controller`` its `controller` (whose base is `fwd_schedule`)
    and the `cost_table` of the bits it may use (`cpt_jax.runner.realized`).
    """

    config: Any
    task: Task
    qmodel: Any
    fwd_schedule: sched_lib.PrecisionSchedule | None
    grad_schedule: sched_lib.PrecisionSchedule | None
    optimizer: optax.GradientTransformation
    ops: Sequence[Any]
    mesh: Any
    data_rng: jax.Array
    train_step: Callable
    eval_step: Callable
    eval_bits: float
    cost: RunCost
    controller: Any = None
    cost_table: Any = None

    @property
    def total_steps(self) -> int:
        return int(self.config.num_steps)


def build_run(config) -> tuple[Run, TrainState]:
    """Build everything a run needs and its initial state (one compiled init).

    Args:
      config: the run's (validated) ConfigDict.

    Returns:
      ``(run, state)``: the `Run` and the initial `TrainState`, sharded over the mesh
      (``config.param_sharding``: "replicate" or "fsdp") when there is more than one
      device.
    """
    total_steps = int(config.num_steps)
    p = config.precision
    task = build_task(config)
    fwd_schedule = precision_schedule_from_config(p, total_steps)
    grad_schedule = grad_schedule_from_config(p, total_steps)
    quant_config = quant_config_from_config(p)
    qmodel = quantize_model(task.model, rules=rules_from_config(p), config=quant_config,
                            provider=provider_from_config(p))
    optimizer = optimizer_from_config(config.optimizer, total_steps)
    init_rng, data_rng = jax.random.split(jax.random.key(int(config.seed)))
    init_kwargs = {"train": False, **task.apply_kwargs}
    with warnings.catch_warnings():  # a pattern matching nothing: the error below
        warnings.simplefilter("ignore", UnmatchedRuleWarning)
        ops = count_ops_before_state(qmodel, task.sample_inputs, init_kwargs)
        check_rules_match(p, [op.name for op in ops])
        controller, table = _controller(p, fwd_schedule, grad_schedule, quant_config, ops,
                                        total_steps)
        # One compiled init instead of many eager ops (fast start; same values every run).
        state = jax.jit(lambda key: create_train_state(
            qmodel, optimizer, key, task.sample_inputs, controller=controller,
            **init_kwargs))(init_rng)
    mesh = parallel.mesh_from_config(config)
    if mesh is not None:
        state = parallel.shard_state(state, mesh, str(config.param_sharding))
    run = Run(config=config, task=task, qmodel=qmodel, fwd_schedule=fwd_schedule,
              grad_schedule=grad_schedule, optimizer=optimizer, ops=ops, mesh=mesh,
              data_rng=data_rng,
              train_step=_train_step(config, task, qmodel, optimizer, fwd_schedule,
                                     grad_schedule, controller),
              eval_step=make_eval_step(qmodel, loss_fn=task.loss_fn,
                                       apply_kwargs=task.apply_kwargs),
              eval_bits=eval_bits_from_config(p),
              cost=run_costs(ops, fwd_schedule, grad_schedule, total_steps,
                             quant_config=quant_config),
              controller=controller, cost_table=table)
    return run, state


def count_ops_before_state(qmodel, sample_inputs, init_kwargs) -> list:
    """The model's ops (`cpt_jax.cost.count_ops`) on the shapes of its variables
    (``jax.eval_shape`` of ``init``): nothing initialized, so a controller's builder can
    read them before the train state (which holds the controller's state) exists."""
    variables = jax.eval_shape(
        lambda key: qmodel.init({"params": key, "dropout": key}, sample_inputs, **init_kwargs),
        jax.random.key(0))
    return cost_lib.count_ops(qmodel, variables, sample_inputs, **init_kwargs)


def _controller(p, fwd_schedule, grad_schedule, quant_config, ops, total_steps: int) -> tuple:
    """``(controller, cost table)`` of ``p.controller`` (``(None, None)`` without one)."""
    spec = get_controller(p.controller)
    if spec is None or spec.build is None or fwd_schedule is None:
        return None, None
    table = cost_table(ops, quant_config)
    return controller_from_config(p, fwd_schedule, grad_schedule, quant_config, ops=ops,
                                  total_steps=total_steps, cost_table=table), table


def _train_step(config, task: Task, qmodel, optimizer, fwd_schedule, grad_schedule,
                controller=None):
    if controller is not None:
        return make_train_step(qmodel, optimizer, loss_fn=task.loss_fn,
                               nonfinite=config.nonfinite, apply_kwargs=task.apply_kwargs,
                               controller=controller)
    return make_train_step(qmodel, optimizer, fwd_schedule, grad_schedule,
                           loss_fn=task.loss_fn, nonfinite=config.nonfinite,
                           apply_kwargs=task.apply_kwargs)


def with_segments(run: Run, segments: Segments) -> Run:
    """`run` trained on segment schedules: an extended run (``--extend``).

    ``bits(t) = schedule_k(t)`` for ``start_k <= t < start_{k+1}``, ``schedule_k``
    built for ``num_steps_k`` (`schedules.switch`, absolute steps); the learning rate
    and every other schedule follow the last segment's length (``config.num_steps``),
    as built by `build_run`. Costs are those of the steps' real bits.

    Args:
      run: the `Run` built for ``config.num_steps`` (the last segment's length).
      segments: the run's `Segments`.

    Returns:
      The `Run` with the segmented forward schedule, its train step and cost.
    """
    if len(segments) <= 1 or run.fwd_schedule is None:
        return run
    p = run.config.precision
    parts: list[Any] = [precision_schedule_from_config(p, int(n)) for _, n in segments]
    starts = [int(start) for start, _ in segments[1:]]
    fwd = sched_lib.switch(parts, starts)
    grad = run.grad_schedule
    spec = get_controller(p.controller)
    if grad is not None and spec is not None and spec.schedules is not None:
        grads: list[Any] = [grad_schedule_from_config(p, int(n)) for _, n in segments]
        grad = sched_lib.switch(grads, starts)  # each segment's own rewritten errors
    controller = controller_from_config(p, fwd, grad, quant_config_from_config(p), ops=run.ops,
                                        total_steps=run.total_steps, cost_table=run.cost_table)
    return dataclasses.replace(
        run, fwd_schedule=fwd, grad_schedule=grad, controller=controller,
        train_step=_train_step(run.config, run.task, run.qmodel, run.optimizer, fwd, grad,
                               controller),
        cost=run_costs(run.ops, fwd, grad, run.total_steps,
                       quant_config=quant_config_from_config(p)))
