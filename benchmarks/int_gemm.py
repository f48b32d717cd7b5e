"""Integer GEMMs and convolutions against float32 on this machine: the evidence behind
``compute="auto"`` (`cpt_jax.providers.int_platforms`).

Side by side in one process, alternating rounds (`common.interleaved`), medians:

* **GEMMs** of a Dense layer's three products at one size, each in float32, bfloat16
  operands (fp32 accumulation) and int8 x int8 -> int32: the forward ``x W`` (K
  contracted: the minor axis of x, the major of W), the input gradient ``g W^T`` (N:
  the minor axis of both), and the weight gradient ``x^T g`` (M: the major axis of
  both) in two layouts: as written (XLA folds the transpose into the dot) and with the
  transposed int8 codes materialized row-major (`cpt_jax.ops.integer_gemm.row_major`,
  what the integer provider does). Each with the kernel XLA chose (`hlo.gemms`:
  ``__ynn_fusion`` is YNNPACK).
* **the quantizer**: int8 codes of the activation (affine, per tensor), next to one
  float32 GEMM;
* **convolution routes** (3x3, NHWC): XLA's float32 convolution, XLA's int8
  convolution (int32 accumulation), and im2col (``conv_general_dilated_patches``)
  into one int8 GEMM.

    python benchmarks/int_gemm.py [--quick] [--json] [--size 2048,1024,1024]

JSON (last line): ``{"gemm": {name: ms}, "ratios": {...}, "conv": {...}, "_machine": ...}``.
"""
from __future__ import annotations

import functools

try:
    from benchmarks import common as C
    from benchmarks.hlo import gemms
except ImportError:  # run as a script
    import common as C  # type: ignore
    from hlo import gemms  # type: ignore

import jax
import jax.numpy as jnp
from jax import lax

from cpt_jax.formats import AffineInt
from cpt_jax.ops.integer_gemm import row_major, signed_codes
from cpt_jax.providers.int_platforms import cpu_flags, integer_gemm_platforms
from cpt_jax.quant_config import TensorQuant

DENSE = (((1,), (0,)), ((), ()))
INPUT_GRAD = (((1,), (1,)), ((), ()))
WEIGHT_GRAD = (((0,), (0,)), ((), ()))


def _dot(dims, dtype=None):
    def f(a, b):
        if dtype == "bf16":
            return lax.dot_general(a.astype(jnp.bfloat16), b.astype(jnp.bfloat16), dims,
                                   preferred_element_type=jnp.float32)
        if dtype == "int8":
            return lax.dot_general(a, b, dims, preferred_element_type=jnp.int32)
        return lax.dot_general(a, b, dims)
    return f


def _int8_weight_grad_materialized(x, g):
    """``x^T g`` with ``x^T`` written row-major first (the integer provider's layout)."""
    return lax.dot_general(row_major(x.T), g, DENSE, preferred_element_type=jnp.int32)


def gemm_candidates(m: int, k: int, n: int):
    """``{name: (jitted fn, args)}``: the three GEMMs of a Dense ``(m, k) x (k, n)``."""
    key = jax.random.key(0)
    x, w, g = (jax.random.normal(jax.random.fold_in(key, i), s)
               for i, s in enumerate(((m, k), (k, n), (m, n))))
    codes = [jnp.clip(jnp.round(a * 40), -127, 127).astype(jnp.int8) for a in (x, w, g)]
    xi, wi, gi = codes
    out = {}
    for product, dims, (fa, fb), (ia, ib) in (
            ("forward", DENSE, (x, w), (xi, wi)),
            ("input_grad", INPUT_GRAD, (g, w), (gi, wi)),
            ("weight_grad", WEIGHT_GRAD, (x, g), (xi, gi))):
        out[f"{product}/fp32"] = (jax.jit(_dot(dims)), (fa, fb))
        out[f"{product}/bf16"] = (jax.jit(_dot(dims, "bf16")), (fa, fb))
        out[f"{product}/int8"] = (jax.jit(_dot(dims, "int8")), (ia, ib))
    out["weight_grad/int8_row_major"] = (jax.jit(_int8_weight_grad_materialized), (xi, gi))
    quant = TensorQuant(AffineInt())
    out["quantize/int8_codes"] = (jax.jit(lambda x: signed_codes(x, 8.0, quant, None)[0].astype(
        jnp.int8)), (x,))
    return out


def conv_candidates(batch: int, size: int, cin: int, cout: int):
    """``{name: (jitted fn, args)}``: one 3x3 SAME convolution, NHWC / HWIO, three routes."""
    key = jax.random.key(1)
    x = jax.random.normal(key, (batch, size, size, cin))
    w = jax.random.normal(jax.random.fold_in(key, 1), (3, 3, cin, cout))
    xi = jnp.clip(jnp.round(x * 40), -127, 127).astype(jnp.int8)
    wi = jnp.clip(jnp.round(w * 40), -127, 127).astype(jnp.int8)
    dn = ("NHWC", "HWIO", "NHWC")
    conv = functools.partial(lax.conv_general_dilated, window_strides=(1, 1), padding="SAME",
                             dimension_numbers=dn)

    def im2col_int8(x, w):
        patches = lax.conv_general_dilated_patches(x.astype(jnp.float32), (3, 3), (1, 1),
                                                   "SAME", dimension_numbers=dn)
        cols = patches.astype(jnp.int8).reshape(-1, patches.shape[-1])
        # patches order features as (C, kh, kw): the kernel's rows follow it
        kernel = jnp.transpose(w, (2, 0, 1, 3)).reshape(-1, w.shape[-1])
        return lax.dot(cols, kernel, preferred_element_type=jnp.int32)

    return {"conv/fp32": (jax.jit(conv), (x, w)),
            "conv/int8_xla": (jax.jit(lambda a, b: conv(a, b, preferred_element_type=jnp.int32)),
                              (xi, wi)),
            "conv/int8_im2col": (jax.jit(im2col_int8), (xi, wi))}


def time_all(cands: dict, rounds: int, iters: int) -> dict[str, float]:
    runners = {name: functools.partial(fn, *args) for name, (fn, args) in cands.items()}
    times = C.interleaved(runners, rounds, iters, warmup=1)
    return {name: round(C.median(t), 3) for name, t in times.items()}


def kernels(cands: dict) -> dict[str, str]:
    """The kernel XLA picked for each candidate's GEMM (``hlo.Gemm.library``)."""
    out = {}
    for name, (fn, args) in cands.items():
        found = gemms(fn.lower(*args).compile().as_text())
        out[name] = ",".join(sorted({g.library or "xla" for g in found})) or "-"
    return out


def ratios(ms: dict[str, float]) -> dict[str, float]:
    """fp32 time / candidate time for each GEMM (> 1: faster than float32)."""
    out = {}
    for name, t in ms.items():
        product, kind = name.split("/")
        base = ms.get(f"{product}/fp32")
        if base and kind != "fp32":
            out[name] = round(base / t, 3)
    out["quantize/int8_codes_vs_forward_fp32"] = round(
        ms["quantize/int8_codes"] / ms["forward/fp32"], 3)
    return out


def main(argv=None) -> dict:
    p = C.parser(__doc__.splitlines()[0])
    p.add_argument("--size", default=None, help="M,K,N of the Dense layer")
    p.add_argument("--conv", default=None, help="batch,size,cin,cout of the convolution")
    args = p.parse_args(argv)
    m, k, n = map(int, (args.size or ("512,512,512" if args.quick else "2048,1024,1024"))
                  .split(","))
    cb, cs, ci, co = map(int, (args.conv or ("32,16,32,32" if args.quick else "128,32,64,64"))
                         .split(","))
    rounds = args.rounds or (3 if args.quick else 7)
    info = C.machine_info() | {"int_gemm_platforms": list(integer_gemm_platforms()),
                               "cpu_int_flags": sorted(f for f in cpu_flags()
                                                       if "amx" in f or "vnni" in f)}
    print(f"# int_gemm: {info}")
    g, c = gemm_candidates(m, k, n), conv_candidates(cb, cs, ci, co)
    ms = time_all(g, rounds, 1) | time_all(c, rounds, 1)
    r = ratios({k: v for k, v in ms.items() if not k.startswith("conv/")})
    kinds = kernels(g) | kernels(c)
    for name, t in ms.items():
        print(f"{name:30s} {t:9.2f} ms  fp32/this {r.get(name, float('nan')):6.2f}  "
              f"kernel {kinds[name]}")
    conv_ratios = {name: round(ms["conv/fp32"] / ms[name], 3) for name in ms
                   if name.startswith("conv/") and name != "conv/fp32"}
    print(f"conv fp32/route: {conv_ratios}")
    summary = {"gemm": {k_: v for k_, v in ms.items() if not k_.startswith("conv/")},
               "ratios": r, "conv": {k_: v for k_, v in ms.items() if k_.startswith("conv/")},
               "conv_ratios": conv_ratios, "kernels": kinds, "size": [m, k, n],
               "conv_shape": [cb, cs, ci, co], "_machine": info}
    if args.json:
        C.emit_json(summary)
    return summary


if __name__ == "__main__":
    main()
