"""Train-step time with quantization versus without: same model, framework and batch.

For each model, two jitted, buffer-donating train steps (`cpt_jax.make_train_step`):

* ``fp32``: the plain Flax model, no precision context;
* ``quant``: ``quantize_model(model, CPT_RULES)``: every Dense/Conv but the
  classifier quantized as CPT does (affine min-max, weights per channel, errors
  at 8 bits with stochastic rounding), forward bits following CPT's cyclic
  schedule 3..8 over the timed steps (so every width runs, one compilation).

They run in alternating rounds; figures are medians over rounds. Also reported:
compile times, the compiled HLO's op/fusion counts and the memory of each step
(`memory_analysis()`: temporaries + arguments).

    python benchmarks/overhead.py [--quick] [--json] [--models resnet20,mlp]

JSON (last line): ``{model: {fp32_ms, quant_ms, ratio, num_compiles, ...}}``.
"""
from __future__ import annotations

import time

try:
    from benchmarks import common as C
except ImportError:  # run as a script
    import common as C  # type: ignore


def measure(name: str, rounds: int, iters: int, hlo: bool = True) -> dict:
    spec = C.build(name)
    total = rounds * iters + 2 * iters + 2
    s = C.make_steps(spec, total)
    steps, states, batch = s["steps"], s["states"], spec["batch"]
    out = {"desc": spec["desc"]}
    for k in ("fp32", "quant"):
        t0 = time.perf_counter()
        compiled = steps[k].lower(states[k], batch).compile()
        out[f"{k}_compile_s"] = round(time.perf_counter() - t0, 2)
        if hlo:
            out[f"{k}_hlo"] = C.hlo_stats(compiled.as_text())
            out[f"{k}_memory"] = C.memory_stats(compiled)

    def runner(k):
        def run():
            states[k], _ = steps[k](states[k], batch)
            return states[k].params
        return run

    times = C.interleaved({k: runner(k) for k in steps}, rounds, iters, warmup=iters)
    fp32, quant = C.median(times["fp32"]), C.median(times["quant"])
    out.update(fp32_ms=round(fp32, 3), quant_ms=round(quant, 3), ratio=round(quant / fp32, 4),
               num_compiles=steps["quant"].num_compiles,
               fp32_compiles=steps["fp32"].num_compiles,
               fp32_spread=C.spread(times["fp32"]), quant_spread=C.spread(times["quant"]),
               rounds=rounds, iters=iters)
    if hlo:
        m0 = out["fp32_memory"].get("temp_plus_argument_MB")
        m1 = out["quant_memory"].get("temp_plus_argument_MB")
        if m0 and m1:
            out["memory_ratio"] = round(m1 / m0, 4)
    return out


def main(argv=None) -> dict:
    p = C.parser(__doc__.splitlines()[0])
    p.add_argument("--models", default=",".join(C.MODELS))
    p.add_argument("--iters", type=int, default=None, help="steps per round")
    p.add_argument("--no-hlo", action="store_true")
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
        r = measure(name, rounds, iters, hlo=not args.no_hlo)
        results[name] = r
        print(f"{name:12s} fp32 {r['fp32_spread']} ms  quant {r['quant_spread']} ms  "
              f"ratio {r['ratio']:.3f}  compiles {r['num_compiles']}  "
              f"compile s {r['fp32_compile_s']}/{r['quant_compile_s']}  [{r['desc']}]")
        if "fp32_hlo" in r:
            print(f"{'':12s} HLO ops {r['fp32_hlo']['ops']}/{r['quant_hlo']['ops']}  fusions "
                  f"{r['fp32_hlo']['fusions']}/{r['quant_hlo']['fusions']}  big passes "
                  f"{r['fp32_hlo']['big_ops']}/{r['quant_hlo']['big_ops']}  memory MB "
                  f"{r['fp32_memory'].get('temp_plus_argument_MB')}/"
                  f"{r['quant_memory'].get('temp_plus_argument_MB')} "
                  f"(ratio {r.get('memory_ratio')})")
    summary = {k: {f: v[f] for f in ("fp32_ms", "quant_ms", "ratio", "num_compiles")}
               | {f: v[f] for f in v if f not in ("fp32_ms", "quant_ms", "ratio", "num_compiles")}
               for k, v in results.items()}
    summary["_machine"] = info
    if args.json:
        C.emit_json(summary)
    return summary


if __name__ == "__main__":
    main()
