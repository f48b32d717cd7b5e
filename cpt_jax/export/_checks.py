"""What export accepts: widths 2..8 (an int8 container), integer grids, quantized models."""
from __future__ import annotations

from typing import Any

from cpt_jax.doors import QuantizedModel
from cpt_jax.formats import format_traits
from cpt_jax.quant_config import QuantConfig

Ranges = dict[str, tuple[float, float]]


MIN_EXPORT_BITS = 2


MAX_EXPORT_BITS = 8


FP32_LAYER_MODES = ("keep", "int8_weights")


EXPORT_FORMAT_VERSION = 2


def check_export_bits(bits: Any, name: str = "bits") -> int:
    """`bits` as an int in ``[2, 8]`` (the codes' int8 container), else ValueError.

    Example:
      >>> check_export_bits(8.0)
      8
    """
    try:
        value = float(bits)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be an integer in [2, 8], got {bits!r}") from None
    if (not MIN_EXPORT_BITS <= value <= MAX_EXPORT_BITS) or value != int(value):
        raise ValueError(f"{name} must be an integer in [2, 8] (an int8 container), got {bits!r}")
    return int(value)


def check_quantized_model(qmodel: Any) -> QuantizedModel:
    if not isinstance(qmodel, QuantizedModel):
        raise ValueError("export needs a model from cpt_jax.quantize_model(...), "
                         f"got {type(qmodel).__name__}")
    return qmodel


def grid_kind(fmt: Any, what: str) -> str:
    """``"affine"`` for `AffineInt`, ``"symmetric"`` for `SymmetricInt`, else ValueError.

    Example:
      >>> from cpt_jax.formats import AffineInt
      >>> grid_kind(AffineInt(), "weight")
      'affine'
    """
    grid = format_traits(fmt).range_grid
    if grid in ("affine", "symmetric"):
        return grid
    raise ValueError(f"export supports AffineInt and SymmetricInt grids; the {what} "
                     f"format is {type(fmt).__name__}")


def layer_bits(bits: int, cfg: QuantConfig, path: str) -> int:
    """The layer's width ``bits + cfg.bits_offset``, checked to fit int8."""
    return check_export_bits(bits + cfg.bits_offset, f"bits of layer {path!r} (bits + bits_offset)")
