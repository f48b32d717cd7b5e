"""Decentralized low-precision training (Aketi, Kodge, Roy 2022) at CPU budget.

    python -m experiments.decentralized --workdir=/tmp/dec --quick            # digits, ~15 min
    python -m experiments.decentralized --workdir=/tmp/dec_cifar \\
        --data_dir=../shared/datasets/cifar10 --seeds=0,1          # CIFAR-10 subset, ResNet-20

P peers (default 8, one per device: on CPU the script sets
``XLA_FLAGS=--xla_force_host_platform_device_count=P`` before importing jax; the
same code runs on a TPU v2-8/v3-8 or 8 GPUs) on a ring, local Nesterov SGD, gossip
with weight 1/3 (`cpt_jax.distributed.gossip`). The grid: data IID (skew 0) vs label skew
0.8 (`cpt_jax.data.peers`), fp32 vs 8-bit training (8-bit forward and errors, traced,
with int8 CHOCO communication), BatchNorm vs Range-EvoNorm (hard sigmoid at 8 bits),
over ``--seeds``.

Writes to WORKDIR:

* ``results.json``: a list with one record per run (``peers``, ``skew``, ``bits``, ``norm``,
  ``seed``, ``final_test_accuracy`` = mean over peers of each peer's own model,
  ``final_test_accuracy_avg_model`` = the peers' average model, ``bytes_sent`` =
  total over all peers and steps, ``relative_compute_cost`` vs fp32, consensus
  distance, and the curves);
* ``results.md`` / ``results.csv``: mean +- std over seeds per setting, and the
  paper's claims checked (8-bit minus fp32; Range-EvoNorm minus BatchNorm);
* ``accuracy.png``, ``consensus.png``: test accuracy and consensus distance over steps;
* ``settings.json``: the study's settings; ``runs/<name>.json``: each run, reloaded
  (not trained again) when the script is rerun with the same settings.

``--quick``: digits (offline), SmallCNN (16, 32), 300 steps, batch 16 per peer.
Otherwise: CIFAR-10 (``--data_dir``, ``--train_subset`` examples), ResNet-20; or any
image dataset of `cpt_jax.data` (``--dataset=fashion_mnist --model=cnn``).
"""
from __future__ import annotations

import os
import sys


def _peers_from_argv(argv, default: int = 8) -> int:
    for i, arg in enumerate(argv):
        if arg.startswith("--peers="):
            return int(arg.split("=", 1)[1])
        if arg == "--peers" and i + 1 < len(argv):
            return int(argv[i + 1])
    return default


def _ensure_host_devices(n: int) -> None:
    """Simulate n CPU devices unless XLA_FLAGS already sets a count (before jax import)."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()


if "jax" not in sys.modules:
    _ensure_host_devices(_peers_from_argv(sys.argv))

import csv  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402
from absl import app, flags, logging  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_string("workdir", None, "Output directory.")
flags.DEFINE_bool("quick", False, "Digits + SmallCNN, 300 steps (minutes on CPU).")
flags.DEFINE_string("seeds", "0,1,2", "Comma-separated seeds.")
flags.DEFINE_string("data_dir", "", "Local dataset folder (CIFAR-10 .npz/pickle files).")
flags.DEFINE_string("dataset", None, "digits | cifar10 (default: digits with --quick, else "
                    "cifar10).")
flags.DEFINE_integer("peers", 8, "Number of peers (one per device).")
flags.DEFINE_integer("steps", 0, "Training steps (0: 300 quick, 2000 otherwise).")
flags.DEFINE_integer("batch_size", 0, "Batch per peer (0: 16 quick, 32 otherwise).")
flags.DEFINE_float("learning_rate", 0.0, "Peak lr, cosine decay (0: 0.05 quick, 0.1 "
                   "otherwise).")
flags.DEFINE_float("weight_decay", 5e-4, "L2 weight decay.")
flags.DEFINE_string("skews", "0,0.8", "Label skews (partition=label_skew).")
flags.DEFINE_string("bits", "32,8", "Training bit-widths: 32 (fp32) and/or b < 32.")
flags.DEFINE_string("norms", "batch,range_evonorm", "Norms: batch, evonorm, range_evonorm.")
flags.DEFINE_enum("partition", "label_skew", ["label_skew", "dirichlet"], "Non-IID scheme.")
flags.DEFINE_string("alphas", "0.1,1", "Dirichlet alphas (partition=dirichlet).")
flags.DEFINE_enum("low_bits_compression", "int8", ["none", "int8", "topk"],
                  "What low-precision runs send (fp32 runs send fp32 parameters).")
flags.DEFINE_float("topk_fraction", 0.1, "Kept fraction for topk compression.")
flags.DEFINE_float("gamma", 1.0, "CHOCO consensus step size for compressed gossip.")
flags.DEFINE_string("model", "", "cnn | resnet20 | ... (default: cnn quick, resnet20 else).")
flags.DEFINE_string("cnn_features", "16,32", "Channels of the SmallCNN blocks (model=cnn).")
flags.DEFINE_integer("train_subset", 10000, "Training examples used, the first N of the "
                     "train split (0: all; digits always uses all 1497).")
flags.DEFINE_integer("test_subset", 2000, "Test examples evaluated (0: all).")
flags.DEFINE_integer("eval_every", 0, "Evaluate every N steps (0: steps // 6).")
flags.DEFINE_integer("log_every", 0, "Consensus distance every N steps (0: steps // 30).")


def _ints(text: str, name: str) -> list[int]:
    try:
        out = [int(p) for p in text.split(",") if p.strip()]
    except ValueError:
        raise ValueError(f"--{name} must be comma-separated integers, got {text!r}") from None
    if not out:
        raise ValueError(f"--{name} is empty")
    return out


def _floats(text: str, name: str) -> list[float]:
    try:
        out = [float(p) for p in text.split(",") if p.strip()]
    except ValueError:
        raise ValueError(f"--{name} must be comma-separated numbers, got {text!r}") from None
    if not out:
        raise ValueError(f"--{name} is empty")
    return out


def settings_from_flags() -> dict[str, Any]:
    """Every setting of the study (flags with the quick/full defaults filled in)."""
    quick = FLAGS.quick
    dataset = FLAGS.dataset or ("digits" if quick else "cifar10")
    s = {
        "quick": quick, "dataset": dataset, "data_dir": FLAGS.data_dir,
        "peers": FLAGS.peers,
        "steps": FLAGS.steps or (300 if quick else 2000),
        "batch_size": FLAGS.batch_size or (16 if quick else 32),
        "learning_rate": FLAGS.learning_rate or (0.05 if quick else 0.1),
        "weight_decay": FLAGS.weight_decay,
        "model": FLAGS.model or ("cnn" if dataset in ("digits", "mnist", "fashion_mnist")
                                 else "resnet20"),
        "partition": FLAGS.partition,
        "skews": _floats(FLAGS.skews, "skews"),
        "alphas": _floats(FLAGS.alphas, "alphas"),
        "bits": _ints(FLAGS.bits, "bits"),
        "norms": [n.strip() for n in FLAGS.norms.split(",") if n.strip()],
        "seeds": _ints(FLAGS.seeds, "seeds"),
        "low_bits_compression": FLAGS.low_bits_compression,
        "topk_fraction": FLAGS.topk_fraction, "gamma": FLAGS.gamma,
        "cnn_features": _ints(FLAGS.cnn_features, "cnn_features"),
        "train_subset": FLAGS.train_subset if dataset != "digits" else 0,
        "test_subset": FLAGS.test_subset,
    }
    s["eval_every"] = FLAGS.eval_every or max(1, s["steps"] // 6)
    s["log_every"] = FLAGS.log_every or max(1, s["steps"] // 30)
    for b in s["bits"]:
        if not 2 <= b <= 32:
            raise ValueError(f"--bits values must be in [2, 32], got {b}")
    for skew in s["skews"]:
        if not 0.0 <= skew < 1.0:
            raise ValueError(f"--skews values must be in [0, 1), got {skew}")
    return s


# --------------------------------------------------------------------------- one run

class _Study:
    """Data, models and compiled functions shared by the runs of a study."""

    def __init__(self, s: dict[str, Any]):
        import jax

        from cpt_jax.data.image import load_image_dataset
        from cpt_jax.distributed import gossip as dec

        self.s = s
        if jax.device_count() < s["peers"]:
            raise ValueError(
                f"--peers={s['peers']} needs {s['peers']} devices, found {jax.device_count()} "
                f"(on CPU run with XLA_FLAGS=--xla_force_host_platform_device_count="
                f"{s['peers']})")
        self.mesh = dec.make_peer_mesh(s["peers"])
        data_dir = s["data_dir"] or None
        ds = load_image_dataset(s["dataset"], data_dir,
                                allow_partial=s["dataset"].startswith("cifar"))
        train_images, train_labels = np.asarray(ds.train_images), np.asarray(ds.train_labels)
        if s["train_subset"] and s["train_subset"] < len(train_labels):
            train_images = train_images[:s["train_subset"]]
            train_labels = train_labels[:s["train_subset"]]
        test_images, test_labels = np.asarray(ds.test_images), np.asarray(ds.test_labels)
        if s["test_subset"] and s["test_subset"] < len(test_labels):
            test_images = test_images[:s["test_subset"]]
            test_labels = test_labels[:s["test_subset"]]
        self.ds = ds
        self.train = (train_images, train_labels)
        self.test = (test_images, test_labels)
        self.augment = s["dataset"].startswith("cifar")
        self._compiled: dict[Any, Any] = {}

    def setting_name(self, bits: int, norm: str, key: str, seed: int) -> str:
        return f"b{bits}_{norm}_{key}_seed{seed}"

    def functions(self, bits: int, norm: str):
        """(qmodel, optimizer, step, peer_eval, eval_step, compression, ops) per (bits, norm)."""
        if (bits, norm) in self._compiled:
            return self._compiled[(bits, norm)]
        import optax

        from cpt_jax import CPT_RULES, quantize_model, schedules
        from cpt_jax.distributed import gossip as dec
        from cpt_jax.models import get_model, make_norm
        from cpt_jax.training import make_eval_step

        s = self.s
        low = bits < 32
        norm_spec = make_norm(norm, hard_sigmoid=low and norm in ("evonorm", "range_evonorm"))
        kwargs = {"norm": norm_spec}
        if s["model"] == "cnn":
            kwargs["features"] = tuple(s["cnn_features"])
        model = get_model(s["model"], num_classes=self.ds.num_classes, **kwargs)
        qmodel = quantize_model(model, rules=CPT_RULES)
        lr = optax.cosine_decay_schedule(s["learning_rate"], s["steps"])
        tx = optax.chain(optax.add_decayed_weights(s["weight_decay"]),
                         optax.sgd(lr, momentum=0.9, nesterov=True))
        if low:
            kind = s["low_bits_compression"]
            compression = dec.Compression(kind, bits=min(8, bits),
                                          fraction=s["topk_fraction"], gamma=s["gamma"])
            fwd, grad = schedules.constant(bits), schedules.constant(bits)
        else:
            compression, fwd, grad = dec.Compression("none"), None, None
        step = dec.make_decentralized_step(qmodel, tx, self.mesh, fwd, grad,
                                           compression=compression)
        eval_step = make_eval_step(qmodel)
        out = (qmodel, tx, step, dec.make_peer_eval(eval_step), eval_step, compression)
        self._compiled[(bits, norm)] = out
        return out

    def test_batches(self):
        import jax.numpy as jnp

        from cpt_jax.data.image import eval_batches, normalize

        images, labels = self.test
        for x, y, m in eval_batches(images, labels, 500):
            yield {"inputs": normalize(jnp.asarray(x), self.ds.mean, self.ds.std,
                                       self.ds.pixel_max),
                   "labels": jnp.asarray(y, jnp.int32), "mask": jnp.asarray(m)}

    def evaluate(self, state, peer_eval, eval_step, eval_bits) -> dict[str, float]:
        """Test accuracy of every peer (mean, min, max) and of the peers' average model."""
        import jax

        from cpt_jax.distributed import gossip as dec

        sums = [jax.device_get(peer_eval(state.train, b, eval_bits))
                for b in self.test_batches()]
        correct = sum(np.asarray(x["correct"], np.float64) for x in sums)
        count = sum(np.asarray(x["count"], np.float64) for x in sums)
        per_peer = correct / np.maximum(count, 1)
        avg = dec.averaged_train_state(state.train)
        avg_sums = [jax.device_get(eval_step(avg, b, eval_bits)) for b in self.test_batches()]
        avg_acc = (sum(float(x["correct"]) for x in avg_sums)
                   / max(sum(float(x["count"]) for x in avg_sums), 1))
        return {"test_accuracy": float(per_peer.mean()),
                "test_accuracy_min": float(per_peer.min()),
                "test_accuracy_max": float(per_peer.max()),
                "test_accuracy_avg_model": avg_acc}

    def run(self, bits: int, norm: str, split: dict[str, Any], seed: int) -> dict[str, Any]:
        import jax
        import jax.numpy as jnp

        from cpt_jax import cost as cost_lib
        from cpt_jax.data import peers as part
        from cpt_jax.distributed import gossip as dec

        s = self.s
        qmodel, tx, step, peer_eval, eval_step, compression = self.functions(bits, norm)
        t0 = time.time()
        images, labels = self.train
        parts = part.partition(labels, s["peers"], split["kind"], skew=split.get("skew", 0.0),
                               alpha=split.get("alpha", 0.5), seed=seed,
                               num_classes=self.ds.num_classes, min_examples=s["batch_size"])
        summary = part.partition_summary(labels, parts, self.ds.num_classes)
        data = part.make_peer_image_data(images, labels, parts, self.ds.mean, self.ds.std,
                                        self.ds.pixel_max, self.mesh)
        key = jax.random.key(seed)
        init_key, data_key = jax.random.split(key)
        sample = jnp.zeros((s["batch_size"],) + tuple(images.shape[1:]), jnp.float32)
        state = dec.init_peer_state(qmodel, tx, init_key, sample, s["peers"], compression,
                                    train=False)
        one_peer = jax.tree_util.tree_map(lambda x: x[0], state.train)
        ops = cost_lib.count_ops(qmodel, one_peer.variables(), sample, train=False)
        rel_cost = (1.0 if bits >= 32 else
                    float(cost_lib.relative_cost_per_step(ops, float(bits), float(bits))))
        bytes_per_peer_step = dec.gossip_bytes_per_step(one_peer.params, compression, s["peers"])
        state = dec.shard_peers(state, self.mesh)
        eval_bits = jnp.float32(min(bits, 32))
        history: list[dict[str, float]] = []

        losses = []
        for t in range(s["steps"]):
            batch = part.peer_batch_at_step(data, t, data_key, batch_size=s["batch_size"],
                                           augment=self.augment)
            state, metrics = step(state, batch)
            done = t + 1
            if done % s["log_every"] == 0 or done == s["steps"]:
                rec = {"step": done, "loss": float(np.mean(jax.device_get(metrics["loss"]))),
                       "consensus_distance": float(dec.consensus_distance(state.params))}
                if done % s["eval_every"] == 0 or done == s["steps"]:
                    rec.update(self.evaluate(state, peer_eval, eval_step, eval_bits))
                history.append(rec)
                losses.append(rec["loss"])
                if not math.isfinite(rec["loss"]):
                    logging.warning("non-finite loss at step %d", done)
        final = history[-1]
        skipped = int(np.sum(jax.device_get(state.train.skipped_steps)))
        return {
            "peers": s["peers"], "skew": split.get("skew"), "alpha": split.get("alpha"),
            "partition": split["kind"], "bits": bits, "norm": norm, "seed": seed,
            "dataset": s["dataset"], "model": s["model"], "steps": s["steps"],
            "batch_size_per_peer": s["batch_size"],
            "compression": compression.kind,
            "final_test_accuracy": final["test_accuracy"],
            "final_test_accuracy_min_peer": final["test_accuracy_min"],
            "final_test_accuracy_max_peer": final["test_accuracy_max"],
            "final_test_accuracy_avg_model": final["test_accuracy_avg_model"],
            "final_consensus_distance": final["consensus_distance"],
            "final_train_loss": final["loss"],
            "bytes_sent": int(bytes_per_peer_step) * s["peers"] * s["steps"],
            "bytes_sent_per_peer_step": int(bytes_per_peer_step),
            "relative_compute_cost": rel_cost,
            "skipped_steps": skipped,
            "num_compiles": step.num_compiles,
            "examples_per_peer": summary["sizes"],
            "top_class_fraction": summary["top_class_fraction"],
            "wall_time_s": round(time.time() - t0, 1),
            "history": history,
        }


# --------------------------------------------------------------------------- reporting

_KEYS = ("partition", "skew", "alpha", "bits", "norm")


def _group(records: list[dict[str, Any]]):
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for r in records:
        groups.setdefault(tuple(r.get(k) for k in _KEYS), []).append(r)
    return groups


def _ms(values) -> str:
    v = np.asarray(values, np.float64) * 100
    if v.size < 2:   # one seed: no spread to state (``± 0.0`` would claim one)
        return f"{v.mean():.1f} (n={v.size})"
    return f"{v.mean():.1f} ± {v.std(ddof=1):.1f}"


def _split_label(key) -> str:
    kind, skew, alpha = key[0], key[1], key[2]
    if kind == "dirichlet":
        return f"Dir({alpha:g})"
    return "IID" if not skew else f"skew {skew:g}"


def write_report(records: list[dict[str, Any]], workdir: str, s: dict[str, Any]) -> str:
    """results.md / results.csv (mean ± std over seeds) and the two plots."""
    groups = _group(records)
    rows = []
    for key, rs in sorted(groups.items(), key=lambda kv: tuple(str(x) for x in kv[0])):
        rows.append({
            "data": _split_label(key), "bits": key[3], "norm": key[4], "seeds": len(rs),
            "acc": _ms([r["final_test_accuracy"] for r in rs]),
            "acc_avg_model": _ms([r["final_test_accuracy_avg_model"] for r in rs]),
            "acc_mean": float(np.mean([r["final_test_accuracy"] for r in rs])),
            "acc_std": float(np.std([r["final_test_accuracy"] for r in rs], ddof=1))
            if len(rs) > 1 else 0.0,
            "consensus": float(np.mean([r["final_consensus_distance"] for r in rs])),
            "mb_sent": rs[0]["bytes_sent"] / 1e6,
            "cost": rs[0]["relative_compute_cost"],
            "key": key})
    lines = [
        f"# Decentralized training: {s['peers']} peers on a ring, {s['dataset']}, "
        f"{s['model']}, {s['steps']} steps, batch {s['batch_size']}/peer",
        "",
        "Accuracy: % on the test set, mean ± std over seeds "
        f"({', '.join(map(str, s['seeds']))}); 'peers' = mean over peers of each peer's own "
        "model, 'avg model' = the peers' averaged parameters (and BN statistics). "
        "MB sent: all peers, all steps. Compute: BitOps per step relative to fp32.",
        "",
        "| data | bits | norm | test acc (peers) | test acc (avg model) | consensus dist. "
        "| MB sent | compute vs fp32 |",
        "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['data']} | {r['bits']} | {r['norm']} | {r['acc']} | "
                     f"{r['acc_avg_model']} | {r['consensus']:.3g} | {r['mb_sent']:.1f} | "
                     f"{r['cost']:.3f} |")
    lines += ["", "## Claims checked (differences in accuracy points, mean ± std over seeds "
              "of the paired difference)", ""]
    by_key = {r["key"]: r for r in rows}

    def paired(key_a, key_b):
        a = {r["seed"]: r["final_test_accuracy"] for r in groups.get(key_a, [])}
        b = {r["seed"]: r["final_test_accuracy"] for r in groups.get(key_b, [])}
        common = sorted(set(a) & set(b))
        if not common:
            return None
        return _ms([a[k] - b[k] for k in common])

    low_bits = [b for b in s["bits"] if b < 32]
    for key in sorted(by_key, key=lambda k: tuple(str(x) for x in k)):
        if key[3] in low_bits and (key[0], key[1], key[2], 32, key[4]) in by_key:
            d = paired(key, (key[0], key[1], key[2], 32, key[4]))
            lines.append(f"- {_split_label(key)}, {key[4]}: {key[3]}-bit minus fp32 = {d}")
    for key in sorted(by_key, key=lambda k: tuple(str(x) for x in k)):
        if key[4] != "batch" and (key[0], key[1], key[2], key[3], "batch") in by_key:
            d = paired(key, (key[0], key[1], key[2], key[3], "batch"))
            lines.append(f"- {_split_label(key)}, {key[3]} bits: {key[4]} minus batch = {d}")
    text = "\n".join(lines) + "\n"
    with open(os.path.join(workdir, "results.md"), "w") as f:
        f.write(text)
    with open(os.path.join(workdir, "results.csv"), "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["data", "bits", "norm", "seeds", "acc_mean", "acc_std", "acc_avg_model",
                    "consensus", "mb_sent", "relative_compute_cost"])
        for r in rows:
            w.writerow([r["data"], r["bits"], r["norm"], r["seeds"], f"{r['acc_mean']:.4f}",
                        f"{r['acc_std']:.4f}", r["acc_avg_model"], f"{r['consensus']:.4g}",
                        f"{r['mb_sent']:.3f}", f"{r['cost']:.4f}"])
    try:
        _plot(groups, workdir)
    except Exception as exc:  # plots must never lose results
        logging.warning("plotting failed: %s", exc)
    return text


def _plot(groups, workdir: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    splits = sorted({k[:3] for k in groups}, key=lambda k: tuple(str(x) for x in k))
    for metric, fname, ylabel, log in (
            ("test_accuracy", "accuracy.png", "test accuracy (mean over peers)", False),
            ("consensus_distance", "consensus.png", "consensus distance", True)):
        fig, axes = plt.subplots(1, len(splits), figsize=(5.2 * len(splits), 3.6), squeeze=False)
        for ax, split in zip(axes[0], splits):
            for key, rs in sorted(groups.items(), key=lambda kv: str(kv[0])):
                if key[:3] != split:
                    continue
                curves = [[(h["step"], h[metric]) for h in r["history"] if metric in h]
                          for r in rs]
                n = min(len(c) for c in curves)
                if n == 0:
                    continue
                steps = [p[0] for p in curves[0][:n]]
                values = np.mean([[p[1] for p in c[:n]] for c in curves], axis=0)
                style = "-" if key[3] >= 32 else "--"
                ax.plot(steps, values, style, marker="o" if metric == "test_accuracy" else None,
                        ms=3, label=f"{'fp32' if key[3] >= 32 else f'{key[3]}-bit'} {key[4]}")
            ax.set_title(_split_label(split + (None, None)))
            ax.set_xlabel("step")
            ax.set_ylabel(ylabel)
            if log:
                ax.set_yscale("log")
            ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(os.path.join(workdir, fname), dpi=110)
        plt.close(fig)


# --------------------------------------------------------------------------- main

def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
    if not FLAGS.workdir:
        raise app.UsageError("--workdir is required")
    try:
        s = settings_from_flags()
        study = _Study(s)
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    workdir = FLAGS.workdir
    os.makedirs(os.path.join(workdir, "runs"), exist_ok=True)
    if s["partition"] == "label_skew":
        splits = [{"kind": "label_skew", "skew": k, "key": f"skew{k:g}"} for k in s["skews"]]
    else:
        splits = [{"kind": "dirichlet", "alpha": a, "key": f"dir{a:g}"} for a in s["alphas"]]
    settings_key = {k: v for k, v in s.items() if k not in ("seeds", "skews", "alphas", "bits",
                                                             "norms")}
    records = []
    t0 = time.time()
    for bits in s["bits"]:
        for norm in s["norms"]:
            for split in splits:
                for seed in s["seeds"]:
                    name = study.setting_name(bits, norm, split["key"], seed)
                    path = os.path.join(workdir, "runs", name + ".json")
                    if os.path.isfile(path):
                        with open(path) as f:
                            stored = json.load(f)
                        if stored.get("settings") == settings_key:
                            records.append(stored["record"])
                            continue
                    logging.info("run %s", name)
                    rec = study.run(bits, norm, {k: v for k, v in split.items() if k != "key"},
                                    seed)
                    with open(path, "w") as f:
                        json.dump({"settings": settings_key, "record": rec}, f)
                    records.append(rec)
                    print(f"{name}: test acc {rec['final_test_accuracy']:.4f} (avg model "
                          f"{rec['final_test_accuracy_avg_model']:.4f}), consensus "
                          f"{rec['final_consensus_distance']:.3g}, {rec['wall_time_s']} s "
                          f"[{time.time() - t0:.0f} s total]", flush=True)
    with open(os.path.join(workdir, "results.json"), "w") as f:
        json.dump(records, f, indent=1)
    with open(os.path.join(workdir, "settings.json"), "w") as f:
        json.dump(s, f, indent=1)
    print(write_report(records, workdir, s))


if __name__ == "__main__":
    app.run(main)
