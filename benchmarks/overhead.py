"""Train-step time with quantization versus without: same model, framework and batch.

For each model, two jitted, buffer-donating train steps (`cpt_jax.make_train_step`):

* ``fp32``: the plain Flax model, no precision context;
* ``quant``: ``quantize_model(model, CPT_RULES)``: every Dense/Conv but the
  classifier quantized as CPT does (affine min-max, weights per channel, errors
  at 8 bits with stochastic rounding), forward bits following CPT's cyclic
  schedule 3..8 over the timed steps (so every width runs, one compilation);
* ``fp32_cpt`` (CPU): the model through ``quantize_model`` with CPT's rules and a
  config quantizing nothing (`common.NO_QUANTIZERS`): the quant step's products,
  layouts and context without quantizers.

``ratio`` is quant / fp32 (what a user sees against the model as written);
``ratio_same_layout`` is quant / fp32_cpt (the quantizers' own cost: cpt_jax lays
some products out differently from plain Flax, e.g. a Dense over (batch, tokens,
features) as one 2-D GEMM, which on CPU is faster in fp32 too).

Each step is compiled once (``lower().compile()``) and the compiled executables run in
alternating rounds; figures are medians over rounds. Also reported, from the same
executables: compile times, peak memory (`common.memory_stats`: the most bytes live at
once, arguments, temporaries and outputs, donated buffers counted once; goal quant /
fp32 <= 1.10; none on jax 0.12's CPU, which reports no temporaries), temporaries +
arguments, and (unless ``--no-hlo``) the compiled HLO's op / fusion counts.

    python benchmarks/overhead.py [--quick] [--json] [--models resnet20,mlp]

JSON (last line): ``{model: {fp32_ms, quant_ms, ratio, peak_ratio, num_compiles, ...}}``.
"""
from __future__ import annotations

import time

try:
    from benchmarks import common as C
except ImportError:  # run as a script
    import common as C  # type: ignore


def measure(name: str, rounds: int, iters: int, hlo: bool = True,
            same_layout: bool = True) -> dict:
    """Compile the fp32 and quantized steps of `name` once each, then time the compiled
    executables side by side; memory (`memory_analysis()`) and HLO counts of the same
    executables."""
    spec = C.build(name)
    total = rounds * iters + 2 * iters + 2
    s = C.make_steps(spec, total, same_layout=same_layout)
    steps, states, batch = s["steps"], s["states"], spec["batch"]
    out = {"desc": spec["desc"]}
    compiled = {}
    for k in steps:
        t0 = time.perf_counter()
        compiled[k] = steps[k].lower(states[k], batch).compile()
        out[f"{k}_compile_s"] = round(time.perf_counter() - t0, 2)
        out[f"{k}_memory"] = C.memory_stats(compiled[k])
        if hlo:
            out[f"{k}_hlo"] = C.hlo_stats(compiled[k].as_text())

    times = C.interleaved(C.step_runners(compiled, states, batch), rounds, iters, warmup=iters)
    fp32, quant = C.median(times["fp32"]), C.median(times["quant"])
    same = C.median(times["fp32_cpt"]) if "fp32_cpt" in times else fp32
    out.update(fp32_ms=round(fp32, 3), quant_ms=round(quant, 3), ratio=round(quant / fp32, 4),
               fp32_cpt_ms=round(same, 3), ratio_same_layout=round(quant / same, 4),
               num_compiles=steps["quant"].num_compiles,
               fp32_compiles=steps["fp32"].num_compiles,
               fp32_spread=C.spread(times["fp32"]), quant_spread=C.spread(times["quant"]),
               rounds=rounds, iters=iters)
    out.update(memory_ratios(out["fp32_memory"], out["quant_memory"]))
    return out


def memory_ratios(fp32: dict, quant: dict) -> dict:
    """``peak_ratio`` (peak of live buffers, quant / fp32; goal <= 1.10) and
    ``memory_ratio`` (temporaries + arguments), where `memory_analysis` reports the
    temporaries (not jax 0.12's CPU backend: `common.memory_stats`)."""
    out = {}
    for key, field in (("peak_ratio", "peak_MB"), ("memory_ratio", "temp_plus_argument_MB")):
        if fp32.get(field) and quant.get(field) and (
                fp32.get("temp_reported") or quant.get("temp_reported")):
            out[key] = round(quant[field] / fp32[field], 4)
    return out


def _summary(results: dict, info: dict) -> dict:
    head = ("fp32_ms", "quant_ms", "ratio", "ratio_same_layout", "peak_ratio", "num_compiles")
    summary: dict = {k: {f: v.get(f) for f in head} | {f: v[f] for f in v if f not in head}
                     for k, v in results.items()}
    summary["_machine"] = info
    return summary


def main(argv=None) -> dict:
    p = C.parser(__doc__.splitlines()[0])
    p.add_argument("--models", default=",".join(C.MODELS))
    p.add_argument("--iters", type=int, default=None, help="steps per round")
    p.add_argument("--no-hlo", action="store_true", help="skip the HLO op counts")
    args = p.parse_args(argv)
    models = [m for m in args.models.split(",") if m]
    info = C.machine_info()
    print(f"# overhead: {info}")
    results = {}
    for name in models:
        heavy = name in ("resnet20", "transformer") and info["backend"] == "cpu"
        if info["backend"] == "cpu":
            rounds = args.rounds or (3 if args.quick else (6 if heavy else 10))
            iters = args.iters or (1 if (args.quick or heavy) else 3)
        else:  # accelerators: steps take milliseconds, time many
            rounds = args.rounds or (5 if args.quick else 15)
            iters = args.iters or 10
        if args.quick and name in ("resnet20", "transformer") and info["backend"] == "cpu":
            # A minute on 2 CPU cores: ResNet-20/Transformer at the full batch are too
            # slow to compile and time; --quick times the others and skips these.
            print(f"{name:12s} skipped in --quick on CPU (run without --quick)")
            continue
        # cpt_jax's own layouts differ from plain Flax on CPU only (the 2-D GEMMs):
        # elsewhere fp32_cpt is fp32, and not timed again.
        r = measure(name, rounds, iters, hlo=not args.no_hlo,
                    same_layout=info["backend"] == "cpu")
        results[name] = r
        if args.json:  # a line per model, so a time limit keeps the models measured
            C.emit_json(_summary(results, info) | {"partial": True})
        print(f"{name:12s} fp32 {r['fp32_spread']} ms  quant {r['quant_spread']} ms  "
              f"ratio {r['ratio']:.3f}  fp32 through cpt_jax {r['fp32_cpt_ms']:.2f} ms  "
              f"ratio_same_layout {r['ratio_same_layout']:.3f}  compiles {r['num_compiles']}  "
              f"compile s {r['fp32_compile_s']}/{r['quant_compile_s']}  [{r['desc']}]")
        print(f"{'':12s} peak memory MB {r['fp32_memory'].get('peak_MB')}/"
              f"{r['quant_memory'].get('peak_MB')} (ratio {r.get('peak_ratio')}, goal <= 1.10)"
              f"  temp+argument MB {r['fp32_memory'].get('temp_plus_argument_MB')}/"
              f"{r['quant_memory'].get('temp_plus_argument_MB')} "
              f"(ratio {r.get('memory_ratio')})")
        if "fp32_hlo" in r:
            print(f"{'':12s} HLO ops {r['fp32_hlo']['ops']}/{r['quant_hlo']['ops']}  fusions "
                  f"{r['fp32_hlo']['fusions']}/{r['quant_hlo']['fusions']}  big passes "
                  f"{r['fp32_hlo']['big_ops']}/{r['quant_hlo']['big_ops']}")
    summary = _summary(results, info)
    if args.json:
        C.emit_json(summary)
    return summary


if __name__ == "__main__":
    main()
