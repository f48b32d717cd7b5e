"""FP8 x FP8 -> fp32 matmul (cpt_jax.format_providers.FP8Product) vs bf16, for an H100/H200.

    python benchmarks/fp8_matmul.py --json --size 8192        # goal: >= 1.3x bf16 (GEMM only)

Times (median of --repeats, after a warm-up) on (n x n) . (n x n):
  bf16      : lax.dot_general(bf16, bf16) -> bf16
  fp8_gemm  : lax.dot_general(e4m3 codes, e4m3 codes, preferred_element_type=f32) * s_x s_w
              (operands quantized once beforehand: the GEMM as a kernel sees it)
  fp8_step  : FP8Product.forward on float32 operands: amax, scale, cast and GEMM
Prints one JSON line: times in ms, TFLOP/s, speedups vs bf16, whether the compiled HLO
holds an f8 GEMM custom call (cublasLt) or a plain dot.
"""
import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from cpt_jax import formats
from cpt_jax.format_providers import FP8Product
from cpt_jax.formats import ScaledFloat
from cpt_jax.interception import dot_general_op

DIMS = (((1,), (0,)), ((), ()))


def timed(fn, *args, repeats):
    fn(*args).block_until_ready()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn(*args).block_until_ready()
        times.append(time.perf_counter() - t0)
    return float(np.median(times)) * 1e3


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--size", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    n = args.size
    kx, kw = jax.random.split(jax.random.key(0))
    x = jax.random.normal(kx, (n, n), jnp.float32)
    w = jax.random.normal(kw, (n, n), jnp.float32) / np.sqrt(n)
    fmt = ScaledFloat("e4m3")
    product = FP8Product(dot_general_op(DIMS), fmt, fmt)
    xc, xs = formats.scaled_codes(x, fmt)
    wc, ws = formats.scaled_codes(w, fmt)
    bf16 = jax.jit(lambda a, b: jax.lax.dot_general(a, b, DIMS))
    gemm = jax.jit(lambda a, b, sa, sb: jax.lax.dot_general(
        a, b, DIMS, preferred_element_type=jnp.float32) * (sa * sb))
    step = jax.jit(lambda a, b: product.fp8(a, b)[0])
    hlo = gemm.lower(xc, wc, xs, ws).compile().as_text()
    ms = {"bf16": timed(bf16, x.astype(jnp.bfloat16), w.astype(jnp.bfloat16), repeats=args.repeats),
          "fp8_gemm": timed(gemm, xc, wc, xs, ws, repeats=args.repeats),
          "fp8_step": timed(step, x, w, repeats=args.repeats)}
    flops = 2.0 * n ** 3
    out = {"benchmark": "fp8_matmul", "size": n, "device": str(jax.devices()[0]),
           "ms": ms, "tflops": {k: flops / v / 1e9 for k, v in ms.items()},
           "speedup_vs_bf16": {k: ms["bf16"] / v for k, v in ms.items() if k != "bf16"},
           "f8_gemm_in_hlo": ("f8e4m3fn" in hlo and "custom-call" in hlo),
           "max_rel_err_vs_fake_quant": float(jnp.max(jnp.abs(
               gemm(xc, wc, xs, ws) - formats.quantize(x, 8, fmt) @ formats.quantize(w, 8, fmt)))
               / jnp.max(jnp.abs(gemm(xc, wc, xs, ws))))}
    print(json.dumps(out) if args.json else out)


if __name__ == "__main__":
    main()
