"""The main job as a library function: `train_and_evaluate(config, workdir)`.

Reads an `ml_collections.ConfigDict` (``experiments/configs/``, all derived from
``default.get_config()``), and runs in the Flax examples' shape, each step a short
function:

=============  ==========================================================================
build          `build_run` (`cpt_jax.runner.run`): task, quantized model, schedules,
               optimizer (each from its config subtree by `cpt_jax.runner.builders`,
               re-exported here), initial state, op inventory and per-step cost
               (`RunCost`, from `cpt_jax.cost`), compiled train/eval steps
restore        `restore_run` (`cpt_jax.runner.resume`): the newest good checkpoint
               in ``workdir/checkpoints``
loop           `train_loop` (`cpt_jax.runner.loop`): one compiled step per batch of
               `train_batches`; periodic work as `PeriodicAction`s (log, evaluate,
               checkpoint; `make_actions`, `cpt_jax.runner.records`)
summarize      `summarize` (`cpt_jax.runner.outputs`): final `evaluate`
               (`cpt_jax.runner.evaluation`, at the eval bits and fp32), costs, timing
write          `write_outputs` (`cpt_jax.runner.outputs`): ``summary.json``, the final
               record, plots
=============  ==========================================================================

Every name of those modules the job's users import is re-exported here.

Records (train, eval, final) go to `cpt_jax.runner.metric_writers` behind one interface:
``metrics.jsonl``, TensorBoard, the progress bar (or absl logging) and the in-memory
history that checkpoints carry.

Written to `workdir`:

* ``metrics.jsonl``: one JSON object per logged step (step, bits, grad_bits, loss,
  accuracy, cumulative relative cost) and per evaluation;
* ``summary.json``: final test metric (at the eval bits and in full precision),
  ``best_test_<metric>`` (best over every evaluation), ``eval_protocol`` (eval bits
  ``max`` or ``current``, activation ranges ``batch`` or ``running``: see
  `eval_bits_at`, `eval_protocol_name`), ``relative_cost_fp32`` (each step counted in
  its format with ``precision.formats``, plus ``formats`` and ``format_steps``),
  ``relative_cost_static8``, ``num_compiles``, ``steps``, ``wall_time_s`` and more
  (with ``config.precision.controller``: the bits actually used, their histogram and
  the base schedule's cost beside them, `cpt_jax.runner.realized`);
* PNG plots (bits over steps; loss and accuracy curves) and TensorBoard events
  (``workdir/tensorboard``);
* ``checkpoints/<step>/``: every ``config.checkpoint_every`` steps (0: no periodic
  ones), always at the last step (export, evaluation and ``--extend`` read it), and on
  SIGTERM/SIGINT; the newest ``config.keep_checkpoints`` are kept.

Preemption and resumption (see ``docs/reliability.md``): the first SIGTERM or SIGINT
(Ctrl-C) finishes the current step, saves a checkpoint, then evaluates and writes what
was measured (``"interrupted": true``). A `workdir` that holds a checkpoint resumes
from its newest good one (a torn or corrupt one is skipped with a warning): the
parameters at the end are bit-identical to an uninterrupted run's, because the state
(step = schedule position, parameters, optimizer state, PRNG key) is restored exactly
and the data order is a pure function of ``(config.seed, step)``. ``metrics.jsonl`` is
rewritten from the checkpoint's history, so no line is duplicated. ``extend=True``
(``--extend``) continues a finished or interrupted run to a new ``config.num_steps``
with every schedule rebuilt for the new length (`with_segments`).

Non-finite steps follow ``config.nonfinite``: ``skip`` (count them in
``skipped_steps``), ``ignore``, or ``stop`` (raise `NonFiniteError` naming the step,
the bits and the layers, after writing ``summary.json``).
"""
from __future__ import annotations

import os
import time
from typing import Any

from absl import logging

from cpt_jax.runner import metric_writers as writers_lib
from cpt_jax.runner import validation
from cpt_jax.runner.builders import (  # noqa: F401 - re-exported: runner.job.<builder>
    controller_from_config,
    eval_bits_from_config,
    eval_protocol_name,
    grad_schedule_from_config,
    optimizer_from_config,
    precision_schedule_from_config,
    provider_from_config,
    quant_config_from_config,
    rules_from_config,
)
from cpt_jax.runner.evaluation import (  # noqa: F401 - re-exported
    LOWER_IS_BETTER,
    best_metrics,
    eval_bits_at,
    evaluate,
    metric_of,
)
from cpt_jax.runner.loop import (  # noqa: F401 - re-exported
    LoopResult,
    NonFiniteError,
    StopRequest,
    nonfinite_event,
    nonfinite_message,
    train_batches,
    train_loop,
    train_steps,
)
from cpt_jax.runner.outputs import (  # noqa: F401 - re-exported
    SUMMARY_FILE,
    finished_message,
    finished_summary,
    params_sha256,
    plot_run,
    precision_series,
    run_cost_summary,
    summarize,
    write_outputs,
    write_plots,
)
from cpt_jax.runner.periodic_actions import PeriodicAction, run_actions  # noqa: F401
from cpt_jax.runner.records import (  # noqa: F401 - re-exported
    METRICS_FILE,
    eval_record,
    make_actions,
    make_writers,
    train_record,
    writes_files,
)
from cpt_jax.runner.resume import (  # noqa: F401 - re-exported
    CHECKPOINT_SUBDIR,
    Checkpointer,
    Segments,
    refuse_other_runs,
    restore_run,
    resume_segments,
)
from cpt_jax.runner.run import Run, RunCost, build_run, run_costs, with_segments  # noqa: F401
from cpt_jax.runner.tasks import Task, build_task  # noqa: F401 - re-exported
from cpt_jax.training import TrainState


def validate_config(config) -> None:
    """Check every field the runner reads (see `cpt_jax.runner.validation.validate_config`)."""
    validation.validate_config(config)


def train_and_evaluate(config, workdir: str, *, progress: bool = True,
                       extend: bool = False) -> dict[str, Any]:
    """Train per `config`, write metrics, plots and ``summary.json`` to `workdir`.

    build -> restore -> loop -> summarize -> write (see the module docstring). A
    `workdir` holding a checkpoint (``workdir/checkpoints``) resumes from its newest
    good one; the final state is always checkpointed. A run that already finished
    its ``config.num_steps`` trains nothing: its ``summary.json`` is returned as it
    is, with a warning naming ``--extend`` (`finished_summary`).

    Args:
      config: the run's ConfigDict (``experiments/configs/default.py`` and derived).
      workdir: output directory (created if needed, once the config, the workdir and
        the data are checked: a bad input leaves nothing behind).
      progress: show a progress bar (else log each record with absl).
      extend: a checkpoint of the same run with another ``num_steps`` is continued
        from its step to ``config.num_steps``, every schedule rebuilt for the new
        length (`with_segments`); without it such a checkpoint is refused.

    Returns:
      The summary dict (as written to ``summary.json``).

    Raises:
      ValueError: a bad config or workdir (before anything is built or created), or
        data that cannot be read (before the workdir is created).
      OSError: a file of the run cannot be written (a checkpoint on a full disk: one
        line naming the folder, `Checkpointer.save`).
      NonFiniteError: with ``config.nonfinite="stop"`` (after writing the summary).
    """
    validate_config(config)
    validation.check_workdir(workdir)
    t_start = time.time()
    refuse_other_runs(workdir, config, extend)
    finished = finished_summary(workdir, int(config.num_steps))
    if finished is not None:   # its record stays as it is (no zero-step rerun over it)
        logging.warning("%s", finished_message(workdir, finished))
        return finished
    run, state = build_run(config)   # the data is read here: nothing created before
    os.makedirs(workdir, exist_ok=True)
    checkpoints = Checkpointer(workdir, int(config.keep_checkpoints), config,
                               run.task.input_pipeline, extend=extend)
    state, records, resumed_from = restore_run(checkpoints, state)
    run = with_segments(run, checkpoints.segments)
    writer, memory = make_writers(config, workdir, records, start_step=int(state.step),
                                  progress=progress)
    actions = make_actions(run, writer, memory, checkpoints)

    def save(step: int, state: TrainState) -> None:
        writer.flush()
        checkpoints.save(step, state, memory.records)

    loop = train_loop(run, state, actions, save, lambda: checkpoints.last_saved)
    checkpoints.close()
    progress_bar = writers_lib.find_writer(writer, writers_lib.ProgressBarWriter)
    if progress_bar is not None:
        progress_bar.close()
    summary = summarize(run, loop, resumed_from=resumed_from, start_time=t_start,
                        segments=checkpoints.segments)
    summary.update(best_metrics(run.task, memory.records, summary))
    write_outputs(workdir, run, summary, writer, memory.records)
    if loop.stop_event is not None:
        raise NonFiniteError(nonfinite_message(loop.stop_event), event=loop.stop_event,
                             summary=summary)
    return summary
