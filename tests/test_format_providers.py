"""Block formats through the seam: blocks along each product's contraction; FP8 compute.

References are built by hand from `quantize` with the axes written out here (the
activation's features, the kernel's input features, the error's output features for
``dL/dx`` and its batch axis for ``dL/dW``), and from `lax.dot_general`.
"""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import cpt_jax
from cpt_jax.formats import MX, ScaledFloat, quantize
from cpt_jax.providers.block_formats import BLOCK_FORMATS, FP8_COMPUTE
from cpt_jax.quant_config import QuantConfig, TensorQuant, get_preset

RNG = np.random.default_rng(0)
X = jnp.asarray(RNG.normal(size=(48, 64)), jnp.float32)
COT = jnp.asarray(RNG.normal(size=(48, 40)) * np.exp(RNG.normal(size=(48, 40))), jnp.float32)


def dense_and_params(features=40):
    model = nn.Dense(features, use_bias=False)
    params = model.init(jax.random.key(0), X)
    return model, params


def apply_quantized(model, params, config, provider, x=X, bits=8.0, grad_bits=8.0):
    qmodel = cpt_jax.quantize_model(model, config=config, provider=provider)

    def loss(params, x):
        with cpt_jax.precision(jnp.float32(bits), jnp.float32(grad_bits), rng=jax.random.key(3)):
            y = qmodel.apply(params, x)
        return jnp.sum(y * COT), y

    (_, y), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(params, x)
    return y, grads


# Nearest rounding everywhere so the references are deterministic; the weight's MX
# axis is left at -1 (output features) on purpose: the provider must move it.
MX_CONFIG = QuantConfig(weight=TensorQuant(MX("e2m1")), activation=TensorQuant(MX("e2m1")),
                        error=TensorQuant(MX("e2m1")))


@pytest.mark.slow
def test_dense_blocks_follow_the_contraction_forward_and_backward():
    model, params = dense_and_params()
    w = params["params"]["kernel"]                                # (in 64, out 40)
    y, (grads, dx) = apply_quantized(model, params, MX_CONFIG, BLOCK_FORMATS)
    xq = quantize(X, 8, MX("e2m1", axis=1))                       # along in-features
    wq = quantize(w, 8, MX("e2m1", axis=0))                       # along in-features
    np.testing.assert_allclose(y, xq @ wq, rtol=1e-6, atol=1e-6)
    g_for_dx = quantize(COT, 8, MX("e2m1", axis=1))               # g W^T sums out-features
    g_for_dw = quantize(COT, 8, MX("e2m1", axis=0))               # x^T g sums the batch
    np.testing.assert_allclose(dx, g_for_dx @ wq.T, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(grads["params"]["kernel"], xq.T @ g_for_dw, rtol=1e-5, atol=1e-5)
    # The two error quantizations differ (blocks along different axes).
    assert not np.allclose(g_for_dx, g_for_dw)


def test_default_fake_quant_keeps_the_format_axis():
    # Without the provider the weight is blocked along its own axis (-1): different.
    model, params = dense_and_params()
    y_blocks, _ = apply_quantized(model, params, MX_CONFIG, BLOCK_FORMATS)
    y_plain, _ = apply_quantized(model, params, MX_CONFIG, cpt_jax.providers.FAKE_QUANT)
    assert not np.allclose(y_blocks, y_plain)


@pytest.mark.slow
def test_conv_kernel_blocked_along_input_channels():
    x = jnp.asarray(RNG.normal(size=(2, 6, 6, 40)), jnp.float32)
    model = nn.Conv(8, (3, 3), use_bias=False)
    params = model.init(jax.random.key(1), x)
    config = MX_CONFIG.replace(error=None)
    qmodel = cpt_jax.quantize_model(model, config=config, provider=BLOCK_FORMATS)
    with cpt_jax.precision(8.0):
        y = qmodel.apply(params, x)
    w = params["params"]["kernel"]                                # HWIO
    want = jax.lax.conv_general_dilated(
        quantize(x, 8, MX("e2m1", axis=3)), quantize(w, 8, MX("e2m1", axis=2)), (1, 1), "SAME",
        dimension_numbers=("NHWC", "HWIO", "NHWC"))
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("preset", ["fp8_tensor", "fp8_rowwise"])
def test_fp8_compute_equals_fake_quant_up_to_accumulation_order(preset):
    model, params = dense_and_params()
    config = get_preset(preset)
    y8, (g8, dx8) = apply_quantized(model, params, config, FP8_COMPUTE)
    yq, (gq, dxq) = apply_quantized(model, params, config, BLOCK_FORMATS)
    np.testing.assert_allclose(y8, yq, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dx8, dxq, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(g8["params"]["kernel"], gq["params"]["kernel"], rtol=1e-5,
                               atol=1e-5)
    # And both differ from fp32 (the operands really are float8).
    assert not np.allclose(y8, X @ params["params"]["kernel"], rtol=1e-3)


def test_fp8_compute_runs_a_float8_dot_with_fp32_accumulation():
    model, params = dense_and_params()
    qmodel = cpt_jax.quantize_model(model, config=get_preset("fp8_tensor"), provider=FP8_COMPUTE)

    def forward(params, x):
        with cpt_jax.precision(8.0):
            return qmodel.apply(params, x)

    text = str(jax.make_jaxpr(forward)(params, X))
    assert "f8_e4m3fn" in text and "preferred_element_type=float32" in text


def test_fp8_compute_at_32_bits_is_the_float_product():
    model, params = dense_and_params()
    y, _ = apply_quantized(model, params, get_preset("fp8_tensor"), FP8_COMPUTE, bits=32.0,
                           grad_bits=32.0)
    np.testing.assert_allclose(y, X @ params["params"]["kernel"], rtol=1e-6, atol=1e-6)


@pytest.mark.slow
def test_fp8_compute_falls_back_for_block_formats():
    model, params = dense_and_params()
    config = get_preset("fp8_blockwise")
    y8, _ = apply_quantized(model, params, config, FP8_COMPUTE)
    yq, _ = apply_quantized(model, params, config, BLOCK_FORMATS)
    np.testing.assert_array_equal(y8, yq)
    w = params["params"]["kernel"]
    want = quantize(X, 8, ScaledFloat("e4m3", "tile", axis=1)) @ quantize(
        w, 8, ScaledFloat("e4m3", "block", axis=0, other_axis=1))
    np.testing.assert_allclose(y8, want, rtol=1e-6, atol=1e-6)


def test_configs_pick_their_provider_and_fp8_compute_is_validated():
    from cpt_jax.providers import default_provider

    assert default_provider(get_preset("mxfp4")) is BLOCK_FORMATS
    assert default_provider(get_preset("nvfp4")) is BLOCK_FORMATS
    assert default_provider(get_preset("fp8_compute")) is FP8_COMPUTE
    assert default_provider(get_preset("cpt")) is cpt_jax.providers.FAKE_QUANT
    with pytest.raises(ValueError, match="compute='fp8'"):
        get_preset("mxfp8").replace(compute="fp8")
    with pytest.raises(ValueError, match="compute='fp8'"):
        get_preset("int8").replace(compute="fp8")
    # A quantize_model without an explicit provider uses the blocks of the config.
    model, params = dense_and_params()
    y_default, _ = apply_quantized(model, params, MX_CONFIG, None)
    y_blocks, _ = apply_quantized(model, params, MX_CONFIG, BLOCK_FORMATS)
    np.testing.assert_array_equal(y_default, y_blocks)


@pytest.mark.slow
def test_fp8_compute_conv_with_explicit_padding_and_strides():
    x = jnp.asarray(RNG.normal(size=(2, 7, 7, 5)), jnp.float32)
    model = nn.Conv(6, (3, 3), strides=(2, 2), padding=((1, 1), (2, 0)), use_bias=False)
    params = model.init(jax.random.key(2), x)
    config = get_preset("fp8_compute").replace(error=None)
    outs = {}
    for name, provider in (("fp8", FP8_COMPUTE), ("fake", BLOCK_FORMATS)):
        qmodel = cpt_jax.quantize_model(model, config=config, provider=provider)
        with cpt_jax.precision(8.0):
            outs[name] = qmodel.apply(params, x)
    np.testing.assert_allclose(outs["fp8"], outs["fake"], rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_embedding_table_of_a_lookup_is_blocked_along_its_features():
    model = nn.Embed(70, 48)
    ids = jnp.arange(20) % 70
    params = model.init(jax.random.key(4), ids)
    qmodel = cpt_jax.quantize_model(model, config=MX_CONFIG.replace(error=None))
    with cpt_jax.precision(8.0):
        y = qmodel.apply(params, ids)
    table = quantize(params["params"]["embedding"], 8, MX("e2m1", axis=1))
    np.testing.assert_array_equal(y, table[ids])
