"""Low-precision GEMMs in all three products (cpt_jax.providers.lowp_gemm, issue 25).

* Agreement: every ``*_gemm`` preset equals the fake-quant path of the same format
  (the same quantized operands, dequantized, float32 GEMM) to float32 rounding,
  forward and both gradients, on three kinds of product.
* The backward GEMMs quantize along their own contraction: checked against a
  reference written here with `quantize` on the transposed axes.
* JAX's MX scale rounding (up) against the OCP floor: both tested, and the ``"up"``
  provider equals ``jax.nn.scaled_dot_general`` itself (jax >= 0.11).
* The train step's jaxpr: every GEMM, forward and backward, on float8 / float4 codes.
* The NVFP4 recipe (16x16 weight blocks, random Hadamard transform, stochastic
  rounding of errors) against float64 references written from its description.
* Delayed scaling from the amax history; full precision at 32 bits; NaN visible.
"""
from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest

import cpt_jax
from cpt_jax import training
from cpt_jax.formats import MX, NVFP4, OCPFloat, ScaledFloat, quantize
from cpt_jax.providers import lowp_gemm as lg
from cpt_jax.providers.block_formats import BLOCK_FORMATS
from cpt_jax.quant_config import PRESETS, LowpGemm, TensorQuant

GEMM_PRESETS = ("fp8_gemm", "fp8_gemm_delayed", "fp8_gemm_rowwise", "fp8_gemm_blockwise",
                "mxfp8_gemm", "mxfp6_gemm", "mxfp4_gemm", "nvfp4_gemm")
RNG = np.random.default_rng(0)
X = jnp.asarray(RNG.normal(size=(64, 96)) * np.exp(RNG.normal(size=(64, 96))), jnp.float32)
DTYPES = {"e4m3": ml_dtypes.float8_e4m3fn, "e2m1": ml_dtypes.float4_e2m1fn}
MAX = {"e4m3": 448.0, "e2m1": 6.0}


def fake(config):
    """The same recipe computed by the fake-quant path."""
    return config.replace(gemm=dataclasses.replace(config.gemm, compute="fake"))


def run(model, params, x, config, bits=8.0, grad_bits=8.0, rng=jax.random.key(3),
        provider=None):
    """``(y, d params, dx)`` of ``sum(y * cot)`` through the quantized model."""
    qmodel = cpt_jax.quantize_model(model, config=config, provider=provider)

    def loss(params, x):
        with cpt_jax.precision(jnp.float32(bits), jnp.float32(grad_bits), rng=rng):
            y = qmodel.apply(params, x)
        cot = jax.random.normal(jax.random.key(7), y.shape) * 3.0
        return jnp.sum(y * cot), y

    (_, y), (dp, dx) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(params, x)
    return y, dp, dx


def assert_close(a, b, rtol=2e-6):
    """Equal to float32 rounding of sums: |a - b| <= rtol * max|b| everywhere."""
    for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        u, v = np.asarray(u, np.float64), np.asarray(v, np.float64)
        scale = max(np.max(np.abs(v)), 1e-30)
        assert np.max(np.abs(u - v)) <= rtol * scale * np.sqrt(u.size), np.max(np.abs(u - v)) / scale


class Scores(nn.Module):
    """Attention-style product of two activations with batch axes: q k^T per head."""

    @nn.compact
    def __call__(self, x):
        b, t, _ = x.shape
        q = nn.Dense(128, use_bias=False, name="q")(x).reshape(b, t, 2, 64)
        k = nn.Dense(128, use_bias=False, name="k")(x).reshape(b, t, 2, 64)
        return jnp.einsum("bqhd,bkhd->bhqk", q, k)


def init(model, x):
    """Parameters with magnitudes spread over binades (lognormal), so blocks along
    different axes get different scales (an initializer's weights share one binade)."""
    params = model.init(jax.random.key(0), x)
    rng = np.random.default_rng(1)
    return jax.tree.map(lambda p: jnp.asarray(
        rng.normal(size=p.shape) * np.exp(rng.normal(size=p.shape)) / np.sqrt(p.shape[0]),
        jnp.float32), params)


PRODUCTS = {
    "dense": (nn.Dense(48, use_bias=False), X),
    "scores": (Scores(), X[:64].reshape(2, 32, 96)[..., :48]),
    "dense_general": (nn.DenseGeneral(40, axis=(-2, -1), use_bias=False), X.reshape(64, 8, 12)),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", GEMM_PRESETS)
def test_every_gemm_preset_equals_its_fake_quant_path_on_a_dense(name):
    model, x = PRODUCTS["dense"]
    params = init(model, x)
    real = run(model, params, x, PRESETS[name])
    reference = run(model, params, x, fake(PRESETS[name]))
    assert_close(real, reference)
    # Not trivially equal to the float product: the formats do quantize.
    plain = run(model, params, x, PRESETS[name], bits=32.0, grad_bits=32.0)
    assert np.max(np.abs(np.asarray(real[0] - plain[0]))) > 1e-3 * np.max(np.abs(plain[0]))


@pytest.mark.slow
@pytest.mark.parametrize("name", ("fp8_gemm", "mxfp8_gemm", "nvfp4_gemm", "fp8_gemm_blockwise"))
@pytest.mark.parametrize("product", ("scores", "dense_general"))
def test_gemm_presets_equal_fake_quant_on_batched_and_multi_axis_products(name, product):
    model, x = PRODUCTS[product]
    params = init(model, x)
    assert_close(run(model, params, x, PRESETS[name]), run(model, params, x, fake(PRESETS[name])))


def test_per_tensor_fp8_gemm_equals_the_fp8_tensor_fake_quant_preset():
    """A per-tensor scale is the same along any axis: all three GEMMs equal fp8_tensor's
    fake quantization (BlockFormatProvider, straight-through backward)."""
    model, x = PRODUCTS["dense"]
    params = init(model, x)
    assert_close(run(model, params, x, PRESETS["fp8_gemm"]),
                 run(model, params, x, PRESETS["fp8_tensor"], provider=BLOCK_FORMATS))


MXFP4_NEAREST = PRESETS["mxfp4_gemm"].replace(error=TensorQuant(MX("e2m1")))


@pytest.mark.slow
@pytest.mark.parametrize("config,fwd,err", (
    (PRESETS["mxfp8_gemm"], MX("e4m3"), MX("e5m2")),
    (MXFP4_NEAREST, MX("e2m1"), MX("e2m1"))), ids=("mxfp8_gemm", "mxfp4_nearest"))
def test_backward_gemms_quantize_along_their_own_contraction(config, fwd, err):
    """y = Q_K(x) Q_K(W); dx = Q_N(g) Q_N(W)^T; dW = Q_M(x)^T Q_M(g)."""
    model, x = PRODUCTS["dense"]
    params = init(model, x)
    w = params["params"]["kernel"]                                 # (K 96, N 48)
    y, dp, dx = run(model, params, x, config)
    g = jax.random.normal(jax.random.key(7), y.shape) * 3.0        # (M 64, N 48)
    q = lambda v, fmt, axis: quantize(v, 8, dataclasses.replace(fmt, axis=axis))
    assert_close(y, q(x, fwd, 1) @ q(w, fwd, 0))
    assert_close(dx, q(g, err, 1) @ q(w, fwd, 1).T)
    assert_close(dp["params"]["kernel"], q(x, fwd, 0).T @ q(g, err, 0))


def test_requantized_backward_differs_from_straight_through_on_forward_blocks():
    """The fake-quant preset keeps W blocked along K in dx (straight-through on the
    forward operands): with e2m1 elements, whose grid depends on the block scale, a
    different number than the requantized W (e4m3 elements are nearly scale-free)."""
    model, x = PRODUCTS["dense"]
    params = init(model, x)
    _, _, dx = run(model, params, x, MXFP4_NEAREST)
    fake_preset = PRESETS["mxfp4"].replace(error=TensorQuant(MX("e2m1")))
    _, _, dx_straight = run(model, params, x, fake_preset, provider=BLOCK_FORMATS)
    assert np.max(np.abs(np.asarray(dx - dx_straight))) > 1e-2 * np.max(np.abs(np.asarray(dx)))


# --------------------------------------------------------------------------- MX scale rounding

def mx_reference(x, element, rounding, block=32) -> np.ndarray:
    """MX along the last axis in float64: OCP ``X = 2^(floor(log2 amax) - emax)``, or
    JAX's ``X = 2^ceil(log2(amax / max))``; elements the ml_dtypes cast of clip(x / X)."""
    x = np.asarray(x, np.float64)
    emax = {"e4m3": 8, "e2m1": 2}[element]
    out = np.zeros_like(x)
    for index in np.ndindex(*x.shape[:-1]):
        for start in range(0, x.shape[-1], block):
            b = x[index][start:start + block]
            amax = np.max(np.abs(b))
            if rounding == "floor":
                e = np.floor(np.log2(amax)) - emax
            else:
                e = np.ceil(np.log2(np.float32(amax) / np.float32(MAX[element])))
            scale = 2.0 ** e
            v = np.clip(b / scale, -MAX[element], MAX[element])
            out[index][start:start + block] = v.astype(DTYPES[element]).astype(np.float64) * scale
    return out


X3 = X.reshape(2, 32, 96)[..., :90]  # K = 90: padded to a whole number of blocks
EXACT_DECODE = {
    "fp8_tensor_e4m3": ScaledFloat("e4m3"), "fp8_tensor_e5m2": ScaledFloat("e5m2"),
    "fp8_row": ScaledFloat("e4m3", granularity="row", axis=2),
    "fp8_tile": ScaledFloat("e4m3", granularity="tile", axis=2),
    "fp8_block": ScaledFloat("e4m3", granularity="block", axis=2, other_axis=1),
    "ocp_e4m3": OCPFloat("e4m3"),
    "mxfp8": MX("e4m3", axis=2), "mxfp6": MX("e3m2", axis=2), "mxfp4": MX("e2m1", axis=2)}


@pytest.mark.parametrize("name", sorted(EXACT_DECODE))
def test_decoded_codes_equal_the_fake_operand_bit_for_bit(name):
    """codes * scales (GemmOperand.decode) is formats.quantize, bit for bit."""
    tq = TensorQuant(EXACT_DECODE[name])
    op = lg.operand_codes(X3, tq, 8)
    decoded = np.asarray(op.decode(X3.shape[-1]))
    fake_q = np.asarray(lg.fake_operand(X3, tq, 8))
    assert decoded.shape == fake_q.shape == X3.shape
    np.testing.assert_array_equal(decoded.view(np.uint32), fake_q.view(np.uint32))


@pytest.mark.parametrize("block_2d", (False, True), ids=("nvfp4", "nvfp4_2d"))
def test_decoded_nvfp4_codes_equal_the_fake_operand_to_one_ulp(block_2d):
    """NVFP4's tensor scale is held as ``1 / s_t`` (what the GEMM multiplies), so
    ``e * s_b * (1 / s_t)`` and quantize's ``e * (s_b / s_t)`` round apart by at most
    one ulp."""
    tq = TensorQuant(NVFP4(axis=2, other_axis=1, block_2d=block_2d))
    op = lg.operand_codes(X3, tq, 8)
    fake_q = np.asarray(lg.fake_operand(X3, tq, 8))
    decoded = np.asarray(op.decode(X3.shape[-1]))
    np.testing.assert_array_max_ulp(decoded, fake_q, maxulp=1)
    np.testing.assert_array_equal(decoded == 0, fake_q == 0)


@pytest.mark.slow
@pytest.mark.parametrize("element", ("e4m3", "e2m1"))
def test_mx_scale_rounding_floor_is_ocp_and_up_is_jax(element):
    x = X[:8]
    floor = np.asarray(quantize(x, 8, MX(element, axis=1)))
    up = np.asarray(quantize(x, 8, MX(element, axis=1, scale_rounding="up")))
    np.testing.assert_array_equal(floor, mx_reference(x, element, "floor"))
    np.testing.assert_array_equal(up, mx_reference(x, element, "up"))
    # They differ: e2m1's grid moves with the scale; e4m3 only where floor saturates
    # (amax / X in [448, 512)) or an element falls in the subnormals.
    assert np.mean(floor != up) > (0.05 if element == "e2m1" else 0.0)
    # up never saturates: every block's largest element keeps its value within a step.
    big = np.array([[500.0, 1.0]], np.float32)
    assert quantize(big, 8, MX("e4m3", block_size=2)).tolist() == [[448.0, 1.0]]
    assert quantize(big, 8, MX("e4m3", block_size=2, scale_rounding="up")).tolist() == [[512.0, 1.0]]


@pytest.mark.skipif(not lg.NATIVE_SCALED_MATMUL, reason="jax.nn.scaled_dot_general runs on "
                    "CPU from jax 0.11")
@pytest.mark.parametrize("mode,element", (("mxfp8", "e4m3"), ("mxfp4", "e2m1")))
def test_round_up_provider_equals_jax_scaled_dot_general(mode, element):
    """JAX's own MX GEMMs (forward and its low-precision backward, which re-quantizes
    along each backward contraction) are ours with ``scale_rounding="up"``."""
    w = jnp.asarray(RNG.normal(size=(96, 32)), jnp.float32)
    cot = jnp.asarray(RNG.normal(size=(64, 32)), jnp.float32)
    dims = (((1,), (0,)), ((), ()))
    jax_config = jax.nn.get_scaled_dot_general_config(mode)

    def theirs(x, w):
        return jnp.sum(jax.nn.scaled_dot_general(x, w, dims, configs=[jax_config] * 3) * cot)

    def ours(rounding):
        tq = TensorQuant(MX(element, axis=2, scale_rounding=rounding))
        spec = lg.GemmSpec(lg.gemm_layout(dims, 2, 2), tq, tq, tq, LowpGemm(), 8.0, 8.0)
        return lambda x, w: jnp.sum(lg.lowp_dot_general(
            spec, x, w, jnp.float32(8), jnp.float32(8), (None,) * 4, (None, None)) * cot)

    reference = jax.value_and_grad(theirs, (0, 1))(X, w)
    assert_close(jax.value_and_grad(ours("up"), (0, 1))(X, w), reference, rtol=1e-6)
    floor = jax.value_and_grad(ours("floor"), (0, 1))(X, w)
    assert abs(float(floor[0] - reference[0])) > 1e-3 * abs(float(reference[0]))


# --------------------------------------------------------------------------- jaxpr

def gemm_equations(jaxpr, out=None):
    """(primitive, operand dtypes) of every GEMM: dot_general, scaled_matmul (jax >= 0.11)
    or the emulation (jax 0.10); of a two-branch cond (the 32-bit escape) the last branch."""
    out = [] if out is None else out
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name in ("dot_general", "scaled_matmul_wrapper", "scaled_matmul"):
            out.append((name, tuple(str(v.aval.dtype) for v in eqn.invars[:2])))
            continue
        if name in ("pjit", "jit") and eqn.params.get("name") == "scaled_matmul_emulation":
            out.append(("emulation", tuple(str(v.aval.dtype) for v in eqn.invars[:2])))
            continue
        subs = [v for v in eqn.params.values() if hasattr(v, "jaxpr") or hasattr(v, "eqns")]
        subs += [b for v in eqn.params.values() if isinstance(v, tuple) for b in v
                 if hasattr(b, "jaxpr")]
        if name == "cond" and len(eqn.params["branches"]) == 2:
            subs = [eqn.params["branches"][1]]
        for sub in subs:
            gemm_equations(getattr(sub, "jaxpr", sub), out)
    return out


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x, train=False):
        return nn.Dense(32, name="fc2")(nn.relu(nn.Dense(64, name="fc1")(x)))


@pytest.mark.slow
@pytest.mark.parametrize("name", ("fp8_gemm", "fp8_gemm_delayed", "mxfp8_gemm", "nvfp4_gemm"))
def test_train_step_runs_every_gemm_on_low_precision_codes_and_compiles_once(name):
    qmodel = cpt_jax.quantize_model(MLP(), config=PRESETS[name])
    x = jnp.asarray(RNG.normal(size=(32, 48)), jnp.float32)
    batch = {"inputs": x, "labels": jnp.arange(32) % 32}
    state = training.create_train_state(qmodel, optax.sgd(0.1), jax.random.key(0), x)
    step = training.make_train_step(qmodel, optax.sgd(0.1), cpt_jax.constant(8),
                                    cpt_jax.constant(8))
    jaxpr = jax.make_jaxpr(lambda s, b, bits, grad_bits: training.train_step_body(
        qmodel, optax.sgd(0.1), training.classification_loss, s, b, bits, grad_bits, "skip",
        None, {}, [0]))(state, batch, 8.0, 8.0)
    gemms = gemm_equations(jaxpr.jaxpr)
    low = [g for g in gemms if all(("float8" in d or "float4" in d) for d in g[1])]
    hadamard = [g for g in gemms if g not in low]
    assert len(low) == 6, gemms                      # 2 products x 3 GEMMs
    assert len(hadamard) == (4 if name == "nvfp4_gemm" else 0), hadamard  # RHT of dW inputs
    if name.startswith("mx") or name.startswith("nv"):
        assert {g[0] for g in low} == ({"scaled_matmul_wrapper"} if lg.NATIVE_SCALED_MATMUL
                                       else {"emulation"})
    else:
        assert {g[0] for g in low} == {"dot_general"}
    for _ in range(3):
        state, _ = step(state, batch)
    assert step.num_compiles == 1
    if name == "fp8_gemm_delayed":
        hist = state.batch_stats["fc1"]["lowp_gemm_history"]["lhs"]
        assert int(hist.count) == 3 and float(hist.hi[0]) == pytest.approx(float(jnp.max(jnp.abs(x))))


# --------------------------------------------------------------------------- NVFP4 recipe

def cast(v, element):
    v = np.clip(np.asarray(v, np.float64), -MAX[element], MAX[element])
    return v.astype(np.float32).astype(DTYPES[element]).astype(np.float64)


def nvfp4_blocks_reference(x, blocks) -> np.ndarray:
    """NVFP4 of a 2-D array in float64: ``s_t = 448 * 6 / amax``; per block (a pair of
    slices) ``s_b = e4m3(amax_b / 6 * s_t)``, ``q = e2m1(x s_t / s_b) s_b / s_t``."""
    x = np.asarray(x, np.float64)
    s_t = 448.0 * 6.0 / np.max(np.abs(x))
    out = np.zeros_like(x)
    for rows, cols in blocks(x.shape):
        b = x[rows, cols]
        s_b = cast(np.max(np.abs(b)) / 6.0 * s_t, "e4m3")
        out[rows, cols] = cast(b * s_t / s_b, "e2m1") * s_b / s_t if s_b > 0 else 0.0
    return out


def along_rows(shape):
    """1 x 16 blocks along axis 1."""
    return [(slice(i, i + 1), slice(j, j + 16)) for i in range(shape[0])
            for j in range(0, shape[1], 16)]


def tiles(shape):
    """16 x 16 blocks."""
    return [(slice(i, i + 16), slice(j, j + 16)) for i in range(0, shape[0], 16)
            for j in range(0, shape[1], 16)]


def hadamard_reference(size, signs) -> np.ndarray:
    """Sylvester's Hadamard matrix, H_{2n} = [[H, H], [H, -H]], times diag(signs) / sqrt(n)."""
    h = np.array([[1.0]])
    while h.shape[0] < size:
        h = np.kron(np.array([[1.0, 1.0], [1.0, -1.0]]), h)
    return h @ np.diag(signs) / np.sqrt(size)


def nvfp4_recipe_reference(x, w, g, two_d=True, hadamard=True):
    """The recipe's three GEMMs in float64: y = Q(x) Q_w(W^T)^T, dx = Q(g) Q_w(W)^T,
    each operand quantized in 1 x 16 blocks along the GEMM's contraction, the weight in
    16 x 16 tiles, the weight-gradient inputs rotated by the random Hadamard transform
    along the tokens, 16 at a time."""
    x, w, g = (np.asarray(v, np.float64) for v in (x, w, g))
    wq = (lambda v: nvfp4_blocks_reference(v, tiles)) if two_d else (
        lambda v: nvfp4_blocks_reference(v, along_rows))
    y = nvfp4_blocks_reference(x, along_rows) @ wq(w.T).T            # W^T (N, K): along K
    dx = nvfp4_blocks_reference(g, along_rows) @ wq(w).T             # W (K, N): along N
    xt, gt = x.T, g.T                                                # (K, M), (N, M)
    if hadamard:
        h = hadamard_reference(16, lg.hadamard_signs(16, 0))
        rotate = lambda v: np.concatenate([v[:, j:j + 16] @ h.T for j in range(0, v.shape[1], 16)], 1)
        xt, gt = rotate(xt), rotate(gt)
    dw = (nvfp4_blocks_reference(gt, along_rows) @ nvfp4_blocks_reference(xt, along_rows).T).T
    return y, dw, dx


NEAREST_ERRORS = TensorQuant(NVFP4())


@pytest.mark.slow
@pytest.mark.parametrize("two_d,hadamard", ((True, True), (False, True), (True, False)))
def test_nvfp4_recipe_equals_a_float64_reference_of_its_description(two_d, hadamard):
    model, x = PRODUCTS["dense"]
    params = init(model, x)
    base = PRESETS["nvfp4_gemm"]
    config = base.replace(weight=TensorQuant(NVFP4(axis=-2, block_2d=two_d)),
                          error=NEAREST_ERRORS,
                          gemm=dataclasses.replace(base.gemm, hadamard_size=16 if hadamard else 0))
    y, dp, dx = run(model, params, x, config)
    g = jax.random.normal(jax.random.key(7), y.shape) * 3.0
    ref_y, ref_dw, ref_dx = nvfp4_recipe_reference(x, params["params"]["kernel"], g, two_d,
                                                   hadamard)
    assert_close(y, ref_y, rtol=1e-5)
    assert_close(dx, ref_dx, rtol=1e-5)
    assert_close(dp["params"]["kernel"], ref_dw, rtol=1e-5)


@pytest.mark.slow
def test_nvfp4_16x16_weight_blocks_quantize_w_and_its_transpose_alike():
    w = jnp.asarray(RNG.normal(size=(96, 48)), jnp.float32)
    two_d = NVFP4(axis=0, block_2d=True)
    np.testing.assert_array_equal(quantize(w, 4, two_d).T,
                                  quantize(w.T, 4, NVFP4(axis=1, block_2d=True)))
    one_d = quantize(w, 4, NVFP4(axis=0))
    assert np.any(np.asarray(one_d.T) != np.asarray(quantize(w.T, 4, NVFP4(axis=0))))
    assert float(cpt_jax.bits_per_element(two_d, 4)) == 4 + 8 / 256


@pytest.mark.slow
def test_nvfp4_stochastic_errors_are_unbiased():
    """SR on the error: each draw differs, and dx averages to ``g Q_w(W)^T`` (the
    error unrounded: E[SR(v)] = v) far closer than the nearest-rounded error does."""
    model, x = PRODUCTS["dense"]
    params = init(model, x)
    config = PRESETS["nvfp4_gemm"].replace(gemm=dataclasses.replace(
        PRESETS["nvfp4_gemm"].gemm, hadamard_size=0))
    keys = jax.random.split(jax.random.key(11), 48)
    dxs = jnp.stack([run(model, params, x, config, rng=k)[2] for k in keys[:2]])
    assert np.any(np.asarray(dxs[0] != dxs[1]))
    batch = jax.vmap(lambda k: run_dx(model, params, x, config, k))(keys)
    y = model.apply(params, x)
    g = np.asarray(jax.random.normal(jax.random.key(7), y.shape) * 3.0, np.float64)
    wq = nvfp4_blocks_reference(params["params"]["kernel"], tiles)
    # E[SR(g / scale)] = g / scale inside the range: the mean approaches g W_q^T.
    mean = np.asarray(batch, np.float64).mean(0)
    nearest = nvfp4_blocks_reference(g, along_rows) @ wq.T
    exact = g @ wq.T
    ratio = np.abs(mean - exact).mean() / np.abs(nearest - exact).mean()
    assert ratio < 0.35, ratio          # (48 draws)


def run_dx(model, params, x, config, key):
    qmodel = cpt_jax.quantize_model(model, config=config)

    def loss(x):
        with cpt_jax.precision(jnp.float32(8), jnp.float32(8), rng=key):
            y = qmodel.apply(params, x)
        return jnp.sum(y * jax.random.normal(jax.random.key(7), y.shape) * 3.0)

    return jax.grad(loss)(x)


# --------------------------------------------------------------------------- the rest

def test_delayed_scaling_quantizes_with_the_history_amax():
    """Step 1 (empty history) is current scaling; step 2 scales 3x with step 1's amax,
    so the largest values saturate at 448 * amax_1 / 448."""
    model, x = PRODUCTS["dense"]
    qmodel = cpt_jax.quantize_model(model, config=PRESETS["fp8_gemm_delayed"])
    variables = qmodel.init(jax.random.key(0), x)
    w = variables["params"]["kernel"]

    def forward(v, x):
        with cpt_jax.precision(jnp.float32(8), jnp.float32(8)):
            return qmodel.apply(v, x, mutable=["batch_stats"])

    y1, upd = jax.jit(forward)(variables, x)
    y_current = run(model, {"params": variables["params"]}, x, PRESETS["fp8_gemm"])[0]
    assert_close(y1, y_current)
    y2, _ = jax.jit(forward)({**variables, **upd}, 3 * x)
    amax_x, amax_w = float(jnp.max(jnp.abs(x))), float(jnp.max(jnp.abs(w)))
    xq = cast(np.clip(3 * np.asarray(x, np.float64) / (amax_x / 448), -448, 448), "e4m3") * (amax_x / 448)
    wq = cast(np.asarray(w, np.float64) / (amax_w / 448), "e4m3") * (amax_w / 448)
    assert_close(y2, xq @ wq, rtol=1e-5)
    assert np.max(np.abs(xq)) == pytest.approx(amax_x)       # 3x saturated at the old amax


def test_bits_32_is_the_float_product_and_traced_bits_compile_once():
    model, x = PRODUCTS["dense"]
    params = init(model, x)
    plain = run(model, params, x, None)
    assert_close(run(model, params, x, PRESETS["mxfp8_gemm"], bits=32.0, grad_bits=32.0), plain)
    qmodel = cpt_jax.quantize_model(model, config=PRESETS["mxfp8_gemm"])

    @jax.jit
    def y_at(bits):
        with cpt_jax.precision(bits, bits):
            return qmodel.apply(params, x)

    assert_close(y_at(jnp.float32(32)), plain[0])
    assert_close(y_at(jnp.float32(8)), run(model, params, x, PRESETS["mxfp8_gemm"])[0])
    assert y_at._cache_size() == 1


def test_a_non_finite_operand_makes_the_output_nan():
    model, x = PRODUCTS["dense"]
    params = init(model, x)
    y, _, _ = run(model, params, x.at[3, 5].set(jnp.inf), PRESETS["fp8_gemm"])
    assert np.all(np.isnan(np.asarray(y)))


def test_convolutions_fall_back_to_block_format_fake_quant():
    conv = nn.Conv(8, (3, 3), use_bias=False)
    x = jnp.asarray(RNG.normal(size=(2, 8, 8, 32)), jnp.float32)
    params = conv.init(jax.random.key(0), x)
    assert_close(run(conv, params, x, PRESETS["mxfp8_gemm"]),
                 run(conv, params, x, PRESETS["mxfp8"], provider=BLOCK_FORMATS))


def test_gemm_configs_are_validated_naming_the_field():
    with pytest.raises(ValueError, match="needs weight in OCPFloat"):
        cpt_jax.QuantConfig(gemm=LowpGemm())                  # CPT's AffineInt
    with pytest.raises(ValueError, match="one block length"):
        PRESETS["mxfp8_gemm"].replace(weight=TensorQuant(NVFP4()))
    with pytest.raises(ValueError, match="scaling='delayed'"):
        PRESETS["mxfp8_gemm"].replace(gemm=LowpGemm(scaling="delayed"))
    with pytest.raises(ValueError, match="hadamard_size"):
        LowpGemm(hadamard_size=12)
    with pytest.raises(ValueError, match="MX.scale_rounding"):
        MX(scale_rounding="nearest")
