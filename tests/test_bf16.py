"""The bf16 provider (`cpt_jax.extensions.bf16`): registered by name through the public
calls, products on bfloat16 operands with float32 accumulation, 16 bits in the cost."""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import cpt_jax
from cpt_jax import providers
from cpt_jax.extensions import bf16

X = jnp.asarray(np.random.default_rng(0).normal(size=(16, 24)), jnp.float32)


def _dense():
    model = cpt_jax.quantize_model(nn.Dense(8), config="bf16")
    return model, model.init(jax.random.key(0), X)


def test_registered_by_name_as_a_provider_and_a_preset():
    assert providers.default_provider(cpt_jax.get_preset("bf16")) is bf16.BF16
    assert cpt_jax.QuantConfig(compute="bf16").compute == "bf16"
    assert "bf16" in cpt_jax.PRESETS.__doc__


def test_forward_is_the_bf16_product_with_fp32_accumulation_and_32_bits_is_fp32():
    model, v = _dense()
    k, b = v["params"]["kernel"], v["params"]["bias"]
    run = jax.jit(lambda v, bits: _apply(model, v, bits))
    want = lax.dot_general(X.astype(jnp.bfloat16), k.astype(jnp.bfloat16), (((1,), (0,)), ((), ())),
                           preferred_element_type=jnp.float32) + b
    np.testing.assert_array_equal(run(v, 4.0), want)
    np.testing.assert_array_equal(run(v, 32.0), X @ k + b)
    assert not np.array_equal(want, X @ k + b)          # bf16 rounding changed something
    assert run._cache_size() == 1


def _apply(model, v, bits, grad_bits=8):
    with cpt_jax.precision(bits, grad_bits=grad_bits):
        return model.apply(v, X)


def test_gradients_are_float32_from_bf16_operands_and_bf16_errors():
    model, v = _dense()
    target = jnp.ones((16, 8))
    loss = lambda v, g: jnp.sum((_apply(model, v, 8.0, g) - target) ** 2)
    gk = jax.grad(loss)(v, 8)["params"]["kernel"]
    gk32 = jax.grad(lambda v: jnp.sum((nn.Dense(8).apply(v, X) - target) ** 2))(v)["params"][
        "kernel"]
    assert gk.dtype == jnp.float32
    np.testing.assert_allclose(gk, gk32, rtol=0, atol=0.05 * float(jnp.abs(gk32).max()))
    g_fp32_errors = jax.grad(loss)(v, None)["params"]["kernel"]   # no grad_bits: fp32 errors
    assert not np.array_equal(gk, g_fp32_errors)


@pytest.mark.parametrize("grad_bits,want", [(8, 16.0), (None, 32.0)])
def test_the_cost_counts_16_bits_per_operand(grad_bits, want):
    b_w, b_a, b_g = cpt_jax.quant_config.operand_bits(cpt_jax.get_preset("bf16"), 4.0, grad_bits)
    assert (float(b_w), float(b_a), float(b_g)) == (16.0, 16.0, want)
