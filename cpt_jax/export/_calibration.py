"""Static activation ranges of a trained model: `calibrate` (min/max over batches,
through the fake-quant model) or `running_ranges` (a run's running averages)."""
from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping
from typing import Any

import jax
from flax import serialization, traverse_util

from cpt_jax.context import precision
from cpt_jax.doors import QuantizedModel, quantize_model
from cpt_jax.export._checks import Ranges, check_export_bits, check_quantized_model
from cpt_jax.providers.running_ranges import COLLECTION as RANGES_COLLECTION
from cpt_jax.providers.static_ranges import (
    CALIBRATION,
    CALIBRATION_COLLECTION,
    range_key_of_variable,
)

Array = jax.Array


def _ranges_of_collection(collection) -> Ranges:
    """``{range_key: (lo, hi)}`` from the calibration collection's variables."""
    flat = traverse_util.flatten_dict(dict(collection), sep="/")
    out = {}
    for key, value in flat.items():
        if not float(value[0]) <= float(value[1]):
            continue  # never computed
        out[range_key_of_variable(key)] = (float(value[0]), float(value[1]))
    return dict(sorted(out.items()))


def with_provider(qmodel: QuantizedModel, provider, rules=None, config=None) -> QuantizedModel:
    """`qmodel` (same model, rules and default config unless given) with `provider`."""
    env = check_quantized_model(qmodel).cpt_interception
    return quantize_model(qmodel, env.rules if rules is None else rules,
                          env.config if config is None else config, provider=provider)


def calibrate(qmodel: QuantizedModel, variables: Mapping, batches: Iterable[Any], bits,
              **apply_kwargs) -> Ranges:
    """Static activation ranges: ``[lo, hi]`` of each quantized product's activation.

    ``lo = min_batches min(x)``, ``hi = max_batches max(x)`` (finite values), with
    the model run as the fake-quant model at `bits` (the training's forward, ranges
    per batch).

    Args:
      qmodel: the model from `cpt_jax.quantize_model`.
      variables: its trained variables (``params``, ``batch_stats``, ...).
      batches: model inputs (e.g. a few training batches' ``"inputs"``).
      bits: the export width, 2..8.
      **apply_kwargs: passed to ``apply`` (e.g. ``train=False``).

    Returns:
      ``{range_key: (lo, hi)}``: the product's path (a right-hand activation, as in
      attention: ``path + ":rhs"``).
    """
    bits = check_export_bits(bits)
    model = with_provider(qmodel, CALIBRATION)

    @jax.jit
    def run(variables, inputs):
        with precision(bits):
            _, updates = model.apply(variables, inputs, mutable=[CALIBRATION_COLLECTION],
                                     **apply_kwargs)
        return updates.get(CALIBRATION_COLLECTION, {})

    batches = iter(batches)
    first = next(batches, None)
    if first is None:
        raise ValueError("calibrate needs at least one batch of inputs")
    init = jax.jit(lambda x: model.init(jax.random.key(0), x, **apply_kwargs))(first)
    collection = init.get(CALIBRATION_COLLECTION, {})
    variables = {k: v for k, v in dict(variables).items() if k != CALIBRATION_COLLECTION}
    for inputs in itertools.chain([first], batches):
        collection = run({**variables, CALIBRATION_COLLECTION: collection}, inputs)
    return _ranges_of_collection(jax.device_get(collection))


def running_ranges(variables: Mapping) -> Ranges:
    """The ranges of a run trained with ``activation_range="running"``:
    ``{range_key: (zero_point, zero_point + range)}`` of each running range."""
    collection = serialization.to_state_dict(dict(variables.get(RANGES_COLLECTION, {})))
    flat = traverse_util.flatten_dict(collection, sep="/")
    out = {}
    for key, value in flat.items():
        path, _, leaf = key.rpartition("/")
        name = range_key_of_variable(path) if leaf == "zero_point" else None
        if name is not None:
            zp = float(value)
            out[name] = (zp, zp + float(flat[f"{path}/range"]))
    return dict(sorted(out.items()))
