"""Per-layer bit allocation from the factors of low-precision matmuls (Shen, Lai,
Zhang 2024, seed 003): accumulation length, usage frequency (reuse) and depth.

For each quantized op of a traced model (`cost.count_ops`), in forward order:

* ``accumulation`` ``K``: elements summed into each output (Dense: ``C_in``; conv:
  ``kh kw C_in / groups``);
* ``weight_reuse`` ``= MACs / |W|``: how many multiply-accumulates each weight
  element enters (Dense: the batch rows; conv: batch x output positions);
* ``activation_reuse`` ``= MACs / |x|`` (Dense: ``C_out``; conv: about ``kh kw C_out``);
* ``reuse`` ``= 2 MACs / (|W| + |x|)``: the mean usage of an operand element;
* ``depth`` ``= i / (n - 1)``: the op's index in forward order, normalised to [0, 1].

A *policy* turns the factors into integer forward-bit offsets, one per layer, at the
same training BitOps as the uniform allocation (solved, see `allocate`):

* ``uniform``: every offset 0;
* ``pos_<factor>`` / ``neg_<factor>``: bits increase / decrease with the factor
  (by rank); "bits set by a factor" is the sign the paper recommends:
  ``neg_accumulation`` (long accumulation tolerates fewer bits) and ``pos_reuse``
  (rarely used elements tolerate fewer bits);
* ``recommended``: both at once, ranked by ``z(log reuse) - z(log K)``;
* ``random``: a random order (a seed).

The result is an `Allocation`, usable as `quantize_model` rules (`Allocation.rules`)
or as ``config.precision.bit_offsets`` (`Allocation.bit_offsets`), with any
precision schedule: the offset is added to the scheduled bits of that layer.

Example:
  >>> from cpt_jax import count_ops, quantize_model
  >>> from cpt_jax.models import MLP
  >>> model = MLP(hidden=(64, 32), num_classes=10)
  >>> x = jnp.ones((16, 100))
  >>> variables = model.init(jax.random.key(0), x)
  >>> ops = count_ops(quantize_model(model, rules=()), variables, x)
  >>> alloc = allocate(ops, "neg_accumulation", bits=4, grad_bits=8, spread=2)
  >>> [name for name, _ in alloc.offsets]
  ['dense1', 'dense2', 'classifier']
  >>> offsets = alloc.offset_dict()        # long accumulation (K=100) gets the fewest bits
  >>> offsets["dense1"] <= offsets["dense2"] <= offsets["classifier"], abs(alloc.cost_error) < 0.1
  (True, True)
  >>> qmodel = quantize_model(model, rules=alloc.rules())
"""
from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from cpt_jax.cost import FP_BITS, OpRecord
from cpt_jax.interception import as_config
from cpt_jax.quant_config import CPT_CONFIG, QuantConfig

FACTORS: tuple[str, ...] = ("accumulation", "reuse", "weight_reuse", "activation_reuse",
                            "depth")
"""Factor names a ``pos_``/``neg_`` policy can use."""

POLICIES: tuple[str, ...] = (("uniform", "random", "recommended")
                             + tuple(f"{s}_{f}" for f in FACTORS for s in ("pos", "neg")))
"""Every policy name `allocate` accepts."""

BitsLike = float | int | Sequence[float] | np.ndarray


@dataclasses.dataclass(frozen=True)
class LayerFactors:
    """The factors of one quantized op (see module docstring for the formulas).

    Example:
      >>> from cpt_jax import count_ops, quantize_model
      >>> v = nn.Dense(5).init(jax.random.key(0), jnp.ones((4, 3)))
      >>> f = layer_factors(count_ops(quantize_model(nn.Dense(5)), v, jnp.ones((4, 3))))[0]
      >>> f.accumulation, f.weight_reuse, f.activation_reuse
      (3, 4.0, 5.0)
    """

    name: str
    index: int
    depth: float
    accumulation: int
    weight_reuse: float
    activation_reuse: float
    reuse: float
    macs: int
    weight_elements: int
    activation_elements: int

    def factor(self, name: str) -> float:
        """The value of factor `name` (one of `FACTORS`)."""
        if name not in FACTORS:
            raise ValueError(f"factor={name!r} is unknown; choose one of {FACTORS}")
        return float(getattr(self, name))


def _merged_quantized_ops(ops: Sequence[OpRecord]) -> list[dict[str, Any]]:
    """Quantized ops by name, in order of first call; a layer called twice (weight
    sharing) sums its MACs and input elements, counts its weight once."""
    merged: dict[str, dict[str, Any]] = {}
    for op in ops:
        if not op.quantized:
            continue
        entry = merged.get(op.name)
        x = int(math.prod(op.lhs_shape))
        if entry is None:
            merged[op.name] = {"name": op.name, "macs": int(op.macs),
                               "reduction": int(op.reduction),
                               "w": int(math.prod(op.rhs_shape)), "x": x}
        else:
            entry["macs"] += int(op.macs)
            entry["x"] += x
    return list(merged.values())


def layer_factors(ops: Sequence[OpRecord]) -> list[LayerFactors]:
    """The `LayerFactors` of every quantized op of `ops`, in forward order.

    Ops kept in full precision are skipped (they get no offset). Depth is the index
    among the quantized ops divided by ``n - 1`` (0 for a single op).
    """
    entries = _merged_quantized_ops(ops)
    n = len(entries)
    out = []
    for i, e in enumerate(entries):
        out.append(LayerFactors(
            name=e["name"], index=i, depth=i / (n - 1) if n > 1 else 0.0,
            accumulation=e["reduction"], weight_reuse=e["macs"] / max(1, e["w"]),
            activation_reuse=e["macs"] / max(1, e["x"]),
            reuse=2.0 * e["macs"] / max(1, e["w"] + e["x"]), macs=e["macs"],
            weight_elements=e["w"], activation_elements=e["x"]))
    return out


def _ranks(values: np.ndarray) -> np.ndarray:
    """Ranks 0..n-1 with ties averaged."""
    order = np.argsort(values, kind="stable")
    ranks = np.empty(len(values), np.float64)
    ranks[order] = np.arange(len(values), dtype=np.float64)
    for v in np.unique(values):
        tie = values == v
        ranks[tie] = ranks[tie].mean()
    return ranks


def _standardized(values: np.ndarray) -> np.ndarray:
    """``(v - mean) / std`` (zeros for a constant input)."""
    std = float(np.std(values))
    return np.zeros_like(values) if std == 0 else (values - np.mean(values)) / std


def _centred(ranks: np.ndarray) -> np.ndarray:
    n = len(ranks)
    if n < 2 or np.ptp(ranks) == 0:
        return np.zeros(n)
    return (ranks - ranks.min()) / np.ptp(ranks) - 0.5


def policy_scores(factors: Sequence[LayerFactors], policy: str, seed: int = 0) -> np.ndarray:
    """Per-layer scores in ``[-0.5, 0.5]``: more score, more bits.

    ``pos_f``: ``s_i = rank(f_i) / (n - 1) - 1/2`` (ties share a rank);
    ``neg_f``: ``-s_i``; ``recommended``: the centred rank of
    ``z(log reuse_i) - z(log K_i)`` (``z``: standardized over the layers, so the two
    factors weigh equally and ties are rare); ``random``: centred ranks of a random permutation
    drawn with `seed`; ``uniform``: zeros.
    """
    if policy not in POLICIES:
        raise ValueError(f"policy={policy!r} is unknown; choose one of {POLICIES}")
    n = len(factors)
    if policy == "uniform" or n == 0:
        return np.zeros(n)
    if policy == "random":
        perm = np.random.default_rng(int(seed)).permutation(n).astype(np.float64)
        return _centred(perm)
    if policy == "recommended":
        logk = np.log([float(f.accumulation) for f in factors])
        logr = np.log([max(float(f.reuse), 1e-12) for f in factors])
        return _centred(_ranks(_standardized(logr) - _standardized(logk)))
    sign, factor = policy.split("_", 1)
    values = np.array([f.factor(factor) for f in factors], np.float64)
    s = _centred(_ranks(values))
    return s if sign == "pos" else -s


# --------------------------------------------------------------------------- cost

def _as_steps(values: BitsLike, name: str) -> np.ndarray:
    arr = np.atleast_1d(np.asarray(values, np.float64))
    if arr.ndim != 1 or arr.size == 0 or not np.all(np.isfinite(arr)):
        raise ValueError(f"{name} must be a number or a non-empty 1-D array of bits, got "
                         f"{values!r}")
    if np.any(arr < 1):
        raise ValueError(f"{name} must be >= 1 bit, got min {arr.min()}")
    return arr


def _bit_histogram(bits: BitsLike, grad_bits: BitsLike | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Unique (b, g) step pairs and their frequencies (the mean over steps is a
    weighted sum over pairs)."""
    b = _as_steps(bits, "bits")
    if grad_bits is None:
        g = np.full_like(b, FP_BITS)
    else:
        g = _as_steps(grad_bits, "grad_bits")
        if g.size == 1 and b.size > 1:
            g = np.full_like(b, g[0])
        if b.size == 1 and g.size > 1:
            b = np.full_like(g, b[0])
        if g.size != b.size:
            raise ValueError(f"bits and grad_bits must have the same number of steps, got "
                             f"{b.size} and {g.size}")
    pairs, counts = np.unique(np.stack([b, g], 1), axis=0, return_counts=True)
    return pairs[:, 0], pairs[:, 1], counts / counts.sum()


def allocation_cost(ops: Sequence[OpRecord], offsets: Mapping[str, float], bits: BitsLike,
                    grad_bits: BitsLike | None = None) -> float:
    """Training BitOps relative to fp32 with per-layer forward offsets:

        cost = mean_t sum_ops MACs_op (b_op,t^2 + 2 b_op,t g_t) / (3 * 32^2 sum_ops MACs_op)

    with ``b_op,t = clip(bits_t + offset_op, 1, 32)`` for quantized ops and 32 for ops
    kept in full precision (the formula of `cost.run_cost`). `bits` / `grad_bits`: a
    number or the per-step values of a schedule; ``grad_bits=None``: fp32 errors.

    Example:
      >>> from cpt_jax import count_ops, quantize_model
      >>> from cpt_jax.models import MLP
      >>> model = MLP(hidden=(64, 32), num_classes=10)
      >>> x = jnp.ones((16, 100))
      >>> variables = model.init(jax.random.key(0), x)
      >>> ops = count_ops(quantize_model(model, rules=()), variables, x)
      >>> allocation_cost(ops, {}, bits=8, grad_bits=8)   # uniform 8/8, all quantized
      0.0625
    """
    b, g, w = _bit_histogram(bits, grad_bits)
    total_macs = float(sum(op.macs for op in ops))
    if total_macs <= 0:
        raise ValueError("ops must contain at least one op with MACs > 0")
    cost = 0.0
    for op in ops:
        if op.quantized:
            bb = np.clip(b + float(offsets.get(op.name, op.bits_offset)), 1.0, FP_BITS)
            gg = np.clip(g + op.grad_bits_offset, 1.0, FP_BITS)
        else:
            bb = np.full_like(b, FP_BITS)
            gg = np.full_like(g, FP_BITS)
        cost += op.macs * float(np.sum(w * (bb * bb + 2.0 * bb * gg)))
    return cost / (3.0 * FP_BITS * FP_BITS * total_macs)


# --------------------------------------------------------------------------- allocation

@dataclasses.dataclass(frozen=True)
class Allocation:
    """Integer forward-bit offsets per layer at (about) the uniform allocation's cost.

    Attributes:
      policy: the policy name.
      offsets: ``((layer name, offset), ...)`` in forward order.
      scores: the policy's scores (same order).
      relative_cost_fp32: the allocation's training BitOps relative to fp32.
      target_cost: the uniform allocation's (the constraint).
    """

    policy: str
    offsets: tuple[tuple[str, int], ...]
    scores: tuple[float, ...]
    relative_cost_fp32: float
    target_cost: float

    @property
    def cost_error(self) -> float:
        """``relative_cost_fp32 / target_cost - 1``."""
        return self.relative_cost_fp32 / self.target_cost - 1.0

    def offset_dict(self) -> dict[str, int]:
        """``{layer name: offset}``."""
        return dict(self.offsets)

    def bit_offsets(self) -> tuple[tuple[str, int], ...]:
        """``((regex, offset), ...)`` for ``config.precision.bit_offsets`` (exact names)."""
        return tuple((exact_name_regex(name), int(o)) for name, o in self.offsets)

    def rules(self, base: QuantConfig | str = CPT_CONFIG) -> list[tuple[str, QuantConfig]]:
        """`quantize_model` rules: ``[(^name$, base.replace(bits_offset=o)), ...]``.

        Put rules keeping layers in full precision first (first match wins). `base`
        may be a preset name (``"int8"``).
        """
        config: QuantConfig = as_config(base, "rules base")
        return [(exact_name_regex(name), config.replace(bits_offset=float(o)))
                for name, o in self.offsets]


def exact_name_regex(name: str) -> str:
    """``^<escaped name>$``: a rule matching exactly one layer path."""
    return "^" + re.escape(name) + "$"


def allocate(ops: Sequence[OpRecord], policy: str, *, bits: BitsLike,
             grad_bits: BitsLike | None = None, spread: float = 2.0,
             min_bits: int = 2, max_bits: int = 16, seed: int = 0) -> Allocation:
    """Per-layer integer offsets of `policy` at the uniform allocation's BitOps.

    Continuous targets ``t_i = clip(spread * s_i + c, lo, hi)`` (``s_i`` from
    `policy_scores`), with the global shift ``c`` solved by bisection so that the
    cost at these fractional offsets equals the uniform cost exactly. Each layer
    then gets ``floor(t_i)`` or ``ceil(t_i)``: the mix (all mixes for up to 14
    layers with a fractional target, greedy flips beyond) whose integer cost is
    closest to the uniform cost while keeping the policy's order (a higher score
    never gets fewer bits; equal scores, equal bits). So every layer stays within
    one bit of the policy's continuous allocation. ``lo, hi`` keep each layer's bits
    within ``[min_bits, max_bits]`` at every step of `bits` (no clipping hides cost).

    With few layers an exact match may not exist: check `Allocation.cost_error`.

    Args:
      ops: `cost.count_ops` of the quantized model (full-precision ops count at 32).
      policy: one of `POLICIES`.
      bits, grad_bits: the run's forward / backward bits (numbers or per-step values).
      spread: the target range of offsets (``0``: every policy is uniform).
      min_bits, max_bits: bounds on any layer's bits.
      seed: for ``random``.
    """
    if not isinstance(spread, (int, float)) or not math.isfinite(spread) or spread < 0:
        raise ValueError(f"spread must be a finite number >= 0, got {spread!r}")
    if not 1 <= int(min_bits) <= int(max_bits) <= 32:
        raise ValueError(f"need 1 <= min_bits <= max_bits <= 32, got min_bits={min_bits}, "
                         f"max_bits={max_bits}")
    factors = layer_factors(ops)
    if not factors:
        raise ValueError("ops has no quantized op to allocate bits to")
    scores = policy_scores(factors, policy, seed)
    b = _as_steps(bits, "bits")
    lo = int(min_bits) - int(math.floor(b.min()))
    hi = int(max_bits) - int(math.ceil(b.max()))
    if lo > 0 or hi < 0:
        raise ValueError(f"bits range [{b.min()}, {b.max()}] leaves no room in "
                         f"[min_bits={min_bits}, max_bits={max_bits}]")
    names = [f.name for f in factors]
    hist = _bit_histogram(bits, grad_bits)

    # cost(offsets) = fixed + sum_ops macs_op E_t[(b_t + o_layer)^2 + 2 (b_t + o_layer) g_op,t]
    bb, gg, ww = hist
    index = {n: i for i, n in enumerate(names)}
    fp_part = 0.0
    q_ops = []  # (layer index, macs, backward bits of this op per (b, g) pair)
    for op in ops:
        if not op.quantized:
            fp_part += op.macs * 3.0 * FP_BITS * FP_BITS
        else:
            q_ops.append((index[op.name], float(op.macs),
                          np.clip(gg + op.grad_bits_offset, 1.0, FP_BITS)))
    norm = 3.0 * FP_BITS * FP_BITS * float(sum(op.macs for op in ops))
    levels = np.arange(lo, hi + 1, dtype=np.float64)
    q = bb[None, :] + levels[:, None]                       # (levels, pairs)
    per_level = [m * np.sum(ww * (q * q + 2.0 * q * g), axis=1) for _, m, g in q_ops]

    def cost_of(o: np.ndarray) -> float:
        return float((fp_part + sum(pl[o[i] - lo] for (i, _, _), pl in zip(q_ops, per_level)))
                     / norm)

    def cost_cont(o: np.ndarray) -> float:  # the same formula at fractional offsets
        total = fp_part
        for i, m, g in q_ops:
            qq = bb + o[i]
            total += m * float(np.sum(ww * (qq * qq + 2.0 * qq * g)))
        return float(total / norm)

    target = cost_of(np.zeros(len(names), int))
    if policy == "uniform" or spread == 0 or np.all(scores == 0):
        offsets = np.zeros(len(names), int)
    else:
        offsets = _solve(scores, float(spread), lo, hi, cost_of, cost_cont, target)
    return Allocation(policy=policy,
                      offsets=tuple((n, int(o)) for n, o in zip(names, offsets)),
                      scores=tuple(float(s) for s in scores),
                      relative_cost_fp32=cost_of(offsets), target_cost=target)


def _solve(scores: np.ndarray, spread: float, lo: int, hi: int, cost_of, cost_cont,
           target: float, exhaustive_max: int = 14) -> np.ndarray:
    """Integer offsets within one bit of the continuous solution, order-preserving,
    closest to `target` cost (exhaustive over floor/ceil for few layers, greedy else)."""
    raw = spread * scores
    a, b = lo - raw.max() - 1.0, hi - raw.min() + 1.0
    for _ in range(100):  # bisection: cost_cont(c) is non-decreasing in c
        mid = 0.5 * (a + b)
        if cost_cont(np.clip(raw + mid, lo, hi)) < target:
            a = mid
        else:
            b = mid
    cont = np.clip(raw + 0.5 * (a + b), lo, hi)
    floor = np.clip(np.floor(cont).astype(int), lo, hi)
    ceil = np.clip(np.ceil(cont).astype(int), lo, hi)
    order = np.argsort(scores, kind="stable")

    def monotone(o: np.ndarray) -> bool:
        so, ss = o[order], scores[order]
        for i in range(len(so) - 1):
            if so[i] > so[i + 1] and ss[i] < ss[i + 1]:
                return False
            if ss[i] == ss[i + 1] and so[i] != so[i + 1]:
                return False
        return True

    free = np.flatnonzero(ceil != floor)
    best, best_err = None, math.inf
    if len(free) <= exhaustive_max:
        for mask in range(1 << len(free)):
            o = floor.copy()
            for j, i in enumerate(free):
                if mask >> j & 1:
                    o[i] = ceil[i]
            if not monotone(o):
                continue
            err = abs(cost_of(o) - target)
            if err < best_err - 1e-15:
                best, best_err = o, err
    else:
        o = np.clip(np.rint(cont).astype(int), lo, hi)
        best, best_err = o, abs(cost_of(o) - target)
        improved = True
        while improved:
            improved = False
            for i in free:
                trial = best.copy()
                trial[i] = ceil[i] if best[i] == floor[i] else floor[i]
                err = abs(cost_of(trial) - target)
                if err < best_err - 1e-15 and monotone(trial):
                    best, best_err, improved = trial, err, True
    if best is None:  # no monotone floor/ceil mix (ties split): round the continuous offsets
        best = np.clip(np.rint(cont).astype(int), lo, hi)
    return best


def factor_table(factors: Sequence[LayerFactors]) -> list[dict[str, Any]]:
    """Rows (dicts) of the factors, for printing or CSV."""
    return [dataclasses.asdict(f) for f in factors]
