"""Where the time of a quantized train step goes: a profile attributed to source files.

Profiles a few train steps (``jax.profiler`` trace, XLA's per-thunk events) and
attributes each compiled op's time to the source of its HLO metadata: ops whose
stack frames pass through `cpt_jax/formats/`, `cpt_jax/ops/` or `cpt_jax/providers/`
(and the noise) are *quantization*; convolutions and dots are *products*; the
rest (BatchNorm, ReLU, optimizer, layout copies) is *other*. Run for the fp32 and
the quantized step of the same model: the difference is what quantization costs,
and the quantization share is what fusing could still save.

It also counts the *passes* of each quantized tensor in the compiled quantized step
(`PassCounter`, `quantizers`, `pass_table`): the quantization kernels grouped by the
tensor they quantize (a weight, an activation, an error), with per tensor the
reduction kernels over its data (min / max / sum: its range or amax), the kernels
writing a tensor-sized result (and how many of them round), the tensor-sized reads,
the scalar / per-channel kernels between them, how many products read the result (a
weight quantized once though two products use it), reductions that run twice, and the
bytes moved. The goal per tensor: one read for its range, one fused read-write for
the rounding (2 reads, 1 write).

    python benchmarks/profile_step.py [--model resnet20] [--steps 2] [--json]
    python benchmarks/profile_step.py --model mlp --no-time        # the pass table only
    python benchmarks/profile_step.py --model mlp --preset fp8_gemm --no-time
    python benchmarks/profile_step.py --model mlp --compute int --no-time   # integer GEMMs

It lists the step's GEMMs too (`gemm_table`): each ``dot`` of the compiled program with
its operand and result types, shapes, contracted axes, the product it belongs to and the
kernel XLA chose on CPU (``__ynn_fusion``: YNNPACK; ``xla``: XLA's own loop), so an
integer GEMM that left the fast kernel, or ran on int32 operands, shows.
"""
from __future__ import annotations

import collections
import dataclasses
import glob
import gzip
import json
import os
import re
import shutil
import tempfile
from typing import Any

try:
    from benchmarks import common as C
    from benchmarks import gpu_model as G
    from benchmarks import hlo as H
except ImportError:  # run as a script
    import common as C  # type: ignore
    import gpu_model as G  # type: ignore
    import hlo as H  # type: ignore

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


def kernel_files(module: H.Module, chain, ins: H.Instr) -> set[str]:
    """Source files on the stacks of a kernel and of everything fused into it."""
    files: set[str] = set()
    for _, b in [("", ins)] + G.kernel_body(module, ins):
        if b.stack_frame is not None:
            files |= chain(b.stack_frame)
    return files


def kernel_kind(module: H.Module, chain, ins: H.Instr) -> str:
    """``"products"`` (a dot / convolution inside), ``"quantization"`` (a stack frame in
    `QUANT_DIRS`) or ``"other"``."""
    body = [b for _, b in G.kernel_body(module, ins)]
    if any(b.op in ("dot", "convolution") or (b.op == "custom-call" and G.GEMM_TARGETS.search(
            b.target)) for b in body):
        return "products"
    files = kernel_files(module, chain, ins)
    return "quantization" if any(d in f for f in files for d in QUANT_DIRS) else "other"


def classify(text: str) -> dict:
    """{kernel name: 'quantization' | 'products' | 'other'} for a compiled program's
    kernels (the entry's ops, taken branches and loop bodies included)."""
    module = H.parse(text)
    chain = _frames(text)
    kernels, _ = G.compiled_kernels(module, {})
    return {k.name: kernel_kind(module, chain, module.instr(k.where, k.name)) for k in kernels}


# --------------------------------------------------------------------------- passes

REDUCERS = {"minimum": "min", "maximum": "max", "add": "sum", "and": "all", "or": "any",
            "multiply": "prod"}


@dataclasses.dataclass
class Quantizer:
    """The quantization kernels of one tensor of a train step, as compiled.

    ``reductions``: one entry per reduction kernel over tensor-sized data (``"min+max"``
    for one multi-output kernel); ``passes``: kernels writing a tensor-sized result,
    ``rounding`` of them the ones that round (a round / floor, or a convert to 8 bits);
    ``reads``: tensor-sized buffers the kernels read (the tensor, its producer's inputs
    where the producer is fused in, or the quantizer's own tensor-sized temporaries);
    ``small``: the scalar / per-channel kernels between them; ``used_by``: product
    kernels (dot / convolution) reading a tensor-sized result; ``duplicates``: reductions
    of the same kind over the same tensor beyond the first.
    """

    tensor: str
    role: str
    products: list[str]
    elements: int
    reductions: list[str]
    passes: int
    rounding: int
    reads: int
    small: int
    mbytes: float
    used_by: int = 0
    duplicates: int = 0
    kernels: list[str] = dataclasses.field(default_factory=list)

    @property
    def notes(self) -> str:
        out = []
        if self.duplicates:
            out.append(f"{self.duplicates} reduction(s) run twice")
        if self.role == "weight" and self.rounding > 1:
            out.append(f"weight rounded {self.rounding}x")
        if len(self.products) > 1:
            out.append(f"quantized by {len(self.products)} products")
        if self.reads > 2:
            out.append(f"{self.reads} tensor reads (goal 2)")
        return "; ".join(out)


class PassCounter:
    """Quantization kernels of a compiled program grouped by the tensor they quantize."""

    def __init__(self, text: str, params: dict[str, Any] | None = None):
        self.m = H.parse(text)
        chain = _frames(text)
        self.kernels, info = G.compiled_kernels(self.m, params or {})
        self.branches = info["branches"]
        self.by_key = {(k.where, k.name): k for k in self.kernels}
        self.kind = {key: kernel_kind(self.m, chain, self.m.instr(*key)) for key in self.by_key}
        self._memo: dict[tuple, frozenset] = {}
        self.producers = {key: self._inputs(k) for key, k in self.by_key.items()}
        self._adopt({key for key in self.by_key
                     if not kernel_files(self.m, chain, self.m.instr(*key))})

    def _adopt(self, anonymous: set) -> None:
        """Kernels without source metadata (layout copies, a reduce-window XLA made) that
        only read quantization kernels' results belong to the quantizer."""
        readers = collections.defaultdict(list)
        for key, prods in self.producers.items():
            for p in prods:
                readers[p].append(key)
        changed = True
        while changed:
            changed = False
            for key in anonymous:
                prods = [p for p in self.producers[key] if p[0] != ""]
                near = [prods, readers[key]]
                if self.kind[key] == "other" and any(
                        n and all(self.kind.get(p) == "quantization" for p in n) for n in near):
                    self.kind[key] = "quantization"
                    changed = True

    def rounds(self, key) -> bool:
        """Whether a kernel rounds: a round / floor / ceil, or a convert to <= 8 bits."""
        return any(b.op in ("round-nearest-even", "round-nearest-afz", "floor", "ceil") or (
            b.op == "convert" and H.is_narrow(b.shape.dtype))
            for _, b in G.kernel_body(self.m, self.m.instr(*key)))

    def _inputs(self, k: G.Kernel) -> frozenset:
        out: frozenset = frozenset()
        for o in k.inputs:
            out |= self.resolve(k.where, o)
        return out

    def resolve(self, comp: str, name: str, index: int | None = None) -> frozenset:
        """The kernels (``(computation, name)``) or inputs (``("", name)``) whose results
        the value `name` of `comp` is, through tuples, branches, calls and parameters."""
        key = (comp, name, index)
        if key not in self._memo:
            self._memo[key] = frozenset()  # a cycle (loop state) resolves to nothing
            self._memo[key] = self._resolve(comp, name, index)
        return self._memo[key]

    def _resolve(self, comp: str, name: str, index: int | None) -> frozenset:
        if (comp, name) in self.by_key:
            return frozenset({(comp, name)})
        ins = self.m.instr(comp, name)
        if ins.op in ("parameter", "constant"):
            return self._parameter(comp, ins, index)
        if ins.op == "get-tuple-element":
            return self.resolve(comp, ins.operands[0], int(ins.attr("index") or 0))
        if ins.op == "tuple":
            ops = ins.operands if index is None or index >= len(ins.operands) else \
                [ins.operands[index]]
            return frozenset().union(*(self.resolve(comp, o) for o in ops))
        if ins.op in ("conditional", "call", "while"):
            taken = self.branches.get((comp, name))
            called = ([ins.called[taken]] if taken is not None else ins.called) \
                if ins.op == "conditional" else [ins.called[0] if ins.op == "call"
                                                  else G.while_body(ins)]
            return frozenset().union(*(self.resolve(c, self.m.comps[c].root, index)
                                       for c in called))
        return frozenset().union(*(self.resolve(comp, o) for o in ins.operands))

    def _parameter(self, comp: str, ins: H.Instr, index: int | None) -> frozenset:
        if ins.op == "constant" or comp == self.m.entry:
            return frozenset({("", ins.name)})
        parent, caller = self.m.callers.get(comp, ("", ""))
        if not parent:
            return frozenset()
        cins = self.m.instr(parent, caller)
        if cins.op == "conditional":
            operand = cins.operands[1 + cins.called.index(comp)]
        elif cins.op in ("call", "while"):
            operand = cins.operands[int(ins.literal)]
        else:
            return frozenset()
        return self.resolve(parent, operand, index)

    def elements(self, key) -> int:
        if key[0] == "":
            return self.m.instr(self.m.entry, key[1]).shape.elements \
                if key[1] in self.m.comps[self.m.entry].by_name else 1
        return self.m.instr(*key).shape.elements

    def direction(self, key) -> str:
        """``"bwd"`` for a kernel of the backward pass (``transpose(...)`` in its op_name)."""
        return "bwd" if "transpose(" in self.by_key[key].label else "fwd"

    def is_constant(self, key) -> bool:
        if key[0] != "":
            return False
        ins = self.m.comps[self.m.entry].by_name.get(key[1])
        return ins is None or ins.op == "constant"

    def lineage(self, key) -> list:
        """The big input an elementwise non-quantization kernel computes its result from
        (the matmul output under a fused bias + ReLU): quantizers reading either read the
        same tensor."""
        if key[0] == "" or self.kind.get(key) != "other" or self.reduction(key):
            return []
        same = [p for p in self.producers[key] if self.elements(p) == self.elements(key)]
        return same if len(same) == 1 else []

    def label(self, key) -> str:
        ins = self.m.instr(key[0] or self.m.entry, key[1])
        return ins.op_name or ins.name

    def reduction(self, key) -> str:
        """``"min"``, ``"max"``, ``"min+max"``... of a kernel's reduces (``""``: none)."""
        names = []
        for _, b in G.kernel_body(self.m, self.m.instr(*key)):
            if b.op in ("reduce", "reduce-window") and b.called:
                root = self.m.comps[b.called[0]]
                names.append(REDUCERS.get(root.by_name[root.root].op, "reduce"))
        return "+".join(sorted(names))

    def source(self, key):
        """Through kernels that only convert or copy one input (a weight's bf16 -> f32)."""
        for _ in range(8):
            if key[0] == "" or self.kind.get(key) == "quantization":
                return key
            big = [p for p in self.producers[key] if self.elements(p) > 1]
            if len(big) != 1 or self.elements(big[0]) != self.elements(key) or \
                    self.reduction(key) or len(G.kernel_body(self.m, self.m.instr(*key))) > 3:
                return key
            key = big[0]
        return key


def product_path(op_name: str) -> str:
    """The product a quantizer op belongs to, from its op_name: ``"dense1"`` of
    ``"jit(fn)/jvp(MLP)/dense1/cond/branch_0_fun/reduce_max"``; ``" (bwd)"`` appended
    for the backward (``transpose(...)``)."""
    parts = op_name.split("/")[1:]
    keep = []
    for p in parts[:-1]:
        if p.startswith(("cond", "jit(", "branch_", "while", "closed_call")):
            break
        if not p.startswith(("jvp(", "transpose(", "vmap(")):
            keep.append(p)
    return "/".join(keep) + (" (bwd)" if "transpose(" in op_name else "")


class _Groups:
    """Union-find over quantization kernels and the tensors they read."""

    def __init__(self):
        self.parent: dict = {}

    def find(self, x):
        self.parent.setdefault(x, x)
        while self.parent[x] != x:
            self.parent[x] = self.parent[self.parent[x]]
            x = self.parent[x]
        return x

    def union(self, a, b):
        self.parent[self.find(a)] = self.find(b)


def group_quantizers(pc: PassCounter) -> dict:
    """``{group root: [kernel keys and ("src", tensor) members]}``: quantization kernels
    joined with the big tensors they read (within 8x of their largest input) and with
    the quantization kernels they read those from, forward and backward apart;
    scalar-only kernels join the one group they feed."""
    quant = [k for k, kind in pc.kind.items() if kind == "quantization"]
    groups, lonely = _Groups(), []
    for k in quant:
        prods = [p for p in pc.producers[k] if not pc.is_constant(p)]
        most = max((pc.elements(p) for p in prods), default=0)
        big = [pc.source(p) for p in prods if pc.elements(p) > 1 and 8 * pc.elements(p) >= most]
        groups.find(k)
        if not big:
            lonely.append(k)
        way = pc.direction(k)  # a forward and a backward quantizer never share a group
        for p in big:
            groups.union(k, p if pc.kind.get(p) == "quantization" else ("src", p, way))
            for q in pc.lineage(p):
                groups.union(k, ("src", q, way))
    readers = collections.defaultdict(set)
    for c in quant:
        for p in pc.producers[c]:
            readers[p].add(c)
    changed = True
    while changed:  # scalar-only kernels join the one real group next to them
        changed = False
        real = {groups.find(x) for x in groups.parent if x[0] == "src"}
        for k in lonely:
            if groups.find(k) in real:
                continue
            near = {groups.find(p) for p in pc.producers[k] if pc.kind.get(p) == "quantization"}
            near = (near | {groups.find(c) for c in readers[k]}) & real
            if len(near) == 1:
                groups.union(k, near.pop())
                changed = True
    out: dict = collections.defaultdict(list)
    for x in list(groups.parent):
        out[groups.find(x)].append(x)
    return out


def quantizers(pc: PassCounter) -> list[Quantizer]:
    """One `Quantizer` per quantized tensor of the program (`group_quantizers`)."""
    out = []
    for members in group_quantizers(pc).values():
        srcs = list(dict.fromkeys(m[1] for m in members if m[0] == "src"))
        kernels = [m for m in members if m[0] != "src"]
        if not srcs or not kernels:
            continue
        q = _quantizer(pc, srcs, kernels)
        if q.rounding == 0 and not q.reductions:
            continue  # no rounding, no range: the dither's seed words (2 uint32 from the key)
        out.append(q)
    return sorted(out, key=lambda q: (q.products, q.role))


def _origins(pc: PassCounter, kernels: list, srcs: set) -> dict:
    """``{kernel: the group's tensors it reads, directly or through group kernels}``."""
    inside, memo = set(kernels), {}

    def walk(k):
        if k not in memo:
            memo[k] = frozenset()
            found = set()
            for p in pc.producers[k]:
                s = pc.source(p)
                if s in srcs or p in srcs:
                    found.add(s if s in srcs else p)
                elif s in inside:
                    found |= walk(s)
                found |= set(pc.lineage(s)) & srcs
            memo[k] = frozenset(found)
        return memo[k]
    return {k: walk(k) for k in kernels}


def _quantizer(pc: PassCounter, srcs: list, kernels: list) -> Quantizer:
    tensor = max(srcs, key=lambda s: (pc.elements(s), s[0] == ""))
    n = pc.elements(tensor)
    big = lambda key: 2 * pc.elements(key) >= n  # noqa: E731
    labels = [pc.by_key[k].label for k in kernels]
    reductions = {k: pc.reduction(k) for k in kernels
                  if pc.reduction(k) and any(big(p) for p in pc.producers[k])}
    origins = _origins(pc, kernels, set(srcs))
    seen = collections.Counter((r, origins[k]) for k, r in reductions.items())
    passes = [k for k in kernels if k not in reductions and big(k)]
    rounding = [k for k in passes if pc.rounds(k)]
    products = {c for c, kind in pc.kind.items() if kind == "products"
                and pc.producers[c] & set(passes)}
    weight = any(s[0] == "" and s[1].startswith("state") for s in srcs)
    backward = sum(pc.direction(k) == "bwd" for k in kernels) * 2 > len(kernels)
    return Quantizer(
        tensor=pc.label(tensor), role="weight" if weight else
        ("error" if backward else "activation"),
        products=sorted({p for p in map(product_path, labels) if p.replace(" (bwd)", "")}),
        elements=n,
        reductions=sorted(reductions.values()), passes=len(passes), rounding=len(rounding),
        reads=sum(big(p) for k in kernels for p in pc.producers[k]),
        small=len(kernels) - len(reductions) - len(passes),
        mbytes=sum(pc.by_key[k].bytes for k in kernels) / 1e6, used_by=len(products),
        duplicates=sum(c - 1 for c in seen.values()), kernels=[k[1] for k in kernels])


def weight_roundings(qs: list[Quantizer]) -> dict[str, int]:
    """``{weight: rounding passes per step}`` over all its quantizers (forward and
    backward): 1 when one quantized copy serves every product."""
    out: collections.Counter = collections.Counter()
    for q in qs:
        if q.role == "weight":
            out[q.tensor] += q.rounding
    return dict(out)


def pass_table(qs: list[Quantizer]) -> str:
    """The quantizers as a table, and a summary against the goal (per tensor: one read for
    its range, one fused read-write for the rounding; a weight quantized once per step;
    no reduction twice)."""
    lines = [f"{'product(s)':28s} {'role':10s} {'elements':>9s} {'reductions':16s} "
             f"{'writes':>6s} {'rounds':>6s} {'reads':>5s} {'small':>5s} {'used by':>7s} "
             f"{'MB':>8s}  notes"]
    for q in qs:
        red = ",".join(q.reductions) or "-"
        lines.append(f"{','.join(q.products)[:28]:28s} {q.role:10s} {q.elements:9d} "
                     f"{red[:16]:16s} {q.passes:6d} {q.rounding:6d} {q.reads:5d} {q.small:5d} "
                     f"{q.used_by:7d} {q.mbytes:8.2f}  {q.notes}")
    roles = collections.Counter(q.role for q in qs)
    lines.append(
        f"{len(qs)} quantized tensors ({', '.join(f'{v} {k}' for k, v in sorted(roles.items()))})"
        f"; reduction kernels {sum(len(q.reductions) for q in qs)} (run twice: "
        f"{sum(q.duplicates for q in qs)}); tensor-sized writes {sum(q.passes for q in qs)} "
        f"({sum(q.rounding for q in qs)} rounding); "
        f"small kernels {sum(q.small for q in qs)}; tensor-sized reads "
        f"{sum(q.reads for q in qs)} (goal {2 * len(qs)}); weights rounded more than once: "
        f"{sum(n > 1 for n in weight_roundings(qs).values())}")
    return "\n".join(lines)


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


def time_shares(step, state, batch, text: str, steps: int) -> dict:
    """Op times of `steps` profiled steps summed by kind; prints the shares and top ops."""
    kinds = classify(text)
    _, agg = profile(step, state, batch, steps)
    shares: collections.Counter = collections.Counter()
    for name, ms in agg.items():
        if name in kinds:
            shares[kinds[name]] += ms
    total = sum(shares.values())
    print("per step (sum of op times, ms): " + "  ".join(
        f"{c} {v:.1f} ({v / max(total, 1e-9):.0%})" for c, v in shares.most_common()))
    for cat in ("quantization", "other"):
        top = sorted(((ms, n) for n, ms in agg.items() if kinds.get(n) == cat), reverse=True)[:6]
        if top:
            print(f"       top {cat} ops: " + ", ".join(f"{n} {ms:.1f}" for ms, n in top))
    return {c: round(v, 2) for c, v in shares.items()} | {"total_ms": round(total, 2)}


def gemm_table(text: str) -> tuple[str, list[dict]]:
    """The GEMMs of a compiled step (`hlo.gemms`) as a printable table and as rows."""
    rows = []
    for g in H.gemms(text):
        rows.append({"product": product_path(g.op_name) or g.op_name[-40:],
                     "lhs": f"{g.lhs}{list(g.lhs_dims)}", "rhs": f"{g.rhs}{list(g.rhs_dims)}",
                     "out": g.out, "contract": f"{list(g.lhs_contracting)}x"
                                               f"{list(g.rhs_contracting)}",
                     "kernel": g.library or "xla", "integer": g.integer})
    head = f"{'product':40s} {'lhs':22s} {'rhs':22s} {'out':4s} {'contract':10s} kernel"
    lines = [head] + [f"{r['product'][:40]:40s} {r['lhs']:22s} {r['rhs']:22s} {r['out']:4s} "
                      f"{r['contract']:10s} {r['kernel']}" for r in rows]
    ints = [r for r in rows if r["integer"]]
    slow = [r for r in ints if r["kernel"] == "xla"]
    lines.append(f"{len(rows)} GEMMs, {len(ints)} int8 x int8 ({len(slow)} outside a library "
                 f"kernel), {sum(r['out'] == 's32' and not r['integer'] for r in rows)} "
                 f"on int32 operands")
    return "\n".join(lines), rows


def main(argv=None) -> dict:
    p = C.parser(__doc__.splitlines()[0])
    p.add_argument("--model", default="resnet20", choices=C.MODELS)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--preset", default="cpt", help="quantizer preset of the quantized step")
    p.add_argument("--compute", default="",
                   help="QuantConfig.compute of the quantized step ('': the preset's)")
    p.add_argument("--no-time", action="store_true",
                   help="only the pass table (compile, no profiled steps)")
    args = p.parse_args(argv)
    from cpt_jax.quant_config import get_preset
    spec = C.build(args.model)
    config = get_preset(args.preset)
    if args.compute:
        config = config.replace(compute=args.compute)
    s = C.make_steps(spec, 64, quant_config=config)
    out: dict[str, Any] = {"model": args.model, "preset": args.preset,
                           "_machine": C.machine_info()}
    for k in ("quant",) if args.no_time else ("fp32", "quant"):
        step, state = s["steps"][k], s["states"][k]
        text = step.lower(state, spec["batch"]).compile().as_text()
        if k == "quant":
            qs = quantizers(PassCounter(text))
            print(f"# passes of the quantizers of {args.model} ({args.preset}), compiled for "
                  f"{out['_machine']['backend']}:")
            print(pass_table(qs))
            out["passes"] = [dataclasses.asdict(q) for q in qs]
            table, out["gemms"] = gemm_table(text)
            print(f"# GEMMs of the quantized step ({args.preset}, compute="
                  f"{config.compute!r}):")
            print(table)
        if not args.no_time:
            print(f"{k:6s} ", end="")
            out[k] = time_shares(step, state, spec["batch"], text, args.steps)
    if args.json:
        C.emit_json(out)
    return out


if __name__ == "__main__":
    main()
