"""The benchmarks' instruments: HLO reading, the GPU roofline model, the pass counter,
the GPU summary. Small programs, lowered or compiled on CPU; nothing is timed."""
import json

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import cpt_jax
from benchmarks import ab, gpu_summary, overhead, profile_step, roofline
from benchmarks import common as C
from benchmarks import gpu_model as G
from benchmarks import hlo as H

HLO = """HloModule m, entry_computation_layout={(f32[8,4]{1,0}, f32[])->f32[8,2]{1,0}}

%branch_lo (p: (f32[8,4], f32[4,2])) -> f32[8,2] {
  %p = (f32[8,4]{1,0}, f32[4,2]{1,0}) parameter(0)
  %a = f32[8,4]{1,0} get-tuple-element(%p), index=0
  %b = f32[4,2]{1,0} get-tuple-element(%p), index=1
  %ca = f8e4m3fn[8,4]{1,0} convert(%a)
  %cb = f8e4m3fn[4,2]{1,0} convert(%b)
  ROOT %d = f32[8,2]{1,0} dot(%ca, %cb), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%branch_hi (q: (f32[8,4], f32[4,2])) -> f32[8,2] {
  %q = (f32[8,4]{1,0}, f32[4,2]{1,0}) parameter(0)
  %x = f32[8,4]{1,0} get-tuple-element(%q), index=0
  %y = f32[4,2]{1,0} get-tuple-element(%q), index=1
  ROOT %e = f32[8,2]{1,0} dot(%x, %y), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

ENTRY %main (x: f32[8,4], bits: f32[]) -> f32[8,2] {
  %x = f32[8,4]{1,0} parameter(0)
  %bits = f32[] parameter(1), metadata={op_name="bits"}
  %w = f32[4,2]{1,0} constant({...})
  %two = f32[] constant(2)
  %b2 = f32[8,4]{1,0} broadcast(%two), dimensions={}
  %y = f32[8,4]{1,0} multiply(%x, %b2)
  %t = (f32[8,4]{1,0}, /*index=1*/f32[4,2]{1,0}) tuple(%y, %w)
  %c32 = f32[] constant(32)
  %lt = pred[] compare(%bits, %c32), direction=LT
  %i = s32[] convert(%lt)
  ROOT %r = f32[8,2]{1,0} conditional(%i, %t, %t), branch_computations={%branch_hi, %branch_lo}
}
"""


def test_hlo_parse_shapes_operands_and_attributes():
    m = H.parse(HLO)
    assert m.entry == "main" and set(m.comps) == {"branch_lo", "branch_hi", "main"}
    t = m.instr("main", "t")
    assert t.op == "tuple" and t.operands == ["y", "w"] and t.shape.is_tuple
    assert t.shape.leaves == (("f32", (8, 4)), ("f32", (4, 2)))
    assert m.instr("main", "r").called == ["branch_hi", "branch_lo"]
    assert m.callers["branch_lo"] == ("main", "r")
    d = m.instr("branch_lo", "d")
    assert d.ints("lhs_contracting_dims") == (1,) and H.dot_flops(d, H.parse_shape(
        "f8e4m3fn[8,4]")) == 2 * 8 * 2 * 4
    assert H.parse_shape("f4e2m1fn[6,4]").nbytes == 12  # half a byte per element
    assert m.instr("main", "bits").op_name == "bits"


def test_graph_takes_the_branch_the_width_selects():
    m = H.parse(HLO)
    low = G.model_kernels(G.Graph(m, {"bits": 8.0}))
    high = G.model_kernels(G.Graph(m, {"bits": 32.0}))
    assert [k.precision for k in low if k.is_gemm] == ["fp8"]
    assert [k.precision for k in high if k.is_gemm] == ["fp32"]
    g = G.Graph(m, {})  # unknown width: the cheapest branch, counted as a guess
    assert g.guessed_branches == 1


def lowered(f, *args):
    return H.parse(jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text(
        dialect="hlo", debug_info=True))


def test_model_fuses_elementwise_into_one_kernel_before_a_gemm():
    x = jax.ShapeDtypeStruct((256, 512), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((512, 1024), jnp.bfloat16)

    def f(x, w):
        return jnp.dot(jax.nn.relu(x * 2 + 1), w)
    kernels = G.model_kernels(G.Graph(lowered(f, x, w), {}))
    gemms = [k for k in kernels if k.is_gemm]
    assert len(gemms) == 1 and gemms[0].gemm_flops == 2 * 256 * 512 * 1024
    assert gemms[0].precision == "bf16"
    loops = [k for k in kernels if not k.is_gemm]
    assert len(loops) == 1  # multiply, add and relu: one pass writing the GEMM's operand
    assert loops[0].bytes == pytest.approx(2 * 256 * 512 * 2, abs=64)  # read x, write bf16
    hw = G.H200
    t, _, _ = G.kernel_time(gemms[0], hw)
    assert t == pytest.approx(max(gemms[0].gemm_flops / hw.gemm_flops["bf16"],
                                  gemms[0].bytes / hw.hbm_bytes))


def test_model_reads_a_block_scaled_dequantize_as_codes_and_scales():
    codes = jax.ShapeDtypeStruct((128, 256), jnp.float8_e4m3fn)
    scales = jax.ShapeDtypeStruct((128, 8), jnp.float32)
    w = jax.ShapeDtypeStruct((256, 64), jnp.float8_e4m3fn)

    def f(c, s, w):
        x = (c.astype(jnp.float32).reshape(128, 8, 32) * s[:, :, None]).reshape(128, 256)
        return jnp.dot(x, w.astype(jnp.float32))
    kernels = G.model_kernels(G.Graph(lowered(f, codes, scales, w), {}))
    (gemm,) = [k for k in kernels if k.is_gemm]
    assert gemm.precision == "fp8" and gemm.block_scaled
    assert gemm.bytes == 128 * 256 + 128 * 8 * 4 + 256 * 64 + 128 * 64 * 4
    xla, _, n = G.kernel_time(gemm, G.H200, "xla")      # dequantize + f32 GEMM
    kern, _, _ = G.kernel_time(gemm, G.H200, "kernel")  # codes at the FP8 rate
    assert n == 3 and xla > kern


@pytest.mark.slow
def test_roofline_runs_small_and_orders_the_configs():
    r = roofline.main(["--workloads", "mlp_block", "--presets", "fp8_gemm", "--d-model", "64",
                       "--tokens", "128", "--seq", "64", "--launch-us", "0"])
    rows = r["model"]["mlp_block"]
    assert set(rows) == {"bf16", "cpt", "fp32", "fp8_gemm"}
    assert rows["bf16"]["vs_base"] == 1.0
    assert rows["fp32"]["precisions"] == ["fp32"] and rows["fp8_gemm"]["precisions"] == ["fp8"]
    assert rows["fp32"]["hbm_gb"] > rows["bf16"]["hbm_gb"]
    assert rows["cpt"]["kernels"] > rows["bf16"]["kernels"]  # the quantizers' passes
    assert rows["cpt"]["vs_base"] > 1.0
    for row in rows.values():
        assert row["gemm_tflop"] == pytest.approx(rows["bf16"]["gemm_tflop"], rel=1e-6)
        assert row["speedup"] == pytest.approx(1 / row["vs_base"], rel=1e-3)
        assert row["guessed_branches"] == 0


def compiled_mlp_step(hidden=(64, 32)):
    model = cpt_jax.models.MLP(hidden=hidden, num_classes=4)
    x = jnp.asarray(np.random.default_rng(0).normal(size=(16, 8, 8, 1)), jnp.float32)
    y = jnp.zeros((16,), jnp.int32)
    qmodel = cpt_jax.quantize_model(model, rules=cpt_jax.CPT_RULES)
    tx = optax.sgd(0.1)
    step = cpt_jax.make_train_step(qmodel, tx, cpt_jax.constant(6), cpt_jax.constant(8))
    state = cpt_jax.create_train_state(model, tx, jax.random.key(0), x[:2], train=False)
    return step.lower(state, {"inputs": x, "labels": y}).compile().as_text()


@pytest.mark.slow
def test_pass_counter_finds_each_quantized_tensor_once():
    qs = profile_step.quantizers(profile_step.PassCounter(compiled_mlp_step()))
    roles = sorted(q.role for q in qs)
    # two quantized Dense layers (the classifier stays fp32): weight, activation, error each
    assert roles == ["activation"] * 2 + ["error"] * 2 + ["weight"] * 2
    for q in qs:
        assert q.reductions and q.rounding == 1 and q.reads >= 2
        assert q.duplicates == 0
    weights = {q.elements: q for q in qs if q.role == "weight"}
    assert set(weights) == {64 * 64, 64 * 32}
    assert weights[64 * 32].used_by == 2  # forward and input-gradient products, one rounding
    table = profile_step.pass_table(qs)
    assert "reductions" in table and "6 quantized tensors" in table
    assert all(q.products for q in qs)


class _TokenMLP(nn.Module):
    """Dense layers over (batch, tokens, features): each error feeds an input-gradient
    and a weight-gradient product that want it in two layouts."""

    @nn.compact
    def __call__(self, x, train: bool = False):
        x = nn.gelu(nn.Dense(128, name="fc1")(x))
        x = nn.Dense(64, name="fc2")(x)
        return nn.Dense(4, name="head")(x)


def test_a_stochastically_rounded_error_is_rounded_once_for_both_gradient_products():
    # (8, 64, 128) errors: above FAST_REDUCTION_MIN_SIZE, so on CPU the quantizer runs
    # whole under its finiteness cond and is written once; before, XLA fused the
    # rounding and its dither into the two products' layout fusions (2 roundings).
    x = jnp.asarray(np.random.default_rng(0).normal(size=(8, 64, 64)), jnp.float32)
    y = jnp.zeros((8, 64), jnp.int32)
    qmodel = cpt_jax.quantize_model(_TokenMLP(), rules=cpt_jax.CPT_RULES)
    tx = optax.sgd(0.1)
    step = cpt_jax.make_train_step(qmodel, tx, cpt_jax.constant(6), cpt_jax.constant(8))
    state = cpt_jax.create_train_state(_TokenMLP(), tx, jax.random.key(0), x[:2], train=False)
    text = step.lower(state, {"inputs": x, "labels": y}).compile().as_text()
    errors = [q for q in profile_step.quantizers(profile_step.PassCounter(text))
              if q.role == "error"]
    assert sorted(q.elements for q in errors) == [8 * 64 * 64, 8 * 64 * 128]
    assert all(q.rounding == 1 for q in errors), profile_step.pass_table(errors)


@pytest.mark.slow
def test_ab_times_a_patched_quantizer_beside_the_library_and_undoes_the_patch(tmp_path):
    from cpt_jax.formats import _scaling
    saved = _scaling._min_max_one_pass
    patch = tmp_path / "two_reductions.py"
    patch.write_text(
        "import jax.numpy as jnp\n"
        "import cpt_jax.formats._scaling as S\n"
        "saved = S._min_max_one_pass\n"
        "def two(x):\n"
        f"    open({str(tmp_path / 'traced')!r}, 'a').write('x')\n"
        "    keep = (1,) * x.ndim\n"
        "    return jnp.min(x).reshape(keep), jnp.max(x).reshape(keep)\n"
        "def apply(): S._min_max_one_pass = two\n"
        "def undo(): S._min_max_one_pass = saved\n")
    r = ab.main(["--model", "mlp", "--patch", str(patch), "--rounds", "1", "--iters", "1"])
    assert _scaling._min_max_one_pass is saved
    assert (tmp_path / "traced").read_text()  # B was traced with the patch
    assert r["fp32_ms"] > 0 and r["a_ms"] > 0 and r["b_ms"] > 0
    assert r["b_over_a"] == pytest.approx(r["b_ms"] / r["a_ms"], rel=1e-3)
    assert r["num_compiles"] == {"A": 1, "B": 1}


def test_product_path_reads_the_module_from_the_op_name():
    assert profile_step.product_path(
        "jit(fn)/jvp(MLP)/dense1/cond/branch_0_fun/reduce_max") == "dense1"
    assert profile_step.product_path(
        "jit(fn)/transpose(jvp(MLP))/mlp/fc1/div") == "mlp/fc1 (bwd)"


def test_memory_stats_and_ratios():
    compiled = jax.jit(lambda x: jnp.sin(x) @ x).lower(jnp.ones((64, 64))).compile()
    m = C.memory_stats(compiled)
    assert m["peak_MB"] >= m["argument_MB"] > 0
    fp32 = {"peak_MB": 10.0, "temp_plus_argument_MB": 8.0, "temp_reported": True}
    quant = {"peak_MB": 10.5, "temp_plus_argument_MB": 9.0, "temp_reported": True}
    assert overhead.memory_ratios(fp32, quant) == {"peak_ratio": 1.05, "memory_ratio": 1.125}
    blind = {**fp32, "temp_reported": False}
    assert overhead.memory_ratios(blind, {**quant, "temp_reported": False}) == {}


def test_gpu_summary_puts_measurement_beside_model(tmp_path):
    (tmp_path / "overhead.json").write_text(json.dumps(
        {"mlp": {"ratio": 1.23, "peak_ratio": 1.04, "fp32_ms": 0.5}, "_machine": {}}))
    (tmp_path / "roofline.json").write_text("not json\n" + json.dumps(
        {"gpu": "H200 SXM", "model": {
            "ovh/mlp": {"fp32": {"ms": 0.25, "vs_base": 1.0}, "quant": {"vs_base": 1.2}},
            "block": {"bf16": {"ms": 10.0}, "fp8_gemm": {"speedup": 1.4,
                                                         "kernel_speedup": 1.4}}}}))
    (tmp_path / "lowp_gemm.json").write_text(json.dumps(
        {"d_model": 4096, "presets": {"fp8_gemm": {"block": {"speedup": 1.3,
                                                             "bf16_ms": 12.0}}}}))
    text = gpu_summary.summary(str(tmp_path))
    mlp = next(line for line in text.splitlines() if line.startswith("mlp"))
    assert mlp.split()[:5] == ["mlp", "1.230", "1.200", "-", "1.040"] and "2.00" in mlp
    fp8 = next(line for line in text.splitlines() if line.startswith("fp8_gemm"))
    assert fp8.split()[:3] == ["fp8_gemm", "1.300", "1.400"] and fp8.endswith("1.20")
