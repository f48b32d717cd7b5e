"""HALP's inner loop with real int8 arithmetic vs fp32 SVRG (logistic regression).

Multinomial logistic regression, ``N`` examples of dimension ``d`` (unit-norm rows
``[u, 1]`` with ``u ~ U[0, 1)``, MNIST-shaped by default: d = 785, 10 classes), L2
``lam``. Both inner loops use the same algebra, with the anchor's logits
``X w~`` and probabilities ``p~`` cached once per epoch (they are part of the
full-gradient pass), so one inner step on a minibatch ``B`` is::

    fp32 SVRG:  p = softmax(X_B w)
                w <- w - a (X_B^T (p - p~_B) / |B| + lam (w - w~) + g~)

    HALP int8:  X stored as int8 codes X_q (scale s_x), offset z = s c as int8 codes c
                logits = (X w~)_B + s_x s * dot(X_q,B, c)          int8 x int8 -> int32
                d = p - p~_B  ->  int8 codes d_q (scale s_d, stochastic rounding)
                grad = s_x s_d dot(X_q,B^T, d_q) / |B| + lam s c + g~   int8 -> int32
                c <- clamp(floor(c - a grad / s + U), -128, 127)

The products use ``lax.dot_general(..., preferred_element_type=jnp.int32)``. A third
line, ``halp_fp32_arith``, runs the same HALP step with fp32 products (int8 storage
only) to separate the storage from the arithmetic. HALP's stochastic rounding draws
``d*C + B*C`` uniforms per step; ``--prng`` picks the generator (threefry by default,
``rbg``/``unsafe_rbg`` are cheaper). Time per step: a jitted
``lax.scan`` of ``--steps`` inner steps, median over ``--repeats`` runs, all methods
measured side by side (interleaved) in one process.

Usage:
  python benchmarks/halp_int8.py --quick
  python benchmarks/halp_int8.py --batch_size=256 --json
"""
from __future__ import annotations

import json
import os
import sys
import time

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402

from cpt_jax import optim  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_bool("quick", False, "Fewer repeats and steps.")
flags.DEFINE_bool("json", False, "Print one JSON object on the last line.")
flags.DEFINE_integer("num_examples", 8192, "N.")
flags.DEFINE_integer("dim", 785, "Features d (MNIST pixels + bias).")
flags.DEFINE_integer("num_classes", 10, "Classes.")
flags.DEFINE_integer("batch_size", 128, "Minibatch of one inner step.")
flags.DEFINE_integer("steps", 200, "Inner steps per timed scan.")
flags.DEFINE_integer("repeats", 15, "Timed repeats (median reported).")
flags.DEFINE_float("lr", 1.0, "Step size.")
flags.DEFINE_float("l2", 1e-3, "L2 strength.")
flags.DEFINE_integer("seed", 0, "Seed.")
flags.DEFINE_enum("prng", "threefry2x32", ["threefry2x32", "rbg", "unsafe_rbg"],
                  "PRNG of the stochastic rounding (jax.random.key impl).")

INT8_DN = (((1,), (0,)), ((), ()))      # (B, d) . (d, C)
INT8_DN_T = (((0,), (0,)), ((), ()))    # (B, d)^T . (B, C)


def make_problem(n: int, d: int, c: int, seed: int):
    rng = np.random.default_rng(seed)
    x = rng.random((n, d), np.float32)
    x[:, -1] = 1.0
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    y = rng.integers(0, c, n)
    return jnp.asarray(x), jnp.asarray(np.eye(c, dtype=np.float32)[y])


def _softmax(z):
    return jax.nn.softmax(z, axis=-1)


def build(x, y1h, *, batch_size: int, steps: int, lr: float, l2: float,
          prng: str = "threefry2x32"):
    """Jitted scans of `steps` inner steps: fp32 SVRG, HALP int8, HALP fp32 arithmetic."""
    n, d = x.shape
    c = y1h.shape[1]
    # Epoch-level quantities (computed once, outside the timed inner loop).
    w_anchor = 0.01 * jax.random.normal(jax.random.PRNGKey(1), (d, c))
    logits_anchor = x @ w_anchor
    p_anchor = _softmax(logits_anchor)
    g_full = x.T @ (p_anchor - y1h) / n + l2 * w_anchor
    s_x = jnp.max(jnp.abs(x)) / 127.0
    x_q = jnp.clip(jnp.round(x / s_x), -127, 127).astype(jnp.int8)
    scale = optim.halp_scale(g_full, 0.1, 8)
    idx = optim.minibatch_indices(jax.random.PRNGKey(2), n, batch_size, steps)
    inv_b = 1.0 / batch_size

    def svrg_step(w, i):
        xb = x[i]
        p = _softmax(xb @ w)
        grad = xb.T @ (p - p_anchor[i]) * inv_b + l2 * (w - w_anchor) + g_full
        return w - lr * grad, None

    def halp_int8_step(carry, ti):
        codes, key = carry
        t, i = ti
        k1, k2 = jax.random.split(jax.random.fold_in(key, t))
        xb = x_q[i]
        acc = lax.dot_general(xb, codes, INT8_DN, preferred_element_type=jnp.int32)
        p = _softmax(logits_anchor[i] + (s_x * scale) * acc.astype(jnp.float32))
        diff = p - p_anchor[i]
        s_d = jnp.maximum(jnp.max(jnp.abs(diff)), 1e-30) / 127.0
        d_q = optim.quantize_to_codes(diff, s_d, 8, key=k1, dtype=jnp.int8)
        acc_t = lax.dot_general(xb, d_q, INT8_DN_T, preferred_element_type=jnp.int32)
        grad = ((s_x * s_d * inv_b) * acc_t.astype(jnp.float32)
                + l2 * scale * codes.astype(jnp.float32) + g_full)
        new = optim.quantize_to_codes(scale * codes.astype(jnp.float32) - lr * grad, scale, 8,
                                      key=k2, dtype=jnp.int8)
        return (new, key), None

    def halp_fp32_step(carry, ti):
        codes, key = carry
        t, i = ti
        xb = x[i]
        z = scale * codes.astype(jnp.float32)
        p = _softmax(logits_anchor[i] + xb @ z)
        grad = xb.T @ (p - p_anchor[i]) * inv_b + l2 * z + g_full
        new = optim.quantize_to_codes(z - lr * grad, scale, 8,
                                      key=jax.random.fold_in(key, t), dtype=jnp.int8)
        return (new, key), None

    ts = jnp.arange(steps)

    @jax.jit
    def run_svrg(w):
        return lax.scan(svrg_step, w, idx)[0]

    @jax.jit
    def run_halp_int8(codes, key):
        return lax.scan(halp_int8_step, (codes, key), (ts, idx))[0][0]

    @jax.jit
    def run_halp_fp32(codes, key):
        return lax.scan(halp_fp32_step, (codes, key), (ts, idx))[0][0]

    w0 = w_anchor
    c0 = jnp.zeros((d, c), jnp.int8)
    key = jax.random.key(3, impl=prng)
    return {
        "svrg_fp32": lambda: run_svrg(w0),
        "halp_int8": lambda: run_halp_int8(c0, key),
        "halp_fp32_arith": lambda: run_halp_fp32(c0, key),
    }


def main(argv):
    del argv
    repeats = 5 if FLAGS.quick else FLAGS.repeats
    steps = 50 if FLAGS.quick else FLAGS.steps
    n = 2048 if FLAGS.quick else FLAGS.num_examples
    x, y1h = make_problem(n, FLAGS.dim, FLAGS.num_classes, FLAGS.seed)
    fns = build(x, y1h, batch_size=min(FLAGS.batch_size, n), steps=steps, lr=FLAGS.lr,
                l2=FLAGS.l2, prng=FLAGS.prng)
    for fn in fns.values():  # compile + warm up
        jax.block_until_ready(fn())
        jax.block_until_ready(fn())
    times = {k: [] for k in fns}
    for _ in range(repeats):  # interleaved, so load changes hit every method alike
        for name, fn in fns.items():
            t0 = time.perf_counter()
            jax.block_until_ready(fn())
            times[name].append((time.perf_counter() - t0) / steps)
    med = {k: float(np.median(v)) for k, v in times.items()}
    ratio = med["halp_int8"] / med["svrg_fp32"]
    device = jax.devices()[0]
    print(f"device: {device.platform} ({device.device_kind}); N={n} d={FLAGS.dim} "
          f"C={FLAGS.num_classes} batch={min(FLAGS.batch_size, n)} steps/scan={steps} "
          f"repeats={repeats} prng={FLAGS.prng}")
    print("| inner loop | median step time (us) | vs fp32 SVRG |")
    print("|---|---|---|")
    for k, v in med.items():
        print(f"| {k} | {v * 1e6:.1f} | {v / med['svrg_fp32']:.2f}x |")
    print(f"HALP int8 / fp32 SVRG step time ratio: {ratio:.3f} "
          f"({'faster' if ratio < 1 else 'slower'} than fp32 SVRG)")
    if FLAGS.json:
        print(json.dumps(dict(
            device=device.platform, device_kind=device.device_kind, num_examples=n,
            dim=FLAGS.dim, num_classes=FLAGS.num_classes,
            batch_size=min(FLAGS.batch_size, n), steps=steps, repeats=repeats,
            prng=FLAGS.prng,
            median_step_s=med, ratio_halp_int8_over_svrg_fp32=ratio)))


if __name__ == "__main__":
    app.run(main)
