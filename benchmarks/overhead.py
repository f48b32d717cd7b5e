"""Train-step time with quantization versus without: same model, framework and batch.

For each model, jitted, buffer-donating train steps (`cpt_jax.make_train_step`), timed
side by side in one run (`common.make_steps`):

* ``fp32``: the plain Flax model, no precision context;
* ``bf16``: the plain Flax model computed in bfloat16 (`common.CastModel`: float32
  parameters cast at each call, as jmp's mixed precision);
* ``fake``: ``quantize_model(model, CPT_RULES)`` with ``compute="fake"``: every
  Dense/Conv but the classifier quantized as CPT does (affine min-max, weights per
  channel, errors at 8 bits with stochastic rounding) in float32 GEMMs, forward bits
  following CPT's cyclic schedule 3..8 over the timed steps (every width runs, one
  compilation);
* ``int``: the same with ``compute="int"``: the three GEMMs of each quantized Dense on
  int8 codes with int32 accumulation (`cpt_jax.ops.integer_gemm`);
* ``qwix`` (where Qwix imports; else skipped with a note): the plain model under Qwix's
  int8 quantized training (`peers.qwix_model`: int8 weights / activations forward, int8
  gradients backward, every product but the classifier), stepped as ``fp32`` is;
* ``fp32_cpt`` (``--same-layout``, CPU): the model through ``quantize_model`` with CPT's
  rules and a config quantizing nothing (`common.NO_QUANTIZERS`): the quantized step's
  products, layouts and context without quantizers.

``ratio`` is what ``compute="auto"`` (the default) runs on this machine over fp32 (auto
takes ``int`` on the platforms of `cpt_jax.providers.integer_gemm_platforms`, else
``fake``); ``ratio_fake`` / ``ratio_int`` / ``ratio_bf16`` each variant over fp32,
``int_over_fake`` and ``int_over_bf16`` side by side; with Qwix, ``ratio_qwix`` (qwix
over fp32) and ``int_over_qwix``. ``int_gemms``: the int8 GEMMs of
the compiled ``int`` step, how many sit in a library kernel (YNNPACK on CPU) and how
many run on int32 operands (none should); ``qwix_gemms`` the same of the ``qwix`` step
(``int8_lowered``: its int8 GEMMs before XLA's optimizations).

Each step is compiled once (``lower().compile()``) and the compiled executables run in
alternating rounds; figures are medians over rounds. Also reported, from the same
executables: compile times, peak memory (`common.memory_stats`: the most bytes live at
once, arguments, temporaries and outputs, donated buffers counted once), temporaries +
arguments, and (unless ``--no-hlo``) the compiled HLO's op / fusion counts.

    python benchmarks/overhead.py [--quick] [--json] [--models mlp,ffn] [--same-layout]

JSON (last line): ``{model: {fp32_ms, bf16_ms, fake_ms, int_ms, ratio, ...}}``.
"""
from __future__ import annotations

import time

try:
    from benchmarks import common as C
    from benchmarks.hlo import gemms
    from benchmarks.peers import qwix_available
except ImportError:  # run as a script
    import common as C  # type: ignore
    from hlo import gemms  # type: ignore
    from peers import qwix_available  # type: ignore

import jax

from cpt_jax.providers import integer_gemm_platforms

TIMED = ("fp32", "bf16", "fake", "int")
PEERS = ("qwix",)  # timed beside TIMED where installed (`peers.qwix_available`)


def int_gemm_stats(compiled_text: str) -> dict:
    """The int8 GEMMs of a compiled step: how many, how many in a library kernel, how
    many GEMMs on int32 operands (`hlo.gemms`)."""
    found = gemms(compiled_text)
    ints = [g for g in found if g.integer]
    return {"int8": len(ints), "in_library": sum(bool(g.library) for g in ints),
            "on_int32": sum(g.lhs == "s32" or g.rhs == "s32" for g in found)}


def measure(name: str, rounds: int, iters: int, hlo: bool = True,
            same_layout: bool = False, qwix: bool = False) -> dict:
    """Compile each variant's step of `name` once, then time the compiled executables
    side by side; memory (`memory_analysis()`) and HLO counts of the same executables.
    With `qwix`, Qwix's int8 training (``qwix``) is one of them."""
    spec = C.build(name)
    total = rounds * iters + 2 * iters + 2
    s = C.make_steps(spec, total, same_layout=same_layout,
                     variants=TIMED + (PEERS if qwix else ()))
    steps, states, batch = s["steps"], s["states"], spec["batch"]
    out = {"desc": spec["desc"]}
    compiled = {}
    for k in steps:
        t0 = time.perf_counter()
        lowered = steps[k].lower(states[k], batch)
        compiled[k] = lowered.compile()
        out[f"{k}_compile_s"] = round(time.perf_counter() - t0, 2)
        out[f"{k}_memory"] = C.memory_stats(compiled[k])
        if hlo:
            out[f"{k}_hlo"] = C.hlo_stats(compiled[k].as_text())
        if k == "qwix":
            out["qwix_gemms"] = int_gemm_stats(compiled[k].as_text()) | {
                "int8_lowered": sum(g.integer for g in gemms(lowered.as_text(dialect="hlo")))}
    out["int_gemms"] = int_gemm_stats(compiled["int"].as_text())
    times = C.interleaved(C.step_runners(compiled, states, batch), rounds, iters, warmup=iters)
    ms = {k: C.median(t) for k, t in times.items()}
    auto = "int" if jax.default_backend() in integer_gemm_platforms() else "fake"
    out.update({f"{k}_ms": round(v, 3) for k, v in ms.items()})
    out.update({f"ratio_{k}": round(ms[k] / ms["fp32"], 4) for k in ms if k != "fp32"})
    out.update(auto=auto, quant_ms=round(ms[auto], 3), ratio=round(ms[auto] / ms["fp32"], 4),
               int_over_fake=round(ms["int"] / ms["fake"], 4),
               int_over_bf16=round(ms["int"] / ms["bf16"], 4),
               num_compiles=steps["int"].num_compiles, fake_compiles=steps["fake"].num_compiles,
               fp32_compiles=steps["fp32"].num_compiles,
               spreads={k: C.spread(t) for k, t in times.items()}, rounds=rounds, iters=iters)
    if "qwix" in ms:
        out["int_over_qwix"] = round(ms["int"] / ms["qwix"], 4)
    if "fp32_cpt" in ms:
        out["ratio_same_layout"] = round(ms[auto] / ms["fp32_cpt"], 4)
    out.update(memory_ratios(out["fp32_memory"], out[f"{auto}_memory"]))
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
    head = ("fp32_ms", "bf16_ms", "fake_ms", "int_ms", "ratio", "ratio_int", "int_over_fake",
            "int_over_bf16", "peak_ratio", "num_compiles")
    summary: dict = {k: {f: v.get(f) for f in head} | {f: v[f] for f in v if f not in head}
                     for k, v in results.items()}
    summary["_machine"] = info
    return summary


def _print(name: str, r: dict) -> None:
    sp = r["spreads"]
    print(f"{name:12s} ms  fp32 {sp['fp32']}  bf16 {sp['bf16']}  fake {sp['fake']}  "
          f"int {sp['int']}   [{r['desc']}]")
    print(f"{'':12s} over fp32: bf16 {r['ratio_bf16']:.3f}  fake {r['ratio_fake']:.3f}  int "
          f"{r['ratio_int']:.3f}  (auto = {r['auto']}: {r['ratio']:.3f});  int / fake "
          f"{r['int_over_fake']:.3f}  int / bf16 {r['int_over_bf16']:.3f};  compiles "
          f"{r['fake_compiles']}/{r['num_compiles']} (fake/int)")
    g = r["int_gemms"]
    print(f"{'':12s} int8 GEMMs {g['int8']} ({g['in_library']} in a library kernel, "
          f"{g['on_int32']} on int32 operands);  peak memory MB fp32 "
          f"{r['fp32_memory'].get('peak_MB')} fake {r['fake_memory'].get('peak_MB')} int "
          f"{r['int_memory'].get('peak_MB')}")
    if "qwix" in sp:
        q = r["qwix_gemms"]
        print(f"{'':12s} Qwix int8 {sp['qwix']} ms, over fp32 {r['ratio_qwix']:.3f}, int / qwix "
              f"{r['int_over_qwix']:.3f};  its int8 GEMMs {q['int8']} ({q['int8_lowered']} "
              f"before XLA's passes, {q['in_library']} in a library kernel, "
              f"{q['on_int32']} on int32 operands);  peak memory MB "
              f"{r['qwix_memory'].get('peak_MB')}")
    if "ratio_same_layout" in r:
        print(f"{'':12s} fp32 through cpt_jax {r['fp32_cpt_ms']:.2f} ms, ratio_same_layout "
              f"{r['ratio_same_layout']:.3f}")


def main(argv=None) -> dict:
    p = C.parser(__doc__.splitlines()[0])
    p.add_argument("--models", default=",".join(C.MODELS))
    p.add_argument("--iters", type=int, default=None, help="steps per round")
    p.add_argument("--no-hlo", action="store_true", help="skip the HLO op counts")
    p.add_argument("--same-layout", action="store_true",
                   help="also time the model through cpt_jax with every product fp32")
    args = p.parse_args(argv)
    models = [m for m in args.models.split(",") if m]
    info = C.machine_info() | {"int_gemm_platforms": list(integer_gemm_platforms())}
    print(f"# overhead: {info}")
    qwix = qwix_available()
    if not qwix:
        print("# Qwix is not installed (or does not import): the qwix variant is skipped")
    results = {}
    for name in models:
        heavy = name in ("resnet20", "transformer", "ffn") and info["backend"] == "cpu"
        if info["backend"] == "cpu":
            rounds = args.rounds or (3 if args.quick else (6 if heavy else 10))
            iters = args.iters or (1 if (args.quick or heavy) else 3)
        else:  # accelerators: steps take milliseconds, time many
            rounds = args.rounds or (5 if args.quick else 15)
            iters = args.iters or 10
        if args.quick and heavy:
            # Minutes on 2 CPU cores: ResNet-20 / Transformer / FFN at the full batch are
            # too slow to compile and time; --quick times the others and skips these.
            print(f"{name:12s} skipped in --quick on CPU (run without --quick)")
            continue
        r = measure(name, rounds, iters, hlo=not args.no_hlo,
                    same_layout=args.same_layout and info["backend"] == "cpu", qwix=qwix)
        results[name] = r
        if args.json:  # a line per model, so a time limit keeps the models measured
            C.emit_json(_summary(results, info) | {"partial": True})
        _print(name, r)
    summary = _summary(results, info)
    if args.json:
        C.emit_json(summary)
    return summary


if __name__ == "__main__":
    main()
