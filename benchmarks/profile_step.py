"""Where the time of a quantized train step goes: a profile attributed to source files.

Profiles a few train steps (``jax.profiler`` trace, XLA's per-thunk events) and
attributes each compiled op's time to the source of its HLO metadata: ops whose
stack frames pass through `cpt_jax/formats/`, `cpt_jax/ops/` or `cpt_jax/providers/`
(and the noise) are *quantization*; convolutions and dots are *products*; the
rest (BatchNorm, ReLU, optimizer, layout copies) is *other*. Run for the fp32 and
the quantized step of the same model: the difference is what quantization costs,
and the quantization share is what fusing could still save.

    python benchmarks/profile_step.py [--model resnet20] [--steps 2] [--json]
"""
from __future__ import annotations

import collections
import glob
import gzip
import json
import os
import re
import shutil
import tempfile

try:
    from benchmarks import common as C
except ImportError:  # run as a script
    import common as C  # type: ignore

import jax

# An op is the quantizer's when a frame of its stack lies in one of these folders.
QUANT_DIRS = ("cpt_jax/formats/", "cpt_jax/ops/", "cpt_jax/providers/")


def _frames(text: str):
    """{stack_frame_id: set(file names)} from the HLO module's stack-frame tables."""
    section = lambda name: text.split(name, 1)[1] if name in text else ""
    fnames, locs, frames = {}, {}, {}
    block = section("FileNames").split("FunctionNames")[0]
    for m in re.finditer(r'^(\d+) "([^"]+)"', block, re.M):
        fnames[int(m.group(1))] = m.group(2).replace(os.sep, "/")
    block = section("FileLocations").split("StackFrames")[0]
    for m in re.finditer(r"^(\d+) \{file_name_id=(\d+)", block, re.M):
        locs[int(m.group(1))] = fnames.get(int(m.group(2)), "?")
    block = section("StackFrames").split("\n\n")[0]
    parent = {}
    for m in re.finditer(r"^(\d+) \{file_location_id=(\d+)(?: parent_frame_id=(\d+))?", block, re.M):
        fid = int(m.group(1))
        frames[fid] = locs.get(int(m.group(2)), "?")
        parent[fid] = int(m.group(3)) if m.group(3) else None

    def chain(fid):
        out, seen = set(), set()
        while fid is not None and fid not in seen:
            seen.add(fid)
            out.add(frames.get(fid, "?"))
            nxt = parent.get(fid)
            fid = nxt if nxt != fid else None
        return out
    return chain


def classify(text: str) -> dict:
    """{instruction name: 'quantization' | 'products' | 'other'} for the entry's ops."""
    chain = _frames(text)
    comps = {}
    cur = None
    for line in text.splitlines():
        m = re.match(r"^%?([\w.\-]+) .*\{\s*$", line) or re.match(r"^ENTRY %?([\w.\-]+)", line)
        if m:
            cur = m.group(1)
            comps[cur] = []
        elif cur is not None:
            comps[cur].append(line)
    kinds = {}
    for line in text.splitlines():
        m = re.match(r"\s*(?:ROOT )?%([\w.\-]+) = \S+ ([\w-]+)\(.*", line)
        if not m:
            continue
        inst, op = m.groups()
        called = re.search(r"calls=%([\w.\-]+)", line)
        body = comps.get(called.group(1), []) if called else [line]
        files = set()
        for b in body + [line]:
            for sf in re.findall(r"stack_frame_id=(\d+)", b):
                files |= chain(int(sf))
        if any(d in f for f in files for d in QUANT_DIRS):
            kinds[inst] = "quantization"
        elif op in ("convolution", "dot") or any(
                re.search(r"= \S+ (convolution|dot)\(", b) for b in body):
            kinds[inst] = "products"
        else:
            kinds[inst] = "other"
    return kinds


def profile(step, state, batch, n: int):
    for _ in range(2):
        state, _ = step(state, batch)
    jax.block_until_ready(state)
    d = tempfile.mkdtemp(prefix="cpt_prof_")
    with jax.profiler.trace(d, create_perfetto_trace=True):
        for _ in range(n):
            state, _ = step(state, batch)
        jax.block_until_ready(state)
    path = glob.glob(os.path.join(d, "**", "*.json.gz"), recursive=True)[0]
    trace = json.load(gzip.open(path))
    shutil.rmtree(d, ignore_errors=True)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    agg = collections.Counter()
    for e in events:
        if e.get("ph") == "X":
            agg[e["name"]] += e.get("dur", 0) / 1e3 / n   # ms per step
    return state, agg


def main(argv=None) -> dict:
    p = C.parser(__doc__.splitlines()[0])
    p.add_argument("--model", default="resnet20")
    p.add_argument("--steps", type=int, default=2)
    args = p.parse_args(argv)
    spec = C.build(args.model)
    s = C.make_steps(spec, 64)
    out = {"model": args.model, "_machine": C.machine_info()}
    for k in ("fp32", "quant"):
        step, state = s["steps"][k], s["states"][k]
        text = step.lower(state, spec["batch"]).compile().as_text()
        kinds = classify(text)
        _, agg = profile(step, state, spec["batch"], args.steps)
        shares = collections.Counter()
        for name, ms in agg.items():
            if name in kinds:
                shares[kinds[name]] += ms
        total = sum(shares.values())
        out[k] = {c: round(v, 2) for c, v in shares.items()} | {"total_ms": round(total, 2)}
        print(f"{k:6s} per step (sum of op times, ms): " + "  ".join(
            f"{c} {v:.1f} ({v / max(total, 1e-9):.0%})" for c, v in shares.most_common()))
        for cat in ("quantization", "other"):
            top = sorted(((ms, n) for n, ms in agg.items() if kinds.get(n) == cat),
                         reverse=True)[:6]
            if top:
                print(f"       top {cat} ops: " + ", ".join(f"{n} {ms:.1f}" for ms, n in top))
    if args.json:
        C.emit_json(out)
    return out


if __name__ == "__main__":
    main()
