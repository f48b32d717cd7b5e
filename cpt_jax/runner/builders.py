"""Builders: the objects a run's ConfigDict names (``experiments/configs/default.py``).

Each reads its ``config`` subtree directly (every config derives from
``default.get_config()``, so every field exists):

==============================  ======================================================
`precision_schedule_from_config` ``config.precision`` -> forward bits per step
`grad_schedule_from_config`      ``config.precision.grad_bits`` -> backward bits
`quant_config_from_config`       ``config.precision.quantizer`` -> `QuantConfig`, or
                                 ``config.precision.formats`` -> a format schedule
                                 (`cpt_jax.format_schedules`)
`provider_from_config`           what computes the products: delayed scaling for
                                 ``quantizer="fp8_delayed"``, the measured products of
                                 ``controller_statistic="quant_error"``, else the default
`rules_from_config`              layers kept fp32 and per-layer bit offsets -> rules
`learning_rate_from_config`      ``config.optimizer`` -> optax learning-rate schedule
`optimizer_from_config`          ``config.optimizer`` -> optax optimizer
`eval_bits_from_config`          the bits of the quantized evaluation
`eval_protocol_name`             the evaluation protocol's name (``summary.json``)
`controller_from_config`         ``config.precision.controller`` -> the registered
                                 controller around the schedules (`cpt_jax.controllers.
                                 CONTROLLERS`, built from a `ControllerContext`)
==============================  ======================================================

`cpt_jax.runner` builds a run from them (and re-exports them).
"""
from __future__ import annotations

import optax

from cpt_jax import controllers as ctl
from cpt_jax import schedules as sched_lib
from cpt_jax.format_schedules import (
    FORMATS_FIELD,
    FormatSchedule,
    check_formats,
    format_switch,
    parse_formats,
)
from cpt_jax.quant_config import PRESETS, QuantConfig, get_preset
from cpt_jax.runner.validation import FULL_PRECISION_SCHEDULES


def precision_schedule_from_config(p, total_steps: int) -> sched_lib.PrecisionSchedule | None:
    """The forward schedule of ``config.precision`` (None for full precision).

    Args:
      p: ``config.precision``. ``p.schedule``: a `SUITE` name (cyclic from
        ``p.min_bits`` to ``p.max_bits`` in ``p.num_cycles`` cycles, period
        convention ``p.convention``), ``"constant"`` (at ``p.max_bits``),
        ``"critical_period"`` (``p.min_bits`` for ``p.deficit_steps`` steps, one more
        with ``p.deficit_inclusive``, then ``p.max_bits``) or ``"none"`` (full precision).
        A controller that rewrites the schedules (``p.controller="final_phase"``: the
        last ``p.controller_fraction`` of the steps at ``p.controller_bits``, 0:
        ``p.max_bits``; the errors too, `grad_schedule_from_config`) rewrites it.
      total_steps: the run's length.

    Returns:
      A `PrecisionSchedule` (step -> bits), or None for full precision.

    Example:
      >>> from experiments.configs import default
      >>> schedule = precision_schedule_from_config(default.get_precision_config(), 800)
      >>> float(schedule(0)), float(schedule(99))
      (3.0, 8.0)
    """
    schedule = _base_schedule(p, total_steps)
    spec = ctl.get_controller(p.controller)
    if schedule is not None and spec is not None and spec.schedules is not None:
        return spec.schedules(p, schedule, None, total_steps)[0]
    return schedule


def _base_schedule(p, total_steps: int) -> sched_lib.PrecisionSchedule | None:
    name = p.schedule
    if name in FULL_PRECISION_SCHEDULES:
        return None
    if name == "constant":
        return sched_lib.constant(p.max_bits)
    if name == "critical_period":
        return sched_lib.critical_period(p.min_bits, p.max_bits, p.deficit_steps,
                                         inclusive=bool(p.deficit_inclusive))
    if name in sched_lib.SUITE:
        return sched_lib.cyclic(name, min_bits=p.min_bits, max_bits=p.max_bits,
                                num_cycles=p.num_cycles, total_steps=total_steps,
                                convention=p.convention)
    raise ValueError(
        f"config.precision.schedule={name!r} is unknown; choose one of "
        f"{list(sched_lib.SUITE) + ['constant', 'critical_period', 'none']}")


def grad_schedule_from_config(p, total_steps: int | None = None
                              ) -> sched_lib.PrecisionSchedule | None:
    """``constant(p.grad_bits)``, or None when ``grad_bits >= 32`` (fp32 errors).

    With a controller that rewrites the schedules and `total_steps`, rewritten
    (``p.controller="final_phase"``: the errors of the last ``p.controller_fraction``
    of the steps at ``max(p.grad_bits, p.controller_bits or p.max_bits)``, as the
    forward bits: the whole last phase in higher precision).

    Args:
      p: ``config.precision``.
      total_steps: the run's length (needed by a controller's ``schedules`` only).

    Returns:
      The backward (error) schedule, or None for fp32 errors or a full-precision run.

    Example:
      >>> from experiments.configs import default
      >>> p = default.get_precision_config(grad_bits=4, controller="final_phase")
      >>> s = grad_schedule_from_config(p, 8)
      >>> [int(s(t)) for t in (5, 6)]
      [4, 8]
    """
    if p.schedule in FULL_PRECISION_SCHEDULES or p.grad_bits >= 32:
        return None
    schedule = sched_lib.constant(p.grad_bits)
    spec = ctl.get_controller(p.controller)
    if spec is not None and spec.schedules is not None and total_steps is not None:
        schedule = spec.schedules(p, None, schedule, total_steps)[1]
    return schedule


def quant_config_from_config(p) -> QuantConfig:
    """The `QuantConfig` recipe named by ``p.quantizer`` (a key of `PRESETS`), with
    ``p.activation_range`` (``"running"``: CPT's running ranges in evaluation) and
    ``p.compute`` (what computes its products, ``""``: the preset's own); or,
    when ``p.formats`` names presets (``"nvfp4_gemm,mxfp6,mxfp8_gemm"``, narrow to
    wide), the `cpt_jax.quant_config.FormatSwitch` of the format schedule: each step
    the widest format whose element width <= the schedule's bits (``p.quantizer``
    is then not used).

    Args:
      p: ``config.precision``.

    Returns:
      The quantizer recipe applied to every quantized layer.

    Example:
      >>> from experiments.configs import default
      >>> p = default.get_precision_config(formats="nvfp4_gemm,mxfp6,mxfp8_gemm")
      >>> quant_config_from_config(p).names
      ('nvfp4_gemm', 'mxfp6', 'mxfp8_gemm')
    """
    text = p.get("formats", "") or ""
    if parse_formats(text):
        check_formats(text, FORMATS_FIELD, p.activation_range)
        return format_switch(parse_formats(text), FORMATS_FIELD)
    if p.quantizer not in PRESETS:
        raise ValueError(f"config.precision.quantizer={p.quantizer!r} is unknown; "
                         f"choose one of {tuple(PRESETS)}")
    config = get_preset(p.quantizer)
    if p.activation_range != config.activation_range:
        config = config.replace(activation_range=p.activation_range)
    compute = p.get("compute", "") or ""
    if compute and compute != config.compute:
        config = config.replace(compute=compute)
    return config


DELAYED_QUANTIZERS = ("fp8_delayed",)
"""Presets whose activations the job scales from an amax history (`DelayedFP8Provider`)."""


def provider_from_config(p):
    """The provider `quantize_model` computes the products with (None: the default).

    ``p.quantizer="fp8_delayed"`` (and no ``p.formats``): `DelayedFP8Provider`,
    Transformer Engine's delayed scaling of each product's activation (E4M3, scale
    from the amax history of the last 16 steps, kept in ``batch_stats``);
    ``p.controller_statistic="quant_error"``: `cpt_jax.controllers.measure_products`
    around it.

    Example:
      >>> from experiments.configs import default
      >>> type(provider_from_config(default.get_precision_config(quantizer="fp8_delayed"))).__name__
      'DelayedFP8Provider'
      >>> provider_from_config(default.get_precision_config()) is None
      True
    """
    from cpt_jax.providers.delayed_scaling import DelayedFP8Provider

    inner = None
    if p.quantizer in DELAYED_QUANTIZERS and not parse_formats(p.get("formats", "") or ""):
        inner = DelayedFP8Provider()
    if p.controller != "none" and p.controller_statistic == "quant_error":
        return ctl.measure_products(inner)
    return inner


def rules_from_config(p) -> tuple:
    """Per-layer rules: ``p.keep_full_precision`` regexes in fp32, then ``p.bit_offsets``.

    Args:
      p: ``config.precision``; ``p.bit_offsets`` is ``((regex, bits_offset), ...)``.

    Returns:
      ``((regex, None), ..., (regex, QuantConfig with bits_offset), ...)`` for
      `quantize_model`.

    Example:
      >>> from experiments.configs import default
      >>> p = default.get_precision_config(bit_offsets=(("conv1", 2),))
      >>> [(pattern, None if c is None else c.bits_offset) for pattern, c in rules_from_config(p)]
      [('classifier', None), ('conv1', 2.0)]
    """
    rules = [(pattern, None) for pattern in p.keep_full_precision]
    base = quant_config_from_config(p)
    for pattern, bits_offset in p.bit_offsets or ():
        rules.append((pattern, base.replace(bits_offset=float(bits_offset))))
    return tuple(rules)


def learning_rate_from_config(o, total_steps: int) -> optax.Schedule:
    """optax schedule: ``o.lr_schedule`` in step (÷10 at 50% and 75%, CPT), cosine, constant.

    ``o.warmup_steps > 0`` prepends a linear warmup from 0 to ``o.learning_rate``.

    Args:
      o: ``config.optimizer``.
      total_steps: the run's length.

    Returns:
      An optax schedule (step -> learning rate).

    Example:
      >>> from experiments.configs import default
      >>> lr = learning_rate_from_config(default.get_optimizer_config(learning_rate=0.1), 100)
      >>> [round(float(lr(s)), 4) for s in (0, 50, 75)]
      [0.1, 0.01, 0.001]
    """
    lr = float(o.learning_rate)
    kind = o.lr_schedule
    warmup = int(o.warmup_steps)
    if kind == "constant":
        base = optax.constant_schedule(lr)
    elif kind == "cosine":
        base = optax.cosine_decay_schedule(lr, max(1, total_steps - warmup))
    elif kind == "step":
        base = optax.piecewise_constant_schedule(
            lr, {int(total_steps * 0.5): 0.1, int(total_steps * 0.75): 0.1})
    else:
        raise ValueError(
            f"config.optimizer.lr_schedule={kind!r} is unknown; choose step, cosine or constant")
    if warmup > 0:
        return optax.join_schedules([optax.linear_schedule(0.0, lr, warmup), base], [warmup])
    return base


def optimizer_from_config(o, total_steps: int) -> optax.GradientTransformation:
    """SGD (momentum, L2 weight decay as PyTorch), Adam or AdamW from ``config.optimizer``.

    ``o.grad_clip > 0`` clips the global gradient norm first.

    Args:
      o: ``config.optimizer`` (name, learning_rate, momentum, nesterov, weight_decay,
        lr_schedule, warmup_steps, grad_clip).
      total_steps: the run's length (for the learning-rate schedule).

    Returns:
      The optax transformation.
    """
    lr = learning_rate_from_config(o, total_steps)
    name = o.name
    wd = float(o.weight_decay)
    if name == "sgd":
        parts = [optax.add_decayed_weights(wd)] if wd else []
        parts.append(optax.sgd(lr, momentum=float(o.momentum) or None,
                               nesterov=bool(o.nesterov)))
        tx = optax.chain(*parts)
    elif name == "adam":
        parts = [optax.add_decayed_weights(wd)] if wd else []
        parts.append(optax.adam(lr))
        tx = optax.chain(*parts)
    elif name == "adamw":
        tx = optax.adamw(lr, weight_decay=wd)
    else:
        raise ValueError(f"config.optimizer.name={name!r} is unknown; choose sgd, adam or adamw")
    clip = float(o.grad_clip or 0.0)
    if clip > 0:
        tx = optax.chain(optax.clip_by_global_norm(clip), tx)
    return tx


def eval_bits_from_config(p) -> float:
    """Bits of the quantized evaluation: ``p.eval_bits``, or ``p.max_bits`` when it is 0
    (or the controller's ``eval_bits``: with ``p.controller="final_phase"`` the highest of
    ``p.max_bits`` and the final phase's bits, the schedule's max).

    Args:
      p: ``config.precision``.

    Returns:
      The evaluation bits (32.0 for a full-precision run).

    Example:
      >>> from experiments.configs import default
      >>> eval_bits_from_config(default.get_precision_config())
      8.0
    """
    if p.schedule in FULL_PRECISION_SCHEDULES:
        return 32.0
    spec = ctl.get_controller(p.controller)
    if not p.eval_bits and spec is not None and spec.eval_bits is not None:
        return float(spec.eval_bits(p))
    return float(p.eval_bits or p.max_bits)


def eval_protocol_name(p) -> str:
    """The evaluation protocol, e.g. ``"max-bits/batch-ranges"`` (cpt_jax's default) or
    ``"current-bits/running-ranges"`` (CPT's); ``"fp32"`` for a full-precision run."""
    if p.schedule in FULL_PRECISION_SCHEDULES:
        return "fp32"
    return f"{p.eval_bits_mode}-bits/{p.activation_range}-ranges"


def controller_from_config(p, fwd_schedule, grad_schedule, quant_config=None, *, ops=None,
                           total_steps: int = 1, cost_table=None):
    """The registered controller ``p.controller`` around the run's schedules, or None.

    Its builder receives a `cpt_jax.controllers.ControllerContext`: ``p``, the base
    (the forward schedule; with ``p.formats``, a `FormatSchedule` over the
    `FormatSwitch` `quant_config`, boosts and floors then counting formats, 0 the
    narrowest), the error schedule, the base's range (``p.min_bits .. p.max_bits``, or
    ``0 .. n - 1``), the run's length, its ops and cost table. ``none``, a controller
    without a builder (``final_phase``: a schedule) and a full-precision run: None.
    The built-ins are `cpt_jax.controllers.CONTROLLERS`' (``on_instability``,
    ``on_plateau``, ``online_range_test``: their fields in `experiments/configs/
    default.py`'s ``--help``).

    Args:
      p: ``config.precision``.
      fwd_schedule: the forward schedule (the controller's base).
      grad_schedule: the error schedule (None: fp32 errors).
      quant_config: the run's `QuantConfig` (a `FormatSwitch`: the base is the
        schedule over its formats).
      ops: the model's ops (`cpt_jax.cost.count_ops`), if counted.
      total_steps: the run's length.
      cost_table: BitOps at each (forward, error) bits (`cpt_jax.controllers.cost_table`).

    Returns:
      A `cpt_jax.controllers.PrecisionController`, or None.

    Example:
      >>> from experiments.configs import default
      >>> p = default.get_precision_config(controller="on_instability")
      >>> c = controller_from_config(p, precision_schedule_from_config(p, 100), None)
      >>> c.measure_every
      0
    """
    spec = ctl.get_controller(p.controller)
    if spec is None or spec.build is None or fwd_schedule is None:
        return None
    formats = hasattr(quant_config, "widths")
    base = FormatSchedule(quant_config, fwd_schedule) if formats else fwd_schedule
    low, high = (0, len(quant_config.widths) - 1) if formats else (p.min_bits, p.max_bits)
    return spec.build(ctl.ControllerContext(
        config=p, base=base, error_base=grad_schedule, low=low, high=high,
        total_steps=int(total_steps), ops=ops, cost_table=cost_table))
