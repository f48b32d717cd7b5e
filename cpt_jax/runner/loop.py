"""The train loop: one compiled step per batch, stop requests and non-finite steps.

`train_loop` steps from the restored state to ``config.num_steps`` over
`train_batches`, running the periodic actions after each step. The first
SIGTERM/SIGINT (`StopRequest`) finishes the step, saves a checkpoint and ends the
loop; with ``config.nonfinite="stop"`` a non-finite step ends it with a
`nonfinite_event` (raised by the job as `NonFiniteError` once the summary is written).
"""
from __future__ import annotations

import dataclasses
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
from absl import logging

from cpt_jax.distributed import mesh as parallel
from cpt_jax.runner.periodic_actions import PeriodicAction, run_actions
from cpt_jax.runner.run import Run
from cpt_jax.training import TrainState, nonfinite_layers


def train_batches(run: Run, start_step: int) -> Iterator[Any]:
    """The training batches from step `start_step` on, placed on the run's mesh.

    The seam for input pipelines: today ``task.train_batch(step, data_rng)``, a pure
    function of ``(config.seed, step)``, so a resumed run sees the same data order.

    Args:
      run: the `Run`.
      start_step: the 0-based step of the first batch (the restored ``state.step``).

    Returns:
      An iterator of batches (dicts of arrays), one per step.
    """
    if run.task.input_pipeline is not None:
        # Streamed (config.input_pipeline="grain"): each process reads its own rows; the
        # iterator's state comes from the checkpoint (`restore_run`), not from the step.
        yield from run.task.input_pipeline.batches(run.mesh)
        return
    step = start_step
    while True:
        batch = run.task.train_batch(jnp.asarray(step, jnp.int32), run.data_rng)
        if run.mesh is not None:
            batch = parallel.shard_batch(batch, run.mesh)
        yield batch
        step += 1


class NonFiniteError(FloatingPointError):
    """Training stopped (``config.nonfinite="stop"``) at a non-finite loss or gradient.

    Attributes: `step` (1-based, as in ``metrics.jsonl``), `bits`, `grad_bits`, `loss`,
    `layers` (parameter paths with a non-finite gradient, the layer nearest the output
    first: where the overflow entered backprop), `summary` (what was written to
    ``summary.json``).
    """

    def __init__(self, message: str, *, event: dict[str, Any], summary: dict[str, Any]):
        super().__init__(message)
        self.event = event
        self.summary = summary
        self.step = event["step"]
        self.bits = event.get("bits")
        self.grad_bits = event.get("grad_bits")
        self.loss = event.get("loss")
        self.layers = list(event.get("layers", []))


class StopRequest:
    """SIGINT/SIGTERM handler: the first signal asks the loop to checkpoint and finish;
    a second SIGINT raises KeyboardInterrupt (stop now, no checkpoint).

    ``signum`` is the first signal received (None: none yet). Use as a context manager
    (handlers are installed in the main thread only and restored on exit).
    """

    def __init__(self):
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                try:
                    self._previous[sig] = signal.signal(sig, self._handle)
                except (ValueError, OSError):  # pragma: no cover - exotic platforms
                    pass
        return self

    def _handle(self, signum, frame) -> None:
        if self.signum is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.signum = signum
        logging.warning("Received %s: saving a checkpoint, then finishing with what was "
                        "measured (send SIGINT again to stop at once).",
                        signal.Signals(signum).name)

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def nonfinite_event(step: int, metrics, params, ops) -> dict[str, Any]:
    """What a ``nonfinite="stop"`` step reports: step, loss, bits and the parameter paths
    with a non-finite gradient, ordered nearest the output first (backprop order)."""
    m = jax.device_get(metrics)
    layers = nonfinite_layers(params, m["grads_finite"])
    order = {op.name: i for i, op in enumerate(ops)}

    def rank(path: str) -> int:
        parts = path.split("/")
        for n in range(len(parts) - 1, 0, -1):
            if "/".join(parts[:n]) in order:
                return order["/".join(parts[:n])]
        return -1

    event = {"step": step, "loss": float(m["loss"]),
             "layers": sorted(layers, key=lambda path: -rank(path))}
    for k in ("bits", "grad_bits"):
        if k in m:
            event[k] = float(m[k])
    return event


def nonfinite_message(event: dict[str, Any]) -> str:
    """One line naming the step, the bits, the loss and the first non-finite layer."""
    where = ", ".join(f"{k}={event[k]:g}" for k in ("bits", "grad_bits") if k in event)
    layers = event["layers"]
    if layers:
        more = f" (and {len(layers) - 1} more: {', '.join(layers[1:4])}" \
               f"{', ...' if len(layers) > 4 else ''})" if len(layers) > 1 else ""
        what = f"non-finite gradient in layer {layers[0]}{more}"
    else:
        what = "non-finite loss"
    return (f"training stopped at step {event['step']} ({where or 'full precision'}, "
            f"loss={event['loss']}): {what} [config.nonfinite='stop']")


@dataclasses.dataclass
class LoopResult:
    """How the loop ended: the last `state`, whether it was `interrupted` (signal or
    Ctrl-C), the `stop_event` of a ``nonfinite="stop"`` step (or None) and the
    training wall time `train_time_s`."""

    state: TrainState
    interrupted: bool = False
    stop_event: dict[str, Any] | None = None
    train_time_s: float = 0.0


def train_steps(run: Run, result: LoopResult, actions: list[PeriodicAction],
                stop: StopRequest) -> None:
    """Step until the end, a stop request or a non-finite stop (``result`` is updated
    after every step, so an interrupt keeps the last completed state)."""
    step = int(result.state.step)
    batches = train_batches(run, step)
    while step < run.total_steps and stop.signum is None:
        result.state, metrics = run.train_step(result.state, next(batches))
        step += 1
        if run.config.nonfinite == "stop" and not bool(metrics["finite"]):
            result.stop_event = nonfinite_event(step, metrics, result.state.params, run.ops)
            logging.error(nonfinite_message(result.stop_event))
            return
        run_actions(actions, step, result.state, metrics)


def train_loop(run: Run, state: TrainState, actions: list[PeriodicAction],
               save: Callable[[int, TrainState], None], last_saved: Callable[[], int]
               ) -> LoopResult:
    """Train from `state` to ``config.num_steps``, running `actions` after each step.

    The final state is always saved (unless the step was just saved, or a
    ``nonfinite="stop"`` ended the run). The first SIGTERM/SIGINT finishes the step,
    then `save` s a checkpoint (unless the step was just saved) and ends the loop; a
    second SIGINT ends it at once.

    Returns:
      The `LoopResult`.
    """
    result = LoopResult(state=state)
    t_train = time.time()
    with StopRequest() as stop:
        try:
            train_steps(run, result, actions, stop)
            step = int(result.state.step)
            if (result.stop_event is None and step == run.total_steps
                    and step > last_saved()):
                save(step, result.state)  # the final state, whatever checkpoint_every says
            if stop.signum is not None:
                result.interrupted = True
                step = int(result.state.step)
                if step > last_saved():
                    save(step, result.state)
                logging.warning("Stopped by %s at step %d; rerun with the same --workdir to "
                                "resume.", signal.Signals(stop.signum).name, step)
        except KeyboardInterrupt:
            result.interrupted = True
            logging.warning("Interrupted at step %d: evaluating and writing what was measured "
                            "(no checkpoint).", int(result.state.step))
    result.train_time_s = time.time() - t_train
    return result
