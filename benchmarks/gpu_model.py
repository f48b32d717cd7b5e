"""A roofline model of a train step on a GPU, from the HLO of the step: kernels, then time.

Two ways to get the kernels (each a `Kernel`: bytes it moves through HBM, its
instructions, and for a GEMM its flops and operand precision):

* `compiled_kernels`: the top-level ops of a *compiled* program, one kernel each, as
  the backend fused them (on a GPU: XLA GPU's fusions and cuBLAS / cuDNN calls; on a
  CPU: the CPU's fusions, bf16 -> f32 converts and library dots included).
* `model_kernels`: a program *lowered for CUDA* on any machine (JAX's GPU lowering
  rules, before XLA's passes), fused here by the rules XLA GPU follows in the main:

  - a GEMM (``dot``, ``convolution``, a GEMM custom call) reads its operands from HBM;
    a chain ``convert(codes) * scale`` in front of it whose codes have <= 8 bits is the
    GEMM's prologue (the FP8 GEMM rewriter, a block-scaled GEMM): it reads the codes
    and the scales; a scalar scale, a convert or a bias add after it is its epilogue;
  - elementwise ops and data movement fuse into the kernel that consumes them; a
    ``reduce`` fuses its elementwise producers (input fusion); an elementwise value is
    written to HBM only when a GEMM, a non-fusing op (custom call, sort, scatter) or the
    step's outputs need it, and recomputed in every other kernel that uses it;
  - sibling kernels reading the same tensors (the min and max reductions of a
    quantizer) are one multi-output kernel, which reads them once;
  - ``call`` is inlined; a ``conditional`` costs the branch its predicate selects when
    that follows from known scalar inputs (the precision width), else its cheapest
    branch (a data-dependent guard's common path); a ``while`` body counts once.

`estimate` turns kernels into time with a per-kernel roofline on a `Hardware`:
``t = max(flops / peak(precision), instructions / vector rate, bytes / HBM bandwidth)
+ launch``, summed over kernels. It is a model, not a measurement.
"""
from __future__ import annotations

import dataclasses
import math
import re
from collections import defaultdict
from collections.abc import Iterable
from typing import Any

try:
    from benchmarks import hlo as H
except ImportError:  # run as a script
    import hlo as H  # type: ignore


@dataclasses.dataclass(frozen=True)
class Hardware:
    """Published peaks of one GPU (dense, no sparsity) and the model's overheads."""

    name: str
    gemm_flops: dict[str, float]   # by GEMM precision: fp32 (TF32), bf16, fp8, fp4, int8
    vector_ops: float              # fp32 instructions/s off the tensor cores
    int_ops: float                 # int32 instructions/s
    hbm_bytes: float               # HBM bandwidth, bytes/s
    block_scaled_gemm: bool        # block-scaled (MX / NVFP4) GEMMs in hardware
    source: str


H200 = Hardware(
    "H200 SXM", {"fp64": 67e12, "fp32": 494.7e12, "bf16": 989.5e12, "fp8": 1979e12,
                 "int8": 1979e12, "fp4": 1979e12},
    vector_ops=33.5e12, int_ops=16.7e12, hbm_bytes=4.8e12, block_scaled_gemm=False,
    source="NVIDIA H200 datasheet (dense = half the sparsity figures): TF32 494.7, BF16 "
           "989.5, FP8 1979 TFLOP/s, HBM3e 4.8 TB/s; FP32 67 TFLOP/s = 33.5 T FMA/s. No "
           "FP4 tensor cores: FP4 GEMMs are modeled at the FP8 rate (codes widened in the "
           "kernel). INT32 at half the FP32 lanes (64 of 128 per SM).")
B200 = Hardware(
    "B200 (HGX)", {"fp64": 40e12, "fp32": 1.1e15, "bf16": 2.25e15, "fp8": 4.5e15,
                   "int8": 4.5e15, "fp4": 9e15},
    vector_ops=40e12, int_ops=20e12, hbm_bytes=8e12, block_scaled_gemm=True,
    source="NVIDIA HGX B200 (dense): TF32 1.1, BF16 2.25, FP8 4.5, FP4 9 PFLOP/s, HBM3e "
           "8 TB/s; MX / NVFP4 block scaling in the tensor cores.")
HARDWARE = {"h200": H200, "b200": B200}

# Custom calls that are GEMMs (cuBLAS, cuBLASLt FP8, cuDNN, JAX's block-scaled dot).
GEMM_TARGETS = re.compile(r"cublas|block_scaled_dot|blockScaled|cudnn\$conv|__cudnn\$fusion")
# Ops that only relabel a buffer, and custom calls that are annotations.
FREE = frozenset({"bitcast", "reshape", "get-tuple-element"})
ALIAS_TARGETS = ("Sharding", "SPMDFullToShardShape", "SPMDShardToFullShape",
                 "annotate_device_placement")
# Ops that must have their operands in memory and write their result there.
ANCHORS = frozenset({
    "reduce", "reduce-window", "select-and-scatter", "scatter", "sort", "rng",
    "rng-bit-generator", "fft", "custom-call", "triangular-solve", "cholesky", "all-reduce",
    "all-gather", "reduce-scatter", "all-to-all", "collective-permute", "infeed", "outfeed",
    "send", "recv", "dynamic-update-slice", "dot", "convolution"})
INPUT_FUSING = frozenset({"reduce", "reduce-window"})


@dataclasses.dataclass
class Kernel:
    """One kernel: HBM bytes, vector instructions (float / int) and, for a GEMM, its flops,
    operand precision and data operands ``((elements, bytes with scales), ...)``."""

    name: str
    bytes: float = 0.0
    ops: float = 0.0
    int_ops: float = 0.0
    gemm_flops: float = 0.0
    precision: str = ""
    block_scaled: bool = False
    operands: tuple[tuple[float, float], ...] = ()
    out_bytes: float = 0.0
    label: str = ""
    inputs: frozenset = frozenset()
    nodes: frozenset = frozenset()
    where: str = ""

    @property
    def is_gemm(self) -> bool:
        return self.gemm_flops > 0


def precision_of(dtypes: Iterable[str]) -> str:
    """The GEMM rate class of two operands: the wider operand decides (``fp8 x bf16 ->
    bf16``). ``f4*`` -> fp4, other <= 8-bit floats -> fp8, ``s8/u8`` -> int8, ``bf16/f16`` ->
    bf16, ``f32`` -> fp32 (TF32 tensor cores, XLA's default precision on a GPU)."""
    order = ["fp4", "fp8", "int8", "bf16", "fp32", "fp64"]

    def cls(t):
        if t.startswith("f4"):
            return "fp4"
        if t.startswith(("f8", "f6")):
            return "fp8"
        if t in ("s8", "u8", "s4", "u4"):
            return "int8"
        return {"bf16": "bf16", "f16": "bf16", "f64": "fp64"}.get(t, "fp32")
    return max((cls(t) for t in dtypes), key=order.index, default="fp32")


# --------------------------------------------------------------------------- flat graph

class Node:
    __slots__ = ("id", "ins", "op", "shape", "operands", "value")

    def __init__(self, nid: int, ins: H.Instr, operands: list[int]):
        self.id, self.ins, self.op, self.shape = nid, ins, ins.op, ins.shape
        self.operands, self.value = operands, None


class Graph:
    """A program with its calls inlined and one branch of each conditional taken."""

    def __init__(self, module: H.Module, params: dict[str, Any]):
        self.module, self.params = module, params
        self.nodes: list[Node] = []
        self.loops = 0
        self.guessed_branches = 0
        self._sizes: dict[str, float] = {}
        out = self._run(module.entry, None)
        self.outputs = list(_leaves(out))

    def add(self, ins: H.Instr, operands: list[int]) -> int:
        self.nodes.append(Node(len(self.nodes), ins, operands))
        return len(self.nodes) - 1

    def _param(self, ins: H.Instr, args):
        if args is not None:
            return args[int(ins.literal)]
        nid = self.add(ins, [])
        base = re.sub(r"\.\d+$", "", ins.name)
        self.nodes[nid].value = self.params.get(base, self.params.get(ins.op_name))
        return nid

    def _run(self, comp_name: str, args):
        """Inline computation `comp_name` on `args` (None: the entry's parameters)."""
        comp = self.module.comps[comp_name]
        env: dict[str, Any] = {}
        for ins in comp.instrs:
            ops = [env[o] for o in ins.operands if o in env]
            if ins.op == "parameter":
                env[ins.name] = self._param(ins, args)
            elif ins.op == "tuple":
                env[ins.name] = list(ops)
            elif ins.op == "get-tuple-element" and isinstance(ops[0], list):
                env[ins.name] = ops[0][int(ins.attr("index") or 0)]
            elif ins.op == "call":
                env[ins.name] = self._run(ins.called[0], ops)
            elif ins.op == "conditional":
                b = self._branch(ins, ops[0])
                env[ins.name] = self._run(ins.called[b], [ops[1 + b]])
            elif ins.op == "while":
                self.loops += 1
                env[ins.name] = self._run(while_body(ins), [ops[0]])
            elif ins.op == "opt-barrier" or (ins.op == "custom-call"
                                             and ins.target in ALIAS_TARGETS):
                env[ins.name] = ops[0]
            else:
                env[ins.name] = self.add(ins, list(_leaves(ops)))
        return env[comp.root]

    def value(self, nid: int, depth: int = 0) -> Any:
        """The scalar value of node `nid` when it follows from known parameters."""
        node = self.nodes[nid]
        if node.value is not None or node.shape.elements != 1 or depth > 200:
            return node.value
        if node.op == "constant":
            return H.literal_value(node.ins)
        args = [self.value(o, depth + 1) for o in node.operands]
        node.value = H.scalar_op(node.ins, args)
        return node.value

    def _branch(self, ins: H.Instr, pred) -> int:
        v = self.value(pred) if isinstance(pred, int) else None
        n = len(ins.called)
        if v is not None:
            return branch_index(self.nodes[pred].shape.dtype, v, n)
        self.guessed_branches += 1
        return cheapest_branch(self.module, ins, self._sizes)


def while_body(ins: H.Instr) -> str:
    """The body computation of a ``while``."""
    m = re.search(r"body=%?([\w.\-]+)", ins.attrs)
    return m.group(1) if m else ins.called[-1]


def branch_index(dtype: str, v: Any, n: int) -> int:
    """The branch a conditional takes: a pred picks true (0) / false (1), an index out of
    range the last branch (XLA's semantics)."""
    if dtype == "pred":
        return 0 if v else 1
    i = int(v)
    return i if 0 <= i < n else n - 1


def cheapest_branch(module: H.Module, ins: H.Instr, sizes: dict[str, float]) -> int:
    """The branch whose instructions write the fewest bytes (calls included)."""
    def size(name: str) -> float:
        if name not in sizes:
            sizes[name] = sum(i.shape.nbytes + sum(size(c) for c in i.called)
                              for i in module.comps[name].instrs if i.op != "parameter")
        return sizes[name]
    return min(range(len(ins.called)), key=lambda b: size(ins.called[b]))


def _leaves(x) -> Iterable[int]:
    if isinstance(x, list):
        for y in x:
            yield from _leaves(y)
    else:
        yield x


# --------------------------------------------------------------------------- model kernels

class _Fusion:
    """The fusion rules of `model_kernels` over one `Graph`."""

    def __init__(self, g: Graph):
        self.g, self.nodes = g, g.nodes
        self.users: dict[int, list[int]] = defaultdict(list)
        for n in self.nodes:
            for o in n.operands:
                self.users[o].append(n.id)
        self.outputs = set(g.outputs)
        self.kinds = [self._kind(n) for n in self.nodes]

    def _kind(self, n: Node) -> str:
        if n.op in ("parameter", "constant"):
            return "input"
        if n.op in FREE:
            return "free"
        if n.op in ("dot", "convolution") or (
                n.op == "custom-call" and bool(GEMM_TARGETS.search(n.ins.target))):
            return "gemm"
        return "anchor" if n.op in ANCHORS else "fusible"

    def source(self, nid: int) -> int:
        """Through relabelings (reshape, bitcast, tuple element) to the computing op."""
        while self.nodes[nid].op in FREE and self.nodes[nid].operands:
            nid = self.nodes[nid].operands[0]
        return nid

    def small_source(self, nid: int) -> int:
        """Through broadcasts and converts to the tensor a broadcast scale reads."""
        nid = self.source(nid)
        while self.nodes[nid].op in {"broadcast", "convert", "copy"} | FREE:
            nid = self.nodes[nid].operands[0]
        return nid

    def _scale_step(self, node: Node) -> tuple[int, int] | None:
        """``(data, scale source)`` of ``data * scale`` / ``data / scale`` whose scale is a
        broadcast of a smaller tensor; None otherwise."""
        if node.op not in ("multiply", "divide") or len(node.operands) != 2:
            return None
        a, b = node.operands
        size = lambda x: self.nodes[self.small_source(x)].shape.elements
        if node.op == "multiply" and size(a) < size(b):
            a, b = b, a
        s = self.small_source(b)
        return (a, s) if self.nodes[s].shape.elements < self.nodes[a].shape.elements else None

    def gemm_operand(self, nid: int) -> tuple[int, list[int]]:
        """``(tensor read, scales read)`` for one GEMM operand: a dequantize prologue
        (converts and scale multiplies of <= 8-bit codes) reads the codes and scales."""
        n, scales = nid, []
        for _ in range(64):
            node = self.nodes[n]
            if H.is_narrow(node.shape.dtype) and node.op not in FREE:
                return n, scales
            if node.op in FREE or node.op in ("transpose", "copy", "convert"):
                n = node.operands[0]
                continue
            step = self._scale_step(node)
            if step is None:
                break
            n, s = step
            scales.append(s)
        n = nid
        while self.nodes[n].op in FREE or self.nodes[n].op in ("transpose", "copy"):
            n = self.nodes[n].operands[0]
        return n, []

    def epilogue(self, gemm: int) -> tuple[int, list[int]]:
        """``(last node, extra inputs)`` of a GEMM's epilogue: one chain of converts,
        scalings by a scalar and a bias add after it (cuBLASLt epilogues)."""
        cur, end, extra = gemm, gemm, []
        for _ in range(16):
            users = self.users[cur]
            if len(users) != 1 or cur in self.outputs:
                break
            u = self.nodes[users[0]]
            others = [o for o in u.operands if o != cur]
            if u.op in FREE:
                cur = u.id
                continue
            if u.op == "convert":
                cur = end = u.id
                continue
            if u.op in ("multiply", "divide", "add") and len(others) == 1:
                s = self.small_source(others[0])
                small = self.nodes[s].shape.elements
                if small == 1 or (u.op == "add" and small < u.shape.elements):
                    extra.append(s)
                    cur = end = u.id
                    continue
            break
        return end, extra


def model_kernels(g: Graph) -> list[Kernel]:
    """The kernels of a flattened lowered program under the fusion rules of this module."""
    f = _Fusion(g)
    kernels: dict[int, Kernel] = {}
    for n in g.nodes:
        if f.kinds[n.id] == "gemm":
            end, extra = f.epilogue(n.id)
            kernels[end] = _gemm_kernel(f, n.id, end, extra)
    stored = _stored(f, kernels)
    for nid in stored:
        if nid not in kernels and f.kinds[nid] != "input":
            kernels[nid] = _region_kernel(f, nid, stored)
    return _merge_siblings(list(kernels.values()), f)


def _stored(f: _Fusion, gemms: dict[int, Kernel]) -> set[int]:
    """Nodes whose values live in HBM: GEMM results, the other anchors, the operands and
    scales GEMMs read, operands of ops that cannot fuse producers, the step's outputs."""
    need = set(gemms)
    for k in gemms.values():
        need |= k.inputs
    for n in f.nodes:
        if f.kinds[n.id] == "anchor":
            need.add(n.id)
            if n.op not in INPUT_FUSING:
                need |= {f.source(o) for o in n.operands}
    need |= {f.source(o) for o in f.g.outputs}
    return need


def _gemm_kernel(f: _Fusion, gemm: int, end: int, extra: list[int]) -> Kernel:
    n = f.nodes[gemm]
    data = n.operands[:2]
    pairs = [f.gemm_operand(o) for o in data]
    scales = [s for _, ss in pairs for s in ss] + [f.small_source(o) for o in n.operands[2:]]
    if n.op == "dot":
        flops = H.dot_flops(n.ins, f.nodes[data[0]].shape)
    elif n.op == "convolution":
        flops = H.conv_flops(n.ins, f.nodes[data[1]].shape)
    else:  # a (B, X, K) x (B, Y, K) block-scaled dot (codes, codes, scales, scales)
        flops = 2.0 * n.shape.elements * f.nodes[data[0]].shape.dims[-1]
    block = n.op == "custom-call" or any(f.nodes[s].shape.elements > 1 for s in scales)
    reads = {t for t, _ in pairs} | set(scales) | set(extra)
    out = f.nodes[end].shape.nbytes
    operands = tuple((f.nodes[t].shape.elements, f.nodes[t].shape.nbytes
                      + sum(f.nodes[s].shape.nbytes for s in ss)) for t, ss in pairs)
    return Kernel(n.ins.name, bytes=sum(f.nodes[r].shape.nbytes for r in reads) + out,
                  gemm_flops=flops, precision=precision_of(f.nodes[t].shape.dtype
                                                           for t, _ in pairs),
                  block_scaled=block, operands=operands, out_bytes=out,
                  label=n.ins.op_name, inputs=frozenset(reads))


def _region_kernel(f: _Fusion, root: int, stored: set[int]) -> Kernel:
    """A loop or reduction kernel: `root` and the unstored elementwise ops feeding it."""
    node = f.nodes[root]
    fuses = f.kinds[root] == "fusible" or node.op in INPUT_FUSING
    reads: set[int] = set()
    seen, stack = {root}, [root]
    while stack:
        n = f.nodes[stack.pop()]
        for o in n.operands:
            s = f.source(o)
            if not fuses or s in stored or f.kinds[s] in ("input", "gemm", "anchor"):
                reads.add(o if f.nodes[o].op == "get-tuple-element" else s)
            elif s not in seen:
                seen.add(s)
                stack.append(s)
    k = Kernel(node.ins.name, label=node.ins.op_name, out_bytes=node.shape.nbytes,
               inputs=frozenset(reads), nodes=frozenset(seen))
    k.bytes = sum(f.nodes[r].shape.nbytes for r in reads) + k.out_bytes
    k.ops, k.int_ops = _region_ops(f, seen)
    return k


def _region_ops(f: _Fusion, nodes: Iterable[int]) -> tuple[float, float]:
    """``(float, integer)`` instructions of a set of nodes, each computed once."""
    ops = int_ops = 0.0
    for nid in nodes:
        n = f.nodes[nid]
        first = f.nodes[n.operands[0]].shape if n.operands else None
        count, is_int = H.elementwise_ops(n.ins, first)
        int_ops += count if is_int else 0.0
        ops += 0.0 if is_int else count
    return ops, int_ops


def _merge_siblings(kernels: list[Kernel], f: _Fusion) -> list[Kernel]:
    """Multi-output fusion: non-GEMM kernels reading the same tensors (scalar parameters
    and constants aside) are one kernel that reads them once and computes their shared
    elementwise ops once."""
    groups: dict[frozenset, Kernel] = {}
    out = []
    for k in kernels:
        key = frozenset(r for r in k.inputs
                        if f.nodes[r].shape.elements > 1 or f.kinds[r] != "input")
        if k.is_gemm or not key:
            out.append(k)
        elif key in groups:
            g = groups[key]
            g.nodes = g.nodes | k.nodes
            g.ops, g.int_ops = _region_ops(f, g.nodes)
            g.out_bytes += k.out_bytes
            g.bytes += k.out_bytes + sum(f.nodes[r].shape.nbytes for r in k.inputs - g.inputs)
            g.inputs = g.inputs | k.inputs
            g.name += "+" + k.name
        else:
            groups[key] = k
            out.append(k)
    return out


# --------------------------------------------------------------------------- compiled kernels

class _Compiled:
    """Kernels of a compiled program: each top-level op of the entry (calls, taken
    branches and loop bodies entered) is one kernel, as the backend fused it."""

    SKIP = frozenset({"parameter", "constant", "tuple", "get-tuple-element", "bitcast",
                      "after-all", "partition-id", "replica-id", "opt-barrier"})

    def __init__(self, module: H.Module, params: dict[str, Any]):
        self.m, self.params = module, params
        self.kernels: list[Kernel] = []
        self.loops = self.guessed_branches = 0
        self.branches: dict[tuple[str, str], int] = {}  # (computation, conditional) -> taken
        self._sizes: dict[str, float] = {}
        self._visit(module.entry)

    def _visit(self, comp_name: str) -> None:
        comp = self.m.comps[comp_name]
        for ins in comp.instrs:
            if ins.op in self.SKIP or (ins.op == "custom-call" and ins.target in ALIAS_TARGETS):
                continue
            if ins.op == "call":
                self._visit(ins.called[0])
            elif ins.op == "conditional":
                b = self.branches[(comp_name, ins.name)] = self._branch(comp_name, ins)
                self._visit(ins.called[b])
            elif ins.op == "while":
                self.loops += 1
                self._visit(while_body(ins))
            else:
                self.kernels.append(self._kernel(comp, ins))

    def _branch(self, comp: str, ins: H.Instr) -> int:
        v = self.value(comp, ins.operands[0])
        if v is not None:
            dtype = self.m.instr(comp, ins.operands[0]).shape.dtype
            return branch_index(dtype, v, len(ins.called))
        self.guessed_branches += 1
        return cheapest_branch(self.m, ins, self._sizes)

    def value(self, comp: str, name: str, depth: int = 0) -> Any:
        """A scalar's value from known entry parameters (through fused computations)."""
        ins = self.m.instr(comp, name)
        if ins.shape.elements != 1 or depth > 100:
            return None
        if ins.op == "parameter":
            if comp == self.m.entry:
                base = re.sub(r"\.\d+$", "", ins.name)
                return self.params.get(base, self.params.get(ins.op_name))
            caller = self.m.callers.get(comp)
            if caller is None or self.m.instr(*caller).op != "fusion":
                return None
            return self.value(caller[0], self.m.instr(*caller).operands[int(ins.literal)],
                              depth + 1)
        if ins.op == "constant":
            return H.literal_value(ins)
        if ins.op == "fusion":
            sub = ins.called[0]
            return self.value(sub, self.m.comps[sub].root, depth + 1)
        return H.scalar_op(ins, [self.value(comp, o, depth + 1) for o in ins.operands])

    def _kernel(self, comp: H.Computation, ins: H.Instr) -> Kernel:
        shapes = {o: comp.by_name[o].shape for o in ins.operands if o in comp.by_name}
        out = ins.shape.nbytes
        k = Kernel(ins.name, bytes=sum(s.nbytes for s in shapes.values()) + out,
                   out_bytes=out, label=ins.op_name, inputs=frozenset(shapes),
                   where=comp.name)
        for c, b in kernel_body(self.m, ins):
            where = self.m.comps[c] if c else comp
            first = where.by_name[b.operands[0]].shape if b.operands and \
                b.operands[0] in where.by_name else None
            if b.op in ("dot", "convolution") or (b.op == "custom-call" and
                                                  GEMM_TARGETS.search(b.target)):
                self._gemm(k, where, b)
            else:
                ops, is_int = H.elementwise_ops(b, first)
                k.int_ops += ops if is_int else 0.0
                k.ops += 0.0 if is_int else ops
        return k

    def _gemm(self, k: Kernel, comp: H.Computation, ins: H.Instr) -> None:
        lhs, rhs = (comp.by_name[o].shape for o in ins.operands[:2])
        if ins.op == "dot":
            k.gemm_flops += H.dot_flops(ins, lhs)
        elif ins.op == "convolution":
            k.gemm_flops += H.conv_flops(ins, rhs)
        else:
            dims = re.search(r'"lhs_contracting_dimensions":\[([^\]]*)\]', ins.attrs)
            kdims = [int(d) for d in re.findall(r"\d+", dims.group(1))] if dims else [-1]
            out = H.Shape(ins.shape.leaves[:1])
            k.gemm_flops += 2.0 * out.elements * math.prod(lhs.dims[d] for d in kdims)
        traced = [self._narrowest(comp.name, o) for o in ins.operands[:2]]
        k.precision = precision_of(t for t, _ in traced)
        k.block_scaled = ("block" in ins.target.lower()) or any(
            b and H.is_narrow(t) for t, b in traced)
        k.operands = tuple((s.elements, s.nbytes) for s in (lhs, rhs))

    def _narrowest(self, comp: str, name: str) -> tuple[str, bool]:
        """The narrowest element type on an operand's data path back through converts,
        layout ops, scale multiplies and fusion boundaries; whether a non-scalar scale
        multiplied it (a block-scaled dequantize)."""
        best, block = "f64", False
        for _ in range(64):
            ins = self.m.instr(comp, name)
            t = ins.shape.dtype
            if t in H.DTYPE_BITS and t != "pred" and H.DTYPE_BITS[t] < H.DTYPE_BITS[best]:
                best = t
            if H.is_narrow(t):
                break
            nxt = self._data_step(comp, ins)
            if nxt is None:
                break
            comp, name, scaled = nxt
            block |= scaled
        return best, block

    def _data_step(self, comp: str, ins: H.Instr) -> tuple[str, str, bool] | None:
        by = self.m.comps[comp].by_name
        if ins.op in ("convert", "bitcast", "reshape", "transpose", "copy", "broadcast"):
            return comp, ins.operands[0], False
        if ins.op in ("multiply", "divide") and len(ins.operands) == 2:
            a, b = ins.operands
            if ins.op == "multiply" and by[a].shape.elements < by[b].shape.elements:
                a, b = b, a
            return comp, a, by[b].shape.elements > 1 and self._is_broadcast(comp, b)
        if ins.op == "fusion":
            return ins.called[0], self.m.comps[ins.called[0]].root, False
        if ins.op == "parameter" and comp in self.m.callers:
            parent, caller = self.m.callers[comp]
            op = self.m.instr(parent, caller)
            if op.op == "fusion":
                return parent, op.operands[int(ins.literal)], False
        return None

    def _is_broadcast(self, comp: str, name: str) -> bool:
        ins = self.m.instr(comp, name)
        return ins.op == "broadcast" or (ins.op in ("reshape", "bitcast", "convert")
                                         and self._is_broadcast(comp, ins.operands[0]))


def kernel_body(module: H.Module, ins: H.Instr) -> list[tuple[str, H.Instr]]:
    """``(computation, instruction)`` of everything a kernel computes: a fusion's fused
    instructions (nested fusions opened; computation ``""`` for a non-fusion kernel)."""
    if ins.op != "fusion":
        return [("", ins)]
    out = []
    for c in ins.called:
        for sub in module.comps[c].instrs:
            out += kernel_body(module, sub) if sub.op == "fusion" else [(c, sub)]
    return out


def compiled_kernels(module: H.Module, params: dict[str, Any]) -> tuple[list[Kernel], dict]:
    """Kernels of a compiled program, and ``{"loops", "guessed_branches", "branches"}``
    (``branches``: ``{(computation, conditional): branch taken}``)."""
    c = _Compiled(module, params)
    return c.kernels, {"loops": c.loops, "guessed_branches": c.guessed_branches,
                       "branches": c.branches}


# --------------------------------------------------------------------------- time

def kernel_time(k: Kernel, hw: Hardware, block_mode: str = "xla") -> tuple[float, float, int]:
    """``(seconds, bytes, kernels)`` of one kernel: ``max(flops / peak, instructions /
    vector rate, bytes / bandwidth)``.

    A block-scaled GEMM on hardware without block scaling (`Hardware.block_scaled_gemm`):
    ``block_mode="xla"`` runs it as XLA expands JAX's block-scaled dot there: one
    dequantize pass per operand into float32, then a float32 (TF32) GEMM;
    ``block_mode="kernel"`` assumes a kernel reading codes and scales at the element
    type's rate (FP8, or FP8 for FP4 on an H200).
    """
    vector = k.ops / hw.vector_ops + k.int_ops / hw.int_ops
    if k.is_gemm and k.block_scaled and not hw.block_scaled_gemm and block_mode == "xla":
        dequant = sum(b + 4.0 * e for e, b in k.operands)
        gemm_bytes = sum(4.0 * e for e, _ in k.operands) + k.out_bytes
        t = dequant / hw.hbm_bytes + max(k.gemm_flops / hw.gemm_flops["fp32"],
                                         gemm_bytes / hw.hbm_bytes)
        return t, dequant + gemm_bytes, 1 + len(k.operands)
    peak = hw.gemm_flops.get(k.precision or "fp32", hw.gemm_flops["fp32"])
    t = max(k.gemm_flops / peak if k.is_gemm else 0.0, vector, k.bytes / hw.hbm_bytes)
    return t, k.bytes, 1


def estimate(kernels: list[Kernel], hw: Hardware, *, launch_us: float = 2.0,
             block_mode: str = "xla") -> dict[str, float]:
    """The step's modeled time on `hw`: per-kernel rooflines summed, plus `launch_us` per
    kernel. Keys: ``ms`` (with launches), ``roofline_ms`` (without), ``gemm_ms``,
    ``other_ms``, ``kernels``, ``gemms``, ``gemm_tflop``, ``hbm_gb``."""
    gemm_t = other_t = moved = 0.0
    n = 0
    for k in kernels:
        t, b, c = kernel_time(k, hw, block_mode)
        gemm_t += t if k.is_gemm else 0.0
        other_t += 0.0 if k.is_gemm else t
        moved += b
        n += c
    roof = gemm_t + other_t
    return {"ms": 1e3 * roof + n * launch_us * 1e-3, "roofline_ms": 1e3 * roof,
            "gemm_ms": 1e3 * gemm_t, "other_ms": 1e3 * other_t, "kernels": n,
            "gemms": sum(k.is_gemm for k in kernels),
            "gemm_tflop": sum(k.gemm_flops for k in kernels) / 1e12, "hbm_gb": moved / 1e9}
