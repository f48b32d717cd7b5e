"""Plots of schedules (matplotlib, imported when a plot is drawn)."""
from __future__ import annotations

from collections.abc import Mapping

import jax
import numpy as np

from cpt_jax.schedules._combinators import schedule_values
from cpt_jax.schedules._schedules import PrecisionSchedule, check_int

Array = jax.Array


def plot_schedules(schedules: PrecisionSchedule | Mapping[str, PrecisionSchedule],
                   total_steps: int, path: str | None = None, *, title: str = "",
                   grid: bool = False):
    """Plot one schedule or a dict of named schedules (bits vs step); save a PNG to `path`.

    `grid=True` draws each named schedule in its own panel (the suite's shapes).
    Returns the matplotlib figure. Needs matplotlib, which the library alone does not
    install (the ``experiments`` extra does).
    """
    try:
        import matplotlib
    except ImportError as exc:   # the core install has no plotting
        raise ImportError("plot_schedules draws with matplotlib: pip install matplotlib, or "
                          "the main job's extra: pip install 'cpt_jax[experiments]'") from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    named = schedules if isinstance(schedules, Mapping) else {"bits": schedules}
    steps = np.arange(check_int("total_steps", total_steps, 1))
    if grid and len(named) > 1:
        cols = min(5, len(named))
        rows = -(-len(named) // cols)
        fig, axes = plt.subplots(rows, cols, figsize=(3.2 * cols, 2.4 * rows),
                                 sharex=True, sharey=True, squeeze=False)
        for ax, (name, sched) in zip(axes.flat, named.items()):
            ax.step(steps, schedule_values(sched, total_steps), where="post", lw=1)
            ax.set_title(name, fontsize=9)
        for ax in list(axes.flat)[len(named):]:
            ax.axis("off")
        fig.supxlabel("step")
        fig.supylabel("bits")
    else:
        fig, ax = plt.subplots(figsize=(7, 3))
        for name, sched in named.items():
            ax.step(steps, schedule_values(sched, total_steps), where="post", lw=1, label=name)
        ax.set_xlabel("step")
        ax.set_ylabel("bits")
        if len(named) > 1:
            ax.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    if path:
        fig.savefig(path, dpi=120)
    plt.close(fig)
    return fig
