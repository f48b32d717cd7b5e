"""A GPU estimate from the compiled program: a roofline model of train steps on an H200.

    python benchmarks/roofline.py [--json]            # CPU is enough: nothing runs
    python benchmarks/roofline.py --quick             # d_model 256 (a minute)
    python benchmarks/roofline.py --program both      # on a GPU: XLA GPU's kernels too

THIS IS A MODEL, NOT A MEASUREMENT. Each train step is lowered, never run (abstract
``jax.ShapeDtypeStruct`` inputs, so a d_model 4096 block needs neither memory nor time),
its HLO is cut into kernels, and each kernel costs ``max(flops / peak, instructions /
vector rate, bytes / HBM bandwidth) + launch`` on the published peaks of the GPU
(`benchmarks.gpu_model`: H200 SXM by default; ``--gpu b200``). Workloads:

* ``block``: the pre-LN Transformer block train step that ``lowp_gemm.py`` times
  (``--d-model`` 4096, 32 heads, MLP 4x, ``--tokens`` 8192 in sequences of 1024, SGD,
  parameters and activations bf16; the attention products unquantized);
* ``mlp_block``: its MLP alone (4096 -> 16384 -> 4096, same tokens);
* ``overhead``: the four steps ``overhead.py`` times (fp32 and CPT ``quant``), so the
  estimate and the GPU measurement of the same program sit side by side.

Configurations of ``block`` / ``mlp_block``: ``fp32`` (parameters and activations
fp32, GEMMs at the TF32 rate), ``bf16`` (the baseline), ``cpt`` (fake quantization, the
default CPT quantizer: affine min-max, errors stochastic, bf16 GEMMs on the fake-quantized
operands) and every low-precision GEMM preset (``fp8_gemm``, ``mxfp8_gemm``, ...).

Programs (``--program``): ``model`` (default) lowers for CUDA on any machine (JAX's GPU
lowering rules) and fuses by `gpu_model.model_kernels`' rules; ``compiled`` compiles for
the machine's own backend and takes its kernels as they are (on a GPU: XLA GPU's fusions,
the best input for the model; on a CPU: the CPU's program, with its bf16 -> f32 converts
and unfused reductions: not a GPU's). ``both`` prints the two.

Columns: ``est ms`` (with ``--launch-us`` per kernel), ``vs base`` (est / the baseline:
bf16 for block and mlp_block, fp32 for overhead; > 1 is slower), ``speedup`` (base / est).
Block-scaled GEMMs (MXFP8/6/4, NVFP4, 1x128 FP8) have no H200 kernel: XLA expands JAX's
block-scaled dot into a dequantize pass and a float32 GEMM; ``kernel ms`` / ``kernel
speedup`` assume instead a kernel reading codes and scales at the FP8 rate.
"""
from __future__ import annotations

import math
import time
from typing import Any

try:
    from benchmarks import common as C
    from benchmarks import gpu_model as G
    from benchmarks import hlo as H
    from benchmarks import lowp_gemm as L
except ImportError:  # run as a script
    import common as C  # type: ignore
    import gpu_model as G  # type: ignore
    import hlo as H  # type: ignore
    import lowp_gemm as L  # type: ignore

import jax.numpy as jnp  # noqa: E402

WORKLOADS = ("block", "mlp_block", "overhead")
BASE_CONFIGS = ("bf16", "cpt", "fp32")
PARAMS = {"bits": 8.0}  # the forward width the estimate assumes (a traced argument)


def first_cost(cost) -> dict[str, float]:
    """``cost_analysis()`` as one dict (older jax returns a list of one)."""
    if isinstance(cost, (list, tuple)):
        cost = cost[0] if cost else {}
    return dict(cost or {})


def program_kernels(step, args, program: str) -> tuple[list[G.Kernel], dict[str, Any]]:
    """Kernels of one step and facts about them: ``program="model"`` lowers for CUDA and
    applies the fusion model; ``"compiled"`` compiles for this machine's backend."""
    t0 = time.perf_counter()
    if program == "model":
        lowered = step.trace(*args).lower(lowering_platforms=("cuda",))
        module = H.parse(lowered.as_text(dialect="hlo", debug_info=True))
        graph = G.Graph(module, PARAMS)
        kernels = G.model_kernels(graph)
        info = {"loops": graph.loops, "guessed_branches": graph.guessed_branches}
        cost = first_cost(lowered.cost_analysis())
    else:
        compiled = step.lower(*args).compile()
        kernels, info = G.compiled_kernels(H.parse(compiled.as_text()), PARAMS)
        info.pop("branches")
        cost = first_cost(compiled.cost_analysis())
        info["xla_bytes_gb"] = round(cost.get("bytes accessed", 0.0) / 1e9, 4)
        info["our_bytes_gb"] = round(sum(k.bytes for k in kernels) / 1e9, 4)
    ours = sum(k.gemm_flops + k.ops + k.int_ops for k in kernels)
    info.update(xla_flops=cost.get("flops", 0.0), our_flops=ours,
                lower_s=round(time.perf_counter() - t0, 1))
    return kernels, info


def block_configs(workload: str, configs, args) -> dict[str, tuple]:
    """``{config: (step, abstract args)}`` of the block or its MLP."""
    out = {}
    for c in configs:
        name = None if c in ("fp32", "bf16") else c
        dtype = jnp.float32 if c == "fp32" else jnp.bfloat16
        out[c] = L.block_setup(name, args.d_model, args.tokens, args.seq, dtype=dtype,
                               mlp_only=workload == "mlp_block", abstract=True)
    return out


def overhead_configs(model: str) -> dict[str, tuple]:
    """``{"fp32"|"quant": (step, args)}``: the two steps `overhead.py` times."""
    spec = C.build(model)
    s = C.make_steps(spec, 64)
    return {k: (s["steps"][k], (s["states"][k], spec["batch"])) for k in ("fp32", "quant")}


def estimate_all(kernels, info, hw, launch_us) -> dict[str, Any]:
    """The estimate with XLA's block-scaled expansion and with an FP8-rate kernel."""
    xla = G.estimate(kernels, hw, launch_us=launch_us, block_mode="xla")
    kern = G.estimate(kernels, hw, launch_us=launch_us, block_mode="kernel")
    return {**{k: round(v, 5) for k, v in xla.items()},
            "kernel_ms": round(kern["ms"], 5),
            "precisions": sorted({f"{k.precision}{'+blocks' if k.block_scaled else ''}"
                                  for k in kernels if k.is_gemm}),
            **info}


def top_kernels(kernels, hw, n: int) -> list[str]:
    """The `n` costliest kernels: time, what bounds it, bytes, instructions, label."""
    rows = []
    for k in kernels:
        t, moved, _ = G.kernel_time(k, hw)
        bound = ("gemm" if k.is_gemm and k.gemm_flops / hw.gemm_flops.get(
            k.precision, hw.gemm_flops["fp32"]) * hw.hbm_bytes >= moved else
            "vector" if k.ops / hw.vector_ops + k.int_ops / hw.int_ops >= moved / hw.hbm_bytes
            else "memory")
        rows.append((t, f"{1e3 * t:8.4f} ms {bound:6s} {moved / 1e6:9.2f} MB "
                        f"{(k.ops + k.int_ops) / 1e6:9.1f} Mop {k.precision:4s} "
                        f"{k.label.removeprefix('jit(step)/')[-60:] or k.name}"))
    return [r for _, r in sorted(rows, key=lambda r: -r[0])[:n]]


def run_workload(workload: str, configs: dict[str, tuple], program: str, hw,
                 launch_us: float, top: int = 0, deadline: float = math.inf) -> dict[str, Any]:
    """Estimates of every configuration of one workload; a line printed per config
    (and its `top` costliest kernels); none started after `deadline` (perf_counter)."""
    out = {}
    for name, (step, args) in configs.items():
        if time.perf_counter() > deadline:
            print(f"  {workload}/{name}: skipped (--budget-s)")
            continue
        try:
            kernels, info = program_kernels(step, args, program)
        except Exception as exc:  # noqa: BLE001  (an untried backend's HLO: keep the rest)
            print(f"  {workload}/{name}: failed: {type(exc).__name__}: {exc}"[:300])
            continue
        out[name] = estimate_all(kernels, info, hw, launch_us)
        print(f"  {workload}/{name}: {out[name]['ms']:.3f} ms est, {out[name]['kernels']} "
              f"kernels ({info['lower_s']} s)", flush=True)
        for line in top_kernels(kernels, hw, top):
            print("      " + line)
    return out


def add_ratios(results: dict[str, Any], base: str) -> None:
    """``vs_base`` (est / base), ``speedup`` (base / est), and the kernel-mode speedup."""
    if base not in results:
        return
    b = results[base]
    for r in results.values():
        r["vs_base"] = round(r["ms"] / b["ms"], 4)
        r["speedup"] = round(b["ms"] / r["ms"], 4)
        r["kernel_speedup"] = round(b["kernel_ms"] / r["kernel_ms"], 4)


def table(results: dict[str, Any], header: str) -> str:
    """One line per (workload, config): the estimate and its ratios."""
    lines = [header,
             f"{'workload':16s} {'config':20s} {'kernels':>7s} {'TFLOP':>7s} {'HBM GB':>7s} "
             f"{'GEMM ms':>8s} {'other ms':>8s} {'est ms':>8s} {'vs base':>7s} "
             f"{'speedup':>7s} {'kernel ms':>9s} {'kernel sp.':>10s}  GEMM precisions"]
    for wl, configs in results.items():
        for name, r in configs.items():
            lines.append(
                f"{wl:16s} {name:20s} {r['kernels']:7d} {r['gemm_tflop']:7.3f} "
                f"{r['hbm_gb']:7.2f} {r['gemm_ms']:8.3f} {r['other_ms']:8.3f} {r['ms']:8.3f} "
                f"{r.get('vs_base', float('nan')):7.3f} {r.get('speedup', float('nan')):7.3f} "
                f"{r['kernel_ms']:9.3f} {r.get('kernel_speedup', float('nan')):10.3f}  "
                f"{','.join(r['precisions'])}")
    return "\n".join(lines)


def parse_args(argv):
    p = C.parser(__doc__.splitlines()[0])
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    p.add_argument("--presets", default=",".join(L.PRESET_ORDER),
                   help="low-precision GEMM presets of block / mlp_block")
    p.add_argument("--models", default="mlp,transformer,resnet20,gcn",
                   help="overhead.py's models (gcn only where Cora is on disk)")
    p.add_argument("--program", choices=("model", "compiled", "both"), default="model")
    p.add_argument("--gpu", choices=sorted(G.HARDWARE), default="h200")
    p.add_argument("--launch-us", type=float, default=2.0, help="overhead per kernel")
    p.add_argument("--top", type=int, default=0, help="print the N costliest kernels")
    p.add_argument("--budget-s", type=float, default=0.0,
                   help="start no configuration after this many seconds (0: no limit)")
    p.add_argument("--d-model", type=int, default=4096)
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--seq", type=int, default=1024)
    args = p.parse_args(argv)
    if args.quick:
        args.d_model, args.tokens, args.seq = 256, 512, 128
        args.models = "mlp"
    return args


def workload_configs(workload: str, args) -> list[tuple[str, dict[str, tuple], str]]:
    """``[(label, {config: (step, args)}, baseline)]`` of one workload."""
    if workload == "overhead":
        models = [m for m in args.models.split(",") if m]
        if "gcn" in models and not C.data_root():
            models.remove("gcn")
        return [(f"ovh/{m}", overhead_configs(m), "fp32") for m in models]
    presets = [p for p in args.presets.split(",") if p]
    return [(workload, block_configs(workload, BASE_CONFIGS + tuple(presets), args), "bf16")]


def main(argv=None) -> dict[str, Any]:
    args = parse_args(argv)
    hw = G.HARDWARE[args.gpu]
    programs = ("model", "compiled") if args.program == "both" else (args.program,)
    info = C.machine_info()
    result: dict[str, Any] = {"benchmark": "roofline", "machine": info, "gpu": hw.name,
                              "peaks": hw.source, "launch_us": args.launch_us,
                              "d_model": args.d_model, "tokens": args.tokens,
                              "note": "a model, not a measurement"}
    print(f"# roofline: A MODEL, NOT A MEASUREMENT. {hw.name}; {hw.source}")
    deadline = time.perf_counter() + (args.budget_s or math.inf)
    result["partial"] = True
    for program in programs:
        results: dict[str, Any] = {}
        result[program] = results
        for wl in [w for w in args.workloads.split(",") if w]:
            for label, configs, base in workload_configs(wl, args):
                results[label] = run_workload(label, configs, program, hw, args.launch_us,
                                              args.top, deadline)
                add_ratios(results[label], base)
                if args.json:
                    C.emit_json(result)
        where = ("lowered for CUDA, fused by gpu_model's rules" if program == "model" else
                 f"compiled for this machine ({info['backend']}: {info['device']})")
        print(table(results, f"# program: {where}; launch {args.launch_us} us/kernel; "
                             f"bits {PARAMS['bits']:g}"))
    result["partial"] = False
    if args.json:
        C.emit_json(result)
    return result


if __name__ == "__main__":
    main()
