"""The provider table's machinery: `ProviderRow`, `PROVIDERS` (filled by
`cpt_jax.providers._default` and by `register_provider`), the choice
(`default_provider`, `branch_provider`).

A config names what computes its products (``QuantConfig.compute``):

* a registered name (``"int"``, ``"fp8"``, ``"bf16"``, a user's own): that row's provider;
* ``"auto"``: the rows with a predicate (``applies``), highest ``priority`` first (ties by
  name): the first whose predicate holds, else `FAKE_QUANT`;
* ``"fake"``: the same, among the rows that compute in float32 (``real=False``).

It imports no provider but the fallback (`FAKE_QUANT`), so a provider that chooses
among the others (the format switch picks one per format) can import the choice
without importing the table's rows.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from cpt_jax.providers.fake_quant import FAKE_QUANT
from cpt_jax.quant_config import AUTO, COMPUTES, ComputeSpec, QuantConfig, register_compute


@dataclasses.dataclass(frozen=True)
class ProviderRow:
    """One row of `PROVIDERS`.

    Attributes:
      name: the row's name, a valid ``QuantConfig.compute``.
      provider: the object with ``compute(product, lhs, rhs, state, apply)``.
      applies: ``applies(config)`` (None: only chosen by name): when it holds, configs
        with ``compute="auto"`` (and ``"fake"`` if the row is not `real`) use this row.
      priority: the order predicates are asked in (higher first; ties by name).
      real: whether it computes on low-precision arithmetic (``compute="fake"``
        skips it).
      in_format_schedules: also a format of a format schedule (`branch_provider`).
    """

    name: str
    provider: Any
    applies: Callable[[Any], bool] | None = None
    priority: int = 0
    real: bool = False
    in_format_schedules: bool = False


PROVIDERS: dict[str, ProviderRow] = {}
"""The table by name (rows in `cpt_jax.providers._default`; `register_provider` adds more)."""


def _by_priority(rows):
    return sorted(rows, key=lambda r: (-r.priority, r.name))


def _first_applying(config, rows):
    return next((row.provider for row in _by_priority(rows)
                 if row.applies is not None and row.applies(config)), FAKE_QUANT)


def default_provider(config: QuantConfig | None):
    """The provider a config asks for (the module docstring): its ``compute`` row, or
    for ``"auto"`` / ``"fake"`` the first applying row by priority, else `FAKE_QUANT`
    (also for None).

    Example:
      >>> default_provider(cpt_jax.get_preset("mxfp8")) is cpt_jax.providers.BLOCK_FORMATS
      True
      >>> default_provider(cpt_jax.get_preset("int8")) is cpt_jax.providers.INTEGER
      True
    """
    if config is None:
        return FAKE_QUANT
    name = getattr(config, "compute", AUTO)
    if name not in (AUTO, "fake"):
        if name not in PROVIDERS:
            raise ValueError(f"QuantConfig.compute={name!r} names no provider; registered: "
                             f"{sorted(PROVIDERS)}")
        return PROVIDERS[name].provider
    rows = PROVIDERS.values() if name == AUTO else (r for r in PROVIDERS.values() if not r.real)
    return _first_applying(config, rows)


def branch_provider(config: QuantConfig):
    """The provider of one format of a format schedule: the first row marked
    ``in_format_schedules`` that applies (by priority), else `FAKE_QUANT`.

    Example:
      >>> from cpt_jax import get_preset
      >>> [type(branch_provider(get_preset(n))).__name__ for n in ("mxfp8_gemm", "mxfp6", "cpt")]
      ['LowpGemmProvider', 'BlockFormatProvider', 'FakeQuantProvider']
    """
    if getattr(config, "compute", AUTO) not in (AUTO, "fake"):
        row = PROVIDERS.get(config.compute)
        if row is not None and row.in_format_schedules:
            return row.provider
    return _first_applying(config, (r for r in PROVIDERS.values() if r.in_format_schedules))


def register_provider(name: str, provider, *, applies: Callable[[Any], bool] | None = None,
                      check: Callable[[QuantConfig], None] | None = None,
                      operand_bits: Callable | None = None, priority: int = 0,
                      real: bool = True, in_format_schedules: bool = False,
                      doc: str = "") -> ProviderRow:
    """Register `provider` under `name`: ``QuantConfig(compute=name)`` selects it.

    Args:
      name: the row's name (ValueError if taken).
      provider: an object with ``compute(product, lhs, rhs, state, apply) -> y``
        (`cpt_jax.interception.Provider`).
      applies: a predicate on configs; when given, ``compute="auto"`` configs for which
        it holds use this provider (before rows of lower `priority`).
      check: ``check(config)`` raises ValueError for a config it cannot compute
        (run when a ``QuantConfig(compute=name)`` is built).
      operand_bits: ``(config, bits, grad_bits) -> (b_w, b_a, b_g)``, the bits its
        operands cost (`cpt_jax.cost`); None: the formats' stored bits.
      priority: where `applies` is asked among the other predicates (higher first).
      real: computes on low-precision arithmetic (``compute="fake"`` skips it).
      in_format_schedules: it may compute one format of a format schedule.
      doc: one line for tables and ``--help``.

    Returns:
      The new `ProviderRow`.

    Example:
      >>> row = register_provider("mine", cpt_jax.providers.FAKE_QUANT, doc="a copy")
      >>> cpt_jax.QuantConfig(compute="mine").compute, default_provider(
      ...     cpt_jax.QuantConfig(compute="mine")) is row.provider
      ('mine', True)
      >>> unregister_provider("mine")
    """
    if name in PROVIDERS or name in (AUTO, "fake"):
        raise ValueError(f"a provider named {name!r} is already registered: {sorted(PROVIDERS)}")
    if not callable(getattr(provider, "compute", None)):
        raise ValueError(f"register_provider({name!r}): the provider needs a compute(product, "
                         f"lhs, rhs, state, apply) method, got {provider!r}")
    register_compute(name, ComputeSpec(check, operand_bits, doc))
    row = ProviderRow(name, provider, applies, priority, real, in_format_schedules)
    PROVIDERS[name] = row
    return row


def unregister_provider(name: str) -> None:
    """Remove a registered provider (and its ``QuantConfig.compute`` name).

    Example:
      >>> unregister_provider("no such row")  # doctest: +ELLIPSIS
      Traceback (most recent call last):
      ValueError: no provider named 'no such row'...
    """
    if name not in PROVIDERS:
        raise ValueError(f"no provider named {name!r}; registered: {sorted(PROVIDERS)}")
    del PROVIDERS[name]
    COMPUTES.pop(name, None)


def add_builtin(row: ProviderRow) -> None:
    """Add a built-in row (its ``compute`` name is declared by `cpt_jax.quant_config`)."""
    PROVIDERS[row.name] = row


__all__ = ["PROVIDERS", "ProviderRow", "add_builtin", "branch_provider", "default_provider",
           "register_provider", "unregister_provider"]
