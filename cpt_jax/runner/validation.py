"""Config validation before anything is built or compiled.

`validate_config(config)` checks every field the runner reads and raises a
`ValueError` whose message names the field, the value and what is allowed, e.g.::

    config.precision.min_bits=9 must be <= config.precision.max_bits=8
    config.dataset='cifar11' is unknown; choose one of ['cifar10', 'cifar100', 'digits', ...]
    config.optimizer.momentum=1.5 must be a number in [0, 1)

Checks: integers and their ranges (steps, batch sizes, seed, intervals), bit ranges
(``1 <= min_bits <= max_bits <= 32``), schedule and quantizer names, cycles vs steps,
dataset and model names, paths (``data_dir`` must be a folder), the batch size vs the
known size of the training set, device counts (``num_devices`` and the batch's
divisibility by them), optimizer fields (name, learning rate > 0, momentum in [0, 1),
weight decay >= 0, lr schedule, warmup < num_steps, grad clip >= 0), the non-finite
policy, and the log/eval/checkpoint intervals.

Data files are checked when they are read (`cpt_jax.data` names a corrupt or truncated
file in its error); that happens before compilation too.

Example:
  >>> from experiments.configs import default
  >>> config = default.get_config(); config.precision.min_bits = 9
  >>> validate_config(config)
  Traceback (most recent call last):
  ValueError: config.precision.min_bits=9 must be <= config.precision.max_bits=8
"""
from __future__ import annotations

import math
import numbers
import os
import re
from typing import Any

import numpy as np

from cpt_jax.controllers import ControllerField, controller_names, get_controller
from cpt_jax.format_schedules import check_formats
from cpt_jax.quant_config import COMPUTES, PRESETS, get_preset
from cpt_jax.training import NONFINITE_POLICIES

FULL_PRECISION_SCHEDULES = ("none", "fp32", "full")
OTHER_SCHEDULES = ("constant", "critical_period")
HISTORY_PRESETS = ("fp8_delayed",)
"""Presets that keep a per-layer history the job wires in (`provider_from_config`):
a run's ``precision.quantizer``, never one of ``precision.formats``."""
EVAL_BITS_MODES = ("max", "current")
OPTIMIZERS = ("sgd", "adam", "adamw")
LR_SCHEDULES = ("step", "cosine", "constant")
MAX_BITS = 32

KNOWN_TRAIN_SIZES = {"digits": 1497, "mnist": 60000, "fashion_mnist": 60000,
                     "cifar10": 50000, "cifar100": 50000}
"""Training-set sizes of the named image datasets (checked against the batch size
before loading; the task checks the size of what it actually loaded)."""


def _fmt(field: str) -> str:
    return f"config.{field}"


def need_int(field: str, value: Any, minimum: int | None = None,
             maximum: int | None = None) -> int:
    """`value` must be an integer (not a bool) in ``[minimum, maximum]``."""
    ok = (not isinstance(value, bool) and isinstance(value, (int, np.integer))
          and (minimum is None or value >= minimum) and (maximum is None or value <= maximum))
    if not ok:
        if minimum is not None and maximum is not None:
            allowed = f"an integer in [{minimum}, {maximum}]"
        elif minimum is not None:
            allowed = f"an integer >= {minimum}"
        elif maximum is not None:
            allowed = f"an integer <= {maximum}"
        else:
            allowed = "an integer"
        raise ValueError(f"{_fmt(field)}={value!r} must be {allowed}")
    return int(value)


def need_number(field: str, value: Any, *, low: float | None = None,
                high: float | None = None, low_open: bool = False,
                high_open: bool = False) -> float:
    """`value` must be a finite real number in the interval given (open or closed ends)."""
    ok = (not isinstance(value, bool) and isinstance(value, numbers.Real)
          and math.isfinite(float(value)))
    if ok:
        v = float(value)
        if low is not None:
            ok = ok and (v > low if low_open else v >= low)
        if high is not None:
            ok = ok and (v < high if high_open else v <= high)
    if not ok:
        lo = "-inf" if low is None else f"{low:g}"
        hi = "inf" if high is None else f"{high:g}"
        interval = f"{'(' if low_open or low is None else '['}{lo}, {hi}" \
                   f"{')' if high_open or high is None else ']'}"
        raise ValueError(f"{_fmt(field)}={value!r} must be a number in {interval}")
    return float(value)


def need_choice(field: str, value: Any, choices) -> Any:
    """`value` must be one of `choices`."""
    if value not in tuple(choices):
        raise ValueError(f"{_fmt(field)}={value!r} is unknown; choose one of {list(choices)}")
    return value


def need_bool(field: str, value: Any, allow_none: bool = False) -> None:
    """`value` must be True or False (or None when `allow_none`)."""
    if not (isinstance(value, (bool, np.bool_)) or (allow_none and value is None)):
        allowed = "True, False or None" if allow_none else "True or False"
        raise ValueError(f"{_fmt(field)}={value!r} must be {allowed}")


def need_regexes(field: str, value: Any) -> None:
    """`value` must be a sequence of valid regular expressions (strings)."""
    if isinstance(value, str) or not isinstance(value, (list, tuple)):
        raise ValueError(f"{_fmt(field)}={value!r} must be a tuple of regex strings")
    for i, pattern in enumerate(value):
        if not isinstance(pattern, str):
            raise ValueError(f"{_fmt(field)}[{i}]={pattern!r} must be a regex string")
        try:
            re.compile(pattern)
        except re.error as exc:
            raise ValueError(f"{_fmt(field)}[{i}]={pattern!r} is not a valid regex: {exc}") \
                from exc


def validate_precision(p, num_steps: int) -> None:
    """The ``config.precision`` fields (see module docstring)."""
    from cpt_jax import schedules as sched_lib

    schedule = p.schedule
    allowed = list(sched_lib.SUITE) + list(OTHER_SCHEDULES) + list(FULL_PRECISION_SCHEDULES)
    need_choice("precision.schedule", schedule, allowed)
    quantizer = p.quantizer
    need_choice("precision.quantizer", quantizer, tuple(PRESETS))  # the registry, read now
    formats = p.get("formats", "")
    named = [n.strip() for n in formats.split(",")] if isinstance(formats, str) else []
    for name in HISTORY_PRESETS:
        if name in named:
            raise ValueError(f"config.precision.formats={formats!r}: {name!r} scales from an "
                             f"amax history and cannot be a format of a format schedule; use "
                             f"--config.precision.quantizer={name} (and formats='')")
    check_formats(formats, activation_range=p.activation_range)
    validate_compute(p)
    need_regexes("precision.keep_full_precision", p.keep_full_precision)
    need_choice("precision.convention", p.convention, sched_lib.CONVENTIONS)
    need_choice("precision.eval_bits_mode", p.eval_bits_mode, EVAL_BITS_MODES)
    need_choice("precision.activation_range", p.activation_range, ("batch", "running"))
    need_bool("precision.deficit_inclusive", p.deficit_inclusive)
    if p.activation_range == "running" and quantizer not in running_range_quantizers():
        raise ValueError(f"config.precision.activation_range='running' needs "
                         f"config.precision.quantizer in {running_range_quantizers()}, "
                         f"got {quantizer!r}")
    offsets = p.bit_offsets
    if isinstance(offsets, str) or not isinstance(offsets, (list, tuple)):
        raise ValueError(f"config.precision.bit_offsets={offsets!r} must be a tuple of "
                         f"(regex, bits_offset) pairs")
    for i, pair in enumerate(offsets):
        if (not isinstance(pair, (list, tuple)) or len(pair) != 2 or not isinstance(pair[0], str)
                or isinstance(pair[1], bool) or not isinstance(pair[1], numbers.Real)):
            raise ValueError(f"config.precision.bit_offsets[{i}]={pair!r} must be a "
                             f"(regex, bits_offset) pair, e.g. ('conv1', 2)")
        need_regexes(f"precision.bit_offsets[{i}]", (pair[0],))
    validate_controller(p)
    if schedule in FULL_PRECISION_SCHEDULES:
        return
    min_bits = need_int("precision.min_bits", p.min_bits, 1, MAX_BITS)
    max_bits = need_int("precision.max_bits", p.max_bits, 1, MAX_BITS)
    if min_bits > max_bits:
        raise ValueError(f"config.precision.min_bits={min_bits} must be <= "
                         f"config.precision.max_bits={max_bits}")
    need_int("precision.grad_bits", p.grad_bits, 1)
    eval_bits = p.eval_bits
    need_int("precision.eval_bits", eval_bits, 0, MAX_BITS)
    if schedule in sched_lib.SUITE:
        num_cycles = need_int("precision.num_cycles", p.num_cycles, 1)
        if num_cycles > num_steps:
            raise ValueError(f"config.precision.num_cycles={num_cycles} must be <= "
                             f"config.num_steps={num_steps} (each cycle needs at least one "
                             f"step)")
    if schedule == "critical_period":
        need_int("precision.deficit_steps", p.deficit_steps, 0, num_steps)


def validate_compute(p) -> None:
    """``config.precision.compute``: ``""`` or a name of `cpt_jax.quant_config.COMPUTES`
    that the quantizer's formats allow (``int`` needs integer grids).

    Example:
      >>> from experiments.configs import default
      >>> validate_compute(default.get_precision_config(quantizer="mxfp8", compute="int"))
      ... # doctest: +ELLIPSIS
      Traceback (most recent call last):
      ValueError: config.precision.compute='int' with config.precision.quantizer='mxfp8': ...
    """
    compute = p.get("compute", "") or ""
    if not compute:
        return
    need_choice("precision.compute", compute, tuple(COMPUTES))
    if p.get("formats", ""):
        raise ValueError(f"config.precision.compute={compute!r} applies to one quantizer; a "
                         f"format schedule (config.precision.formats) computes each format "
                         f"its own way: leave compute=''")
    try:
        get_preset(p.quantizer).replace(compute=compute)
    except ValueError as err:
        raise ValueError(f"config.precision.compute={compute!r} with config.precision."
                         f"quantizer={p.quantizer!r}: {err}") from None


def check_rules_match(p, paths, shown: int = 12) -> None:
    """Every ``config.precision.keep_full_precision`` and ``bit_offsets`` pattern must
    match a product of the model (`paths`, read when the run is built): a pattern that
    matches nothing is a typo (the layer would be quantized) and a ValueError naming
    the field, the pattern and the model's products.

    Example:
      >>> from experiments.configs import default
      >>> check_rules_match(default.get_precision_config(), ["Dense_0", "classifier"])
      >>> typo = default.get_precision_config(keep_full_precision=("clasifier",))
      >>> try:
      ...   check_rules_match(typo, ["Dense_0", "classifier"])
      ... except ValueError as e:
      ...   print(str(e).split(";")[0])
      config.precision.keep_full_precision[0]='clasifier' matches no product of the model
    """
    paths = list(dict.fromkeys(paths))
    fields = [(f"keep_full_precision[{i}]", pattern)
              for i, pattern in enumerate(p.keep_full_precision)]
    fields += [(f"bit_offsets[{i}]", pair[0]) for i, pair in enumerate(p.bit_offsets or ())]
    for field, pattern in fields:
        if not any(re.search(pattern, path) for path in paths):
            more = f" (first {shown})" if len(paths) > shown else ""
            raise ValueError(f"config.precision.{field}={pattern!r} matches no product of the "
                             f"model; its {len(paths)} products{more}: {paths[:shown]}")


def running_range_quantizers() -> tuple[str, ...]:
    """The presets whose activations can take CPT's running ranges (per-tensor
    `AffineInt` / `SymmetricInt`: ``QuantConfig.replace(activation_range="running")``
    accepts them), read from the registry.

    Example:
      >>> running_range_quantizers()
      ('cpt', 'symmetric')
    """
    names = []
    for name, config in PRESETS.items():
        try:
            config.replace(activation_range="running")
        except ValueError:
            continue
        names.append(name)
    return tuple(names)


def need_field(field: str, value: Any, spec: ControllerField) -> None:
    """`value` must be what the registered field `spec` allows: its default's type (bool,
    int, float, str) within ``low`` / ``high`` or among ``choices``."""
    if spec.choices is not None:
        need_choice(field, value, spec.choices)
    elif isinstance(spec.default, bool):
        need_bool(field, value)
    elif isinstance(spec.default, int):
        need_int(field, value, None if spec.low is None else int(spec.low),
                 None if spec.high is None else int(spec.high))
    elif isinstance(spec.default, float):
        need_number(field, value, low=spec.low, high=spec.high, low_open=spec.low_open)
    elif not isinstance(value, str):
        raise ValueError(f"{_fmt(field)}={value!r} must be a string")


def validate_controller(p) -> None:
    """``config.precision.controller`` (a registered name, `cpt_jax.controllers.CONTROLLERS`)
    and the fields that controller declared (a controller needs a quantized run).

    Example:
      >>> from experiments.configs import default
      >>> validate_controller(default.get_precision_config(controller="on_plateau",
      ...                                                  controller_patience=0))
      Traceback (most recent call last):
      ValueError: config.precision.controller_patience=0 must be an integer >= 1
    """
    name = need_choice("precision.controller", p.controller, controller_names())
    spec = get_controller(name)
    if spec is None:
        return
    if p.schedule in FULL_PRECISION_SCHEDULES:
        raise ValueError(f"config.precision.controller={name!r} needs a quantized run, but "
                         f"config.precision.schedule={p.schedule!r} is full precision")
    for field, field_spec in spec.fields.items():
        need_field(f"precision.{field}", p[field], field_spec)


def validate_optimizer(o, num_steps: int) -> None:
    """The ``config.optimizer`` fields (see module docstring)."""
    name = need_choice("optimizer.name", o.name, OPTIMIZERS)
    need_number("optimizer.learning_rate", o.learning_rate, low=0.0, low_open=True)
    if name == "sgd":
        need_number("optimizer.momentum", o.momentum, low=0.0, high=1.0,
                    high_open=True)
        need_bool("optimizer.nesterov", o.nesterov)
    need_number("optimizer.weight_decay", o.weight_decay, low=0.0)
    need_choice("optimizer.lr_schedule", o.lr_schedule, LR_SCHEDULES)
    warmup = need_int("optimizer.warmup_steps", o.warmup_steps, 0)
    if warmup >= num_steps and warmup > 0:
        raise ValueError(f"config.optimizer.warmup_steps={warmup} must be < "
                         f"config.num_steps={num_steps}")
    need_number("optimizer.grad_clip", o.grad_clip, low=0.0)


def check_workdir(workdir: Any, field: str = "workdir") -> None:
    """ValueError naming `field` unless `workdir` is a folder, or a path a folder can be
    created at (its nearest existing parent a writable folder). Creates nothing.

    Example:
      >>> check_workdir("", field="--workdir")
      Traceback (most recent call last):
      ValueError: --workdir='' is empty: expected the folder to write the run to (created if missing)
    """
    if not isinstance(workdir, (str, os.PathLike)) or not str(workdir).strip():
        raise ValueError(f"{field}={workdir!r} is empty: expected the folder to write the run "
                         f"to (created if missing)")
    path = os.path.abspath(os.path.expanduser(str(workdir)))
    if os.path.exists(path):
        if not os.path.isdir(path):
            raise ValueError(f"{field}={workdir} is an existing file: expected a folder (new, "
                             f"or holding this run's outputs)")
        if not os.access(path, os.W_OK | os.X_OK):
            raise ValueError(f"{field}={workdir} is a folder this user cannot write to")
        return
    parent = os.path.dirname(path)
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise ValueError(f"{field}={workdir} cannot be created: {parent} is a file, not a "
                         f"folder")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"{field}={workdir} cannot be created: {parent} is not writable")


def validate_config(config, *, device_count: int | None = None) -> None:
    """Check every field the runner reads; `ValueError` names field, value and what is
    allowed. Nothing is built, loaded or compiled.

    `device_count` defaults to ``jax.device_count()``.

    Example:
      >>> from experiments.configs import default
      >>> validate_config(default.get_config())        # fine: returns None
    """
    from cpt_jax.runner import tasks

    num_steps = need_int("num_steps", config.num_steps, 1)
    batch_size = need_int("batch_size", config.batch_size, 1)
    need_int("eval_batch_size", config.eval_batch_size, 0)
    need_int("seed", config.seed, 0, 2**63 - 1)
    need_int("log_every", config.log_every, 1)
    need_int("eval_every", config.eval_every, 0)
    need_int("checkpoint_every", config.checkpoint_every, 0)
    need_int("keep_checkpoints", config.keep_checkpoints, 1)
    need_choice("nonfinite", config.nonfinite, NONFINITE_POLICIES)
    need_bool("tensorboard", config.tensorboard)
    need_bool("plots", config.plots)
    need_bool("augment", config.augment, allow_none=True)

    dataset = config.dataset
    need_choice("dataset", dataset, tasks.available_datasets())
    need_choice("input_pipeline", config.input_pipeline, ("device", "grain"))
    need_int("image_size", config.image_size, 1)
    from cpt_jax import data as image_data
    if dataset in image_data.IMAGE_DATASETS:
        from cpt_jax.models import MODEL_NAMES
        need_choice("model", config.model, MODEL_NAMES)
    known = KNOWN_TRAIN_SIZES.get(dataset)
    if known is not None and batch_size > known:
        raise ValueError(f"config.batch_size={batch_size} must be <= {known}, the number of "
                         f"training examples of {dataset!r}")
    model_kwargs = config.model_kwargs
    if model_kwargs is not None and not hasattr(model_kwargs, "keys"):
        raise ValueError(f"config.model_kwargs={model_kwargs!r} must be a dict of keyword "
                         f"arguments for the model")

    data_dir = config.data_dir
    if data_dir:
        if not isinstance(data_dir, (str, os.PathLike)):
            raise ValueError(f"config.data_dir={data_dir!r} must be a path (string)")
        if not os.path.isdir(os.path.expanduser(str(data_dir))):
            raise ValueError(f"config.data_dir={data_dir!r} is not a directory")

    num_devices = need_int("num_devices", config.num_devices, 0)
    if device_count is None:
        import jax
        device_count = jax.device_count()
    if num_devices > device_count:
        raise ValueError(f"config.num_devices={num_devices} must be <= {device_count}, "
                         f"the number of devices available (0 uses all)")
    n = num_devices or device_count
    if n > 1 and batch_size % n:
        raise ValueError(f"config.batch_size={batch_size} must be divisible by the {n} "
                         f"devices of the data-parallel mesh (config.num_devices="
                         f"{num_devices}; 0 uses all)")

    param_sharding = config.param_sharding
    if param_sharding not in ("replicate", "fsdp"):
        raise ValueError(f"config.param_sharding={param_sharding!r} must be 'replicate' "
                         f"(data parallel) or 'fsdp' (parameters sharded over the devices)")

    validate_precision(config.precision, num_steps)
    validate_optimizer(config.optimizer, num_steps)
