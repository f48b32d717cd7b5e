"""Reading HLO text: computations, instructions, shapes, and the scalars a branch needs.

The benchmarks that look inside a train step (`roofline.py`, `profile_step.py`) read the
text XLA prints for a program, optimized (``compiled.as_text()``: the kernels a backend
runs, fusions with their fused computations) or not (``lowered.as_text(dialect="hlo")``:
one instruction per operation, calls and conditionals as JAX emitted them). Both
spellings parse (with or without ``%`` before names, shapes of operands inline or not).

    module = parse(text)
    entry = module.comps[module.entry]
    [(i.name, i.op, i.shape) for i in entry.instrs]

Shapes: ``Shape.leaves`` is ``[(dtype, dims), ...]`` (one per tuple leaf); ``nbytes``
counts float4 / int4 as half a byte. ``scalar_value`` evaluates the scalar integer /
float / bool expression behind a predicate or branch index (a conditional on the
precision width) from known entry-parameter values; unknown inputs give ``None``.
"""
from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

# Bits per element of each HLO element type (pred as one byte, as XLA stores it).
DTYPE_BITS = {
    "pred": 8, "s2": 2, "u2": 2, "s4": 4, "u4": 4, "s8": 8, "u8": 8, "s16": 16, "u16": 16,
    "s32": 32, "u32": 32, "s64": 64, "u64": 64, "f16": 16, "bf16": 16, "f32": 32, "f64": 64,
    "c64": 64, "c128": 128, "f4e2m1fn": 4, "f6e2m3fn": 6, "f6e3m2fn": 6,
    "f8e4m3fn": 8, "f8e5m2": 8, "f8e4m3": 8, "f8e3m4": 8, "f8e4m3fnuz": 8,
    "f8e5m2fnuz": 8, "f8e4m3b11fnuz": 8, "f8e8m0fnu": 8, "token": 0,
}
# Ops that move or relabel data without arithmetic (no flops counted for them).
DATA_MOVEMENT = frozenset({
    "broadcast", "reshape", "bitcast", "transpose", "copy", "slice", "dynamic-slice",
    "concatenate", "pad", "reverse", "get-tuple-element", "tuple", "parameter", "constant",
    "iota", "gather", "dynamic-update-slice", "opt-barrier", "copy-start", "copy-done",
})
# Elementwise ops that cost many instructions per element on a GPU (special-function unit).
TRANSCENDENTAL = frozenset({
    "exponential", "exponential-minus-one", "log", "log-plus-one", "tanh", "logistic", "rsqrt",
    "sqrt", "cbrt", "power", "sine", "cosine", "tan", "atan2", "erf",
})

_SHAPE_LEAF = re.compile(r"([a-z][a-z0-9]*)\[([\d,]*)\]")
_INSTR = re.compile(
    r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*(\(.*?\)|\S+)\s+([a-z][a-z0-9\-]*)\((.*)$")
_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*(\(.*\))?\s*(->\s*.*)?\{\s*$")
_COMMENT = re.compile(r"/\*.*?\*/")


@dataclasses.dataclass(frozen=True)
class Shape:
    """An HLO shape: ``leaves`` = ``((dtype, dims), ...)``, one per tuple leaf."""

    leaves: tuple[tuple[str, tuple[int, ...]], ...]

    @property
    def dtype(self) -> str:
        """The first leaf's element type (``"tuple"`` for an empty tuple)."""
        return self.leaves[0][0] if self.leaves else "tuple"

    @property
    def dims(self) -> tuple[int, ...]:
        return self.leaves[0][1] if self.leaves else ()

    @property
    def elements(self) -> int:
        """Elements of the first leaf (the array an elementwise op iterates over)."""
        return math.prod(self.dims)

    @property
    def nbytes(self) -> float:
        """Bytes of all leaves (sub-byte types packed)."""
        return sum(math.prod(d) * DTYPE_BITS.get(t, 32) / 8 for t, d in self.leaves)

    @property
    def is_tuple(self) -> bool:
        return len(self.leaves) != 1


def parse_shape(text: str) -> Shape:
    """``Shape`` of ``"f32[4,8]{1,0}"`` or ``"(f32[], bf16[2]{0})"``."""
    return Shape(tuple((t, tuple(int(d) for d in dims.split(",") if d))
                       for t, dims in _SHAPE_LEAF.findall(text)))


@dataclasses.dataclass
class Instr:
    """One HLO instruction: its result shape, opcode, operand names and attributes."""

    name: str
    shape: Shape
    op: str
    operands: list[str]
    attrs: str
    literal: str = ""
    root: bool = False

    def attr(self, key: str) -> str | None:
        """The raw value of attribute `key` (``direction``, ``custom_call_target``...)."""
        m = re.search(rf"(?:^|[\s,]){re.escape(key)}=(\{{[^}}]*\}}|\"[^\"]*\"|[^,\s]+)",
                      self.attrs)
        return m.group(1).strip('"') if m else None

    def ints(self, key: str) -> tuple[int, ...]:
        """An integer-list attribute (``lhs_contracting_dims={1}``), ``()`` if absent."""
        raw = self.attr(key) or ""
        return tuple(int(v) for v in re.findall(r"-?\d+", raw))

    @property
    def called(self) -> list[str]:
        """Names of the computations this instruction calls (fusion, call, branches...)."""
        names = re.findall(r"(?:calls|to_apply|body|condition|true_computation|"
                           r"false_computation)=%?([\w.\-]+)", self.attrs)
        branches = re.search(r"branch_computations=\{([^}]*)\}", self.attrs)
        if branches:
            names += [b.strip().lstrip("%") for b in branches.group(1).split(",")]
        return names

    @property
    def op_name(self) -> str:
        m = re.search(r'op_name="([^"]*)"', self.attrs)
        return m.group(1) if m else ""

    @property
    def stack_frame(self) -> int | None:
        m = re.search(r"stack_frame_id=(\d+)", self.attrs)
        return int(m.group(1)) if m else None

    @property
    def target(self) -> str:
        """``custom_call_target`` (``""`` for other ops)."""
        return self.attr("custom_call_target") or ""


@dataclasses.dataclass
class Computation:
    name: str
    instrs: list[Instr]
    by_name: dict[str, Instr]
    params: dict[int, str]
    root: str


@dataclasses.dataclass
class Module:
    """Computations by name, the entry's name, and who calls each computation."""

    comps: dict[str, Computation]
    entry: str
    callers: dict[str, tuple[str, str]]  # computation -> (calling computation, instruction)

    def instr(self, comp: str, name: str) -> Instr:
        return self.comps[comp].by_name[name]


def _split_operands(text: str) -> tuple[str, str]:
    """``("a, b", "rest")`` of ``"a, b), rest"``: the operand list up to its closing paren."""
    depth = 0
    for i, ch in enumerate(text):
        if ch in "({[":
            depth += 1
        elif ch in ")}]":
            if depth == 0:
                return text[:i], text[i + 1:]
            depth -= 1
    return text, ""


def _operand_names(text: str) -> list[str]:
    out, depth, cur = [], 0, ""
    for ch in text + ",":
        if ch in "({[":
            depth += 1
        elif ch in ")}]":
            depth -= 1
        if ch == "," and depth == 0:
            if cur.strip():
                out.append(cur.strip().split()[-1].lstrip("%"))
            cur = ""
        else:
            cur += ch
    return out


def parse_instr(line: str) -> Instr | None:
    """An `Instr` from one line of HLO text (``None`` for anything else)."""
    m = _INSTR.match(_COMMENT.sub("", line))
    if not m:
        return None
    root, name, shape, op, rest = m.groups()
    inner, attrs = _split_operands(rest)
    literal = ""
    if op in ("constant", "parameter", "iota"):
        literal, operands = inner, []
    else:
        operands = _operand_names(inner)
    return Instr(name, parse_shape(shape), op, operands, attrs, literal, bool(root))


def parse(text: str) -> Module:
    """Every computation of an HLO module's text (`Module`)."""
    comps: dict[str, Computation] = {}
    entry, cur = "", None
    for line in text.splitlines():
        if cur is None:
            m = _HEADER.match(line)
            if m and not line.startswith("HloModule"):
                cur = Computation(m.group(2), [], {}, {}, "")
                if m.group(1):
                    entry = cur.name
            continue
        if line.strip() == "}":
            cur.root = cur.root or (cur.instrs[-1].name if cur.instrs else "")
            comps[cur.name] = cur
            cur = None
            continue
        ins = parse_instr(line)
        if ins is None:
            continue
        cur.instrs.append(ins)
        cur.by_name[ins.name] = ins
        if ins.op == "parameter":
            cur.params[int(ins.literal)] = ins.name
        if ins.root:
            cur.root = ins.name
    callers = {c: (comp.name, ins.name) for comp in comps.values() for ins in comp.instrs
               for c in ins.called}
    return Module(comps, entry, callers)


# --------------------------------------------------------------------------- costs

def dot_flops(ins: Instr, lhs: Shape) -> float:
    """``2 * (output elements) * (contracted size)`` of a ``dot``."""
    k = math.prod(lhs.dims[d] for d in ins.ints("lhs_contracting_dims"))
    return 2.0 * ins.shape.elements * k


def conv_flops(ins: Instr, rhs: Shape) -> float:
    """``2 * (output elements) * (kernel elements per output feature)`` of a convolution."""
    labels = ins.attr("dim_labels") or ""
    kernel = labels.split("_")[1].split("->")[0] if "_" in labels else ""
    out_feat = rhs.dims[kernel.index("o")] if "o" in kernel else 1
    return 2.0 * ins.shape.elements * rhs.elements / max(out_feat, 1)


def elementwise_ops(ins: Instr, operand: Shape | None) -> tuple[float, bool]:
    """``(instructions, integer?)`` an op costs per its result: 1 per element, 8 for a
    transcendental, 0 for data movement; a reduce counts its input's elements."""
    if ins.op in DATA_MOVEMENT or ins.op in ("fusion", "call", "conditional", "while"):
        return 0.0, False
    n = operand.elements if (ins.op in ("reduce", "reduce-window") and operand) else \
        ins.shape.elements
    dtype = operand.dtype if operand is not None else ins.shape.dtype
    weight = 8.0 if ins.op in TRANSCENDENTAL else 1.0
    return n * weight, dtype.startswith(("s", "u"))


def is_narrow(dtype: str) -> bool:
    """Element types of <= 8 bits that feed a low-precision GEMM (float8/6/4, int8/4)."""
    return dtype != "pred" and DTYPE_BITS.get(dtype, 32) <= 8 and dtype != "f8e8m0fnu"


# --------------------------------------------------------------------------- scalars

_CMP = {"EQ": lambda a, b: a == b, "NE": lambda a, b: a != b, "LT": lambda a, b: a < b,
        "LE": lambda a, b: a <= b, "GT": lambda a, b: a > b, "GE": lambda a, b: a >= b}
_BINARY = {"add": lambda a, b: a + b, "subtract": lambda a, b: a - b,
           "multiply": lambda a, b: a * b, "divide": lambda a, b: a / b if b else None,
           "maximum": max, "minimum": min, "and": lambda a, b: a and b,
           "or": lambda a, b: a or b}
_UNARY = {"negate": lambda a: -a, "abs": abs, "floor": math.floor, "ceil": math.ceil,
          "round-nearest-even": round, "round-nearest-afz": round, "not": lambda a: not a}


def literal_value(ins: Instr) -> Any:
    """The value of a scalar constant (``None`` for arrays)."""
    text = ins.literal.strip()
    if ins.shape.elements != 1 or text.startswith("{"):
        return None
    if text in ("true", "false"):
        return text == "true"
    try:
        return float(text.replace("inf", "Infinity")) if ins.shape.dtype[0] in "fb" \
            else int(text)
    except ValueError:
        return None


def scalar_op(ins: Instr, args: list[Any]) -> Any:
    """The value of a one-element op from its operands' values (``None``: unknown)."""
    if any(a is None for a in args) or ins.shape.elements != 1:
        return None
    if ins.op == "compare":
        return _CMP[ins.attr("direction") or "EQ"](*args)
    if ins.op in _BINARY:
        return _BINARY[ins.op](*args)
    if ins.op in _UNARY:
        return _UNARY[ins.op](args[0])
    if ins.op == "select":
        return args[1] if args[0] else args[2]
    if ins.op == "convert":
        kind = ins.shape.dtype
        return bool(args[0]) if kind == "pred" else (
            float(args[0]) if kind[0] in "fb" else int(args[0]))
    if ins.op in ("reshape", "bitcast", "broadcast", "copy"):
        return args[0]
    return None


# --------------------------------------------------------------------------- GEMMs

@dataclasses.dataclass(frozen=True)
class Gemm:
    """One ``dot`` of a compiled program: where it is, its operand and result types, and
    which kernel runs it (``library``: the fusion kind around it on CPU, e.g.
    ``__ynn_fusion`` for XLA's YNNPACK, ``""`` for XLA's own loop)."""

    computation: str
    name: str
    lhs: str
    rhs: str
    out: str
    lhs_dims: tuple[int, ...]
    rhs_dims: tuple[int, ...]
    lhs_contracting: tuple[int, ...]
    rhs_contracting: tuple[int, ...]
    library: str
    op_name: str

    @property
    def integer(self) -> bool:
        """An int8 x int8 GEMM (the integer path's)."""
        return self.lhs in ("s8", "u8") and self.rhs in ("s8", "u8")


def _operand_shape(module: Module, comp: str, name: str) -> Shape:
    return module.comps[comp].by_name[name].shape


def _library(module: Module, comp: str) -> str:
    """The fusion kind of the instruction that calls `comp` (``""``: none)."""
    caller = module.callers.get(comp)
    if caller is None:
        return ""
    ins = module.instr(*caller)
    m = re.search(r'"kind":"([^"]+)"', ins.attrs)
    return m.group(1) if m else ""


def gemms(text: str) -> list[Gemm]:
    """Every ``dot`` of an optimized HLO module's text with its operand types (`Gemm`).

    Example (XLA CPU):
      >>> import jax, jax.numpy as jnp
      >>> f = jax.jit(lambda a, b: jax.lax.dot(a, b, preferred_element_type=jnp.int32))
      >>> a = jnp.ones((64, 64), jnp.int8)
      >>> [(g.lhs, g.rhs, g.out) for g in gemms(f.lower(a, a).compile().as_text())]
      [('s8', 's8', 's32')]
    """
    module = parse(text)
    out = []
    for comp in module.comps.values():
        for ins in comp.instrs:
            if ins.op != "dot" or len(ins.operands) != 2:
                continue
            lhs, rhs = (_operand_shape(module, comp.name, n) for n in ins.operands)
            out.append(Gemm(comp.name, ins.name, lhs.dtype, rhs.dtype, ins.shape.dtype,
                            lhs.dims, rhs.dims, ins.ints("lhs_contracting_dims"),
                            ins.ints("rhs_contracting_dims"), _library(module, comp.name),
                            ins.op_name))
    return out
