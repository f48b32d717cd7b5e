"""Export a finished run as a real integer model, and measure it against fake quant.

    python -m experiments.export --run_dir=RUN --out=OUT --bits=8

Reads RUN (a workdir of ``experiments.train`` with a checkpoint: its config and its
newest checkpoint), calibrates static activation ranges on a few training batches,
exports (`cpt_jax.export.export_model`), evaluates on the run's test set

* the fake-quant model at ``--bits`` with the same static ranges (the reference),
* the integer model (`cpt_jax.export.int8_apply`),
* the fake-quant model as trained and evaluated (ranges per batch),

and writes ``OUT/export.json`` (``fake_quant_test_accuracy``, ``int8_test_accuracy``,
``argmax_agreement``, ``param_bytes_fp32``, ``param_bytes_int8``, CPU latency of both
per test batch, measured side by side in one process, ...) and the saved model
(``OUT/model`` orbax, ``OUT/export.npz`` plain arrays, ``OUT/export_meta.json``).

A run without a checkpoint, or ``--bits`` outside 2..8: one ``error: ...`` line, exit 2.
``experiments.train`` always checkpoints its final state, so any finished run exports
(a run interrupted before its first checkpoint, or stopped by ``nonfinite=stop``, has
none).
"""
from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

from absl import app, flags, logging

FLAGS = flags.FLAGS
_RUN_DIR = flags.DEFINE_string("run_dir", None, "Workdir of a finished experiments.train run.")
_OUT = flags.DEFINE_string("out", None, "Output directory (export.json and the saved model).")
_BITS = flags.DEFINE_float("bits", 8, "Export width, an integer in 2..8.")
_CALIBRATION_BATCHES = flags.DEFINE_integer(
    "calibration_batches", 8, "Training batches for the static activation ranges.")
_FP32_LAYERS = flags.DEFINE_enum(
    "fp32_layers", "keep", ["keep", "int8_weights"],
    "Layers the run kept in fp32: keep them, or store int8 weight codes (float activations).")
_LATENCY_REPEATS = flags.DEFINE_integer("latency_repeats", 20, "Timed runs of each model.")
_DATA_DIR = flags.DEFINE_string("data_dir", None, "Override the run's config.data_dir.")

EXIT_USER_ERROR = 2


# --------------------------------------------------------------------------- the run

def latest_checkpoint(run_dir: str) -> tuple[str, int]:
    """``(checkpoint root, newest step)`` of a run, or a one-line ValueError."""
    root = os.path.join(run_dir, "checkpoints")
    steps = []
    if os.path.isdir(root):
        steps = sorted(int(name) for name in os.listdir(root) if name.isdigit())
    if not steps:
        raise ValueError(f"run directory {run_dir!r} has no checkpoint (expected {root}/<step>/); "
                         "finish the run first (experiments.train checkpoints its last step)")
    return root, steps[-1]


def _merge(config, saved: dict[str, Any]) -> None:
    for key, value in saved.items():
        if isinstance(value, dict) and key in config and hasattr(config[key], "items"):
            _merge(config[key], value)
        elif key in config and isinstance(config[key], tuple) and isinstance(value, list):
            config[key] = tuple(tuple(v) if isinstance(v, list) else v for v in value)
        else:
            config[key] = value


def config_with_defaults(saved: dict[str, Any]):
    """The run's saved config (JSON) over today's ``default.get_config()``: a run
    written before a field existed gets that field's default."""
    from experiments.configs import default

    config = default.get_config()
    with config.unlocked(), config.ignore_type():
        _merge(config, saved)
    return config


def as_running_ranges(tree):
    """A restored ``activation_ranges`` collection (plain dicts) with each
    ``{"zero_point", "range"}`` leaf pair back as a `RunningRange`."""
    import jax.numpy as jnp

    from cpt_jax.providers.running_ranges import RunningRange

    if isinstance(tree, dict) and set(tree) == {"zero_point", "range"}:
        return RunningRange(zero_point=jnp.asarray(tree["zero_point"], jnp.float32),
                            range=jnp.asarray(tree["range"], jnp.float32))
    if isinstance(tree, dict):
        return {k: as_running_ranges(v) for k, v in tree.items()}
    return tree


def load_run(run_dir: str, data_dir=None) -> tuple[Any, dict[str, Any], int]:
    """``(config, variables, step)`` of the newest checkpoint of `run_dir`.

    `variables` holds ``params`` and, where the run has them, ``batch_stats`` and the
    running ``activation_ranges``.
    """
    import orbax.checkpoint as ocp

    from cpt_jax.runner import checkpoint as ckpt_lib

    root, step = latest_checkpoint(run_dir)
    problem = ckpt_lib.verify_manifest(os.path.join(root, str(step)), step)
    if problem is not None:
        raise ValueError(f"checkpoint {root}/{step} is unusable: {problem}")
    manager = ocp.CheckpointManager(root)
    try:
        meta = manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
        state = manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore()))["state"]
    finally:
        manager.close()
    if "config" not in (meta or {}):
        raise ValueError(f"checkpoint {root}/{step} has no config in its meta")
    config = config_with_defaults(meta["config"])
    if data_dir is not None:
        config.data_dir = data_dir
    variables = {"params": state["params"]}
    if state.get("batch_stats"):
        variables["batch_stats"] = state["batch_stats"]
    if state.get("activation_ranges"):
        variables["activation_ranges"] = as_running_ranges(state["activation_ranges"])
    return config, variables, step


def build_quantized_model(config, task):
    """The run's `QuantizedModel`: its model, rules and quantizer."""
    from cpt_jax.doors import quantize_model
    from cpt_jax.runner import job as runner

    p = config.precision
    return quantize_model(task.model, rules=runner.rules_from_config(p),
                          config=runner.quant_config_from_config(p),
                          provider=runner.provider_from_config(p))


# --------------------------------------------------------------------------- measuring

def evaluate(task, predict_fns: dict[str, Any]) -> dict[str, float]:
    """Test accuracy of each ``predict(inputs) -> logits`` and their argmax agreement
    with ``"fake_quant"`` (over the masked examples of every test batch)."""
    import jax.numpy as jnp
    import numpy as np

    correct = {name: 0.0 for name in predict_fns}
    agree = {name: 0.0 for name in predict_fns}
    count = 0.0
    for batch in task.eval_batches("test"):
        preds = {name: np.asarray(jnp.argmax(fn(batch["inputs"]), -1))
                 for name, fn in predict_fns.items()}
        labels = np.asarray(batch["labels"])
        mask = np.asarray(batch.get("mask", np.ones(labels.shape)), np.float64)
        count += mask.sum()
        for name, pred in preds.items():
            correct[name] += float(((pred == labels) * mask).sum())
            agree[name] += float(((pred == preds["fake_quant"]) * mask).sum())
    out = {f"{name}_test_accuracy": correct[name] / max(count, 1.0) for name in predict_fns}
    out.update({f"{name}_argmax_agreement": agree[name] / max(count, 1.0)
                for name in predict_fns if name != "fake_quant"})
    out["test_examples"] = int(count)
    return out


def latency_ms(predict_fns: dict[str, Any], inputs, repeats: int) -> dict[str, float]:
    """Median wall time (ms) of each compiled predict on `inputs`, interleaved runs."""
    import jax
    import numpy as np

    times = {name: [] for name in predict_fns}
    for fn in predict_fns.values():
        for _ in range(2):
            jax.block_until_ready(fn(inputs))
    for _ in range(max(1, repeats)):
        for name, fn in predict_fns.items():
            t0 = time.perf_counter()
            jax.block_until_ready(fn(inputs))
            times[name].append(1e3 * (time.perf_counter() - t0))
    return {name: float(np.median(t)) for name, t in times.items()}


def predict_functions(qmodel, variables, exported, ranges, bits: int, apply_kwargs):
    """Compiled ``inputs -> logits`` of the three models (names as in export.json).

    Parameters are arguments of the compiled functions, not constants folded into
    them (as a server holding its weights), so the timings compare like with like.
    """
    import functools

    import jax

    import cpt_jax
    from cpt_jax import export as export_lib

    @jax.jit
    def fake_quant(variables, ranges, inputs):
        return export_lib.fake_quant_apply(qmodel, variables, inputs, bits=bits, ranges=ranges,
                                           **apply_kwargs)

    @jax.jit
    def int8(exported, inputs):
        return export_lib.int8_apply(exported, inputs, **apply_kwargs)

    @jax.jit
    def fake_quant_dynamic(variables, inputs):
        with cpt_jax.precision(bits):
            return qmodel.apply(variables, inputs, **apply_kwargs)

    return {"fake_quant": functools.partial(fake_quant, variables, ranges),
            "int8": functools.partial(int8, exported),
            "fake_quant_dynamic": functools.partial(fake_quant_dynamic, variables)}


def activation_ranges(task, qmodel, variables, bits: int, calibration_batches: int, seed: int,
                      apply_kwargs) -> tuple[dict[str, tuple[float, float]], str]:
    """``(ranges, source)``: the run's running activation ranges when it kept them
    (``"running"``), else a calibration over its first training batches."""
    import jax

    from cpt_jax import export as export_lib

    if variables.get("activation_ranges"):
        return export_lib.running_ranges(variables), "running"
    key = jax.random.key(seed)
    batches = (task.train_batch(jax.numpy.int32(i), key)["inputs"]
               for i in range(calibration_batches))
    ranges = export_lib.calibrate(qmodel, variables, batches, bits, **apply_kwargs)
    return ranges, f"calibration ({calibration_batches} training batches)"


def export_run(run_dir: str, out: str, bits, *, calibration_batches: int = 8,
               fp32_layers: str = "keep", latency_repeats: int = 20,
               data_dir=None) -> dict[str, Any]:
    """Export the run in `run_dir` to `out` and measure it; returns export.json's dict."""
    import jax

    from cpt_jax import export as export_lib
    from cpt_jax.runner.tasks import build_task

    bits = export_lib.check_export_bits(bits, "--bits")
    if calibration_batches < 1:
        raise ValueError(f"--calibration_batches must be >= 1, got {calibration_batches}")
    config, variables, step = load_run(run_dir, data_dir)
    task = build_task(config)
    qmodel = build_quantized_model(config, task)
    apply_kwargs = {"train": False, **task.apply_kwargs}
    first = next(iter(task.eval_batches("test")))["inputs"]
    t0 = time.time()
    ranges, source = activation_ranges(task, qmodel, variables, bits, calibration_batches,
                                       int(config.seed), apply_kwargs)
    exported = export_lib.export_model(qmodel, variables, bits, ranges, first,
                                       fp32_layers=fp32_layers, **apply_kwargs)
    export_time = time.time() - t0
    fns = predict_functions(qmodel, variables, exported, ranges, bits, apply_kwargs)
    metrics = evaluate(task, fns)
    latency = latency_ms({k: fns[k] for k in ("fake_quant", "int8")}, first, latency_repeats)
    result = {
        "run_dir": os.path.abspath(run_dir), "checkpoint_step": step, "bits": bits,
        "dataset": config.dataset, "model": config.model, "fp32_layers": fp32_layers,
        "calibration_batches": calibration_batches, "activation_ranges": source,
        "fake_quant_test_accuracy": metrics["fake_quant_test_accuracy"],
        "int8_test_accuracy": metrics["int8_test_accuracy"],
        "argmax_agreement": metrics["int8_argmax_agreement"],
        "fake_quant_dynamic_test_accuracy": metrics["fake_quant_dynamic_test_accuracy"],
        "fake_quant_dynamic_argmax_agreement": metrics["fake_quant_dynamic_argmax_agreement"],
        "test_examples": metrics["test_examples"],
        "param_bytes_fp32": export_lib.param_bytes(variables),
        "param_bytes_int8": export_lib.param_bytes(exported),
        "latency_batch_size": int(jax.tree_util.tree_leaves(first)[0].shape[0]),
        "fake_quant_latency_ms": latency["fake_quant"], "int8_latency_ms": latency["int8"],
        "latency_device": jax.devices()[0].platform, "export_time_s": export_time,
        "exported_layers": list(exported.layers()),
    }
    result["param_bytes_ratio"] = result["param_bytes_int8"] / max(result["param_bytes_fp32"], 1)
    export_lib.save_exported(out, exported)
    with open(os.path.join(out, "export.json"), "w") as f:
        json.dump(result, f, indent=2, sort_keys=True)
    return result


def _user_error(exc: BaseException) -> None:
    logging.debug("%s", type(exc).__name__, exc_info=exc)
    print(f"error: {' '.join(str(exc).split()) or type(exc).__name__}", file=sys.stderr)
    sys.exit(EXIT_USER_ERROR)


def main(argv):
    if len(argv) > 1:
        _user_error(app.UsageError(f"unexpected arguments: {argv[1:]}"))
    from cpt_jax.runner.orbax_logs import quiet_orbax_logs

    quiet_orbax_logs()   # orbax logs each restore and save at INFO (64 lines); warnings show
    try:
        result = export_run(_RUN_DIR.value, _OUT.value, _BITS.value,
                            calibration_batches=_CALIBRATION_BATCHES.value,
                            fp32_layers=_FP32_LAYERS.value,
                            latency_repeats=_LATENCY_REPEATS.value, data_dir=_DATA_DIR.value)
    except (ValueError, OSError) as exc:
        _user_error(exc)
    shown = {k: v for k, v in result.items() if k not in ("exported_layers", "run_dir")}
    print(json.dumps(shown, indent=1, sort_keys=True))


if __name__ == "__main__":
    flags.mark_flags_as_required(["run_dir", "out"])
    app.run(main)
