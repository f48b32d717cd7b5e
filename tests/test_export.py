"""Export to a real integer model: grids against cpt_jax.formats, agreement with fake
quant per model kind, integer products in the program, round trips, bad input, CLI."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import cpt_jax
from cpt_jax import export as ex
from cpt_jax.formats import AffineInt, BlockFloat, SymmetricInt, quantize
from cpt_jax.models import get_model
from cpt_jax.ops import grids, quantize_with_range
from cpt_jax.quant_config import QuantConfig, TensorQuant

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EVAL = {"train": False}


def _perturb_batch_stats(variables, key):
    """Non-trivial BatchNorm statistics (init has mean 0, var 1)."""
    if "batch_stats" not in variables:
        return variables
    leaves, tree = jax.tree_util.tree_flatten(variables["batch_stats"])
    keys = jax.random.split(key, len(leaves))
    leaves = [leaf + 0.3 * jnp.abs(jax.random.normal(k, leaf.shape)) for leaf, k in zip(leaves, keys)]
    return {**variables, "batch_stats": jax.tree_util.tree_unflatten(tree, leaves)}


def _export(model, inputs, kwargs, *, bits=8, rules=cpt_jax.CPT_RULES, config=cpt_jax.CPT_CONFIG,
            calibration=None, fp32_layers="keep"):
    qmodel = cpt_jax.quantize_model(model, rules=rules, config=config)
    variables = _perturb_batch_stats(qmodel.init(jax.random.key(0), inputs, **kwargs),
                                     jax.random.key(1))
    ranges = ex.calibrate(qmodel, variables, calibration or [inputs], bits, **kwargs)
    exported = ex.export_model(qmodel, variables, bits, ranges, inputs, fp32_layers=fp32_layers,
                               **kwargs)
    return qmodel, variables, ranges, exported


def _both(qmodel, variables, ranges, exported, inputs, kwargs, bits=8):
    @jax.jit
    def both(exported, variables, inputs, ranges):
        return (ex.int8_apply(exported, inputs, **kwargs),
                ex.fake_quant_apply(qmodel, variables, inputs, bits=bits, ranges=ranges, **kwargs))

    y_int8, y_ref = both(exported, variables, inputs, ranges)
    return np.asarray(y_int8), np.asarray(y_ref)


def _assert_agree(y_int8, y_ref, rtol=2e-5):
    scale = float(np.max(np.abs(y_ref)))
    np.testing.assert_allclose(y_int8, y_ref, rtol=0, atol=rtol * scale + 1e-7)
    assert np.mean(np.argmax(y_int8, -1) == np.argmax(y_ref, -1)) >= 0.99


# --------------------------------------------------------------------------- grids

@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("fmt,kind", [(AffineInt(channel_axis=-1), "affine"),
                                      (SymmetricInt(channel_axis=-1), "symmetric")])
def test_kernel_codes_are_the_training_grid(bits, fmt, kind):
    w = jax.random.normal(jax.random.key(bits), (3, 3, 4, 5)) * jnp.arange(1.0, 6.0)
    codes, scale, offset = grids.kernel_codes(w, bits, kind, channel_axis=-1)
    assert codes.dtype == jnp.int8 and scale.shape == offset.shape == (5,)
    code_min, code_max, shift = grids.code_bounds(kind, bits)
    assert int(codes.min()) >= code_min - shift and int(codes.max()) <= code_max - shift
    assert -128 <= code_min - shift and code_max - shift <= 127
    np.testing.assert_allclose(codes * scale + offset, quantize(w, bits, fmt), rtol=0, atol=1e-6)


@pytest.mark.parametrize("fmt,kind", [(AffineInt(), "affine"), (SymmetricInt(), "symmetric")])
def test_static_grid_of_the_own_range_is_the_dynamic_grid(fmt, kind):
    x = jax.random.normal(jax.random.key(0), (64,)) + 0.7
    for bits in (2, 5, 8):
        static = grids.static_quantize(x, bits, kind, x.min(), x.max())
        np.testing.assert_array_equal(static, quantize(x, bits, fmt))
        np.testing.assert_array_equal(static, quantize_with_range(x, x.min(), x.max(), bits, fmt))


@pytest.mark.slow
@pytest.mark.parametrize("bits", [2, 8])
def test_reference_is_the_models_fake_quant_when_ranges_are_the_batchs_own(bits):
    """Calibrated on the batch itself, the static reference = cpt_jax's dynamic one."""
    x = jax.random.normal(jax.random.key(2), (4, 6, 6, 3)) + 2.0   # range excludes 0
    for layer in (nn.Conv(5, (3, 3), padding="SAME"), nn.Dense(7)):
        qmodel = cpt_jax.quantize_model(nn.Sequential([layer]))
        variables = qmodel.init(jax.random.key(3), x)
        ranges = ex.calibrate(qmodel, variables, [x], bits)
        with cpt_jax.precision(bits):
            dynamic = qmodel.apply(variables, x)
        reference = ex.fake_quant_apply(qmodel, variables, x, bits=bits, ranges=ranges)
        np.testing.assert_allclose(reference, dynamic, rtol=1e-6, atol=1e-6)


# --------------------------------------------------------------------------- agreement

@pytest.mark.slow
@pytest.mark.parametrize("bits", [3, 8])
def test_conv_with_padding_and_offset_inputs_matches_fake_quant(bits):
    """Zero padding of an input whose grid excludes 0: the ``op(1_x, W_q)`` term."""
    x = jax.random.uniform(jax.random.key(4), (2, 7, 7, 3), minval=1.0, maxval=3.0)
    model = nn.Sequential([nn.Conv(4, (3, 3), strides=(2, 2), padding=((1, 2), (0, 1)))])
    _assert_agree(*_both(*_export(model, x, {}, bits=bits, rules=()), x, {}, bits=bits))


def _kinds():
    img = jax.random.normal(jax.random.key(5), (6, 8, 8, 1))
    graph = {"features": jax.random.normal(jax.random.key(6), (10, 5)),
             "senders": jnp.arange(10), "receivers": (jnp.arange(10) + 3) % 10,
             "edge_weight": jnp.full((10,), 0.5)}
    tokens = jax.random.randint(jax.random.key(7), (3, 8), 1, 30)
    return {
        "cnn": (get_model("cnn", num_classes=10, features=(4, 8)), img),
        "resnet": (get_model("resnet", depth=8, num_classes=10, width=4),
                   jax.random.normal(jax.random.key(8), (2, 8, 8, 3))),
        "mlp": (get_model("mlp", num_classes=10, hidden=(16,)), img),
        "gcn": (get_model("gcn", num_classes=3, hidden=8), graph),
        "transformer": (get_model("transformer_classifier", num_classes=2, vocab_size=30,
                                  d_model=16, num_heads=2, num_layers=1, mlp_dim=16,
                                  max_len=8), tokens),
        "lstm": (get_model("lstm_lm", num_classes=30, embed=8, hidden=8, num_layers=1), tokens),
    }


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["cnn", "resnet", "mlp", "gcn", "transformer", "lstm"])
def test_int8_model_matches_fake_quant_per_model_kind(kind):
    model, inputs = _kinds()[kind]
    rules = cpt_jax.CPT_RULES if kind not in ("gcn", "lstm") else ()
    qmodel, variables, ranges, exported = _export(model, inputs, EVAL, rules=rules)
    assert exported.layers(), "no layer was exported"
    _assert_agree(*_both(qmodel, variables, ranges, exported, inputs, EVAL))
    if rules:  # the classifier kept in fp32 stays a float kernel
        assert exported.variables["params"]["classifier"]["kernel"].dtype == jnp.float32
    flat = ex.to_numpy_dict(exported)
    if kind in ("transformer", "lstm"):  # the embedding lookup reads an int8 table
        assert [k for k in flat if k.endswith("/embedding") and flat[k].dtype == np.int8]
    if kind == "transformer":  # both attention products, two activation grids each
        assert {k.rsplit("/", 1)[-1] for k in flat if k.endswith("_scale")} >= {
            "lhs_scale", "rhs_scale", "kernel_scale", "input_scale"}
        assert any(p.endswith("attn/query_key") for p in exported.layers())
        assert any(p.endswith("attn/weights_value") for p in exported.layers())


class RawAttention(nn.Module):
    """Projections and attention written with raw einsums on its own parameters."""

    @nn.compact
    def __call__(self, tokens):
        embed = nn.Embed(30, 16, name="embed")
        x = embed(tokens)
        init = nn.initializers.normal(0.3)
        wq, wk, wv = (self.param(n, init, (16, 2, 8)) for n in ("wq", "wk", "wv"))
        q, k, v = (jnp.einsum("btd,dhk->bthk", x, w) for w in (wq, wk, wv))
        probs = jax.nn.softmax(jnp.einsum("bthk,bshk->bhts", q, k) / np.sqrt(8.0))
        o = jnp.einsum("bhts,bshk->bthk", probs, v).reshape(x.shape)
        x = x + o @ self.param("wo", init, (16, 16))
        return embed.attend(x)


@pytest.mark.slow
def test_raw_einsum_model_with_attention_exports_to_int8():
    tokens = jax.random.randint(jax.random.key(7), (3, 8), 1, 30)
    qmodel, variables, ranges, exported = _export(RawAttention(), tokens, {}, rules=())
    _assert_agree(*_both(qmodel, variables, ranges, exported, tokens, {}))
    params = exported.variables["params"]
    for name in ("wq", "wk", "wv", "wo"):
        assert params[name].dtype == jnp.int8 and f"{name}_scale" in params
    assert params["embed"]["embedding"].dtype == jnp.int8       # lookup and attend share it
    assert set(exported.layers()) >= {"einsum_3", "einsum_4", "matmul_0", "embed/attend"}
    assert "lhs_scale" in params["einsum_3"] and "input_scale" in params["matmul_0"]


def _jit_apply(qmodel, bits, **kwargs):
    @jax.jit
    def run(variables, inputs):
        with cpt_jax.precision(bits):
            return qmodel.apply(variables, inputs, **kwargs)
    return run


@pytest.mark.slow
def test_running_ranges_make_the_reference_the_models_own_evaluation():
    """A run trained with running activation ranges (CPT's evaluation protocol): the
    static reference with `running_ranges` is the model's own evaluation."""
    model, img = _kinds()["cnn"]
    config = cpt_jax.CPT_CONFIG.replace(activation_range="running")
    qmodel = cpt_jax.quantize_model(model, rules=cpt_jax.CPT_RULES, config=config)
    variables = qmodel.init(jax.random.key(0), img, **EVAL)
    _, updates = _jit_apply(qmodel, 8, train=True, mutable=["batch_stats", "activation_ranges"])(
        variables, img)
    variables = {**variables, **updates}
    ranges = ex.running_ranges(variables)
    assert set(ranges) == {"conv1", "conv2"} and all(hi > lo for lo, hi in ranges.values())
    own = _jit_apply(qmodel, 8, **EVAL)(variables, img)
    reference = ex.fake_quant_apply(qmodel, variables, img, bits=8, ranges=ranges, **EVAL)
    np.testing.assert_allclose(reference, own, rtol=1e-6, atol=1e-6)
    exported = ex.export_model(qmodel, variables, 8, ranges, img, **EVAL)
    _assert_agree(np.asarray(ex.int8_apply(exported, img, **EVAL)), np.asarray(reference))


@pytest.mark.slow
def test_symmetric_quantizer_and_other_calibration_batches():
    model, img = _kinds()["cnn"]
    calibration = [jax.random.normal(jax.random.key(i), img.shape) for i in (10, 11)]
    parts = _export(model, img, EVAL, config=cpt_jax.get_preset("int8"), calibration=calibration)
    _assert_agree(*_both(*parts, img, EVAL))
    assert float(parts[3].variables["params"]["conv1"]["input_code_shift"]) == 0.0


def test_integer_products_are_in_the_program():
    x = jax.random.normal(jax.random.key(0), (4, 5))
    *_, exported = _export(nn.Sequential([nn.Dense(3)]), x, {}, rules=())
    text = str(jax.make_jaxpr(ex.int8_apply)(exported, x))
    assert "i8[5,3]" in text and "preferred_element_type=int32" in text


@pytest.mark.slow
def test_layer_bits_offset_and_its_limit():
    model, img = _kinds()["cnn"]
    low = (("conv2", QuantConfig(bits_offset=-4.0)), ("classifier", None))
    parts = _export(model, img, EVAL, rules=low)
    codes = parts[3].variables["params"]["conv2"]["kernel"]
    assert int(codes.min()) >= -8 and int(codes.max()) <= 7      # 4 bits
    _assert_agree(*_both(*parts, img, EVAL))
    with pytest.raises(ValueError, match=r"bits of layer 'conv2'.*\[2, 8\]"):
        _export(model, img, EVAL, rules=(("conv2", QuantConfig(bits_offset=1.0)),))


@pytest.mark.slow
def test_fp32_layers_as_int8_weights():
    model, img = _kinds()["mlp"]
    qmodel, variables, ranges, exported = _export(model, img, EVAL, fp32_layers="int8_weights")
    classifier = exported.variables["params"]["classifier"]
    assert classifier["kernel"].dtype == jnp.int8 and "input_scale" not in classifier
    y_int8, y_ref = _both(qmodel, variables, ranges, exported, img, EVAL)
    _assert_agree(y_int8, y_ref, rtol=2e-2)     # 8-bit weights where the run kept fp32
    kept = ex.export_model(qmodel, variables, 8, ranges, img, **EVAL)
    assert ex.param_bytes(exported) < ex.param_bytes(kept) < ex.param_bytes(variables)


# --------------------------------------------------------------------------- round trips

@pytest.mark.slow
def test_orbax_and_numpy_round_trips(tmp_path):
    model, img = _kinds()["cnn"]
    qmodel, variables, ranges, exported = _export(model, img, EVAL)
    ex.save_exported(str(tmp_path / "out"), exported)
    restored = ex.restore_exported(str(tmp_path / "out"), model)
    arrays = dict(np.load(tmp_path / "out" / "export.npz"))
    from_npz = ex.from_numpy_dict(arrays, model)
    expected = ex.to_numpy_dict(exported)
    assert arrays["variables/params/conv1/kernel"].dtype == np.int8
    for other in (restored, from_npz):
        assert other.bits == exported.bits and other.layers() == exported.layers()
        got = ex.to_numpy_dict(other)
        assert sorted(got) == sorted(expected)
        for key, value in expected.items():
            assert got[key].dtype == value.dtype, key
            np.testing.assert_array_equal(got[key], value, err_msg=key)
    np.testing.assert_array_equal(ex.int8_apply(restored, img, **EVAL),
                                  ex.int8_apply(exported, img, **EVAL))
    meta = json.loads((tmp_path / "out" / "export_meta.json").read_text())
    assert meta["layers"] == ["conv1", "conv2"] and meta["param_bytes"] == ex.param_bytes(exported)


def test_param_bytes_of_int8_kernels():
    x = jnp.ones((1, 8, 8, 16))
    *_, exported = _export(nn.Sequential([nn.Conv(32, (3, 3), use_bias=False)]), x, {}, rules=())
    # 3*3*16*32 int8 codes + 32 scales + 32 offsets (float32) + 5 input scalars
    assert ex.param_bytes(exported) == 3 * 3 * 16 * 32 + 2 * 32 * 4 + 5 * 4


# --------------------------------------------------------------------------- bad input

@pytest.mark.parametrize("bits", [1, 9, 4.5, 0, -3, "eight", None, 32, float("nan"),
                                  float("inf")])
def test_bits_out_of_range_is_a_one_line_error(bits):
    with pytest.raises(ValueError, match=r"integer in \[2, 8\]") as info:
        ex.check_export_bits(bits)
    assert "\n" not in str(info.value)


@pytest.mark.slow
def test_bad_models_formats_and_arguments(tmp_path):
    x = jnp.ones((2, 4))
    dense = nn.Sequential([nn.Dense(3)])
    with pytest.raises(ValueError, match="quantize_model"):
        ex.calibrate(dense, {}, [x], 8)
    block = QuantConfig(weight=TensorQuant(BlockFloat()), activation=TensorQuant(BlockFloat()))
    qmodel = cpt_jax.quantize_model(dense, config=block)
    variables = qmodel.init(jax.random.key(0), x)
    ranges = ex.calibrate(qmodel, variables, [x], 8)
    with pytest.raises(ValueError, match="BlockFloat"):
        ex.export_model(qmodel, variables, 8, ranges, x)
    image = jnp.ones((1, 4, 4, 2))
    qmodel = cpt_jax.quantize_model(nn.Sequential([nn.ConvLocal(3, (3, 3))]))
    variables = qmodel.init(jax.random.key(0), image)
    with pytest.raises(ValueError, match=r"'layers_0' \(conv\) is quantized"):
        ex.export_model(qmodel, variables, 8, ex.calibrate(qmodel, variables, [image], 8), image)
    qmodel = cpt_jax.quantize_model(dense)
    variables = qmodel.init(jax.random.key(0), x)
    with pytest.raises(ValueError, match="at least one batch"):
        ex.calibrate(qmodel, variables, [], 8)
    with pytest.raises(ValueError, match="no activation range"):
        ex.export_model(qmodel, variables, 8, {}, x)
    ranges = ex.calibrate(qmodel, variables, [x], 8)
    with pytest.raises(ValueError, match="fp32_layers"):
        ex.export_model(qmodel, variables, 8, ranges, x, fp32_layers="float16")
    with pytest.raises(ValueError, match=r"\[2, 8\]"):
        ex.export_model(qmodel, variables, 16, ranges, x)
    with pytest.raises(ValueError, match="no exported model"):
        ex.restore_exported(str(tmp_path), dense)
    with pytest.raises(ValueError, match="not an exported model"):
        ex.from_numpy_dict({"w": np.zeros(3)}, dense)


# --------------------------------------------------------------------------- the CLI

def _cli(*args):
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO)
    return subprocess.run([sys.executable, "-m", "experiments.export", *args], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=300)


def test_cli_run_without_checkpoint_and_bad_bits_are_one_line_errors(tmp_path):
    from experiments import export as export_cli

    result = _cli(f"--run_dir={tmp_path}", f"--out={tmp_path / 'out'}")  # the CLI path once
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1].startswith("error: run directory")
    assert "no checkpoint" in result.stderr
    with pytest.raises(ValueError, match=r"--bits must be an integer in \[2, 8\]"):
        export_cli.export_run(str(tmp_path), str(tmp_path / "out"), 9)


@pytest.mark.slow
@pytest.mark.parametrize("activation_range", ["batch", "running"])
def test_export_of_a_finished_digits_run(tmp_path, activation_range):
    from cpt_jax.runner import job as runner
    from experiments import export as export_cli
    from experiments.configs import default

    config = default.get_config()  # checkpoint_every=0: the final state is kept anyway
    config.num_steps, config.eval_every = 8, 0
    config.batch_size, config.log_every = 32, 3
    config.tensorboard = config.plots = False
    config.precision.activation_range = activation_range
    runner.train_and_evaluate(config, str(tmp_path / "run"), progress=False)
    out = tmp_path / "export"
    result = export_cli.export_run(str(tmp_path / "run"), str(out), 8, calibration_batches=2,
                                   latency_repeats=1)
    saved = json.loads((out / "export.json").read_text())
    assert saved == json.loads(json.dumps(result, sort_keys=True))
    for key in ("fake_quant_test_accuracy", "int8_test_accuracy", "argmax_agreement",
                "param_bytes_fp32", "param_bytes_int8", "fake_quant_latency_ms",
                "int8_latency_ms"):
        assert key in saved, key
    assert saved["argmax_agreement"] >= 0.99 and saved["test_examples"] > 0
    assert abs(saved["int8_test_accuracy"] - saved["fake_quant_test_accuracy"]) <= 0.01
    assert saved["param_bytes_int8"] < 0.5 * saved["param_bytes_fp32"]
    if activation_range == "running":  # the reference is then the run's own evaluation
        assert saved["activation_ranges"] == "running"
        assert saved["fake_quant_dynamic_argmax_agreement"] == 1.0
    else:
        assert saved["activation_ranges"].startswith("calibration")
    restored = ex.restore_exported(str(out), get_model("cnn", num_classes=10))
    assert restored.layers() == ("conv1", "conv2")
