"""The measured figures of `gpu_check.sh` beside the roofline model's, one table each.

    python benchmarks/gpu_summary.py gpu_results/      # reads the *.json gpu_check.sh wrote

Reads the last JSON line of ``overhead.json`` (measured train steps, quant / fp32),
``lowp_gemm.json`` (measured Transformer block steps, bf16 / preset) and
``roofline.json`` (the model: ``model`` = the CUDA-lowered program under the fusion
model, ``compiled`` = XLA GPU's own kernels), and prints them side by side with
``measured / modeled`` time: how far the model is from the GPU. Missing files or
entries print as ``-``.
"""
from __future__ import annotations

import json
import os
import sys
from typing import Any


def last_json(path: str) -> dict[str, Any]:
    """The last line of `path` that parses as a JSON object ({} if none)."""
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        lines = f.read().splitlines()
    for line in reversed(lines):
        try:
            obj = json.loads(line)
        except ValueError:
            continue
        if isinstance(obj, dict):
            return obj
    return {}


def fmt(x, spec: str = ".3f") -> str:
    return "-" if x is None else format(x, spec)


def ratio(a, b):
    return a / b if a is not None and b else None


def overhead_rows(overhead: dict, roof: dict) -> list[str]:
    """Per overhead.py model: measured quant / fp32 (time, peak memory) and the model's."""
    lines = [f"{'model':12s} {'measured':>9s} {'modeled':>8s} {'XLA GPU':>8s} "
             f"{'peak mem':>8s} {'fp32 ms':>8s} {'modeled':>8s} {'meas/mod':>8s}"]
    for name, m in overhead.items():
        if name.startswith("_") or name == "partial" or not isinstance(m, dict):
            continue
        est = roof.get("model", {}).get(f"ovh/{name}", {})
        comp = roof.get("compiled", {}).get(f"ovh/{name}", {})
        est_fp32 = est.get("fp32", {}).get("ms")
        lines.append(
            f"{name:12s} {fmt(m.get('ratio')):>9s} "
            f"{fmt(est.get('quant', {}).get('vs_base')):>8s} "
            f"{fmt(comp.get('quant', {}).get('vs_base')):>8s} {fmt(m.get('peak_ratio')):>8s} "
            f"{fmt(m.get('fp32_ms')):>8s} {fmt(est_fp32):>8s} "
            f"{fmt(ratio(m.get('fp32_ms'), est_fp32), '.2f'):>8s}")
    return lines


def block_rows(lowp: dict, roof: dict) -> list[str]:
    """Per preset timed in the block: measured speed-up over bf16 and the model's."""
    est = roof.get("model", {}).get("block", {})
    comp = roof.get("compiled", {}).get("block", {})
    lines = [f"{'preset':20s} {'measured':>9s} {'modeled':>8s} {'kernel':>8s} {'XLA GPU':>8s} "
             f"{'bf16 ms':>8s} {'modeled':>8s} {'meas/mod':>8s}"]
    for name, r in lowp.get("presets", {}).items():
        b = r.get("block")
        if not b:
            continue
        bf16_est = est.get("bf16", {}).get("ms")
        lines.append(
            f"{name:20s} {fmt(b.get('speedup')):>9s} {fmt(est.get(name, {}).get('speedup')):>8s} "
            f"{fmt(est.get(name, {}).get('kernel_speedup')):>8s} "
            f"{fmt(comp.get(name, {}).get('speedup')):>8s} {fmt(b.get('bf16_ms')):>8s} "
            f"{fmt(bf16_est):>8s} {fmt(ratio(b.get('bf16_ms'), bf16_est), '.2f'):>8s}")
    return lines


def summary(folder: str) -> str:
    overhead = last_json(os.path.join(folder, "overhead.json"))
    lowp = last_json(os.path.join(folder, "lowp_gemm.json"))
    roof = last_json(os.path.join(folder, "roofline.json"))
    gpu = roof.get("gpu", "the GPU")
    out = [f"=== MEASURED vs MODELED ({gpu}; the model: benchmarks/roofline.py) ===",
           "overhead.py: train step quant / fp32 (goal <= 1.10), peak memory quant / fp32 "
           "(goal <= 1.10), fp32 step ms measured and modeled:"]
    out += overhead_rows(overhead, roof)
    out += ["", f"lowp_gemm.py block (d_model {lowp.get('d_model', '-')}): speed-up over bf16 "
                "(> 1 faster); modeled "
                "with XLA's block-scaled expansion, with an FP8-rate kernel, and from XLA GPU's "
                "kernels; bf16 step ms measured and modeled:"]
    out += block_rows(lowp, roof)
    if roof.get("partial"):
        out.append("(roofline.json is partial: its time limit cut it short)")
    return "\n".join(out)


def main(argv=None) -> str:
    args = sys.argv[1:] if argv is None else argv
    text = summary(args[0] if args else "gpu_results")
    print(text)
    return text


if __name__ == "__main__":
    main()
