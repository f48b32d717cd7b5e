"""What a checkpoint's files are: saveable trees, the sha256 manifest, the saved structure.

A checkpoint stores the `TrainState` as a nested dict of plain arrays (`to_saveable`):
``step``, parameters, ``batch_stats``, optimizer state, ``skipped_steps`` and the PRNG
key, a typed key stored as its raw ``key_data`` and re-wrapped on restore
(`from_saveable`).

Layout of a step folder (written by `cpt_jax.runner.checkpoint_manager`)::

    <directory>/<step>/state/...           orbax PyTree (OCDBT) of the state
    <directory>/<step>/meta/...            orbax JSON of `meta`
    <directory>/<step>/cpt_manifest.json   sha256 + size of every file above

Integrity: the manifest is written last (atomically, fsynced: `write_manifest`); a
checkpoint without one, or whose files do not match it (`verify_manifest`), is *not*
used. An intact checkpoint whose leaves, shapes or dtypes differ from the current
model's (`structure_mismatch`) is another model's.
"""
from __future__ import annotations

import hashlib
import json
import os
from typing import Any

import jax
import jax.numpy as jnp
from flax import serialization

MANIFEST_NAME = "cpt_manifest.json"
_FORMAT_VERSION = 1


# --------------------------------------------------------------------------- pytrees

def _is_typed_key(x) -> bool:
    return isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jax.dtypes.prng_key)


def to_saveable(tree: Any) -> Any:
    """`tree` as a nested dict of plain arrays: typed PRNG keys become ``key_data``.

    ``to_saveable(state)["rng"] == jax.random.key_data(state.rng)``; dataclasses and
    namedtuples become dicts (`flax.serialization.to_state_dict`).

    Example:
      >>> to_saveable({"rng": jax.random.key(0)})["rng"].dtype
      dtype('uint32')
    """
    raw = jax.tree_util.tree_map(lambda x: jax.random.key_data(x) if _is_typed_key(x) else x,
                                 tree)
    return serialization.to_state_dict(raw)


def from_saveable(template: Any, saved: Any) -> Any:
    """Inverse of `to_saveable`: `saved` (nested dict) back into `template`'s pytree type,
    re-wrapping raw key data where the template holds a typed key (same key impl).

    Example:
      >>> t = {"rng": jax.random.key(0), "w": jnp.ones(2)}
      >>> from_saveable(t, to_saveable(t))["rng"].dtype
      key<fry>
    """
    raw_template = jax.tree_util.tree_map(
        lambda x: jax.random.key_data(x) if _is_typed_key(x) else x, template)
    restored = serialization.from_state_dict(raw_template, saved)
    return jax.tree_util.tree_map(
        lambda t, s: jax.random.wrap_key_data(s, impl=jax.random.key_impl(t))
        if _is_typed_key(t) else s, template, restored)


# --------------------------------------------------------------------------- manifest

def _sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _list_files(step_dir: str) -> list[str]:
    out = []
    for root, _, files in os.walk(step_dir):
        for name in files:
            rel = os.path.relpath(os.path.join(root, name), step_dir)
            if rel != MANIFEST_NAME and not rel.startswith(MANIFEST_NAME + "."):
                out.append(rel)
    return sorted(out)


def write_manifest(step_dir: str, step: int) -> str:
    """Write ``cpt_manifest.json`` (sha256 and size of every file) into `step_dir`.

    Written to a temporary file, fsynced, then renamed: the manifest exists only
    complete, and only after every file it lists.
    """
    files = {rel: {"sha256": _sha256_file(os.path.join(step_dir, rel)),
                   "size": os.path.getsize(os.path.join(step_dir, rel))}
             for rel in _list_files(step_dir)}
    manifest = {"format": _FORMAT_VERSION, "step": int(step), "files": files}
    path = os.path.join(step_dir, MANIFEST_NAME)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def verify_manifest(step_dir: str, step: int | None = None) -> str | None:
    """None if `step_dir` matches its manifest, else what is wrong (one line)."""
    path = os.path.join(step_dir, MANIFEST_NAME)
    if not os.path.isfile(path):
        return f"no {MANIFEST_NAME} (a save that did not finish)"
    try:
        with open(path) as f:
            manifest = json.load(f)
        files = manifest["files"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"unreadable {MANIFEST_NAME}: {exc}"
    if step is not None and manifest.get("step") != step:
        return f"{MANIFEST_NAME} is for step {manifest.get('step')}, not {step}"
    if not files:
        return f"{MANIFEST_NAME} lists no files"
    for rel, info in sorted(files.items()):
        full = os.path.join(step_dir, rel)
        if not os.path.isfile(full):
            return f"missing file {rel}"
        size = os.path.getsize(full)
        if size != info.get("size"):
            return f"file {rel} has {size} bytes, the manifest says {info.get('size')}"
        if _sha256_file(full) != info.get("sha256"):
            return f"file {rel} does not match its sha256 in the manifest"
    return None


# --------------------------------------------------------------------------- structure

def _leaf_specs(tree: Any) -> dict[str, tuple]:
    """``{"params/dense/kernel": (shape, dtype name)}`` of every array leaf of `tree`."""
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    out = {}
    for path, leaf in leaves:
        if hasattr(leaf, "shape") and hasattr(leaf, "dtype"):
            key = "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)
            out[key] = (tuple(leaf.shape), str(jax.numpy.dtype(leaf.dtype)))
    return out


def structure_mismatch(saved: Any, template: Any) -> str | None:
    """None if `saved` (a checkpoint's state metadata) has `template`'s leaves, shapes and
    dtypes, else the first difference on one line (a leaf missing on either side, or of
    another shape or dtype).

    Example:
      >>> structure_mismatch({"w": jnp.zeros((2, 3))}, {"w": jnp.zeros((2, 4))})
      'w has shape (2, 3) and dtype float32 there, (2, 4) and float32 here'
    """
    there, here = _leaf_specs(saved), _leaf_specs(template)
    missing, extra = sorted(set(here) - set(there)), sorted(set(there) - set(here))
    if missing:
        return (f"{len(missing)} leaves of this model are not there ({', '.join(missing[:3])}"
                f"{', ...' if len(missing) > 3 else ''})")
    if extra:
        return (f"it holds {len(extra)} leaves this model lacks ({', '.join(extra[:3])}"
                f"{', ...' if len(extra) > 3 else ''})")
    for key in sorted(here, key=lambda k: (not k.startswith("params/"), k)):  # params first
        if there[key] != here[key]:
            (s1, d1), (s2, d2) = there[key], here[key]
            return f"{key} has shape {s1} and dtype {d1} there, {s2} and {d2} here"
    return None

