"""Two implementations of the quantized train step side by side in one process.

``A`` is the quantized step as the library traces it; ``B`` is the same step traced
while a patch is applied (a Python file defining ``apply()`` and ``undo()``, e.g.
one that swaps a function of `cpt_jax.formats`). Both are compiled, then timed with
the plain fp32 step in alternating rounds (`common.interleaved`), so machine drift
cancels out of ``B / A``. For choosing between implementations of a quantizer;
`overhead.py` gives the figures of the library as it is.

    python benchmarks/ab.py --model mlp --rounds 30 --patch my_patch.py [--json]

A patch file, for example (the per-tensor range as two library reductions)::

    import jax.numpy as jnp
    import cpt_jax.formats._scaling as S
    saved = S._min_max_one_pass
    def two(x):
        keep = (1,) * x.ndim
        return jnp.min(x).reshape(keep), jnp.max(x).reshape(keep)
    def apply(): S._min_max_one_pass = two
    def undo(): S._min_max_one_pass = saved

JSON (last line): ``{fp32_ms, a_ms, b_ms, a_ratio, b_ratio, b_over_a, ...}``.
"""
from __future__ import annotations

import runpy

import jax

try:
    from benchmarks import common as C
except ImportError:  # run as a script
    import common as C  # type: ignore

import cpt_jax
from cpt_jax.training import create_train_state, make_train_step


def measure(name: str, patch: str, rounds: int, iters: int) -> dict:
    """fp32, A and B steps of model `name` (B traced under `patch`), timed alternately."""
    spec = C.build(name)
    model, opt, batch = spec["model"], spec["optimizer"], spec["batch"]
    total = rounds * iters + 2 * iters + 2

    def quantized_step():
        qmodel = cpt_jax.quantize_model(model, rules=cpt_jax.CPT_RULES, config=cpt_jax.CPT_CONFIG)
        return make_train_step(qmodel, opt, C.cyclic_schedule(total), cpt_jax.constant(8))

    states = {k: create_train_state(model, opt, jax.random.key(1), spec["sample"], train=False)
              for k in ("fp32", "A", "B")}
    steps = {"fp32": make_train_step(model, opt, None), "A": quantized_step()}
    compiled = {k: steps[k].lower(states[k], batch).compile() for k in steps}
    hooks = runpy.run_path(patch)
    hooks["apply"]()
    try:
        steps["B"] = quantized_step()
        compiled["B"] = steps["B"].lower(states["B"], batch).compile()
    finally:
        hooks["undo"]()

    times = C.interleaved(C.step_runners(compiled, states, batch), rounds, iters, warmup=iters)
    fp32, a, b = (C.median(times[k]) for k in ("fp32", "A", "B"))
    return {"model": name, "patch": patch, "fp32_ms": round(fp32, 3), "a_ms": round(a, 3),
            "b_ms": round(b, 3), "a_ratio": round(a / fp32, 4), "b_ratio": round(b / fp32, 4),
            "b_over_a": round(b / a, 4), "a_spread": C.spread(times["A"]),
            "b_spread": C.spread(times["B"]), "rounds": rounds, "iters": iters,
            "num_compiles": {k: steps[k].num_compiles for k in ("A", "B")}}


def main(argv=None) -> dict:
    p = C.parser(__doc__.splitlines()[0])
    p.add_argument("--model", default="mlp", choices=C.MODELS)
    p.add_argument("--patch", required=True, help="file defining apply() and undo()")
    p.add_argument("--iters", type=int, default=None, help="steps per round")
    args = p.parse_args(argv)
    heavy = args.model in ("resnet20", "transformer")
    rounds = args.rounds or (3 if args.quick else (10 if heavy else 30))
    iters = args.iters or (1 if heavy or args.quick else 3)
    r = measure(args.model, args.patch, rounds, iters)
    print(f"{r['model']}: fp32 {r['fp32_ms']} ms  A {r['a_spread']} ms ({r['a_ratio']:.3f}x)  "
          f"B {r['b_spread']} ms ({r['b_ratio']:.3f}x)  B/A {r['b_over_a']:.3f}")
    if args.json:
        C.emit_json(r | {"_machine": C.machine_info()})
    return r


if __name__ == "__main__":
    main()
