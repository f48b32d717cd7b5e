"""Controllers by name: `register_controller`, what the main job's ``--config.precision.
controller`` chooses from.

A controller registers its name, its ``config.precision.controller_*`` fields (a default,
a help line, the values allowed) and a builder; the main job's choices, validation,
config defaults and ``--help`` read the registry, so a new controller is one call in
one module:

    register_controller("budget", build=build_budget, doc="...",
                        fields={"controller_budget": ControllerField(0.6, "...", low=0.0)})

The builder receives a `ControllerContext`: the precision config (its fields and the
schedule's), the base (the forward schedule, or the schedule over formats), the error
schedule, the base's range, the run's length, the model's ops and the cost table of the
bits it may use; it returns a `PrecisionController`. A controller that rewrites the
run's schedules instead (``final_phase``) gives ``schedules`` (and ``eval_bits``).
"""
from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from cpt_jax.controllers._core import PrecisionController
from cpt_jax.registry import Registry

FIELD = re.compile(r"controller_[a-z0-9_]+")
NONE = "none"
"""The choice without a controller: the schedule alone."""


@dataclasses.dataclass(frozen=True)
class ControllerField:
    """One ``config.precision.<name>`` field a controller reads: its default (whose
    type is the field's: bool, int, float or str), a help line (``--help``) and the
    values the job accepts (``low`` / ``high`` bounds, ``low_open``; ``choices``)."""

    default: bool | int | float | str
    help: str
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    choices: tuple | None = None

    def __post_init__(self):
        if not isinstance(self.default, (bool, int, float, str)):
            raise ValueError(f"ControllerField.default must be a bool, int, float or str, "
                             f"got {self.default!r}")
        if not isinstance(self.help, str) or not self.help.strip():
            raise ValueError(f"ControllerField.help must be a non-empty string, got {self.help!r}")


@dataclasses.dataclass(frozen=True)
class ControllerContext:
    """What a controller's builder receives (`register_controller`).

    Attributes:
      config: ``config.precision`` (a mapping): the controller's fields
        (``config["controller_budget"]``) and the schedule's (``min_bits``, ...).
      base: the forward base: a `PrecisionSchedule`, or a schedule over formats
        (``cpt_jax.format_schedule``; raises and floors then count formats).
      error_base: the error bits' schedule (None: fp32 errors).
      low, high: the base's range: ``(min_bits, max_bits)``, or the format indices
        ``(0, n - 1)``.
      total_steps: the run's length.
      ops: the model's products (`cpt_jax.cost.count_ops`), counted before the train
        state is built; None outside the main job.
      cost_table: BitOps of one step at each ``(forward, error)`` bits, float64
        ``(33, 33)`` (`cpt_jax.controllers.cost_table` of `ops` and the run's recipe).
    """

    config: Mapping[str, Any]
    base: Any
    error_base: Any = None
    low: float = 1.0
    high: float = 32.0
    total_steps: int = 1
    ops: Sequence[Any] | None = None
    cost_table: np.ndarray | None = None


@dataclasses.dataclass(frozen=True)
class ControllerSpec:
    """A registered controller: its fields and how the main job builds it.

    Attributes:
      fields: ``{field name: ControllerField}``.
      build: ``build(ControllerContext) -> PrecisionController`` (None: the
        controller only rewrites the schedules).
      schedules: ``schedules(config, fwd, grad, total_steps) -> (fwd, grad)``: the run's
        forward and error schedules rewritten (either may be None and stays None).
      eval_bits: ``eval_bits(config) -> bits`` of the quantized evaluation when
        ``config.eval_bits`` is 0 (None: ``max_bits``).
    """

    fields: Mapping[str, ControllerField]
    build: Callable[[ControllerContext], PrecisionController] | None = None
    schedules: Callable[..., tuple] | None = None
    eval_bits: Callable[[Mapping[str, Any]], float] | None = None


_CONTROLLERS: Registry[ControllerSpec] = Registry("controller")

CONTROLLERS = _CONTROLLERS.view(
    intro="""Precision controllers by name: a read-only view of the controller registry, the
main job's ``--config.precision.controller`` choices (besides ``none``).
`register_controller` adds one. The controllers registered now:""")


def _check_fields(name: str, fields: Mapping[str, ControllerField]) -> None:
    """ValueError unless every field is a ``controller_*`` name and agrees (default and
    type) with the same field of the controllers registered before."""
    known = controller_fields()
    for field, spec in fields.items():
        if not isinstance(field, str) or not FIELD.fullmatch(field):
            raise ValueError(f"register_controller({name!r}): a field name must match "
                             f"{FIELD.pattern} (config.precision.controller_*), got {field!r}")
        if not isinstance(spec, ControllerField):
            raise ValueError(f"register_controller({name!r}): fields[{field!r}] must be a "
                             f"ControllerField, got {spec!r}")
        old = known.get(field)
        if old is not None and (type(old.default), old.default) != (type(spec.default),
                                                                     spec.default):
            raise ValueError(f"register_controller({name!r}): field {field!r} has default "
                             f"{old.default!r} already (one config field, one default), got "
                             f"{spec.default!r}")


def register_controller(name: str, build: Callable[[ControllerContext], PrecisionController]
                        | None = None, *, doc: str,
                        fields: Mapping[str, ControllerField] | None = None,
                        schedules: Callable[..., tuple] | None = None,
                        eval_bits: Callable[[Mapping[str, Any]], float] | None = None,
                        replace: bool = False) -> ControllerSpec:
    """Register the controller `name`: ``--config.precision.controller=name`` builds it.

    Its `fields` become ``config.precision`` fields (in every config: defaults, ``--help``,
    validation when it is chosen); the main job calls ``build(ControllerContext)`` with
    the run's base schedule, ops and cost table. Call it once, in the module that
    defines the controller (a user's module imported by a config file is enough).

    Args:
      name: ``[a-z][a-z0-9_]*``, not ``"none"``.
      build: ``ControllerContext -> PrecisionController``.
      doc: what it does, one or two sentences (``CONTROLLERS.__doc__``, ``--help``).
      fields: ``{"controller_*": ControllerField}``; a field another controller
        declared keeps its one default (a different one is refused).
      schedules: instead of (or besides) `build`: ``(config, fwd, grad, total_steps)
        -> (fwd, grad)``, the run's schedules rewritten (``final_phase``).
      eval_bits: ``config -> bits`` of the evaluation when ``eval_bits`` is 0.
      replace: replace a controller registered under `name`.

    Returns:
      The registered `ControllerSpec`.

    Example:
      >>> def build(ctx):
      ...     return cpt_jax.controllers.scheduled(ctx.base, error_base=ctx.error_base)
      >>> spec = register_controller("plain", build, doc="The base schedule itself.")
      >>> "plain" in CONTROLLERS, controller_names()[:2]
      (True, ('none', 'on_instability'))
      >>> unregister_controller("plain")
    """
    if name == NONE:
        raise ValueError(f"{NONE!r} is the choice without a controller; pick another name")
    if build is None and schedules is None:
        raise ValueError(f"register_controller({name!r}): give build (a controller) or "
                         f"schedules (rewritten schedules)")
    fields = dict(fields or {})
    _check_fields(name, fields)
    return _CONTROLLERS.register(name, ControllerSpec(fields, build, schedules, eval_bits), doc,
                                 replace=replace)


def unregister_controller(name: str) -> None:
    """Remove the controller `name` (tests, notebooks); ValueError naming the known ones."""
    _CONTROLLERS.unregister(name)


def get_controller(name: str) -> ControllerSpec | None:
    """The `ControllerSpec` registered as `name`; None for ``"none"``; ValueError naming
    the known ones otherwise.

    Example:
      >>> sorted(get_controller("on_plateau").fields)
      ['controller_boost', 'controller_patience', 'controller_statistic']
    """
    return None if name == NONE else _CONTROLLERS.get(name)


def controller_names() -> tuple[str, ...]:
    """``("none", *registered)``: the choices of ``config.precision.controller``."""
    return (NONE,) + _CONTROLLERS.names()


def controller_doc(name: str) -> str:
    """The doc `name` was registered with."""
    return _CONTROLLERS.doc(name)


def controller_fields() -> dict[str, ControllerField]:
    """Every registered controller's fields, merged: ``{name: ControllerField}`` with the
    one default and, for a field several controllers read, each one's help prefixed by
    its name (what ``--help`` and the config's defaults read).

    Example:
      >>> controller_fields()["controller_hold"].help
      'on_instability: boosted steps after a trigger'
    """
    helps: dict[str, list[tuple[str, str]]] = {}
    first: dict[str, ControllerField] = {}
    for name in _CONTROLLERS.names():
        for field, spec in _CONTROLLERS.get(name).fields.items():
            first.setdefault(field, spec)
            helps.setdefault(field, []).append((name, spec.help))
    out = {}
    for field, spec in first.items():
        texts = [h for _, h in helps[field]]
        if len(set(texts)) == 1:
            text = f"{', '.join(n for n, _ in helps[field])}: {texts[0]}"
        else:
            text = "; ".join(f"{n}: {h}" for n, h in helps[field])
        out[field] = dataclasses.replace(spec, help=text)
    return out


__all__ = ["CONTROLLERS", "ControllerContext", "ControllerField", "ControllerSpec", "NONE",
           "controller_doc", "controller_fields", "controller_names", "get_controller",
           "register_controller", "unregister_controller"]
