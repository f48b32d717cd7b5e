"""Deprecated alias of `cpt_jax.quant_config` (renamed: `config` is the run's ConfigDict).

Import `QuantConfig`, `TensorQuant` and the presets from `cpt_jax` or
`cpt_jax.quant_config` instead; this module will be removed in a future release.
"""
import warnings

from cpt_jax.quant_config import (  # noqa: F401
    CPT_CONFIG,
    FULL_PRECISION,
    INT8_CONFIG,
    SCALINGS,
    QuantConfig,
    TensorQuant,
)

warnings.warn("cpt_jax.config is renamed cpt_jax.quant_config; import from there "
              "(or from cpt_jax)", DeprecationWarning, stacklevel=2)
