"""cpt_jax's train step against PyTorch running CPT's quantizer semantics (same machine).

The PyTorch side is written here from REFERENCE.md, as CPT's code does it: every conv
of the CIFAR ResNet-20 quantizes its input (affine min-max per tensor) and its
weight (affine min-max per output channel) at the forward bits with nearest
rounding and a straight-through backward, and the gradient w.r.t. its output (the
error) per tensor at 8 bits with stochastic rounding (an `autograd.Function`,
identity forward); the final Linear and the BatchNorms stay fp32; SGD momentum 0.9.
Each quantize op runs as separate PyTorch kernels (eager mode, as CPT's code).

Four train steps, same batch (128 CIFAR-10 images), timed in alternating rounds:
JAX fp32, JAX CPT, PyTorch fp32, PyTorch CPT. The fp32 ratio (PyTorch/JAX) tells the
frameworks apart (XLA's CPU convolutions and oneDNN's differ), the quantized ratio
what quantization costs in each.

    python benchmarks/vs_pytorch.py [--quick] [--json] [--device cpu|cuda]
"""
from __future__ import annotations

import os

try:
    from benchmarks import common as C
except ImportError:  # run as a script
    import common as C  # type: ignore

import numpy as np

# --------------------------------------------------------------------------- PyTorch

def torch_models(torch, device: str):
    """PyTorch CIFAR ResNet-20 (option B shortcuts) with CPT's quantized convs."""
    nn = torch.nn
    F = torch.nn.functional

    def affine_quant(x, bits, dims=None, noise=None):
        # CPT: scale = max((max-min)/(2^b-1), 1e-8); q = clamp(round((x-min)/s), 0, 2^b-1)*s + min
        if dims is None:
            lo, hi = x.min(), x.max()
        else:
            lo = x.amin(dim=dims, keepdim=True)
            hi = x.amax(dim=dims, keepdim=True)
        levels = 2.0 ** bits - 1.0
        scale = torch.clamp((hi - lo) / levels, min=1e-8)
        v = (x - lo) / scale
        v = torch.floor(v + noise) if noise is not None else torch.round(v)
        return torch.clamp(v, 0.0, levels) * scale + lo

    class STEQuant(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, bits, per_channel):
            return affine_quant(x, bits, dims=(1, 2, 3) if per_channel else None)

        @staticmethod
        def backward(ctx, g):
            return g, None, None

    class ErrorQuant(torch.autograd.Function):
        """Identity forward; backward quantizes the error per tensor, stochastic."""

        @staticmethod
        def forward(ctx, x, grad_bits):
            ctx.grad_bits = grad_bits
            return x.view_as(x)

        @staticmethod
        def backward(ctx, g):
            noise = torch.rand_like(g)
            return affine_quant(g, ctx.grad_bits, noise=noise), None

    class QConv2d(nn.Conv2d):
        bits = None  # forward bits; None: fp32
        grad_bits = 8

        def forward(self, x):
            if QConv2d.bits is None:
                return super().forward(x)
            xq = STEQuant.apply(x, QConv2d.bits, False)
            wq = STEQuant.apply(self.weight, QConv2d.bits, True)
            y = F.conv2d(xq, wq, self.bias, self.stride, self.padding)
            return ErrorQuant.apply(y, QConv2d.grad_bits)

    class Block(nn.Module):
        def __init__(self, cin, cout, stride):
            super().__init__()
            self.conv1 = QConv2d(cin, cout, 3, stride, 1, bias=False)
            self.bn1 = nn.BatchNorm2d(cout)
            self.conv2 = QConv2d(cout, cout, 3, 1, 1, bias=False)
            self.bn2 = nn.BatchNorm2d(cout)
            self.short = None
            if stride != 1 or cin != cout:
                self.short = nn.Sequential(QConv2d(cin, cout, 1, stride, 0, bias=False),
                                           nn.BatchNorm2d(cout))

        def forward(self, x):
            y = F.relu(self.bn1(self.conv1(x)))
            y = self.bn2(self.conv2(y))
            return F.relu(y + (x if self.short is None else self.short(x)))

    class ResNet20(nn.Module):
        def __init__(self, num_classes=10):
            super().__init__()
            self.conv = QConv2d(3, 16, 3, 1, 1, bias=False)
            self.bn = nn.BatchNorm2d(16)
            layers, cin = [], 16
            for width, stride in ((16, 1), (32, 2), (64, 2)):
                for i in range(3):
                    layers.append(Block(cin, width, stride if i == 0 else 1))
                    cin = width
            self.layers = nn.Sequential(*layers)
            self.fc = nn.Linear(64, num_classes)

        def forward(self, x):
            y = F.relu(self.bn(self.conv(x)))
            y = self.layers(y)
            return self.fc(F.adaptive_avg_pool2d(y, 1).flatten(1))

    return ResNet20, QConv2d


def torch_step_fn(torch, model, qconv, opt, x, y, bits_fn, device):
    counter = [0]

    def step():
        qconv.bits = bits_fn(counter[0])
        counter[0] += 1
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        if device == "cuda":
            torch.cuda.synchronize()
        return None
    return step


# --------------------------------------------------------------------------- main

def main(argv=None) -> dict:
    p = C.parser(__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                   help="PyTorch device (JAX uses its default backend)")
    p.add_argument("--threads", type=int, default=0,
                   help="torch.set_num_threads (0: PyTorch's default)")
    args = p.parse_args(argv)
    # OpenMP threads that spin while waiting lose their core on a shared machine and
    # then stall every parallel region (measured here: a 3x3 conv 35x slower);
    # passive waiting is the setting that measures PyTorch's kernels, not the load.
    # Must be set before PyTorch starts its OpenMP runtime.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    try:
        import torch
    except ImportError as exc:  # pragma: no cover - reported, not hidden
        print(f"PyTorch is not installed ({exc}); pip install torch to run this benchmark")
        if args.json:
            C.emit_json({"error": "torch not installed"})
        return {}
    if args.threads:
        torch.set_num_threads(args.threads)
    device = args.device
    info = C.machine_info()
    info.update(torch=torch.__version__, torch_threads=torch.get_num_threads(), torch_device=device,
                omp_wait_policy=os.environ.get("OMP_WAIT_POLICY"))
    print(f"# vs_pytorch: {info}")

    batch = 32 if args.quick else 128
    on_cpu = device == "cpu" and info["backend"] == "cpu"
    rounds = args.rounds or (3 if args.quick else (6 if on_cpu else 10))
    iters = 1 if on_cpu else 10
    spec = C.build("resnet20")
    x_np = np.asarray(spec["batch"]["inputs"][:batch])
    y_np = np.asarray(spec["batch"]["labels"][:batch])
    spec["batch"] = {"inputs": spec["batch"]["inputs"][:batch],
                     "labels": spec["batch"]["labels"][:batch]}
    total = rounds * iters + 4 * iters
    schedule = C.cyclic_schedule(total)
    bits_of = [float(schedule(t)) for t in range(total + 8)]

    # JAX
    s = C.make_steps(spec, total)
    states, steps, jbatch = s["states"], s["steps"], spec["batch"]

    def jax_runner(k):
        def run():
            states[k], _ = steps[k](states[k], jbatch)
            return states[k].params
        return run

    # PyTorch
    torch.manual_seed(0)
    ResNet20, QConv2d = torch_models(torch, device)
    xt = torch.tensor(x_np.transpose(0, 3, 1, 2).copy(), device=device)
    yt = torch.tensor(y_np.astype(np.int64), device=device)
    tmodels = {k: ResNet20().to(device).train() for k in ("torch_fp32", "torch_quant")}
    topts = {k: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for k, m in tmodels.items()}
    cands = {
        "jax_fp32": jax_runner("fp32"),
        "jax_quant": jax_runner("quant"),
        "torch_fp32": torch_step_fn(torch, tmodels["torch_fp32"], QConv2d, topts["torch_fp32"],
                                    xt, yt, lambda t: None, device),
        "torch_quant": torch_step_fn(torch, tmodels["torch_quant"], QConv2d,
                                     topts["torch_quant"], xt, yt,
                                     lambda t: bits_of[t % len(bits_of)], device),
    }
    times = C.interleaved(cands, rounds, iters, warmup=2)
    med = {k: C.median(v) for k, v in times.items()}
    out = {
        "batch": batch, "rounds": rounds,
        "jax_fp32_ms": round(med["jax_fp32"], 2), "jax_quant_ms": round(med["jax_quant"], 2),
        "torch_fp32_ms": round(med["torch_fp32"], 2),
        "torch_quant_ms": round(med["torch_quant"], 2),
        "jax_quant_over_fp32": round(med["jax_quant"] / med["jax_fp32"], 4),
        "torch_quant_over_fp32": round(med["torch_quant"] / med["torch_fp32"], 4),
        "fp32_torch_over_jax": round(med["torch_fp32"] / med["jax_fp32"], 4),
        "quant_torch_over_jax": round(med["torch_quant"] / med["jax_quant"], 4),
        "jax_num_compiles": steps["quant"].num_compiles,
        "_machine": info,
    }
    for k in ("jax_fp32", "jax_quant", "torch_fp32", "torch_quant"):
        print(f"{k:12s} {C.spread(times[k])} ms/step")
    print(f"quant/fp32: JAX {out['jax_quant_over_fp32']:.3f}  PyTorch "
          f"{out['torch_quant_over_fp32']:.3f}")
    print(f"PyTorch/JAX: fp32 {out['fp32_torch_over_jax']:.3f}  quantized "
          f"{out['quant_torch_over_jax']:.3f}")
    if args.json:
        C.emit_json(out)
    return out


if __name__ == "__main__":
    main()
