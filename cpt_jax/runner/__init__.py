"""The main job: `train_and_evaluate(config, workdir)`, behind ``python -m experiments.train``.

Not imported by ``import cpt_jax`` (it brings absl logging, orbax and matplotlib):
``import cpt_jax.runner``. The Flax examples' shape, one module per idea:

======================  =====================================================
module                  what
======================  =====================================================
``job``                 `train_and_evaluate`: build -> restore -> loop ->
                        summarize -> write (re-exports the steps' names)
``run``                 `build_run`: the `Run` and its cost (`RunCost`)
``loop``                `train_loop`: steps, stop requests, non-finite stops
``evaluation``          `evaluate` at the eval protocol's bits, best metrics
``records``             train/eval records, the run's writers and actions
``outputs``             `summarize`, ``summary.json``, plots
``builders``            schedules, quantizer, rules, optimizer from the config
``validation``          the config checked before anything is built
``tasks``               the one registry: ``config.dataset`` -> `Task`
                        (``image_tasks``, ``domain_tasks``; ``task``: `Task`)
``resume``              exact resume, refusal of foreign checkpoints (the
                        run's `Checkpointer`, `restore_run`)
``checkpoint_manager``  the storage: orbax save/restore, verified
``checkpoint_files``    saveable trees, the sha256 manifest, the structure
``orbax_logs``          orbax's chatter dropped, its errors held, their OSError
``checkpoint``          re-exports the four above
``periodic_actions``    work every N steps (log, evaluate, checkpoint)
``metric_writers``      one interface to metrics.jsonl, TensorBoard, progress
``realized``            a controlled run's bits as used: records, cost, plot
======================  =====================================================
"""
from cpt_jax.runner.job import (
    NonFiniteError,
    Run,
    build_run,
    evaluate,
    params_sha256,
    restore_run,
    train_and_evaluate,
    train_batches,
    train_loop,
)
from cpt_jax.runner.task import Task
from cpt_jax.runner.tasks import available_datasets, build_task, register_task

__all__ = (
    "NonFiniteError",
    "Run",
    "Task",
    "available_datasets",
    "build_run",
    "build_task",
    "evaluate",
    "params_sha256",
    "register_task",
    "restore_run",
    "train_and_evaluate",
    "train_batches",
    "train_loop",
)
