"""Compilations over a whole cyclic run: traced bits (cpt_jax) versus static bits.

cpt_jax evaluates the precision schedule on the traced step inside the compiled
train step, so a whole cyclic run compiles once. A static-bits design (AQT, Qwix,
Flax fp8, Transformer Engine: the width is configuration) needs one compiled
program per distinct width; emulated here by building the train step with each
width as a compile-time constant (``constant(b)`` schedules, one jitted step each).

Reported: compilations of the traced step over the run (must be 1), the number of
distinct widths the schedule visits (= compilations of the static design), and
compile times (lower + compile) of one traced step and of each static step.

    python benchmarks/compiles.py [--quick] [--json] [--model resnet20] [--steps 40]
"""
from __future__ import annotations

import time

try:
    from benchmarks import common as C
except ImportError:  # run as a script
    import common as C  # type: ignore

import jax
import numpy as np

import cpt_jax
from cpt_jax.training import create_train_state, make_train_step


def main(argv=None) -> dict:
    p = C.parser(__doc__.splitlines()[0])
    p.add_argument("--model", default=None)
    p.add_argument("--steps", type=int, default=None, help="steps of the cyclic run")
    args = p.parse_args(argv)
    info = C.machine_info()
    name = args.model or ("mlp" if args.quick or info["backend"] == "cpu" else "resnet20")
    total = args.steps or (24 if args.quick else 48)
    spec = C.build(name)
    model, opt, batch = spec["model"], spec["optimizer"], spec["batch"]
    qmodel = cpt_jax.quantize_model(model, cpt_jax.CPT_RULES)
    cycles = 4
    sched = cpt_jax.cyclic("cos_growth", min_bits=3, max_bits=8, num_cycles=cycles,
                           total_steps=total)
    widths = sorted({float(w) for w in cpt_jax.schedule_values(sched, total)})
    print(f"# compiles: {spec['desc']}, CPT 3..8 x{cycles} cycles over {total} steps, "
          f"widths {widths}, {info}")

    def fresh_state():
        return create_train_state(model, opt, jax.random.key(0), spec["sample"], train=False)

    # Traced bits: one step function over the whole run.
    step = make_train_step(qmodel, opt, sched, cpt_jax.constant(8))
    state = fresh_state()
    t0 = time.perf_counter()
    step.lower(state, batch).compile()
    traced_compile_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    seen = []
    for _ in range(total):
        state, metrics = step(state, batch)
        seen.append(metrics["bits"])
    jax.block_until_ready(state)
    run_s = time.perf_counter() - t0
    seen = sorted({float(b) for b in np.asarray(jax.device_get(seen))})

    # Static bits: one compiled step per width (the width baked in as a constant).
    static_compile_s = []
    for w in widths:
        s_step = make_train_step(qmodel, opt, cpt_jax.constant(w), cpt_jax.constant(8))
        t0 = time.perf_counter()
        s_step.lower(state, batch).compile()
        static_compile_s.append(time.perf_counter() - t0)
    out = {
        "model": name, "steps": total, "widths_visited": seen,
        "traced_num_compiles": step.num_compiles,
        "static_num_compiles": len(widths),
        "traced_compile_s": round(traced_compile_s, 2),
        "static_compile_s_each": [round(s, 2) for s in static_compile_s],
        "static_compile_s_total": round(sum(static_compile_s), 2),
        "run_s_including_first_compile": round(run_s, 2),
        "_machine": info,
    }
    print(f"traced bits: {out['traced_num_compiles']} compilation over {total} steps "
          f"(widths {seen}), compile {out['traced_compile_s']} s")
    print(f"static bits: {out['static_num_compiles']} compilations, "
          f"{out['static_compile_s_total']} s in total ({out['static_compile_s_each']})")
    if args.json:
        C.emit_json(out)
    return out


if __name__ == "__main__":
    main()
