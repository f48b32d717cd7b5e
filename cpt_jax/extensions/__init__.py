"""Extensions: one module each, written only through cpt_jax's public calls.

A module in this folder adds a format, a preset, a controller (or a provider) the way
a user's own module would: it defines it through the public protocol
(`cpt_jax.formats.FormatProtocol`, `cpt_jax.controllers.PrecisionController`) and
registers it in one call (`cpt_jax.formats.register_format`,
`cpt_jax.register_preset`, `cpt_jax.register_controller`). ``import cpt_jax``
imports every module here (found by listing the folder: no list to edit), so a new
extension is its module, its test file and its line in the docs' table.

Outside cpt_jax the same module works from anywhere: import it (a script, or a
``--config`` file of the main job) before the registry is read.
"""
from __future__ import annotations

import importlib
import pkgutil


def extension_modules() -> tuple[str, ...]:
    """The modules of this folder (names not starting with ``_``), sorted.

    Example:
      >>> all(name.startswith("cpt_jax.extensions.") for name in extension_modules())
      True
    """
    return tuple(sorted(f"{__name__}.{info.name}" for info in pkgutil.iter_modules(__path__)
                        if not info.name.startswith("_")))


def load_extensions() -> tuple[str, ...]:
    """Import every extension module (each registers what it defines); their names."""
    names = extension_modules()
    for name in names:
        importlib.import_module(name)
    return names


LOADED = load_extensions()
"""The extension modules ``import cpt_jax`` imported."""

__all__ = ["LOADED", "extension_modules", "load_extensions"]
