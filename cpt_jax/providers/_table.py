"""The provider table's machinery: `ProviderRow`, `PROVIDERS` (filled by
`cpt_jax.providers._default`), the choice (`default_provider`, `branch_provider`) and
`register_provider`.

It imports no provider but the fallback (`FAKE_QUANT`), so a provider that chooses
among the others (the format switch picks one per format) can import the choice
without importing the table's rows.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from cpt_jax.providers.fake_quant import FAKE_QUANT
from cpt_jax.quant_config import QuantConfig


@dataclasses.dataclass(frozen=True)
class ProviderRow:
    """One row of `PROVIDERS`: ``provider`` computes the products of the configs for
    which ``applies(config)`` holds; ``in_format_schedules``: also each format of a
    format schedule."""

    name: str
    applies: Callable[[Any], bool]
    provider: Any
    in_format_schedules: bool = False


PROVIDERS: list[ProviderRow] = []
"""The table (first match wins; rows in `cpt_jax.providers._default`, `register_provider`
adds more)."""


def default_provider(config: QuantConfig | None):
    """The provider a config asks for: the first row of `PROVIDERS` that applies, else
    `FAKE_QUANT` (also for None).

    Example:
      >>> default_provider(cpt_jax.CPT_CONFIG) is cpt_jax.providers.FAKE_QUANT
      True
      >>> [row.name for row in PROVIDERS if row.applies(cpt_jax.get_preset("mxfp8_gemm"))]
      ['lowp_gemm', 'block_formats']
    """
    if config is None:
        return FAKE_QUANT
    return next((row.provider for row in PROVIDERS if row.applies(config)), FAKE_QUANT)


def branch_provider(config: QuantConfig):
    """The provider of one format of a format schedule: the first row marked
    ``in_format_schedules`` that applies, else `FAKE_QUANT`.

    Example:
      >>> from cpt_jax import get_preset
      >>> [type(branch_provider(get_preset(n))).__name__ for n in ("mxfp8_gemm", "mxfp6", "cpt")]
      ['LowpGemmProvider', 'BlockFormatProvider', 'FakeQuantProvider']
    """
    rows = (row for row in PROVIDERS if row.in_format_schedules and row.applies(config))
    return next((row.provider for row in rows), FAKE_QUANT)


def register_provider(row: ProviderRow, *, before: str | None = None) -> None:
    """Add a row to `PROVIDERS`: first (``before=None``) or just before the named row.

    ValueError for a name already in the table or an unknown ``before``.

    Example:
      >>> mine = ProviderRow("mine", lambda c: False, cpt_jax.providers.FAKE_QUANT)
      >>> register_provider(mine, before="int8")
      >>> [r.name for r in PROVIDERS][-2:]
      ['mine', 'int8']
      >>> PROVIDERS.remove(mine)
    """
    names = [r.name for r in PROVIDERS]
    if row.name in names:
        raise ValueError(f"a provider row named {row.name!r} is already in PROVIDERS: {names}")
    if before is not None and before not in names:
        raise ValueError(f"register_provider(before={before!r}): no such row; rows: {names}")
    PROVIDERS.insert(0 if before is None else names.index(before), row)


__all__ = ["PROVIDERS", "ProviderRow", "branch_provider", "default_provider",
           "register_provider"]
