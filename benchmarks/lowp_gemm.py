"""bf16 versus the low-precision GEMM presets: a GEMM at 8192^3 and a Transformer block step.

    python benchmarks/lowp_gemm.py --json                   # on a GPU (H100/H200/B200)
    python benchmarks/lowp_gemm.py --quick --json           # CPU: it runs; speeds mean nothing

Side by side in one run (alternating rounds, medians; `benchmarks.common.interleaved`):

* ``gemm``: ``(n x n) . (n x n)``, n = ``--size``: bf16 ``lax.dot_general`` against each
  preset's forward GEMM on codes quantized beforehand (the kernel as a GPU runs it:
  float8 ``dot_general`` with fp32 accumulation, or ``scaled_matmul``);
* ``gemm_train``: the same product's forward and both gradients on float32 operands
  (`cpt_jax.providers.lowp_gemm.lowp_dot_general`: quantization of each GEMM's operands
  included) against bf16's three GEMMs;
* ``block``: a train step (SGD) of a pre-LN Transformer block (`cpt_jax.models`'
  ``TransformerBlock``, ``--d-model`` 4096, 32 heads, MLP 4x, ``--tokens`` tokens),
  bf16 parameters and activations; the preset quantizes the projections and the MLP
  (the attention products stay bf16, ``FP32_ATTENTION``), bits traced as in training.

``speedup`` = bf16 ms / preset ms (> 1: faster than bf16). ``hlo``: the custom-call
targets of each compiled program, and whether one is a low-precision GEMM (cuBLASLt
FP8: a target with ``f8``; cuDNN block-scaled: ``blockScaled`` / ``block_scaled``).
A JSON line is printed after every preset (``partial``: true), so a time limit
(``--budget-s``, or the caller's ``timeout``) still leaves the figures so far; the
last line is complete.

On CPU XLA converts float8 / float4 codes to float32 before each dot: the ratios
there say nothing about a GPU (``--quick`` says so in its output).
"""
from __future__ import annotations

import re
import time
from typing import Any

try:
    from benchmarks import common as C
except ImportError:  # run as a script
    import common as C  # type: ignore

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import cpt_jax  # noqa: E402
from cpt_jax import FP32_ATTENTION  # noqa: E402
from cpt_jax.models.transformer import MlpBlock, TransformerBlock  # noqa: E402
from cpt_jax.providers import lowp_gemm as lg  # noqa: E402
from cpt_jax.quant_config import PRESETS  # noqa: E402

PRESET_ORDER = ("fp8_gemm", "mxfp8_gemm", "nvfp4_gemm", "fp8_gemm_delayed", "mxfp4_gemm",
                "fp8_gemm_rowwise", "fp8_gemm_blockwise", "mxfp6_gemm")
DIMS = (((1,), (0,)), ((), ()))
CPU_NOTE = ("CPU: float8/float4 codes are converted to float32 before each dot; these speeds "
            "are not meaningful, run on a GPU")


def hlo_info(compiled) -> dict[str, Any]:
    """Custom-call targets of a compiled program; whether one is a low-precision GEMM."""
    text = compiled.as_text()
    targets = sorted(set(re.findall(r'custom_call_target="([^"]+)"', text)))
    fp8 = any("f8" in t for t in targets)
    blocked = any("blockscaled" in t.lower().replace("_", "") for t in targets)
    return {"custom_calls": targets, "fp8_gemm_call": fp8, "block_scaled_call": blocked,
            "lowp_gemm_call": fp8 or blocked}


def spec_of(name: str) -> lg.GemmSpec:
    """The `GemmSpec` of a Dense ``(n, n) . (n, n)`` in preset `name`, widths 8 (static)."""
    cfg = PRESETS[name]
    return lg.GemmSpec(lg.gemm_layout(DIMS, 2, 2), lg.along_contraction(cfg.activation),
                       lg.along_contraction(cfg.weight), lg.along_contraction(cfg.error),
                       cfg.gemm, 8.0, 8.0)


def gemm_candidates(name: str, x, w, cot) -> dict[str, Any]:
    """``{label: (jitted fn, args)}`` of one preset's kernel and its three-GEMM step."""
    spec = spec_of(name)
    a = lg.operand_codes(x[None], spec.lhs, 8.0)
    b = lg.operand_codes(w.T[None], spec.rhs, 8.0)
    kernel = jax.jit(lambda a, b: lg.scaled_product(a, b))
    keys = tuple(jax.random.split(jax.random.key(0), 4))
    amaxes = ((jnp.max(jnp.abs(x)), jnp.max(jnp.abs(w))) if spec.recipe.scaling == "delayed"
              else (None, None))

    def train(x, w, cot):
        y, vjp = jax.vjp(lambda x, w: lg.lowp_dot_general(
            spec, x, w, jnp.float32(8), jnp.float32(8), keys, amaxes), x, w)
        return (y,) + vjp(cot)

    return {"gemm": (kernel, (a, b)), "gemm_train": (jax.jit(train), (x, w, cot))}


def bf16_candidates(x, w, cot) -> dict[str, Any]:
    xb, wb, cb = (v.astype(jnp.bfloat16) for v in (x, w, cot))
    kernel = jax.jit(lambda a, b: jax.lax.dot_general(a, b, DIMS))

    def train(x, w, cot):
        y, vjp = jax.vjp(lambda x, w: jax.lax.dot_general(x, w, DIMS), x, w)
        return (y,) + vjp(cot)

    return {"gemm": (kernel, (xb, wb)), "gemm_train": (jax.jit(train), (xb, wb, cb))}


def block_model(name, d_model: int, mlp_only: bool = False):
    """The pre-LN Transformer block of width `d_model` (``d_model // 128`` heads, MLP 4x),
    or its MLP alone, quantized by preset `name` (None: not quantized). The attention
    products stay unquantized (``FP32_ATTENTION``), as Transformer Engine leaves them."""
    block = (MlpBlock(4 * d_model) if mlp_only else
             TransformerBlock(d_model=d_model, num_heads=max(1, d_model // 128),
                              mlp_dim=4 * d_model))
    if name is None:
        return block
    return cpt_jax.quantize_model(block, rules=None if mlp_only else [FP32_ATTENTION],
                                  config=PRESETS[name])


def block_train_step(model, quantized: bool, tx):
    """``step(state, x, bits, key) -> state``: one SGD step on ``mean(model(x)^2)``, the
    precision context around the model when `quantized`; jitted, state donated."""
    def loss(params, stats, x, bits, key):
        def apply():
            return model.apply({"params": params, **stats}, x, mutable=list(stats))
        if not quantized:
            y, new = apply()
        else:
            with cpt_jax.precision(bits, bits, rng=key):
                y, new = apply()
        return jnp.mean(jnp.square(y.astype(jnp.float32))), new

    def step(state, x, bits, key):
        params, opt, stats = state
        (_, new_stats), grads = jax.value_and_grad(loss, has_aux=True)(
            params, stats, x, bits, key)
        updates, opt = tx.update(grads, opt, params)
        return optax.apply_updates(params, updates), opt, new_stats

    return jax.jit(step, donate_argnums=(0,))


def block_setup(name, d_model: int, tokens: int, seq: int, *, dtype=jnp.bfloat16,
                mlp_only: bool = False, abstract: bool = False):
    """``(jitted step, (state, x, bits, key))`` of the block's train step (`block_model`,
    `block_train_step`): parameters and activations in `dtype`, ``tokens // seq``
    sequences of `seq`. ``abstract=True``: the arguments are ``jax.ShapeDtypeStruct``s
    (for lowering and cost analysis; nothing allocated, nothing run)."""
    model = block_model(name, d_model, mlp_only)
    tx = optax.sgd(1e-3)
    x_spec = jax.ShapeDtypeStruct((max(1, tokens // seq), seq, d_model), dtype)

    def init(x):
        variables = dict(model.init(jax.random.key(0), x))
        params = jax.tree.map(lambda v: v.astype(dtype), variables.pop("params"))
        return params, tx.init(params), variables

    if abstract:
        args = (jax.eval_shape(init, x_spec), x_spec, jax.ShapeDtypeStruct((), jnp.float32),
                jax.eval_shape(lambda: jax.random.key(2)))
    else:
        x = jax.random.normal(jax.random.key(1), x_spec.shape, dtype)
        args = (init(x), x, jnp.float32(8), jax.random.key(2))
    return block_train_step(model, name is not None, tx), args


def compiled_of(fn, args):
    """``(compiled executable, args)``: compiled once, timed and inspected as it is."""
    return fn.lower(*args).compile(), args


def timed_pair(base, cand, rounds: int, iters: int) -> dict[str, float]:
    """Median ms of two ``(compiled, args)`` candidates, side by side."""
    fns = {"bf16": lambda: base[0](*base[1]), "preset": lambda: cand[0](*cand[1])}
    times = C.interleaved(fns, rounds, iters, warmup=1)
    b, p = C.median(times["bf16"]), C.median(times["preset"])
    return {"bf16_ms": round(b, 3), "preset_ms": round(p, 3), "speedup": round(b / p, 3)}


def measure_block(name, base, args, rounds, iters) -> dict[str, Any]:
    """The preset's block step against bf16's (`base`: ``{"step", "args"}``, whose
    donated state is replaced as it runs)."""
    step, step_args = block_setup(name, args.d_model, args.tokens, args.seq)
    t0 = time.perf_counter()
    compiled = step.lower(*step_args).compile()
    compile_s = time.perf_counter() - t0
    holder = {"args": step_args}

    def run(h, fn):
        state = fn(*h["args"])
        h["args"] = (state,) + h["args"][1:]
        return state[0]

    times = C.interleaved({"bf16": lambda: run(base, base["step"]),
                           "preset": lambda: run(holder, compiled)},
                          rounds, iters, warmup=1)
    b, p = C.median(times["bf16"]), C.median(times["preset"])
    return {"bf16_ms": round(b, 3), "preset_ms": round(p, 3), "speedup": round(b / p, 3),
            "compile_s": round(compile_s, 2), "hlo": hlo_info(compiled)}


def measure_preset(name, x, w, cot, bf16, base_block, args, rounds, iters) -> dict[str, Any]:
    """One preset's ``gemm``, ``gemm_train`` and (if asked) ``block`` figures."""
    out = {}
    for label, (fn, fn_args) in gemm_candidates(name, x, w, cot).items():
        cand = compiled_of(fn, fn_args)
        out[label] = timed_pair(bf16[label], cand, rounds, iters)
        out[label]["hlo"] = hlo_info(cand[0])
    if base_block is not None and name in args.block_presets.split(","):
        out["block"] = measure_block(name, base_block, args, rounds, max(1, iters // 2))
    return out


def main(argv=None) -> dict[str, Any]:
    p = C.parser(__doc__.splitlines()[0])
    p.add_argument("--size", type=int, default=8192)
    p.add_argument("--d-model", type=int, default=4096)
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--presets", default=",".join(PRESET_ORDER))
    p.add_argument("--iters", type=int, default=None)
    p.add_argument("--budget-s", type=float, default=0.0,
                   help="stop starting presets after this many seconds (0: no limit)")
    p.add_argument("--no-block", action="store_true", help="skip the Transformer block")
    p.add_argument("--block-presets", default=",".join(PRESET_ORDER),
                   help="presets timed in the Transformer block step too")
    args = p.parse_args(argv)
    if args.quick:
        args.size, args.d_model, args.tokens, args.seq = 512, 256, 512, 128
    rounds = args.rounds or (3 if args.quick else 5)
    iters = args.iters or (2 if args.quick else 10)
    start = time.perf_counter()
    info = C.machine_info()
    result: dict[str, Any] = {"benchmark": "lowp_gemm", "machine": info, "size": args.size,
                              "d_model": args.d_model, "tokens": args.tokens,
                              "native_scaled_matmul": lg.NATIVE_SCALED_MATMUL, "presets": {},
                              "partial": True}
    if info["backend"] == "cpu":
        result["note"] = CPU_NOTE
        print(f"# lowp_gemm: {CPU_NOTE}")
    n = args.size
    kx, kw, kc = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(kx, (n, n), jnp.float32)
    w = jax.random.normal(kw, (n, n), jnp.float32) / np.sqrt(n)
    cot = jax.random.normal(kc, (n, n), jnp.float32)
    bf16 = {k: compiled_of(*v) for k, v in bf16_candidates(x, w, cot).items()}
    result["bf16_hlo"] = hlo_info(bf16["gemm"][0])
    base_block = None
    if not args.no_block:
        base_step, base_args = block_setup(None, args.d_model, args.tokens, args.seq)
        base_block = {"step": base_step.lower(*base_args).compile(), "args": base_args}
    for name in [s for s in args.presets.split(",") if s]:
        if args.budget_s and time.perf_counter() - start > args.budget_s:
            result["skipped_for_time"] = result.get("skipped_for_time", []) + [name]
            continue
        result["presets"][name] = measure_preset(name, x, w, cot, bf16, base_block, args,
                                                 rounds, iters)
        result["elapsed_s"] = round(time.perf_counter() - start, 1)
        C.emit_json(result)
    result["partial"] = False
    print(table(result))
    C.emit_json(result)
    return result


def table(result) -> str:
    """The speed-ups side by side, one line per preset."""
    lines = ["preset               gemm    gemm_train  block   lowp GEMM call (gemm / block)"]
    for name, r in result["presets"].items():
        block = r.get("block", {})
        lines.append(f"{name:20s} {r['gemm']['speedup']:6.2f}  {r['gemm_train']['speedup']:9.2f}"
                     f"  {block.get('speedup', float('nan')):6.2f}   "
                     f"{r['gemm']['hlo']['lowp_gemm_call']} / "
                     f"{block.get('hlo', {}).get('lowp_gemm_call')}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
