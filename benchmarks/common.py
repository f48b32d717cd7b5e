"""Shared helpers of the benchmarks: interleaved timing, model/batch builders, HLO stats.

Timing rule (the machine may be shared, so absolute times drift): every figure that
is compared is measured *side by side in one run*: the candidates run in
alternating rounds (the order flips every round), each round times a few steps,
and the reported figure is the median over rounds. Ratios are of medians.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import re
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

import cpt_jax  # noqa: E402
from cpt_jax.training import create_train_state, make_train_step  # noqa: E402

MODELS = ("resnet20", "mlp", "transformer", "gcn", "ffn")


# --------------------------------------------------------------------------- cli

def parser(description: str) -> argparse.ArgumentParser:
    """An argparse parser with the flags every benchmark shares."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--quick", action="store_true", help="a run of about a minute")
    p.add_argument("--json", action="store_true",
                   help="print the figures as one JSON object on the last line")
    p.add_argument("--rounds", type=int, default=None, help="timing rounds (alternating)")
    return p


def emit_json(obj: dict[str, Any]) -> None:
    """Print `obj` as one JSON line (the last line of a benchmark's output)."""
    print(json.dumps(obj, sort_keys=True, default=float))


def machine_info() -> dict[str, Any]:
    """Device, CPU count and versions, for the record."""
    dev = jax.devices()[0]
    return {"backend": jax.default_backend(), "device": str(dev.device_kind),
            "cpu_count": os.cpu_count(), "jax": jax.__version__,
            "python": platform.python_version(),
            "date": time.strftime("%Y-%m-%d %H:%M:%S")}


def data_root() -> str | None:
    """The offline datasets folder (``$CPT_DATA_ROOT`` or ``../shared/datasets``)."""
    for cand in (os.environ.get("CPT_DATA_ROOT"), os.path.join(ROOT, "local_data"),
                 os.path.join(ROOT, "..", "shared", "datasets"), "/work/shared/datasets"):
        if cand and os.path.isdir(cand):
            return cand
    return None


# --------------------------------------------------------------------------- timing

def block(tree) -> None:
    """Wait for every array in `tree` (no host transfer of the values)."""
    jax.block_until_ready(tree)


def interleaved(candidates: dict[str, Callable[[], Any]], rounds: int, iters: int,
                warmup: int = 1) -> dict[str, list[float]]:
    """Time each ``candidates[name]()`` in alternating rounds; ms per call per round.

    Every round runs each candidate `iters` times back to back (waiting for the
    result after the last call) and records the mean; the order of the candidates
    reverses every round so drifting machine load hits them alike.
    """
    names = list(candidates)
    for name in names:
        for _ in range(warmup):
            block(candidates[name]())
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        order = names if r % 2 == 0 else names[::-1]
        for name in order:
            fn = candidates[name]
            t0 = time.perf_counter()
            out = None
            for _ in range(iters):
                out = fn()
            block(out)
            times[name].append((time.perf_counter() - t0) / iters * 1e3)
    return times


def step_runners(compiled: dict[str, Callable], states: dict, batch) -> dict[str, Callable]:
    """For `interleaved`: per name, one call of its compiled train step on `batch`,
    carrying the state (donated buffers) in ``states[name]``; returns the params."""
    def runner(k):
        def run():
            states[k], _ = compiled[k](states[k], batch)
            return states[k].params
        return run
    return {k: runner(k) for k in compiled}


def median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs))


def spread(xs: Sequence[float]) -> str:
    """``median [q1, q3]`` of a list of milliseconds, for printing."""
    if len(xs) < 2:
        return f"{median(xs):.2f}"
    q = np.percentile(xs, [25, 75])
    return f"{median(xs):.2f} [{q[0]:.2f}, {q[1]:.2f}]"


# --------------------------------------------------------------------------- models

class TokenClassifier(nn.Module):
    """A pre-LN Transformer block with a per-token classifier (for a train step).

    ``logits = classifier(TransformerBlock(x, causal_mask))``; the classifier is
    kept in fp32 by ``cpt_jax.CPT_RULES``.
    """

    d_model: int = 256
    num_heads: int = 4
    mlp_dim: int = 1024
    num_classes: int = 16

    @nn.compact
    def __call__(self, x, train: bool = False):
        from cpt_jax.models.transformer import TransformerBlock, causal_mask
        y = TransformerBlock(self.d_model, self.num_heads, self.mlp_dim, name="block")(
            x, causal_mask(x.shape[1]), train)
        return nn.Dense(self.num_classes, name="classifier")(y)


class MlpBlockModel(nn.Module):
    """A Transformer MLP block ``fc2(gelu(fc1(x)))`` as a regression model (int8 bench)."""

    d_model: int = 4096
    mlp_dim: int = 16384

    @nn.compact
    def __call__(self, x, train: bool = False):
        y = nn.gelu(nn.Dense(self.mlp_dim, name="fc1")(x))
        return nn.Dense(self.d_model, name="fc2")(y)


class FfnClassifier(nn.Module):
    """A Transformer FFN ``fc2(gelu(fc1(x)))`` with a per-token classifier (kept fp32 by
    ``CPT_RULES``): issue 44's FFN (d 512 -> 2048 -> 512 over 8 x 512 tokens)."""

    d_model: int = 512
    mlp_dim: int = 2048
    num_classes: int = 16

    @nn.compact
    def __call__(self, x, train: bool = False):
        y = nn.gelu(nn.Dense(self.mlp_dim, name="fc1")(x))
        y = nn.Dense(self.d_model, name="fc2")(y)
        return nn.Dense(self.num_classes, name="classifier")(y)


class CastModel(nn.Module):
    """`inner` computed in `dtype` (plain mixed precision, as jmp's policies: float32
    parameters cast at each call, inputs cast, the output back to float32): "plain
    bf16 Flax" for the benchmarks."""

    inner: nn.Module
    dtype: Any = jnp.bfloat16

    @nn.compact
    def __call__(self, x, train: bool = False):
        def cast(tree, dtype):
            return jax.tree.map(lambda a: a.astype(dtype) if jnp.issubdtype(
                jnp.asarray(a).dtype, jnp.floating) else a, tree)
        fields = {f.name: getattr(self.inner, f.name) for f in dataclasses.fields(self.inner)
                  if f.init and f.name not in ("parent", "name")}
        mapped = nn.map_variables(type(self.inner), "params", init=self.is_initializing(),
                                  trans_in_fn=lambda v: cast(v, self.dtype))(**fields)
        return cast(mapped(cast(x, self.dtype), train=train), jnp.float32)


def _cifar_batch(batch_size: int, seed: int = 0):
    root = data_root()
    path = os.path.join(root, "cifar10", "data_batch_1.npz") if root else None
    if path and os.path.exists(path):
        with np.load(path) as d:
            images, labels = d["image"][:batch_size], d["label"][:batch_size]
        x = images.astype(np.float32) / 255.0
        x = (x - np.array([0.4914, 0.4822, 0.4465])) / np.array([0.2470, 0.2435, 0.2616])
        return jnp.asarray(x, jnp.float32), jnp.asarray(labels, jnp.int32), "cifar10"
    rng = np.random.default_rng(seed)
    return (jnp.asarray(rng.normal(size=(batch_size, 32, 32, 3)), jnp.float32),
            jnp.asarray(rng.integers(0, 10, batch_size), jnp.int32), "random")


def build(name: str, *, quick: bool = False) -> dict[str, Any]:
    """A model, one batch, its optimizer and a description, by benchmark name.

    resnet20: CIFAR ResNet-20, batch 128 (CIFAR-10 images when present);
    mlp: MLP 784-1024-1024-10, batch 256; transformer: one pre-LN block
    (d_model 256, 4 heads, MLP 1024) + classifier, batch 16 x 128 tokens;
    gcn: 2-layer GCN (hidden 64) on Cora, full batch; ffn: a Transformer FFN
    (d 512 -> 2048 -> 512) + classifier over 8 x 512 tokens.
    """
    rng = np.random.default_rng(0)
    if name == "resnet20":
        from cpt_jax.models import resnet20
        x, y, src = _cifar_batch(128)
        return dict(model=resnet20(num_classes=10), batch={"inputs": x, "labels": y},
                    sample=x[:2], optimizer=optax.sgd(0.1, momentum=0.9),
                    desc=f"CIFAR ResNet-20, batch 128 ({src} images)")
    if name == "mlp":
        from cpt_jax.models import MLP
        x = jnp.asarray(rng.normal(size=(256, 28, 28, 1)), jnp.float32)
        y = jnp.asarray(rng.integers(0, 10, 256), jnp.int32)
        return dict(model=MLP(hidden=(1024, 1024), num_classes=10),
                    batch={"inputs": x, "labels": y}, sample=x[:2],
                    optimizer=optax.sgd(0.05, momentum=0.9),
                    desc="MLP 784-1024-1024-10, batch 256")
    if name == "transformer":
        b, t, d = 16, 128, 256
        x = jnp.asarray(rng.normal(size=(b, t, d)), jnp.float32)
        y = jnp.asarray(rng.integers(0, 16, (b, t)), jnp.int32)
        return dict(model=TokenClassifier(d_model=d), batch={"inputs": x, "labels": y},
                    sample=x[:2], optimizer=optax.adam(1e-3),
                    desc="pre-LN Transformer block d256 h4 mlp1024 + classifier, 16x128 tokens")
    if name == "gcn":
        from cpt_jax.data.graph import load_planetoid
        from cpt_jax.models.gcn import GCN
        root = data_root()
        g = load_planetoid("cora", os.path.join(root, "planetoid"))
        batch = {"inputs": g, "labels": jnp.asarray(g.labels), "mask": jnp.asarray(g.train_mask)}
        return dict(model=GCN(num_classes=g.num_classes, hidden=64), batch=batch, sample=g,
                    optimizer=optax.adam(0.01), desc="GCN (hidden 64) on Cora, full batch")
    if name == "ffn":
        b, t, d = 8, 512, 512
        x = jnp.asarray(rng.normal(size=(b, t, d)), jnp.float32)
        y = jnp.asarray(rng.integers(0, 16, (b, t)), jnp.int32)
        return dict(model=FfnClassifier(d_model=d), batch={"inputs": x, "labels": y},
                    sample=x[:2], optimizer=optax.adam(1e-3),
                    desc="FFN d512 -> 2048 -> 512 + classifier, 8x512 tokens")
    raise ValueError(f"unknown benchmark model {name!r}; choose one of {MODELS}")


def cyclic_schedule(total_steps: int, min_bits: int = 3, max_bits: int = 8,
                    num_cycles: int = 1):
    """CPT's cos_growth schedule over `total_steps` (every width 3..8 is visited)."""
    return cpt_jax.cyclic("cos_growth", min_bits=min_bits, max_bits=max_bits,
                          num_cycles=num_cycles, total_steps=max(total_steps, num_cycles))


NO_QUANTIZERS = cpt_jax.QuantConfig(weight=None, activation=None, error=None)
"""A config quantizing no tensor: each product is still computed by its provider, laid
out as a quantized one (a Dense over (batch, tokens, features) as one 2-D GEMM on CPU),
in fp32. (A product kept in fp32 by a rule, or run outside a precision context, is
computed as the model wrote it, bit for bit the model without cpt_jax: issue 41.)"""


VARIANTS = ("fp32", "bf16", "quant", "fake", "int", "fp32_cpt", "qwix")
"""The train steps `make_steps` builds: plain fp32 Flax, plain bf16 Flax (`CastModel`),
CPT through cpt_jax with the config's own ``compute`` (``"auto"``), the same with
``compute="fake"`` and with ``compute="int"``, the model through cpt_jax with no
quantizer (`same_layout`), and Qwix's int8 training where Qwix is installed
(`peers.qwix_model`)."""


def make_steps(spec: dict[str, Any], total_steps: int, quant_config=None,
               donate: bool = True, same_layout: bool = False,
               variants: Sequence[str] = ("fp32", "quant")) -> dict[str, Any]:
    """Train steps of one model (`VARIANTS`), each with its own state.

    fp32: the plain model, no precision context; bf16: the plain model computed in
    bfloat16 (`CastModel`); qwix: the model under Qwix's int8 quantized training
    (`peers.qwix_model`: int8 forward and backward GEMMs on every product but the
    classifier), stepped as fp32 is (Qwix must be installed). quant / fake / int: ``quantize_model(model, CPT_RULES)``
    (every Dense/Conv but the classifier) with `quant_config` (default CPT's) as it is
    / ``compute="fake"`` / ``compute="int"``, cyclic 3..8 forward bits over
    `total_steps`, 8-bit errors with stochastic rounding. With `same_layout` (or
    ``"fp32_cpt"`` in `variants`), also ``fp32_cpt``: the model through
    ``quantize_model(model, CPT_RULES, NO_QUANTIZERS)``, the same schedule and context:
    the quant step's products and layouts without its quantizers (e.g. a Dense over
    (batch, tokens, features) computed as one 2-D GEMM, whose weight gradient XLA CPU
    then reads without a transposed copy).
    """
    model, opt = spec["model"], spec["optimizer"]
    config = quant_config or cpt_jax.CPT_CONFIG
    variants = tuple(variants) + (("fp32_cpt",) if same_layout else ())
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise ValueError(f"unknown variants {unknown}; choose from {VARIANTS}")
    computes = {"quant": config, "fake": config.replace(compute="fake"),
                "int": config.replace(compute="int"), "fp32_cpt": NO_QUANTIZERS}
    steps, models = {}, {}
    for v in dict.fromkeys(variants):
        if v in ("fp32", "bf16", "qwix"):
            if v == "qwix":
                from benchmarks import peers
                models[v] = peers.qwix_model(model, spec["sample"])
            else:
                models[v] = model if v == "fp32" else CastModel(model)
            steps[v] = make_train_step(models[v], opt, None, donate=donate)
            continue
        models[v] = cpt_jax.quantize_model(model, rules=cpt_jax.CPT_RULES,
                                           config=computes.get(v, config))
        steps[v] = make_train_step(models[v], opt, cyclic_schedule(total_steps),
                                   cpt_jax.constant(8), donate=donate)
    states = {k: create_train_state(models[k] if k == "bf16" else model, opt,
                                    jax.random.key(1), spec["sample"], train=False)
              for k in steps}
    return {"steps": steps, "states": states, "qmodel": models.get("quant")}


# --------------------------------------------------------------------------- HLO

_INSTR = re.compile(r"^\s*(?:ROOT )?%(\S+) = (\([^=]*?\)|\S+) ([\w-]+)\((.*)$")


def hlo_stats(compiled_text: str, big: int = 100_000) -> dict[str, Any]:
    """Counts of the top-level ops of a compiled HLO module's entry computation.

    ``ops``: instructions (parameters, constants, tuples and bitcasts excluded);
    ``fusions``; ``big_ops``: ops writing a result of at least `big` elements (the
    memory-bound passes over activations); ``big_elements``: the elements they
    write in total (a proxy of memory traffic).
    """
    start = compiled_text.find("\nENTRY")
    entry = compiled_text[start:] if start >= 0 else compiled_text
    counts: Counter = Counter()
    big_ops, big_elems = 0, 0
    for line in entry.splitlines()[1:]:
        m = _INSTR.match(line)
        if not m:
            continue
        _, shape, op, _ = m.groups()
        if op in ("parameter", "constant", "tuple", "get-tuple-element", "bitcast"):
            continue
        counts[op] += 1
        sizes = [math.prod(int(d) for d in dims.split(",") if d) if dims else 1
                 for dims in re.findall(r"\w+\[([\d,]*)\]", shape)]
        n = max(sizes) if sizes else 0
        if n >= big:
            big_ops += 1
            big_elems += n
    return {"ops": int(sum(counts.values())), "fusions": int(counts.get("fusion", 0)),
            "convolutions": int(counts.get("convolution", 0)),
            "copies": int(counts.get("copy", 0)), "big_ops": big_ops,
            "big_elements_M": round(big_elems / 1e6, 2)}


def memory_stats(compiled) -> dict[str, float]:
    """``memory_analysis()`` of a compiled step in MB.

    ``peak_MB``: the most bytes live at once, ``max(peak_memory_in_bytes, argument +
    temp + output - alias)`` (XLA's temp allocation is already the peak of the
    temporaries; the CPU backend's ``peak_memory_in_bytes`` leaves them out, a GPU's
    includes them). jax 0.12's CPU backend reports no temporaries at all
    (``temp_MB`` 0): its peak is then arguments + outputs only (``temp_reported``
    False).
    """
    ma = compiled.memory_analysis()
    if ma is None:
        return {}
    temp = ma.temp_size_in_bytes / 1e6
    arg = ma.argument_size_in_bytes / 1e6
    out = ma.output_size_in_bytes / 1e6
    alias = getattr(ma, "alias_size_in_bytes", 0) / 1e6
    peak = max(getattr(ma, "peak_memory_in_bytes", 0) / 1e6, arg + temp + out - alias)
    return {"temp_MB": round(temp, 2), "argument_MB": round(arg, 2),
            "output_MB": round(out, 2), "alias_MB": round(alias, 2),
            "temp_plus_argument_MB": round(temp + arg, 2), "peak_MB": round(peak, 2),
            "temp_reported": temp > 0}
