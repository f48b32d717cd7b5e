"""`Task`: what a run trains on, bundled for the runner (data, model, batches, loss, eval).

A `Task` hides the domain (images, graphs, text) from the training loop:

* ``model``: the float Linen model (the runner quantizes it with `quantize_model`);
* ``sample_inputs``: inputs for `init` and cost tracing;
* ``train_batch(step, key) -> batch``: a jittable pure function of the step, so the
  data order is reproducible and resumable;
* ``eval_batches(split) -> iterator of batches`` with ``"mask"`` for exact sums;
* ``loss_fn`` and the ``metric`` reported (``"accuracy"`` or ``"perplexity"``);
* ``input_pipeline``: None, or (``config.input_pipeline="grain"``) a
  `cpt_jax.data.pipeline.GrainInput` that streams the training batches instead of
  ``train_batch`` (the runner saves its state in checkpoints).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import flax.linen as nn
import jax

from cpt_jax.training import LossFn, classification_loss

if TYPE_CHECKING:
    from cpt_jax.data import pipeline as grain_pipeline

Batch = dict[str, Any]


@dataclasses.dataclass
class Task:
    """Everything the runner needs about a problem (see the module docstring)."""

    name: str
    model: nn.Module
    sample_inputs: Any
    train_batch: Callable[[Any, jax.Array], Batch]
    eval_batches: Callable[[str], Iterator[Batch]]
    num_train_examples: int
    steps_per_epoch: int
    loss_fn: LossFn = classification_loss
    metric: str = "accuracy"
    eval_splits: Sequence[str] = ("test",)
    apply_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    info: dict[str, Any] = dataclasses.field(default_factory=dict)
    input_pipeline: grain_pipeline.GrainInput | None = None


TaskBuilder = Callable[[Any], Task]
"""``builder(config) -> Task``."""


__all__ = ["Batch", "Task", "TaskBuilder"]
