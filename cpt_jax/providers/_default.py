"""`PROVIDERS`: the one table from a `QuantConfig` to the provider that computes it.

Each row is a `ProviderRow`: a name, a predicate on the config and the provider; the
first row whose predicate holds wins, else CPT's fake quantization. A new provider
is one module (a `cpt_jax.interception.Provider`) plus one row, here or through
`register_provider`.

======================  =====================================  =====================
row                     when                                   provider
======================  =====================================  =====================
``running_ranges``      ``activation_range="running"``         `RUNNING_RANGES`
``format_switch``       a `FormatSwitch` (format schedule)     `FORMAT_SWITCH`
``lowp_gemm``           ``gemm=LowpGemm(...)``                 `LOWP_GEMM`
``fp8_compute``         ``fp8_compute=True``                   `FP8_COMPUTE`
``block_formats``       an MX / NVFP4 / ScaledFloat tensor     `BLOCK_FORMATS`
``int8``                ``int8=True``                          `INT8`
======================  =====================================  =====================

A format schedule computes each of its formats with the rows marked
``in_format_schedules`` (`branch_provider`).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from cpt_jax.formats import is_blocked
from cpt_jax.providers.block_formats import BLOCK_FORMATS, FP8_COMPUTE
from cpt_jax.providers.fake_quant import FAKE_QUANT
from cpt_jax.providers.format_switch import FORMAT_SWITCH
from cpt_jax.providers.int8 import INT8
from cpt_jax.providers.lowp_gemm import LOWP_GEMM
from cpt_jax.providers.running_ranges import RUNNING_RANGES
from cpt_jax.quant_config import FormatSwitch, QuantConfig


@dataclasses.dataclass(frozen=True)
class ProviderRow:
    """One row of `PROVIDERS`: ``provider`` computes the products of the configs for
    which ``applies(config)`` holds; ``in_format_schedules``: also each format of a
    format schedule."""

    name: str
    applies: Callable[[Any], bool]
    provider: Any
    in_format_schedules: bool = False


def uses_block_format(config) -> bool:
    """Whether any of the config's weight, activation or error formats is block-scaled
    (`MX`, `NVFP4`, `ScaledFloat`)."""
    tensors = (config.weight, config.activation, config.error)
    return any(tq is not None and is_blocked(tq.fmt) for tq in tensors)


PROVIDERS: list[ProviderRow] = [
    ProviderRow("running_ranges", lambda c: getattr(c, "activation_range", "") == "running",
                RUNNING_RANGES),
    ProviderRow("format_switch", lambda c: isinstance(c, FormatSwitch), FORMAT_SWITCH),
    ProviderRow("lowp_gemm", lambda c: getattr(c, "gemm", None) is not None, LOWP_GEMM,
                in_format_schedules=True),
    ProviderRow("fp8_compute", lambda c: bool(getattr(c, "fp8_compute", False)), FP8_COMPUTE,
                in_format_schedules=True),
    ProviderRow("block_formats", uses_block_format, BLOCK_FORMATS, in_format_schedules=True),
    ProviderRow("int8", lambda c: bool(getattr(c, "int8", False)), INT8),
]
"""The table (first match wins; `register_provider` adds rows)."""


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
           "register_provider", "uses_block_format"]
