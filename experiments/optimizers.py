"""Low-precision optimizer study: HALP vs SVRG vs LP-SGD (convex), SWALP (CNN).

(a) Convex: multinomial logistic regression with L2 on MNIST (the t10k set, split into
    train/validation; each row ``[pixels/255, 1]`` scaled to unit norm) or on
    scikit-learn digits. The optimum ``f*`` comes from scipy L-BFGS in float64 to a
    gradient norm of about 1e-10; every method's training loss is evaluated in
    float64 and its gap ``f(w) - f*`` is recorded after every epoch for SGD, SVRG,
    LP-SGD (8 bit), SWALP (the fp32 average of the LP-SGD iterates), LP-SVRG (8 bit)
    and HALP (8 bit). Writes ``convex.json``,
    ``convex.png`` (log scale) and a markdown table.
(b) CNN: a small conv net with BatchNorm; fp32 SGD vs LP-SGD vs SWALP (8-bit block
    float weights, gradients, momentum, activations and errors, stochastic rounding),
    test accuracy. SWALP's average is evaluated after recomputing the BatchNorm
    statistics. Writes ``swalp.json`` and a markdown table.

Usage:
  python experiments/optimizers.py --workdir=/tmp/opt --quick
  python experiments/optimizers.py --workdir=/tmp/opt --data_dir=../shared/datasets/mnist
"""
from __future__ import annotations

import functools
import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any

from absl import app, flags, logging

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import cpt_jax  # noqa: E402
from cpt_jax import data as cdata  # noqa: E402
from cpt_jax import optim  # noqa: E402
from cpt_jax.formats import BlockFloat, FixedPoint  # noqa: E402
from experiments import study_utils as su  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_string("workdir", None, "Output folder (json, png).", required=True)
flags.DEFINE_bool("quick", False, "Small budget (a few minutes on 2 CPU cores).")
flags.DEFINE_string("data_dir", "../shared/datasets/mnist",
                    "Folder with the MNIST t10k IDX files.")
flags.DEFINE_enum("dataset", None, ["mnist", "digits"],
                  "Dataset; default mnist when its files are in --data_dir, else digits.")
flags.DEFINE_integer("seed", 0, "Random seed.")
flags.DEFINE_enum("part", "all", ["all", "convex", "swalp"], "Which study to run.")
flags.DEFINE_integer("convex_epochs", None, "Epochs of the convex study (default 30, quick 12).")
flags.DEFINE_integer("cnn_epochs", None, "Epochs of the CNN study (default 15, quick 6).")
flags.DEFINE_integer("cnn_seeds", 1, "Seeds of the CNN study (seed, seed + 1, ...).")
flags.DEFINE_list("cnn_runs", ["sgd_fp32", "lp_sgd", "swalp"], "Runs of the CNN study.")
flags.DEFINE_float("l2", 1e-3, "L2 strength of the logistic regression.")
flags.DEFINE_float("lr", 4.0, "Step size of every convex method.")
flags.DEFINE_integer("batch_size", 16, "Minibatch size of the convex methods.")
flags.DEFINE_float("mu", 0.01, "HALP's mu (grid radius ||g~||/mu).")
flags.DEFINE_list("mu_sweep", None, "Extra HALP runs at these mu (default: none with "
                  "--quick, else 0.001,0.003,0.03,0.1).")
flags.DEFINE_integer("bits", 8, "Bits of the low-precision methods.")

NUM_VAL = {"mnist": 2000, "digits": 300}


# --------------------------------------------------------------------------- data

def load(dataset: str, data_dir: str, seed: int) -> cdata.ImageDataset:
    """MNIST t10k split into train/validation (stratified), or sklearn digits."""
    if dataset == "digits":
        return cdata.load_image_dataset("digits")
    ds = cdata.load_image_dataset("mnist", data_dir, splits=("test",))
    return cdata.split_dataset(ds, NUM_VAL["mnist"], seed, source="test")


def mnist_available(data_dir: str) -> bool:
    return any(os.path.exists(os.path.join(data_dir, f))
               for f in ("t10k-images-idx3-ubyte.gz", "t10k-images-idx3-ubyte"))


def features(images: np.ndarray, pixel_max: float) -> np.ndarray:
    """Rows ``[pixels / pixel_max, 1]`` scaled to unit 2-norm (float64)."""
    x = images.reshape(images.shape[0], -1).astype(np.float64) / pixel_max
    x = np.concatenate([x, np.ones((x.shape[0], 1))], axis=1)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


# --------------------------------------------------------------------------- convex

def loss64(w: np.ndarray, x: np.ndarray, y1h: np.ndarray, l2: float
           ) -> tuple[float, np.ndarray]:
    """Float64 multinomial logistic loss + (l2/2)||W||^2 and its gradient."""
    wm = w.reshape(x.shape[1], -1)
    z = x @ wm
    z -= z.max(axis=1, keepdims=True)
    lse = np.log(np.exp(z).sum(axis=1))
    p = np.exp(z - lse[:, None])
    loss = np.mean(lse - (z * y1h).sum(axis=1)) + 0.5 * l2 * np.sum(wm * wm)
    grad = x.T @ (p - y1h) / x.shape[0] + l2 * wm
    return float(loss), grad.ravel()


def solve_optimum(x: np.ndarray, y1h: np.ndarray, l2: float) -> tuple[np.ndarray, float, float]:
    """(w*, f*, ||grad f(w*)||) by scipy L-BFGS in float64, polished to ~1e-10."""
    import scipy.optimize

    res = scipy.optimize.minimize(
        loss64, np.zeros(x.shape[1] * y1h.shape[1]), args=(x, y1h, l2), jac=True,
        method="L-BFGS-B", options=dict(maxiter=50_000, maxfun=100_000, gtol=1e-14,
                                        ftol=1e-17, maxcor=50))
    return res.x.reshape(x.shape[1], -1), float(res.fun), float(np.linalg.norm(res.jac))


def make_loss(l2: float) -> Callable:
    def loss_fn(w, batch):
        xb, yb = batch
        logits = xb @ w
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, yb)
        return jnp.mean(ce) + 0.5 * l2 * jnp.sum(w * w)
    return loss_fn


def sgd_epoch_fn(loss_fn: Callable, opt: optax.GradientTransformation, n: int,
                 batch_size: int) -> Callable:
    """Jitted epoch of an optax optimizer: ``n // batch_size`` minibatch steps."""
    steps = n // batch_size
    grad_fn = jax.grad(loss_fn)

    @jax.jit
    def epoch(w, opt_state, data, key):
        idx = optim.minibatch_indices(key, n, batch_size, steps)

        def body(carry, i):
            w, s = carry
            batch = jax.tree_util.tree_map(lambda a: a[i], data)
            updates, s = opt.update(grad_fn(w, batch), s, w)
            return (optax.apply_updates(w, updates), s), None

        (w, opt_state), _ = jax.lax.scan(body, (w, opt_state), idx)
        return w, opt_state

    return epoch


def fixed_point_frac_bits(w_max: float, bits: int) -> int:
    """Largest f with range ``2^(bits-f-1) >= 2 w_max`` (the fixed LP grid)."""
    return int(np.floor(bits - 1 - np.log2(2.0 * w_max)))


def run_convex(ds: cdata.ImageDataset, *, epochs: int, l2: float, lr: float,
               batch_size: int, mu: float, bits: int, seed: int, workdir: str,
               mu_sweep: tuple[float, ...] = ()) -> dict[str, Any]:
    x64 = features(ds.train_images, ds.pixel_max)
    y = np.asarray(ds.train_labels)
    y1h = np.eye(ds.num_classes)[y]
    n = x64.shape[0]
    t0 = time.time()
    w_star, f_star, g_star = solve_optimum(x64, y1h, l2)
    logging.info("optimum: f*=%.12f |grad|=%.2e (%.1fs)", f_star, g_star, time.time() - t0)
    w_max = float(np.abs(w_star).max())
    frac = fixed_point_frac_bits(w_max, bits)

    data = (jnp.asarray(x64, jnp.float32), jnp.asarray(y, jnp.int32))
    loss_fn = make_loss(l2)
    gap = lambda w: max(loss64(np.asarray(w, np.float64), x64, y1h, l2)[0] - f_star,  # noqa
                        0.0)
    w0 = jnp.zeros((x64.shape[1], ds.num_classes), jnp.float32)
    key = jax.random.PRNGKey(seed)

    epoch_fns = convex_methods(loss_fn, n=n, lr=lr, batch_size=batch_size, mu=mu, bits=bits,
                               frac=frac, seed=seed, mu_sweep=mu_sweep)
    gaps: dict[str, list[float]] = {}
    seconds: dict[str, float] = {}
    for name, (kind, fn, opt) in epoch_fns.items():
        w = w0
        state = opt.init(w0) if opt is not None else None
        out = []
        t0 = time.time()
        for e in range(epochs):
            k = jax.random.fold_in(key, e)
            if kind == "optax":
                w, state = fn(w, state, data, k)
            else:
                w = fn(w, data, k)
            if name == "swalp" and int(optim.swa_count(state)) > 0:
                out.append(gap(optim.swa_params(state)))  # the average, not the iterate
            else:
                out.append(gap(w))
        seconds[name] = time.time() - t0
        gaps[name] = out
        logging.info("%s: gaps %s (%.1fs)", name, [f"{g:.2e}" for g in out], seconds[name])

    result = dict(
        dataset=ds.name, num_train=n, dim=int(x64.shape[1]), num_classes=ds.num_classes,
        l2=l2, lr=lr, batch_size=batch_size, mu=mu, bits=bits, epochs=epochs, seed=seed,
        f_star=f_star, grad_norm_at_optimum=g_star, w_star_max_abs=w_max,
        fixed_grid_frac_bits=frac, seconds=seconds,
        gaps={k: v for k, v in gaps.items() if not k.startswith("halp_mu=")},
        halp_mu_sweep={k[len("halp_mu="):]: v for k, v in gaps.items()
                       if k.startswith("halp_mu=")})
    if mu_sweep:
        result["halp_mu_sweep"][f"{mu:g}"] = gaps["halp"]
    write_convex(result, workdir)
    return result


def convex_methods(loss_fn, *, n: int, lr: float, batch_size: int, mu: float, bits: int,
                   frac: int, seed: int, mu_sweep: tuple[float, ...] = ()) -> dict[str, tuple]:
    """``{name: (kind, epoch function, optax optimizer or None)}`` of the convex study:
    SGD, SVRG, LP-SGD and SWALP on the fixed grid ``2^-frac``, LP-SVRG, HALP (and
    HALP at each mu of `mu_sweep`)."""
    sgd = optax.sgd(lr)
    lpsgd = optim.lp_sgd(lr, 0.0, weight_bits=bits, weight_fmt=FixedPoint(frac),
                         grad_bits=None, momentum_bits=None, seed=seed)
    # SWALP on the convex problem: the same LP-SGD, its iterates averaged (fp32) at
    # every step from the end of epoch 1.
    swalp = optim.swa(lpsgd, swa_start=n // batch_size, swa_freq=1)
    epoch_fns = {
        "sgd": ("optax", sgd_epoch_fn(loss_fn, sgd, n, batch_size), sgd),
        "svrg": ("epoch", optim.svrg(loss_fn, learning_rate=lr, batch_size=batch_size), None),
        "lp_sgd": ("optax", sgd_epoch_fn(loss_fn, lpsgd, n, batch_size), lpsgd),
        "swalp": ("optax", sgd_epoch_fn(loss_fn, swalp, n, batch_size), swalp),
        "lp_svrg": ("epoch", optim.lp_svrg(loss_fn, learning_rate=lr, batch_size=batch_size,
                                           scale=2.0 ** -frac, bits=bits), None),
        "halp": ("epoch", optim.halp(loss_fn, learning_rate=lr, batch_size=batch_size,
                                     mu=mu, bits=bits), None),
    }
    for m in mu_sweep:
        epoch_fns[f"halp_mu={m:g}"] = ("epoch", optim.halp(
            loss_fn, learning_rate=lr, batch_size=batch_size, mu=m, bits=bits), None)
    return epoch_fns


def write_convex(result: dict[str, Any], workdir: str) -> None:
    """``convex.json``, ``convex.png`` and (with a mu sweep) ``convex_mu.png``."""
    with open(os.path.join(workdir, "convex.json"), "w") as f:
        json.dump(result, f, indent=1)
    bits, lr, l2 = result["bits"], result["lr"], result["l2"]
    plot_convex(result["gaps"], os.path.join(workdir, "convex.png"),
                title=f"{result['dataset']} logistic regression, L2={l2:g}, {bits}-bit")
    if result["halp_mu_sweep"]:
        plot_convex({f"HALP mu={k}": v for k, v in sorted(
            result["halp_mu_sweep"].items(), key=lambda kv: float(kv[0]))},
            os.path.join(workdir, "convex_mu.png"),
            title=f"HALP {bits}-bit: effect of mu (lr={lr:g}, L2={l2:g})")


def plot_convex(gaps: dict[str, list[float]], path: str, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = {"sgd": "SGD (fp32)", "svrg": "SVRG (fp32)", "lp_sgd": "LP-SGD",
              "swalp": "SWALP (average of LP-SGD)", "lp_svrg": "LP-SVRG", "halp": "HALP"}
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, g in gaps.items():
        ax.semilogy(np.arange(1, len(g) + 1), np.maximum(g, 1e-17), marker=".",
                    label=labels.get(name, name))
    ax.set_xlabel("epoch")
    ax.set_ylabel("training loss - f*")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def convex_table(result: dict[str, Any]) -> str:
    gaps = dict(result["gaps"])
    gaps.update({f"halp mu={k}": v for k, v in result.get("halp_mu_sweep", {}).items()
                 if float(k) != result["mu"]})
    epochs = result["epochs"]
    cols = sorted({1, max(1, epochs // 4), max(1, epochs // 2), epochs})
    lines = ["| method | " + " | ".join(f"gap @ epoch {c}" for c in cols) + " | seconds |",
             "|---|" + "---|" * (len(cols) + 1)]
    for name, g in gaps.items():
        lines.append(f"| {name} | " + " | ".join(f"{g[c - 1]:.2e}" for c in cols)
                     + f" | {result['seconds'].get(name.replace(' ', '_'), 0.0):.1f} |")
    return "\n".join(lines)


# --------------------------------------------------------------------------- CNN / SWALP

class CNN(nn.Module):
    """conv3x3(16)-BN-ReLU-pool, conv3x3(32)-BN-ReLU-pool, Dense(10)."""

    num_classes: int = 10

    @nn.compact
    def __call__(self, x, train: bool = False):
        for i, f in enumerate((16, 32)):
            x = nn.Conv(f, (3, 3), padding="SAME", use_bias=False, name=f"conv{i}")(x)
            x = nn.BatchNorm(use_running_average=not train, momentum=0.9, name=f"bn{i}")(x)
            x = nn.relu(x)
            if x.shape[1] >= 2:
                x = nn.max_pool(x, (2, 2), strides=(2, 2))
        return nn.Dense(self.num_classes, name="classifier")(x.reshape((x.shape[0], -1)))


LP_CONFIG = cpt_jax.QuantConfig(
    weight=None,  # the optimizer keeps the weights on the 8-bit grid
    activation=cpt_jax.TensorQuant(BlockFloat(channel_axis=0), "stochastic"),
    error=cpt_jax.TensorQuant(BlockFloat(channel_axis=0), "stochastic"))
"""SWALP's activations and errors: 8-bit block float, one exponent per example."""


def swa_lr_schedule(lr0: float, ratio: float, budget_steps: int) -> optax.Schedule:
    """SWA's schedule: lr0 for 50% of the budget, linear to ratio*lr0 at 90%, then flat."""
    def schedule(step):
        t = step / budget_steps
        factor = jnp.where(t <= 0.5, 1.0,
                           jnp.where(t <= 0.9, 1.0 - (1.0 - ratio) * (t - 0.5) / 0.4, ratio))
        return lr0 * factor
    return schedule


def lp_forward(m, lp: bool, params, stats, x, train: bool, rng, *, bits: int):
    """``m.apply`` (BatchNorm statistics mutable in training), under
    ``precision(bits, bits, rng)`` when `lp`."""
    v = {"params": params, "batch_stats": stats}
    if lp:
        with cpt_jax.precision(bits, bits, rng=rng):
            return m.apply(v, x, train=train, mutable=["batch_stats"] if train else [])
    return m.apply(v, x, train=train, mutable=["batch_stats"] if train else [])


def heldout_metrics(forward, prep, data, num_test: int) -> dict[str, float]:
    """Test accuracy and mean negative log-likelihood of ``forward(x, train, rng)``."""
    @jax.jit
    def sums(x, yb, mask):
        logits, _ = forward(prep(x), False, jax.random.PRNGKey(1))
        nll = optax.softmax_cross_entropy_with_integer_labels(logits, yb)
        return (jnp.sum((jnp.argmax(logits, -1) == yb) * mask), jnp.sum(nll * mask))
    correct = nll = 0.0
    for xb, yb, mask in cdata.eval_batches(data.test_images, data.test_labels, 500):
        c, l = sums(xb, yb, mask)
        correct, nll = correct + float(c), nll + float(l)
    return dict(test_acc=correct / num_test, test_nll=nll / num_test)


def swalp_study_runs(model, lp_model, *, bits: int, lr0: float, swa_lr: float, total: int,
                     swa_start: int, steps_per_epoch: int, weight_decay: float,
                     seed: int) -> dict[str, tuple]:
    """``{name: (model, optimizer, low precision?)}``: SGD fp32, LP-SGD and SWALP at
    `bits` (weights, gradients, momentum), SWA's learning-rate schedule."""
    q8 = dict(weight_bits=bits, grad_bits=bits, momentum_bits=bits)
    return {
        "sgd_fp32": (model, optax.chain(optax.add_decayed_weights(weight_decay),
                                        optax.sgd(swa_lr_schedule(lr0, 0.01, total), 0.9)),
                     False),
        "lp_sgd": (lp_model, optim.lp_sgd(swa_lr_schedule(lr0, 0.01, total), 0.9,
                                          weight_decay=weight_decay, seed=seed, **q8), True),
        "swalp": (lp_model, optim.swalp(swa_lr_schedule(lr0, swa_lr / lr0, swa_start), 0.9,
                                        swa_start=swa_start, swa_freq=steps_per_epoch,
                                        swa_lr=swa_lr, weight_decay=weight_decay, bits=bits,
                                        seed=seed),
                  True),
    }


def swalp_average_results(evaluate, bn_apply, opt_state, stats, batches,
                          bits: int) -> dict[str, Any]:
    """The SWALP average evaluated three ways: BN recomputed (`recompute_batch_stats`),
    BN not recomputed, and quantized to `bits`-bit block float (BN recomputed).
    `evaluate(params, batch_stats)` returns the test metrics."""
    avg = optim.swa_params(opt_state)
    avg_stats = optim.recompute_batch_stats(bn_apply, {"params": avg, "batch_stats": stats},
                                            batches)
    avg_q = optim.quantize_tree(avg, bits, BlockFloat(), rounding="nearest")
    q_stats = optim.recompute_batch_stats(bn_apply, {"params": avg_q, "batch_stats": stats},
                                          batches)
    return {"swalp_average": dict(evaluate(avg, avg_stats),
                                  n_averaged=int(optim.swa_count(opt_state))),
            "swalp_average_no_bn_update": evaluate(avg, stats),
            "swalp_average_q8": evaluate(avg_q, q_stats)}


def run_swalp(ds: cdata.ImageDataset, *, epochs: int, seed: int, bits: int,
              runs_to_do: tuple[str, ...] = ("sgd_fp32", "lp_sgd", "swalp"),
              batch_size: int = 64, lr0: float = 0.02, swa_lr: float = 0.01,
              weight_decay: float = 5e-4) -> dict[str, Any]:
    data = cdata.to_device(ds)
    n = ds.num_train
    steps = n // batch_size
    total = epochs * steps
    swa_start_epoch = max(1, int(round(0.6 * epochs)))
    swa_start = swa_start_epoch * steps
    model = CNN(ds.num_classes)
    lp_model = cpt_jax.quantize_model(model, config=LP_CONFIG)
    key = jax.random.PRNGKey(seed)
    x0 = jnp.zeros((1,) + ds.image_shape, jnp.float32)
    variables = model.init(key, x0)

    def prep(images):
        return cdata.normalize(images, data.mean, data.std, ds.pixel_max)

    runs = swalp_study_runs(model, lp_model, bits=bits, lr0=lr0, swa_lr=swa_lr, total=total,
                            swa_start=swa_start, steps_per_epoch=steps,
                            weight_decay=weight_decay, seed=seed)

    forward = functools.partial(lp_forward, bits=bits)

    def evaluate(m, lp, params, stats) -> dict[str, float]:
        return heldout_metrics(functools.partial(forward, m, lp, params, stats), prep, data,
                            ds.num_test)

    unknown = set(runs_to_do) - set(runs)
    if unknown:
        raise ValueError(f"cnn_runs must be a subset of {sorted(runs)}, got {sorted(unknown)}")
    results: dict[str, Any] = {}
    for name, (m, opt, lp) in runs.items():
        if name not in runs_to_do:
            continue
        params, stats = variables["params"], variables["batch_stats"]
        opt_state = opt.init(params)

        @jax.jit
        def train_step(params, stats, opt_state, step, m=m, lp=lp, opt=opt):
            images, labels = cdata.batch_at_step(data, step, jax.random.fold_in(key, 7),
                                                 batch_size=batch_size, augment=False)

            def loss_fn(p):
                logits, mut = forward(m, lp, p, stats, images, True,
                                      jax.random.fold_in(key, step))
                ce = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
                return ce, mut["batch_stats"]

            (loss, new_stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
            updates, opt_state = opt.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), new_stats, opt_state, loss

        t0 = time.time()
        for step in range(total):
            params, stats, opt_state, loss = train_step(params, stats, opt_state, step)
        seconds = time.time() - t0
        results[name] = dict(evaluate(m, lp, params, stats), final_batch_loss=float(loss),
                             seconds=seconds)
        logging.info("%s: %s", name, results[name])
        if name == "swalp":
            def bn_apply(v, x, m=m, lp=lp):
                _, mut = forward(m, lp, v["params"], v["batch_stats"], prep(x), True,
                                 jax.random.PRNGKey(2))
                return mut["batch_stats"]

            batches = [data.train_images[i * batch_size:(i + 1) * batch_size]
                       for i in range(steps)]
            results.update(swalp_average_results(
                lambda p, st, m=m, lp=lp: evaluate(m, lp, p, st), bn_apply, opt_state, stats,
                batches, bits))
    return dict(dataset=ds.name, num_train=n, num_test=ds.num_test, epochs=epochs,
                swa_start_epoch=swa_start_epoch, batch_size=batch_size, lr0=lr0,
                swa_lr=swa_lr, weight_decay=weight_decay, bits=bits, seed=seed,
                results=results)


SWALP_NAMES = {
    "sgd_fp32": "SGD fp32 (last iterate)",
    "lp_sgd": "LP-SGD {b}-bit (last iterate)",
    "swalp": "SWALP run, last LP iterate",
    "swalp_average": "SWALP average (fp32 avg, BN recomputed)",
    "swalp_average_no_bn_update": "SWALP average, BN not recomputed",
    "swalp_average_q8": "SWALP average quantized to {b}-bit BFP (BN recomputed)",
}


def summarize_swalp(per_seed: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Mean and standard deviation over seeds of test accuracy and NLL per model."""
    out = {}
    for name in per_seed[0]["results"]:
        acc = np.array([r["results"][name]["test_acc"] for r in per_seed])
        nll = np.array([r["results"][name]["test_nll"] for r in per_seed])
        out[name] = dict(acc_mean=float(acc.mean()), acc_std=float(acc.std()),
                         nll_mean=float(nll.mean()), nll_std=float(nll.std()),
                         accs=acc.tolist())
    return out


def swalp_table(summary: dict[str, dict[str, float]], num_seeds: int, bits: int) -> str:
    lines = [f"| model | test accuracy (%) | test NLL | accuracy per seed ({num_seeds}) |",
             "|---|---|---|---|"]
    for k, v in summary.items():
        seeds = ", ".join(f"{100 * a:.2f}" for a in v["accs"])
        acc = su.pm(100 * v["acc_mean"], 100 * v["acc_std"], 2, n=len(v["accs"]))
        nll = su.pm(v["nll_mean"], v["nll_std"], 4, n=len(v["accs"]))
        lines.append(f"| {SWALP_NAMES.get(k, k).format(b=bits)} | {acc} | {nll} | {seeds} |")
    return "\n".join(lines)


# --------------------------------------------------------------------------- main

def main(argv):
    del argv
    os.makedirs(FLAGS.workdir, exist_ok=True)
    dataset = FLAGS.dataset or ("mnist" if mnist_available(FLAGS.data_dir) else "digits")
    ds = load(dataset, FLAGS.data_dir, FLAGS.seed)
    print(f"dataset {dataset}: {ds.num_train} train / {ds.num_test} validation")
    if FLAGS.part in ("all", "convex"):
        epochs = FLAGS.convex_epochs or (10 if FLAGS.quick else 25)
        sweep = FLAGS.mu_sweep
        if sweep is None:
            sweep = [] if FLAGS.quick else ["0.001", "0.003", "0.03", "0.1"]
        res = run_convex(ds, epochs=epochs, l2=FLAGS.l2, lr=FLAGS.lr,
                         batch_size=FLAGS.batch_size, mu=FLAGS.mu, bits=FLAGS.bits,
                         seed=FLAGS.seed, workdir=FLAGS.workdir,
                         mu_sweep=tuple(float(m) for m in sweep))
        print(f"\n## Convex: training-loss gap f(w) - f* (f* = {res['f_star']:.10f}, "
              f"L2 = {res['l2']:g}, lr = {res['lr']:g}, batch {res['batch_size']}, "
              f"mu = {res['mu']:g}, {res['bits']} bits, fixed grid 2^-"
              f"{res['fixed_grid_frac_bits']})\n")
        print(convex_table(res))
    if FLAGS.part in ("all", "swalp"):
        epochs = FLAGS.cnn_epochs or (6 if FLAGS.quick else 15)
        cnn_ds = ds
        if FLAGS.quick and ds.name == "mnist":
            cnn_ds = ds.replace(train_images=ds.train_images[:3000],
                                train_labels=ds.train_labels[:3000])
        seeds = [FLAGS.seed + i for i in range(FLAGS.cnn_seeds)]
        per_seed = [run_swalp(cnn_ds, epochs=epochs, seed=s, bits=FLAGS.bits,
                              runs_to_do=tuple(FLAGS.cnn_runs)) for s in seeds]
        summary = summarize_swalp(per_seed)
        first = per_seed[0]
        with open(os.path.join(FLAGS.workdir, "swalp.json"), "w") as f:
            json.dump(dict(seeds=seeds, summary=summary, runs=per_seed), f, indent=1)
        print(f"\n## SWALP: {first['dataset']} small CNN ({first['num_train']} train / "
              f"{first['num_test']} test), {first['epochs']} epochs, averaging every epoch "
              f"from epoch {first['swa_start_epoch']}, {FLAGS.bits}-bit, seeds {seeds}\n")
        print(swalp_table(summary, len(seeds), FLAGS.bits))


if __name__ == "__main__":
    app.run(main)
