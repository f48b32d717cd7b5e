"""What a number format must provide: `FormatProtocol` (a new format is one class).

The built-in formats (`FORMATS`) are dispatched by type. Any other object is a
format when it has a ``grid`` method, the fake quantizer of one tensor:

    q = fmt.grid(x, bits, rounding, key)

on float32 ``x`` and a float32 (possibly traced) ``bits``; `quantize` does the rest
of the contract around it (``bits >= 32`` is the identity, non-finite inputs pass
through, dtype and shape kept, rounding and bits checked). Optional: an
``element_width(bits)`` method (the stored bits of one element; default ``bits``) and
a ``scale_bits_per_element`` attribute (the scales' bits spread over the elements;
default 0), read by `bits_per_element` and so by the cost. docs/formats.md ("Adding
a format") writes one in full.
"""
from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import jax

Array = jax.Array


@runtime_checkable
class FormatProtocol(Protocol):
    """A number format defined outside cpt_jax: its ``grid`` (see the module docstring)."""

    def grid(self, x: Array, bits: Array, rounding: str, key: Array | None) -> Array:
        """``x`` on the format's grid at word length ``bits`` (traceable)."""


def is_custom_format(fmt: Any) -> bool:
    """True for an object that is a format by `FormatProtocol` (has a callable ``grid``).

    Example:
      >>> class Halves:
      ...     def grid(self, x, bits, rounding, key):
      ...         return jnp.round(x * 2) / 2
      >>> is_custom_format(Halves()), is_custom_format(3)
      (True, False)
    """
    return callable(getattr(fmt, "grid", None))


def custom_element_width(fmt: Any, bits: Array) -> Array:
    """``fmt.element_width(bits)`` if the format defines it, else ``bits``."""
    width = getattr(fmt, "element_width", None)
    return bits if width is None else jax.numpy.asarray(width(bits), jax.numpy.float32)


def custom_scale_bits(fmt: Any) -> float:
    """``fmt.scale_bits_per_element`` if the format defines it, else 0."""
    return float(getattr(fmt, "scale_bits_per_element", 0.0))
