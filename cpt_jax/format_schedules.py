"""Schedules over formats: the precision schedule picks the number format of each step.

Given recipes ordered narrow to wide (``("nvfp4_gemm", "mxfp6", "mxfp8_gemm")``:
element widths 4, 6, 8) and a precision schedule ``b(t)``, step ``t`` computes
every quantized product with

    f(t) = the widest recipe whose element width w_f <= b(t)
           (the narrowest when b(t) is below all of them)

through ``lax.switch`` on the traced index (`cpt_jax.quant_config.format_index`),
so every recipe is a branch of the one compiled train step: a CPT cosine from 4 to 8
bits moves NVFP4 -> MXFP6 -> MXFP8 inside each cycle and never recompiles. The cost
of a step counts its recipe's stored bits with the block scales
(`cpt_jax.quant_config.operand_bits`: NVFP4 4.5 for activations, MXFP6 6.25, MXFP8
8.25), so ``cost.run_cost(..., config=switch)`` and the main job's summary count
each step in its own format.

Library users::

    fs = cpt_jax.format_schedule(("nvfp4_gemm", "mxfp6", "mxfp8_gemm"),
                                 cpt_jax.cpt(4, 8, num_cycles=8, total_steps=T))
    qmodel = cpt_jax.quantize_model(model, config=fs.config)
    step = cpt_jax.training.make_train_step(qmodel, optimizer, fs, cpt_jax.constant(8))
    fs.format_steps(T)      # {"nvfp4_gemm": ..., "mxfp6": ..., "mxfp8_gemm": ...}

The main job: ``--config.precision.formats=nvfp4_gemm,mxfp6,mxfp8_gemm`` with the
usual ``precision.schedule`` / ``min_bits`` / ``max_bits``.

A recipe's element width is the widest of its weight and activation elements and
must not depend on the traced width (the papers' integer formats and ``mx_int`` /
``mx_float`` do: they are schedules over widths already). Recipes that keep state
or need their own product (int8, running ranges, delayed scaling) cannot be
switched per step. A per-layer bit offset shifts the width a layer's switch reads
(its index and its cost alike).

The products are computed by `cpt_jax.providers.format_switch.FORMAT_SWITCH`.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from cpt_jax import cost as cost_lib
from cpt_jax.formats import element_width
from cpt_jax.quant_config import (
    PRESETS,
    FormatSwitch,
    QuantConfig,
    check_switch_branch,
    format_index,
    get_preset,
)
from cpt_jax.schedules import PrecisionSchedule, schedule_values

Array = jax.Array
FormatSpec = str | tuple[str, QuantConfig]
FORMATS_FIELD = "config.precision.formats"


def preset_width(config: QuantConfig, label: str = "format") -> float:
    """The element width of a recipe: the widest of its weight and activation elements.

    Raises ValueError when the width depends on the traced bits (``cpt``, ``mx_int``...).

    Example:
      >>> [preset_width(get_preset(n)) for n in ("nvfp4_gemm", "mxfp6", "mxfp8_gemm")]
      [4.0, 6.0, 8.0]
    """
    tensors = [tq for tq in (config.weight, config.activation) if tq is not None]
    if not tensors:
        raise ValueError(f"{label} quantizes neither weights nor activations")
    at = [max(float(element_width(tq.fmt, b)) for tq in tensors) for b in (4.0, 16.0)]
    if at[0] != at[1]:
        raise ValueError(f"{label} has no fixed element width (it follows the traced "
                         f"bits: {at[0]:g} at 4, {at[1]:g} at 16); use a hardware-format preset")
    return at[0]


def parse_formats(text: str) -> tuple[str, ...]:
    """``"a,b,c"`` -> ``("a", "b", "c")`` (blanks dropped; ``""`` -> ``()``).

    Example:
      >>> parse_formats(" nvfp4_gemm, mxfp6 ,mxfp8_gemm")
      ('nvfp4_gemm', 'mxfp6', 'mxfp8_gemm')
    """
    return tuple(part.strip() for part in str(text).split(",") if part.strip())


def _named_configs(formats: Sequence[FormatSpec], field: str) -> tuple[tuple, tuple]:
    """``(names, configs)`` of preset names or ``(name, QuantConfig)`` pairs."""
    names, configs = [], []
    for i, item in enumerate(formats):
        if isinstance(item, str):
            if item not in PRESETS:
                raise ValueError(f"{field}[{i}]={item!r} is not a preset; choose from "
                                 f"{sorted(PRESETS)}")
            names.append(item)
            configs.append(get_preset(item))
        elif (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)
              and isinstance(item[1], QuantConfig)):
            names.append(item[0])
            configs.append(item[1])
        else:
            raise ValueError(f"{field}[{i}]={item!r} must be a preset name or a "
                             f"(name, QuantConfig) pair")
    return tuple(names), tuple(configs)


HISTORY_PRESETS = ("fp8_delayed",)
"""Presets whose history lives in a provider (`cpt_jax.providers.DelayedFP8Provider`),
not in their `QuantConfig`: never a format of a `FormatSwitch`."""


def format_switch(formats: Sequence[FormatSpec], field: str = "formats") -> FormatSwitch:
    """The `FormatSwitch` config of recipes ordered narrow to wide (validated).

    Args:
      formats: preset names (`PRESETS`) or ``(name, QuantConfig)`` pairs, at least
        one, element widths strictly increasing.
      field: how errors name the argument.

    Returns:
      A `FormatSwitch`: pass it as the `config` of `cpt_jax.quantize_model`.

    Example:
      >>> format_switch(["nvfp4_gemm", "mxfp6", "mxfp8_gemm"]).widths
      (4.0, 6.0, 8.0)
    """
    if isinstance(formats, str) or not formats:
        raise ValueError(f"{field} must be a non-empty sequence of presets, got {formats!r}")
    names, configs = _named_configs(formats, field)
    labels = [f"{field}[{i}]={name!r}" for i, name in enumerate(names)]
    for label, name, config in zip(labels, names, configs):
        if name in HISTORY_PRESETS and isinstance(formats[names.index(name)], str):
            raise ValueError(f"{label} scales its activations from an amax history (a "
                             f"provider, DelayedFP8Provider): it cannot be one of several "
                             f"formats switched per step (fp8_tensor has its grids, current "
                             f"scaling)")
        check_switch_branch(label, config)
    widths = tuple(preset_width(c, label) for label, c in zip(labels, configs))
    if any(b <= a for a, b in zip(widths, widths[1:])):
        raise ValueError(f"{field} must be ordered narrow to wide with distinct element widths, "
                         f"got {dict(zip(names, widths))}")
    widest = configs[-1]
    return FormatSwitch(weight=widest.weight, activation=widest.activation, error=widest.error,
                        names=names, branches=configs, widths=widths)


def check_formats(text: str, field: str = FORMATS_FIELD, activation_range: str = "batch") -> None:
    """Raise ValueError (naming `field`) unless `text` ("a,b,c") is a valid format
    schedule, or empty (no format schedule).

    Example:
      >>> check_formats("mxfp8,mxfp4")  # doctest: +ELLIPSIS
      Traceback (most recent call last):
      ValueError: config.precision.formats must be ordered narrow to wide ... {'mxfp8': 8.0, 'mxfp4': 4.0}
    """
    if not isinstance(text, str):
        raise ValueError(f"{field}={text!r} must be a string of comma-separated presets")
    names = parse_formats(text)
    if names and activation_range != "batch":
        raise ValueError(f"{field} needs config.precision.activation_range='batch', got "
                         f"{activation_range!r}")
    if names:
        format_switch(names, field)


def format_steps(config: FormatSwitch, schedule: PrecisionSchedule,
                 total_steps: int) -> dict[str, int]:
    """How many of the first `total_steps` steps each format computes.

    Example:
      >>> sw = format_switch(["nvfp4_gemm", "mxfp6", "mxfp8_gemm"])
      >>> format_steps(sw, cpt_jax.cyclic("linear_growth", min_bits=4, max_bits=8,
      ...                                 num_cycles=1, total_steps=10), 10)
      {'nvfp4_gemm': 4, 'mxfp6': 5, 'mxfp8_gemm': 1}
    """
    bits = schedule_values(schedule, total_steps)
    index = np.asarray(jax.vmap(lambda b: format_index(config.widths, b))(jnp.asarray(bits)))
    return {name: int(np.sum(index == i)) for i, name in enumerate(config.names)}


def format_summary(config, schedule: PrecisionSchedule | None, steps: int) -> dict:
    """``{"formats": names, "format_steps": {name: steps}}`` of a run's first `steps`
    steps under a `FormatSwitch` config (``{}`` for any other config or no schedule):
    what the main job adds to ``summary.json``.

    Example:
      >>> format_summary(get_preset("mxfp8"), cpt_jax.constant(8), 10)
      {}
    """
    if not isinstance(config, FormatSwitch) or schedule is None:
        return {}
    counts = (format_steps(config, schedule, steps) if steps > 0
              else {name: 0 for name in config.names})
    return {"formats": list(config.names), "format_steps": counts}


@dataclasses.dataclass(frozen=True)
class FormatSchedule:
    """A precision schedule whose value picks a format (`format_schedule`).

    Calling it gives the bits of a step (a `PrecisionSchedule`: pass it to
    `cpt_jax.training.make_train_step`); `config` goes to `cpt_jax.quantize_model`.
    """

    config: FormatSwitch
    schedule: PrecisionSchedule

    def __call__(self, step):
        return self.schedule(step)

    def index(self, step) -> Array:
        """The format index of `step` (traceable)."""
        return format_index(self.config.widths, self.schedule(step))

    def format_steps(self, total_steps: int) -> dict[str, int]:
        """Steps per format over a run of `total_steps` (`format_steps`)."""
        return format_steps(self.config, self.schedule, total_steps)

    def run_cost(self, grad_schedule: PrecisionSchedule | None, total_steps: int,
                 ops=None, baseline_bits: int = 8) -> dict:
        """`cpt_jax.cost.run_cost` with each step counted in its own format."""
        return cost_lib.run_cost(self.schedule, grad_schedule, total_steps, ops,
                                 baseline_bits=baseline_bits, config=self.config)


def format_schedule(formats: Sequence[FormatSpec], schedule: PrecisionSchedule) -> FormatSchedule:
    """A schedule over formats: each step the widest format whose width <= ``schedule(step)``.

    ``f(t) = max{i : w_i <= b(t)}`` (0 below the narrowest), with ``w_i`` the
    element widths of `formats` (narrow to wide); each product runs every format
    as a ``lax.switch`` branch, so the train step compiles once.

    Args:
      formats: preset names (or ``(name, QuantConfig)`` pairs), narrow to wide.
      schedule: a `PrecisionSchedule` (step -> bits), e.g. ``cpt_jax.cpt(4, 8, ...)``.

    Returns:
      A `FormatSchedule` (its ``config`` for `quantize_model`, itself the bits schedule).

    Example:
      >>> fs = format_schedule(("nvfp4_gemm", "mxfp6", "mxfp8_gemm"),
      ...                      cpt_jax.cyclic("linear_growth", min_bits=4, max_bits=8,
      ...                                     num_cycles=1, total_steps=10))
      >>> [fs.config.names[int(fs.index(t))] for t in (0, 5, 9)]
      ['nvfp4_gemm', 'mxfp6', 'mxfp8_gemm']
    """
    if not callable(schedule):
        raise ValueError(f"schedule must be a PrecisionSchedule (step -> bits), got {schedule!r}")
    return FormatSchedule(format_switch(formats), schedule)


__all__ = ["FORMATS_FIELD", "FormatSchedule", "check_formats", "format_schedule", "format_steps",
           "format_summary", "format_switch", "parse_formats", "preset_width"]
