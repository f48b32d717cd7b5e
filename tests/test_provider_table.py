"""`cpt_jax.providers.PROVIDERS`: one table from a config to its provider; a new
provider is one class registered by name (`register_provider`)."""
from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

import cpt_jax
from cpt_jax import providers
from cpt_jax.format_schedules import format_switch

EXPECTED = {"cpt": "FAKE_QUANT", "symmetric_per_token": "FAKE_QUANT", "int8": "INTEGER",
            "int8_per_token": "INTEGER", "int8_tile128": "INTEGER", "mxfp8": "BLOCK_FORMATS", "nvfp4": "BLOCK_FORMATS",
            "fp8_compute": "FP8_COMPUTE", "fp8_gemm": "LOWP_GEMM", "nvfp4_gemm": "LOWP_GEMM"}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_each_preset_gets_the_provider_of_its_row(name):
    assert providers.default_provider(cpt_jax.get_preset(name)) is getattr(providers,
                                                                           EXPECTED[name])


def test_running_ranges_and_format_schedules_have_their_rows():
    running = cpt_jax.CPT_CONFIG.replace(activation_range="running")
    assert providers.default_provider(running) is providers.RUNNING_RANGES
    assert providers.default_provider(format_switch(["mxfp4", "mxfp8"])) is providers.FORMAT_SWITCH
    assert providers.default_provider(None) is providers.FAKE_QUANT
    # a format schedule's branches: the rows marked in_format_schedules only
    assert providers.branch_provider(cpt_jax.get_preset("int8")) is providers.FAKE_QUANT
    assert providers.branch_provider(cpt_jax.get_preset("mxfp8_gemm")) is providers.LOWP_GEMM


@dataclasses.dataclass(frozen=True)
class Doubling(providers.FakeQuantProvider):
    """A toy provider: the fake-quant product, times two."""

    def compute(self, product, lhs, rhs, state, apply):
        return 2.0 * super().compute(product, lhs, rhs, state, apply)


def test_a_new_provider_is_one_class_registered_by_name():
    marked = cpt_jax.CPT_CONFIG.replace(bits_offset=0.25)
    x = jnp.linspace(-1.0, 1.0, 12).reshape(3, 4)
    plain = cpt_jax.quantize_model(nn.Dense(2), config=cpt_jax.CPT_CONFIG)
    v = plain.init(jax.random.key(0), x)
    with pytest.raises(ValueError, match="compute must be one of"):
        cpt_jax.QuantConfig(compute="doubling")
    row = providers.register_provider("doubling", Doubling(),
                                      applies=lambda c: c.bits_offset == 0.25, priority=99)
    try:
        assert providers.default_provider(marked) is row.provider      # by its predicate
        by_name = cpt_jax.CPT_CONFIG.replace(compute="doubling")
        assert providers.default_provider(by_name) is row.provider     # by its name
        model = cpt_jax.quantize_model(nn.Dense(2), config=marked)
        with cpt_jax.precision(8.0, rng=jax.random.key(0)):
            doubled = model.apply(v, x)
        assert providers.default_provider(cpt_jax.CPT_CONFIG) is providers.FAKE_QUANT
        # compute="fake" skips rows that compute on low-precision arithmetic
        assert providers.default_provider(marked.replace(compute="fake")) is providers.FAKE_QUANT
        with pytest.raises(ValueError, match="already registered"):
            providers.register_provider("doubling", Doubling())
        with pytest.raises(ValueError, match="compute"):
            providers.register_provider("no_compute", object())
    finally:
        providers.unregister_provider("doubling")
    with pytest.raises(ValueError, match="compute must be one of"):
        cpt_jax.QuantConfig(compute="doubling")
    with cpt_jax.precision(8.25, rng=jax.random.key(0)):
        single = plain.apply(v, x)
    assert jnp.allclose(doubled, 2.0 * single)
    assert providers.default_provider(marked) is providers.FAKE_QUANT


def test_auto_asks_the_predicates_by_priority_not_by_registration_order():
    """Two rows that both apply: the higher priority wins whichever registered first."""
    config = cpt_jax.CPT_CONFIG.replace(bits_offset=0.5)
    for order in ((("low", 1), ("high", 2)), (("high", 2), ("low", 1))):
        rows = {name: providers.register_provider(name, Doubling(), priority=p,
                                                  applies=lambda c: c.bits_offset == 0.5)
                for name, p in order}
        try:
            assert providers.default_provider(config) is rows["high"].provider
        finally:
            for name, _ in order:
                providers.unregister_provider(name)


def test_a_format_schedule_at_static_bits_computes_the_branch_of_that_width():
    x = jnp.linspace(-2.0, 2.0, 64).reshape(2, 32)
    switch = cpt_jax.quantize_model(nn.Dense(4), config=format_switch(["mxfp4", "mxfp8"]))
    v = switch.init(jax.random.key(0), x)
    for bits, name in ((4, "mxfp4"), (8, "mxfp8")):
        alone = cpt_jax.quantize_model(nn.Dense(4), config=cpt_jax.get_preset(name))
        with cpt_jax.precision(bits, rng=jax.random.key(2)):
            assert jnp.array_equal(switch.apply(v, x), alone.apply(v, x)), name
