"""Storing an exported model: orbax, a flat ``.npz`` any code can read, and its metadata."""
from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import serialization, traverse_util

from cpt_jax.export._checks import EXPORT_FORMAT_VERSION, check_export_bits
from cpt_jax.export._model import ExportedModel

Array = jax.Array


def param_bytes(tree: Any) -> int:
    """``sum(leaf.nbytes)`` over a pytree of arrays (an `ExportedModel`: its variables).

    Example:
      >>> param_bytes({"w": jnp.zeros((4, 4)), "c": jnp.zeros(4, jnp.int8)})
      68
    """
    if isinstance(tree, ExportedModel):
        tree = tree.variables
    return int(sum(np.asarray(leaf).nbytes for leaf in jax.tree_util.tree_leaves(tree)))


def to_numpy_dict(exported: ExportedModel) -> dict[str, np.ndarray]:
    """A flat dict of numpy arrays any code can read (``np.savez`` it).

    Keys: ``"bits"``, ``"format_version"`` and ``"variables/<collection>/<path>/<leaf>"``,
    e.g. ``"variables/params/conv1/kernel"`` (int8 codes).
    """
    state = serialization.to_state_dict(jax.device_get(dict(exported.variables)))
    flat = traverse_util.flatten_dict(state, sep="/")
    arrays = {f"variables/{k}": np.asarray(v) for k, v in flat.items()}
    arrays["bits"] = np.asarray(exported.bits, np.int32)
    arrays["format_version"] = np.asarray(EXPORT_FORMAT_VERSION, np.int32)
    return arrays


def from_numpy_dict(arrays: Mapping[str, Any], model: nn.Module) -> ExportedModel:
    """The `ExportedModel` of `to_numpy_dict`'s arrays (or a loaded ``.npz``) and `model`."""
    if "bits" not in arrays or "format_version" not in arrays:
        raise ValueError("not an exported model: the arrays lack 'bits' and 'format_version'")
    version = int(np.asarray(arrays["format_version"]))
    if version != EXPORT_FORMAT_VERSION:
        raise ValueError(f"exported model format_version={version}; this cpt_jax reads "
                         f"{EXPORT_FORMAT_VERSION}")
    flat = {k[len("variables/"):]: jnp.asarray(np.asarray(v)) for k, v in arrays.items()
            if k.startswith("variables/")}
    variables = traverse_util.unflatten_dict(flat, sep="/")
    return ExportedModel(variables=variables, model=model,
                         bits=check_export_bits(int(np.asarray(arrays["bits"]))))


def save_exported(directory: str, exported: ExportedModel) -> str:
    """Save with orbax (``directory/model``) plus ``directory/export.npz``
    (`to_numpy_dict`) and ``directory/export_meta.json``; returns `directory`."""
    import orbax.checkpoint as ocp

    directory = os.path.abspath(os.path.expanduser(directory))
    os.makedirs(directory, exist_ok=True)
    arrays = to_numpy_dict(exported)
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(os.path.join(directory, "model"), arrays, force=True)
        checkpointer.wait_until_finished()
    np.savez(os.path.join(directory, "export.npz"), **arrays)
    meta = {"bits": exported.bits, "format_version": EXPORT_FORMAT_VERSION,
            "layers": list(exported.layers()), "param_bytes": param_bytes(exported)}
    with open(os.path.join(directory, "export_meta.json"), "w") as f:
        json.dump(meta, f, indent=2)
    return directory


def restore_exported(directory: str, model: nn.Module) -> ExportedModel:
    """The `ExportedModel` saved by `save_exported` in `directory`, for `model`
    (the float Linen model it was exported from)."""
    import orbax.checkpoint as ocp

    path = os.path.join(os.path.abspath(os.path.expanduser(directory)), "model")
    if not os.path.isdir(path):
        raise ValueError(f"no exported model in {directory!r} (expected {path})")
    with ocp.StandardCheckpointer() as checkpointer:
        arrays = checkpointer.restore(path)
    return from_numpy_dict(arrays, model)
