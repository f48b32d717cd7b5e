"""What a controlled run realized: the bits of every step, their cost and histogram.

With ``config.precision.controller`` set (`cpt_jax.controllers`), the bits of a step
are known only once it ran. The main job then reports what was used:

* ``metrics.jsonl``: each ``train`` record's ``bits`` / ``grad_bits`` are those of its
  step, ``bits_per_step`` / ``grad_bits_per_step`` list every step since the previous
  record (`BitsLog`: kept on device, fetched at the log, so no step waits for the
  host; after a resume the first list starts at the checkpoint's step), and
  ``cumulative_relative_cost`` counts the bits used so far; ``grad_norm`` (and
  ``quant_effect`` / ``quant_error`` when measured) are the logged step's statistics;
* ``summary.json`` (`summary_fields`): ``relative_cost_fp32`` / ``_static8``,
  ``mean_bits`` and ``mean_grad_bits`` of the bits used (from the step counts the
  state carries, so a resumed run counts exactly), the base schedule's beside them
  (``base_*``), ``realized_bits_histogram`` (steps per forward and per error bits),
  ``measured_steps`` (fp32 forward passes that measured ``quant_effect``, counted in
  the cost),
  and with ``precision.formats`` the steps each format computed;
* ``bits.png`` (`plot_bits`): the realized bits beside the base schedule.
"""
from __future__ import annotations

import os
from typing import Any

import jax
import numpy as np

from cpt_jax import controllers as ctl
from cpt_jax import schedules as sched_lib


class BitsLog:
    """The (device) bits of every step since the last `drain`: an action run after
    each step (``collect(step, state, metrics)``) that never syncs with the device."""

    def __init__(self):
        self._bits: list = []

    def collect(self, step: int, state: Any, metrics) -> None:
        del step, state
        self._bits.append((metrics["bits"], metrics.get("grad_bits")))

    def drain(self) -> dict[str, list[float]]:
        """``{"bits_per_step": [...], "grad_bits_per_step": [...]}`` (errors only when
        quantized) of the steps collected, then forget them.

        Example:
          >>> log = BitsLog()
          >>> log.collect(1, None, {"bits": 4.0}); log.collect(2, None, {"bits": 6.0})
          >>> log.drain(), log.drain()
          ({'bits_per_step': [4.0, 6.0]}, {'bits_per_step': []})
        """
        fetched = jax.device_get(self._bits)
        self._bits = []
        out = {"bits_per_step": [float(b) for b, _ in fetched]}
        if fetched and all(g is not None for _, g in fetched):
            out["grad_bits_per_step"] = [float(g) for _, g in fetched]
        return out


def counts_of(state) -> np.ndarray:
    """The ``(33, 33)`` step counts per (forward, error) bits a controlled state carries."""
    return np.asarray(jax.device_get(state.controller.counts), np.int64)


def train_fields(state, log: BitsLog, table: np.ndarray, total_steps: int,
                 ops=None, measure_every: int = 0, products: bool = False) -> dict[str, Any]:
    """The fields a controlled run adds to (or overrides in) a ``train`` record:
    ``cumulative_relative_cost`` of the bits used, ``sum_{s<=t} cost_s / T`` (as the
    scheduled runs log it, with the fp32 forward passes that measured ``quant_effect``
    and, with `products`, the fp32 products of ``quant_error``),
    the step's ``grad_norm`` (and ``quant_effect`` / ``quant_error`` when measured)
    and the per-step bits of `log`."""
    counts = counts_of(state)
    steps = int(counts.sum())
    used = ctl.realized_cost(counts, ops, table=table,
                             measured=ctl.measured_steps(measure_every, steps),
                             measured_products=steps if products else 0)
    fields: dict[str, Any] = {
        "cumulative_relative_cost": used["relative_cost_fp32"] * steps / total_steps}
    stats = jax.device_get(state.controller.stats)
    fields["grad_norm"] = float(stats.grad_norm)
    for key in ("quant_effect", "quant_error"):  # when measured
        if np.isfinite(getattr(stats, key)):
            fields[key] = float(getattr(stats, key))
    fields.update(log.drain())
    return fields


def summary_fields(state, base_costs: dict[str, float], table: np.ndarray, ops=None,
                   quant_config=None, name: str = "", measure_every: int = 0,
                   products: bool = False) -> dict[str, Any]:
    """What ``summary.json`` reports of a controlled run (see the module docstring).

    Args:
      state: the final `TrainState` (its ``controller.counts``).
      base_costs: the base schedule's ``relative_cost_*`` / ``mean_*`` of the same steps.
      table: `cpt_jax.controllers.cost_table` of the run's ops and recipe.
      ops: the op inventory.
      quant_config: the run's recipe (a `FormatSwitch`: steps per format).
      name: ``config.precision.controller``.
      measure_every: the controller's ``quant_effect`` period (its fp32 forward
        passes count in the cost; ``measured_steps`` says how many).
      products: every step measured ``quant_error`` (its fp32 products count too).
    """
    counts = counts_of(state)
    steps = int(counts.sum())
    measured = ctl.measured_steps(measure_every, steps)
    out: dict[str, Any] = {"controller": name, "measured_steps": measured}
    out.update({f"base_{k}": float(v) for k, v in base_costs.items()})
    out.update(ctl.realized_cost(counts, ops, table=table, measured=measured,
                                 measured_products=steps if products else 0))
    out["realized_bits_histogram"] = ctl.bits_histogram(counts)
    widths = getattr(quant_config, "widths", None)
    if widths is not None:
        forward = counts.sum(axis=1)
        out["format_steps"] = {n: int(forward[int(round(w))])
                               for n, w in zip(quant_config.names, widths)}
    return out


def realized_steps(records: list[dict[str, Any]]) -> tuple[list[int], list[float]]:
    """``(steps, bits)`` of every step listed in the records' ``bits_per_step`` (the
    record at step ``s`` with ``n`` values covers steps ``s - n + 1 .. s``; 1-based)."""
    steps, bits = [], []
    for r in records:
        values = r.get("bits_per_step") or []
        first = int(r["step"]) - len(values) + 1
        steps += list(range(first, first + len(values)))
        bits += [float(b) for b in values]
    return steps, bits


def plot_bits(path: str, base, total_steps: int, records: list[dict[str, Any]],
              title: str = "") -> None:
    """``bits.png``: the base schedule and the realized forward bits of every step."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3))
    ax.step(np.arange(1, total_steps + 1), sched_lib.schedule_values(base, total_steps),
            where="post", lw=3, alpha=0.4, label="base schedule", color="0.4")
    steps, bits = realized_steps([r for r in records if "step" in r])
    if steps:
        ax.step(steps, bits, where="post", lw=1, label="realized (controller)")
    ax.set_xlabel("step")
    ax.set_ylabel("forward bits")
    ax.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


__all__ = ["BitsLog", "counts_of", "plot_bits", "realized_steps", "summary_fields",
           "train_fields"]
