"""Periodic actions: the training loop's "every N steps" work as small objects.

A `PeriodicAction` calls ``callback(step, state, metrics)`` after the steps where it
is due (1-based step numbers, as in ``metrics.jsonl``):

    due(step) = every > 0 and (step % every == 0 or (at_last and step == total))
                and not (skip_last and step == total)

``every = 0`` never fires. The runner builds three (see `cpt_jax.runner`): log
(``config.log_every``, and the last step), evaluate (``config.eval_every``, not the
last step: the final evaluation follows the loop) and checkpoint
(``config.checkpoint_every``, and the last step).

Example:
  >>> seen = []
  >>> log = PeriodicAction(4, lambda step, state, metrics: seen.append(step), total_steps=10,
  ...                      at_last=True)
  >>> for step in range(1, 11):
  ...     log(step, None, None)
  >>> seen
  [4, 8, 10]
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

ActionCallback = Callable[[int, Any, Any], None]
"""``callback(step, state, metrics)``: `step` is 1-based (steps done), `state` the
`TrainState` after it, `metrics` the step's (device) metrics dict."""


@dataclasses.dataclass(frozen=True)
class PeriodicAction:
    """Run `callback` every `every` steps (0: never).

    Attributes:
      every: the period in steps (0 disables the action).
      callback: ``callback(step, state, metrics)``.
      total_steps: the run's length (for `at_last` / `skip_last`).
      at_last: also fire on the last step.
      skip_last: never fire on the last step (e.g. the final evaluation follows).
    """

    every: int
    callback: ActionCallback
    total_steps: int
    at_last: bool = False
    skip_last: bool = False

    def __post_init__(self):
        if self.every < 0:
            raise ValueError(f"PeriodicAction(every={self.every}) must be >= 0")

    def due(self, step: int) -> bool:
        """Whether the action fires after step `step` (the formula in the module docstring).

        Example:
          >>> PeriodicAction(5, print, total_steps=12, skip_last=True).due(10)
          True
        """
        if self.every <= 0:
            return False
        last = step == self.total_steps
        if self.skip_last and last:
            return False
        return step % self.every == 0 or (self.at_last and last)

    def __call__(self, step: int, state: Any, metrics: Any) -> None:
        if self.due(step):
            self.callback(step, state, metrics)


def run_actions(actions: Sequence[PeriodicAction], step: int, state: Any, metrics: Any) -> None:
    """Call each of `actions` (in order) after step `step`."""
    for action in actions:
        action(step, state, metrics)
