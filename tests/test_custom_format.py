"""A format defined outside cpt_jax (`FormatProtocol`: an object with a ``grid``
method) gets the whole contract of `quantize`, the cost's bits, products and presets."""
from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import cpt_jax
from cpt_jax.formats import FormatProtocol, bits_per_element, check_format, quantize


@dataclasses.dataclass(frozen=True)
class Halves:
    """Multiples of 2^-(bits - 4), stored in `bits` bits plus an 8-bit scale per 32."""

    scale_bits_per_element: float = 8.0 / 32

    def grid(self, x, bits, rounding, key):
        unit = 2.0 ** -(bits - 4.0)
        return jnp.round(x / unit) * unit

    def element_width(self, bits):
        return bits


def test_quantize_wraps_a_custom_grid_in_the_contract():
    x = jnp.array([0.3, -1.26, jnp.nan, jnp.inf, 7.1], jnp.bfloat16)
    q = quantize(x, 5, Halves())
    assert q.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(q[:2], np.float32), [0.5, -1.5])
    assert bool(jnp.isnan(q[2])) and bool(jnp.isinf(q[3]))
    np.testing.assert_array_equal(quantize(x, 32, Halves()), x)
    f = jax.jit(lambda x, b: quantize(x, b, Halves()))
    assert [float(f(jnp.float32(0.3), jnp.float32(b))) for b in (4, 5, 6)] == [0.0, 0.5, 0.25]
    assert f._cache_size() == 1
    assert isinstance(Halves(), FormatProtocol)


def test_objects_without_a_grid_are_still_refused():
    with pytest.raises(ValueError, match="fmt must be one of"):
        check_format(object())
    with pytest.raises(ValueError, match="fmt must be one of"):
        cpt_jax.TensorQuant("int8")


def test_the_cost_reads_the_custom_widths():
    assert float(bits_per_element(Halves(), 6)) == 6.25
    assert float(bits_per_element(Halves(), 32)) == 32.0


def test_a_custom_preset_trains_and_the_main_job_accepts_it():
    from cpt_jax.runner.validation import validate_config
    from experiments.configs import default

    config = cpt_jax.QuantConfig(weight=cpt_jax.TensorQuant(Halves()),
                                 activation=cpt_jax.TensorQuant(Halves()),
                                 error=cpt_jax.TensorQuant(Halves()))
    model = cpt_jax.quantize_model(nn.Dense(3), config=config)
    x = jnp.linspace(-1.0, 1.0, 8).reshape(2, 4)
    v = model.init(jax.random.key(0), x)
    with cpt_jax.precision(5, 5):
        y = model.apply(v, x)
    w = quantize(v["params"]["kernel"], 5, Halves())
    np.testing.assert_allclose(y, quantize(x, 5, Halves()) @ w + v["params"]["bias"],
                               rtol=1e-6)
    cfg = default.get_config()
    cfg.precision.quantizer = "halves"
    with pytest.raises(ValueError, match="'halves' is unknown"):
        validate_config(cfg, device_count=1)
    cpt_jax.register_preset("halves", config, "Multiples of 2^-(bits - 4) everywhere.")
    try:
        validate_config(cfg, device_count=1)
        assert "``halves``" in cpt_jax.PRESETS.__doc__
    finally:
        cpt_jax.quant_config.unregister_preset("halves")
    assert "halves" not in cpt_jax.PRESETS
