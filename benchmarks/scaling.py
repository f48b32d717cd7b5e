"""Scaling from history (delayed, Autoflex) against per-step min/max: speed and accuracy.

A small CNN on scikit-learn's digits (8x8, offline), trained with CPT's cyclic
schedule (3..8 forward bits, 8-bit errors) under five quantizers of the layer
inputs, everything else equal (weights per channel and errors dynamic, as CPT):

* ``fp32``: no quantization;
* ``dynamic_affine``: CPT's per-step min/max (``quantize_model``, the default);
* ``delayed_affine``: the same grid, range = max/min of the last 16 steps;
* ``dynamic_symmetric``: max-abs grid, per-step max;
* ``autoflex_symmetric``: max-abs grid, Flexpoint's Autoflex prediction.

Train-step times are measured interleaved (medians); accuracy is the test accuracy
at the end (evaluated at 8 bits) and the fraction of steps where the history
overflowed is reported for the history methods.

    python benchmarks/scaling.py [--quick] [--json] [--steps 600]
"""
from __future__ import annotations

try:
    from benchmarks import common as C
except ImportError:  # run as a script
    import common as C  # type: ignore

import jax
import jax.numpy as jnp
import numpy as np
import optax

import cpt_jax
from cpt_jax.formats import AffineInt, SymmetricInt
from cpt_jax.models import SmallCNN
from cpt_jax.quant_config import QuantConfig, TensorQuant
from cpt_jax.training import create_train_state, make_eval_step, make_train_step

METHODS = ("fp32", "dynamic_affine", "delayed_affine", "dynamic_symmetric",
           "autoflex_symmetric")


def digits():
    from sklearn.datasets import load_digits
    d = load_digits()
    x = (d.images.astype(np.float32) / 16.0)[..., None]
    x = (x - x.mean()) / x.std()
    y = d.target.astype(np.int32)
    perm = np.random.default_rng(0).permutation(len(y))
    x, y = x[perm], y[perm]
    n_test = 360
    return (jnp.asarray(x[n_test:]), jnp.asarray(y[n_test:]),
            jnp.asarray(x[:n_test]), jnp.asarray(y[:n_test]))


def build_models(base):
    sym = QuantConfig(weight=TensorQuant(SymmetricInt(-1)), activation=TensorQuant(SymmetricInt()))
    return {
        "fp32": base,
        "dynamic_affine": cpt_jax.quantize_model(base, cpt_jax.CPT_RULES),
        "delayed_affine": cpt_jax.doors.delayed_scaling_model(base, cpt_jax.CPT_RULES,
                                                        fmt=AffineInt(), method="delayed"),
        "dynamic_symmetric": cpt_jax.quantize_model(base, cpt_jax.CPT_RULES, config=sym),
        "autoflex_symmetric": cpt_jax.doors.delayed_scaling_model(
            base, cpt_jax.CPT_RULES, config=sym, fmt=SymmetricInt(), method="autoflex"),
    }


def overflow_fraction(model, state, xb) -> float:
    """Fraction of history-scaled layers whose range overflowed on batch `xb`."""
    with cpt_jax.precision(8.0):
        _, inter = model.apply(state.variables(), xb, train=False,
                               mutable=["intermediates"])
    flags = [np.asarray(v) for v in jax.tree_util.tree_leaves(inter)]
    return float(np.mean(flags)) if flags else float("nan")


def main(argv=None) -> dict:
    p = C.parser(__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--batch", type=int, default=64)
    args = p.parse_args(argv)
    steps_n = args.steps or (150 if args.quick else 600)
    info = C.machine_info()
    print(f"# scaling: SmallCNN(16, 32) on digits, {steps_n} steps, batch {args.batch}, {info}")
    xtr, ytr, xte, yte = digits()
    base = SmallCNN(features=(16, 32), num_classes=10)
    models = build_models(base)
    opt = optax.sgd(0.05, momentum=0.9)
    sched = cpt_jax.cyclic("cos_growth", min_bits=3, max_bits=8, num_cycles=4,
                           total_steps=steps_n)
    steps, states, evals = {}, {}, {}
    for k, m in models.items():
        states[k] = create_train_state(m, opt, jax.random.key(0), xtr[:2], train=False)
        steps[k] = make_train_step(m, opt, None if k == "fp32" else sched,
                                   None if k == "fp32" else cpt_jax.constant(8))
        evals[k] = make_eval_step(m)
    n = xtr.shape[0]
    rng = np.random.default_rng(1)
    order = [rng.integers(0, n, args.batch) for _ in range(steps_n)]
    batches = [{"inputs": xtr[i], "labels": ytr[i]} for i in order]
    pos = {k: 0 for k in models}

    def runner(k):
        def run():
            b = batches[pos[k] % steps_n]
            pos[k] += 1
            states[k], _ = steps[k](states[k], b)
            return states[k].params
        return run

    # Interleaved: each round advances every method by the same number of steps.
    iters = 10
    rounds = max(1, steps_n // iters)
    times = C.interleaved({k: runner(k) for k in models}, rounds, iters, warmup=0)
    out = {"steps": steps_n, "batch": args.batch, "methods": {}, "_machine": info}
    fp32 = C.median(times["fp32"])
    for k in models:
        metrics = evals[k](states[k], {"inputs": xte, "labels": yte}, jnp.float32(8.0))
        acc = float(metrics["correct"]) / float(metrics["count"])
        ms = C.median(times[k])
        rec = {"step_ms": round(ms, 3), "ratio_to_fp32": round(ms / fp32, 4),
               "test_accuracy": round(acc, 4), "num_compiles": steps[k].num_compiles,
               "skipped_steps": int(states[k].skipped_steps)}
        if k.startswith(("delayed", "autoflex")):
            rec["overflow_fraction_last_batch"] = round(
                overflow_fraction(models[k], states[k], batches[-1]["inputs"]), 3)
        out["methods"][k] = rec
        print(f"{k:20s} {C.spread(times[k]):>24s} ms/step  x{ms / fp32:5.3f} of fp32  "
              f"test acc {acc:.4f}  compiles {rec['num_compiles']}")
    dyn, dl = out["methods"]["dynamic_affine"], out["methods"]["delayed_affine"]
    out["delayed_over_dynamic_time"] = round(dl["step_ms"] / dyn["step_ms"], 4)
    print(f"delayed/dynamic step time (affine): {out['delayed_over_dynamic_time']:.3f}")
    if args.json:
        C.emit_json(out)
    return out


if __name__ == "__main__":
    main()
