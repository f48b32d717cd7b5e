"""Other low-precision training libraries, set up to train a benchmark's model in the
same process as cpt_jax's variants (`common.make_steps`), where they are installed.

Qwix (``pip install --no-deps qwix``; not a dependency of cpt_jax): quantized training
(``qwix.QtProvider``) with int8 weights and activations in the forward GEMMs and int8
gradients in the backward GEMMs (`QWIX_INT8`), on every product but the ones CPT keeps
in fp32 (`cpt_jax.CPT_RULES`: the last, the classifier).

    if qwix_available():
        qmodel = qwix_model(spec["model"], spec["sample"])  # a Flax Linen model
"""
from __future__ import annotations

import importlib.util
import re
from typing import Any

import jax

QWIX_INT8 = {"weight_qtype": "int8", "act_qtype": "int8", "bwd_qtype": "int8"}
"""The `qwix.QtRule` fields of Qwix's int8 training: the forward GEMM on int8 weights
(absmax, per output channel) and int8 activations (dynamic absmax, per token); the two
backward GEMMs on the incoming gradient quantized to int8 (absmax, round to nearest)
times the forward pass's int8 residuals. Each quantized dot_general then runs on int8
operands with int32 accumulation (Qwix's fast path: both operands quantized)."""


def qwix_available() -> bool:
    """Whether Qwix imports here (with this jax / flax)."""
    if importlib.util.find_spec("qwix") is None:
        return False
    try:
        import qwix  # noqa: F401
    except Exception:  # installed but broken against this jax / flax
        return False
    return True


def fp32_products(model, sample) -> list[str]:
    """The paths of the products `cpt_jax.CPT_RULES` keeps in fp32 in `model` on `sample`
    (the last product in call order, e.g. ``["classifier"]``), product suffixes
    (``@1``) dropped: the Flax module paths Qwix's rules match."""
    import cpt_jax
    qmodel = cpt_jax.quantize_model(model, rules=cpt_jax.CPT_RULES)
    variables = jax.eval_shape(lambda: qmodel.init(jax.random.key(0), sample, train=False))
    layers = cpt_jax.quantized_layers(qmodel, variables, sample)
    return list(dict.fromkeys(re.sub(r"@\d+$", "", p.path) for p in layers
                              if p.config is None))


def qwix_rules(model, sample) -> list[Any]:
    """Qwix rules (first match wins): an empty `qwix.QtRule` (nothing quantized) for each
    product CPT keeps in fp32 (`fp32_products`), then `QWIX_INT8` on every other
    dot_general / einsum / conv."""
    import jax.numpy as jnp
    import qwix
    int8 = {k: getattr(jnp, v) for k, v in QWIX_INT8.items()}
    keep = [qwix.QtRule(module_path=re.escape(p)) for p in fp32_products(model, sample)]
    return [*keep, qwix.QtRule(module_path=".*", **int8)]


def qwix_model(model, sample):
    """`model` (Flax Linen) under Qwix's int8 quantized training (`qwix_rules`): a Linen
    model with the same parameters, for `cpt_jax.make_train_step` as the fp32 model is
    (no precision schedule; Qwix's dynamic-range rules add no variables)."""
    import qwix
    return qwix.quantize_model(model, qwix.QtProvider(qwix_rules(model, sample)))
