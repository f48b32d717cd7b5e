"""Quantizer throughput on a large tensor (GB/s) against this machine's memory bandwidth.

An elementwise op cannot beat a plain copy: read ``n`` floats, write ``n`` floats.
The copy (``x * 1.0001`` under jit, which XLA cannot elide) is measured in the same
run, interleaved with each quantizer; GB/s counts ``2 * 4n`` bytes (read + write)
for every op, so the ratio to the copy is the fraction of bandwidth reached.
Dynamic quantizers also read `x` for their ranges (min/max/sum reductions) before
the quantize pass, so their floor is more than one copy; the delayed-scaling
quantizer (range from history) is a single pass plus the observation of the range.

    python benchmarks/throughput.py [--quick] [--json] [--size 33554432]
"""
from __future__ import annotations

try:
    from benchmarks import common as C
except ImportError:  # run as a script
    import common as C  # type: ignore

import jax
import jax.numpy as jnp

from cpt_jax.formats import AffineInt, BlockFloat, Float, SymmetricInt, quantize
from cpt_jax.ops.fake_quant import fake_quant
from cpt_jax.ops.scale_history import init_history, update_history
from cpt_jax.providers.delayed_scaling import delayed_scale_quantize


def candidates(x, key):
    hist = update_history(init_history(), jnp.min(x), jnp.max(x), False)
    fns = {
        "copy": lambda x: x * 1.0001,
        "affine_nearest": lambda x: quantize(x, 8.0, AffineInt()),
        "affine_stochastic": lambda x: quantize(x, 8.0, AffineInt(), rounding="stochastic",
                                                key=key),
        "affine_per_channel": lambda x: quantize(x, 8.0, AffineInt(channel_axis=-1)),
        "symmetric": lambda x: quantize(x, 8.0, SymmetricInt()),
        "block_float": lambda x: quantize(x, 8.0, BlockFloat()),
        "float_e4m3": lambda x: quantize(x, 8.0, Float(4)),
        "fake_quant_affine": lambda x: fake_quant(x, 8.0, AffineInt()),
        "delayed_affine": lambda x: delayed_scale_quantize(x, 8.0, hist, AffineInt())[0],
        "x_plus_jax_random_uniform": lambda x: x + jax.random.uniform(key, x.shape),
    }
    return {k: jax.jit(v) for k, v in fns.items()}


def main(argv=None) -> dict:
    p = C.parser(__doc__.splitlines()[0])
    p.add_argument("--size", type=int, default=None, help="elements (float32)")
    args = p.parse_args(argv)
    n = args.size or ((1 << 23) if args.quick else (1 << 25))
    rounds = args.rounds or (5 if args.quick else 9)
    info = C.machine_info()
    print(f"# throughput: {n} float32 ({4 * n / 1e6:.0f} MB), {info}")
    x = jax.random.normal(jax.random.key(0), (n // 256, 256), jnp.float32)
    key = jax.random.key(1)
    fns = candidates(x, key)
    times = C.interleaved({k: (lambda f=f: f(x)) for k, f in fns.items()}, rounds, 3, warmup=1)
    copy_ms = C.median(times["copy"])
    gbytes = 2 * 4 * n / 1e9
    out = {"elements": n, "copy_GBps": round(gbytes / (copy_ms / 1e3), 2), "ops": {},
           "_machine": info}
    for k, v in times.items():
        ms = C.median(v)
        gbps = gbytes / (ms / 1e3)
        out["ops"][k] = {"ms": round(ms, 3), "GBps": round(gbps, 2),
                         "fraction_of_copy": round(copy_ms / ms, 3)}
        print(f"{k:22s} {C.spread(v):>26s} ms  {gbps:7.2f} GB/s  "
              f"{copy_ms / ms:5.2f} of copy")
    if args.json:
        C.emit_json(out)
    return out


if __name__ == "__main__":
    main()
