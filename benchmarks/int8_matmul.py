"""The real-int8 path against fake quantization in fp32 and bf16.

Two workloads, each a jitted forward+backward (``value_and_grad`` of a squared
loss, the parameters' gradients) at 8 traced bits, errors quantized at 8 bits:

* a Transformer MLP block ``fc2(gelu(fc1(x)))``: d_model 4096, hidden 16384,
  8192 tokens (--quick / CPU: d_model 256, hidden 1024, 512 tokens);
* the CIFAR ResNet-20 at batch 128 (--quick / CPU: batch 16).

Variants (all with `SymmetricInt` operands so the grids are the same):
``fp32_fake`` (fake quantization, float32 products), ``bf16_fake`` (the same with
bfloat16 inputs and parameters), ``int8`` (`QuantConfig(compute="int")`: int8 x int8
-> int32 products, rescaled). Also ``fp32`` without quantization. Timed in
alternating rounds; medians and ratios to fp32_fake.

    python benchmarks/int8_matmul.py [--quick] [--json] [--workloads mlp,resnet20]
"""
from __future__ import annotations

try:
    from benchmarks import common as C
except ImportError:  # run as a script
    import common as C  # type: ignore

import jax
import jax.numpy as jnp
import numpy as np

import cpt_jax
from cpt_jax.formats import AffineInt, SymmetricInt
from cpt_jax.quant_config import INT8_CONFIG, QuantConfig, TensorQuant

FAKE_SYMMETRIC = QuantConfig(weight=TensorQuant(SymmetricInt(-1)),
                             activation=TensorQuant(SymmetricInt()),
                             error=TensorQuant(AffineInt(), "stochastic"))


def workload(name: str, small: bool):
    rng = np.random.default_rng(0)
    if name == "mlp":
        d, h, t = (256, 1024, 512) if small else (4096, 16384, 8192)
        model = C.MlpBlockModel(d_model=d, mlp_dim=h)
        x = jnp.asarray(rng.normal(size=(t, d)), jnp.float32)
        return model, x, f"MLP block d_model {d}, hidden {h}, {t} tokens", {}
    if name == "resnet20":
        from cpt_jax.models import resnet20
        b = 16 if small else 128
        x = jnp.asarray(rng.normal(size=(b, 32, 32, 3)), jnp.float32)
        return resnet20(num_classes=10), x, f"ResNet-20 batch {b}", {"mutable": ["batch_stats"],
                                                                    "train": True}
    raise ValueError(f"unknown workload {name!r}")


def make_fn(model, config, dtype, apply_kwargs):
    qmodel = cpt_jax.quantize_model(model, cpt_jax.CPT_RULES, config=config) if config else model

    def loss(params, rest, x, bits, key):
        variables = {"params": params, **rest}
        if config is None:
            out = qmodel.apply(variables, x, **apply_kwargs)
        else:
            with cpt_jax.precision(bits, 8.0, rng=key):
                out = qmodel.apply(variables, x, **apply_kwargs)
        if isinstance(out, tuple):
            out = out[0]
        return jnp.mean(jnp.square(out.astype(jnp.float32)))

    return qmodel, jax.jit(jax.value_and_grad(loss))


def main(argv=None) -> dict:
    p = C.parser(__doc__.splitlines()[0])
    p.add_argument("--workloads", default="mlp,resnet20")
    p.add_argument("--small", action="store_true", help="small shapes (default on CPU)")
    args = p.parse_args(argv)
    info = C.machine_info()
    small = args.small or args.quick or info["backend"] == "cpu"
    rounds = args.rounds or (3 if args.quick else 7)
    print(f"# int8_matmul: {info}")
    out = {"_machine": info}
    for name in [w for w in args.workloads.split(",") if w]:
        model, x, desc, apply_kwargs = workload(name, small)
        variables = model.init(jax.random.key(0), x[:2], **({"train": False}
                                                             if name == "resnet20" else {}))
        params = variables["params"]
        rest = {k: v for k, v in variables.items() if k != "params"}
        variants = {"fp32": (None, jnp.float32), "fp32_fake": (FAKE_SYMMETRIC, jnp.float32),
                    "bf16_fake": (FAKE_SYMMETRIC, jnp.bfloat16),
                    "int8": (INT8_CONFIG, jnp.float32)}
        cands = {}
        for k, (cfg, dtype) in variants.items():
            _, fn = make_fn(model, cfg, dtype, apply_kwargs)
            p_ = jax.tree_util.tree_map(lambda a, dtype=dtype: a.astype(dtype), params)
            x_ = x.astype(dtype)
            key = jax.random.key(1)
            cands[k] = (lambda fn=fn, p_=p_, x_=x_, key=key, rest=rest:
                        fn(p_, rest, x_, jnp.float32(8.0), key))
        times = C.interleaved(cands, rounds, 2, warmup=1)
        base = C.median(times["fp32_fake"])
        res = {"desc": desc}
        for k, v in times.items():
            ms = C.median(v)
            res[f"{k}_ms"] = round(ms, 3)
            res[f"{k}_over_fp32_fake"] = round(ms / base, 4)
            print(f"{name:9s} {k:10s} {C.spread(v):>26s} ms  x{ms / base:5.3f} of fp32_fake"
                  f"  [{desc}]")
        out[name] = res
    if args.json:
        C.emit_json(out)
    return out


if __name__ == "__main__":
    main()
