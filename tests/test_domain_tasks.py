"""Tests for cpt_jax.runner.domain_tasks: graph and language tasks wired into the runner."""
from __future__ import annotations

import importlib
import json
import math
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest

from cpt_jax.data import text as text_data
from cpt_jax.models.lstm import LSTMLanguageModel
from cpt_jax.runner import domain_tasks as dt
from cpt_jax.runner import validation
from cpt_jax.runner.tasks import available_datasets, build_task
from cpt_jax.training import aggregate, create_train_state, make_eval_step

DATASETS = Path(os.environ.get(
    "CPT_JAX_DATASETS", Path(__file__).resolve().parents[2] / "shared" / "datasets"))
PLANETOID = DATASETS / "planetoid"
PTB = DATASETS / "ptb"
SHAKESPEARE = DATASETS / "tinyshakespeare"
SST2 = DATASETS / "glue" / "SST-2"

CONFIGS = ("cora_gcn", "citeseer_gcn", "ptb_lstm", "shakespeare_transformer",
           "sst2_transformer")


def _needs(path: Path):
    return pytest.mark.skipif(not path.exists(), reason=f"{path} not available")


def _config(name: str, **overrides) -> ml_collections.ConfigDict:
    config = importlib.import_module(f"experiments.configs.{name}").get_config()
    config.plots = False
    config.tensorboard = False
    for key, value in overrides.items():
        target = config
        *parents, leaf = key.split(".")
        for p in parents:
            target = target[p]
        target[leaf] = value
    return config


TINY = {
    "ptb_lstm": {"model_kwargs": ml_collections.ConfigDict(
        {"embed": 8, "hidden": 8, "num_layers": 2, "dropout": 0.0, "init_scale": 0.1}),
        "batch_size": 4, "seq_len": 5, "eval_seq_len": 10, "eval_stride": 5,
        "max_eval_tokens": 40, "eval_batch_size": 3},
    "shakespeare_transformer": {"model_kwargs": ml_collections.ConfigDict(
        {"d_model": 16, "num_heads": 2, "num_layers": 1, "mlp_dim": 32, "dropout": 0.1}),
        "batch_size": 4, "seq_len": 8, "eval_seq_len": 8, "eval_stride": 4,
        "max_eval_tokens": 50, "eval_batch_size": 4},
    "sst2_transformer": {"model_kwargs": ml_collections.ConfigDict(
        {"d_model": 16, "num_heads": 2, "num_layers": 1, "mlp_dim": 32, "dropout": 0.1}),
        "batch_size": 8, "eval_batch_size": 100},
    "cora_gcn": {}, "citeseer_gcn": {},
}
DATA = {"cora_gcn": PLANETOID, "citeseer_gcn": PLANETOID, "ptb_lstm": PTB,
        "shakespeare_transformer": SHAKESPEARE, "sst2_transformer": SST2}


# ---------------------------------------------------------------- configs

@pytest.mark.parametrize("name", CONFIGS)
def test_config_files_load_and_validate(name):
    config = _config(name)
    assert config.dataset in available_datasets()
    validation.validate_config(config, device_count=1)
    keep = tuple(config.precision.keep_full_precision)
    assert keep == {"cora_gcn": (), "citeseer_gcn": (), "ptb_lstm": (),
                    "shakespeare_transformer": ("lm_head",),
                    "sst2_transformer": ("classifier",)}[name]


def test_cora_recipe_fields():
    c = _config("cora_gcn")
    assert (c.model_kwargs.hidden, c.model_kwargs.dropout, c.num_steps) == (16, 0.5, 200)
    assert (c.optimizer.name, c.optimizer.learning_rate, c.optimizer.weight_decay) == \
        ("adam", 0.01, 5e-4)
    assert (c.precision.min_bits, c.precision.max_bits, c.precision.grad_bits) == (3, 8, 8)


@pytest.mark.parametrize("name,dataset", [("cora_gcn", "Planetoid"), ("ptb_lstm", "PTB")])
def test_empty_data_dir_without_tfds_says_what_to_pass(name, dataset):
    with pytest.raises(ValueError, match=r"--config\.data_dir") as info:
        build_task(_config(name))
    assert dataset in str(info.value)


# ---------------------------------------------------------------- eval windows

@pytest.mark.parametrize("n,window,stride,max_tokens",
                         [(8, 4, 2, 0), (101, 10, 3, 0), (101, 10, 10, 57), (30, 50, 7, 0),
                          (12, 5, 5, 0)])
def test_eval_windows_score_every_prediction_once(n, window, stride, max_tokens):
    tokens = (np.arange(n) * 7919) % 1009  # distinct values: positions are recoverable
    w = dt.lm_eval_windows(tokens, window=window, stride=stride, max_tokens=max_tokens)
    m = min(n - 1, max_tokens) if max_tokens else n - 1
    pos = {int(t): i for i, t in enumerate(tokens)}
    scored = []
    for x, y, mask in zip(w["inputs"], w["labels"], w["mask"]):
        start = pos[int(x[0])]
        np.testing.assert_array_equal(x, tokens[start:start + len(x)])
        np.testing.assert_array_equal(y, tokens[start + 1:start + 1 + len(x)])
        for p in np.nonzero(mask)[0]:
            j = start + int(p)
            scored.append(j)
            assert p >= min(j, min(window, m) - min(stride, window, m))  # context kept
    assert sorted(scored) == list(range(m))


def test_eval_windows_reject_bad_arguments():
    with pytest.raises(ValueError, match="stride"):
        dt.lm_eval_windows(np.arange(10), window=3, stride=4)
    with pytest.raises(ValueError, match="max_tokens"):
        dt.lm_eval_windows(np.arange(10), window=3, stride=2, max_tokens=-1)
    with pytest.raises(ValueError, match="1-D"):
        dt.lm_eval_windows(np.arange(1), window=3, stride=2)


def test_padded_batches_fixed_shape_and_exact_mask():
    data = {"x": np.arange(7) + 10, "mask": np.array([1, 1, 0, 1, 1, 1, 1], np.float32)}
    batches = list(dt.padded_batches(data, 3))
    assert [b["x"].shape for b in batches] == [(3,)] * 3
    np.testing.assert_array_equal(np.concatenate([b["x"] for b in batches])[:7], data["x"])
    np.testing.assert_array_equal(np.concatenate([b["mask"] for b in batches]),
                                  [1, 1, 0, 1, 1, 1, 1, 0, 0])


# ---------------------------------------------------------------- carried LSTM state

def test_carried_state_continues_the_stream():
    lm = LSTMLanguageModel(vocab_size=11, embed=6, hidden=5, num_layers=2, dropout=0.0)
    model = dt.CarriedStateLM(lm, batch_size=2)
    tokens = jax.random.randint(jax.random.key(1), (2, 12), 0, 11)

    @jax.jit
    def run(key):
        variables = model.init(key, tokens[:, :6])
        params = variables["params"]
        # Two consecutive segments with the carried state ...
        out1, upd = model.apply(variables, tokens[:, :6], train=True, mutable=["batch_stats"])
        out2, _ = model.apply({"params": params, **upd}, tokens[:, 6:], train=True,
                              mutable=["batch_stats"])
        # ... and evaluation, which starts from zeros whatever the stored state.
        ev = model.apply({"params": params, **upd}, tokens[:, 6:], train=False)
        full = lm.apply({"params": params["lm"]}, tokens, train=False)
        fresh = lm.apply({"params": params["lm"]}, tokens[:, 6:], train=False)
        return out1, out2, ev, full, fresh, upd["batch_stats"]["h_1"]

    out1, out2, ev, full, fresh, h1 = run(jax.random.key(0))
    assert float(jnp.abs(h1).sum()) > 0
    # the two carried segments equal one pass over the whole rows
    np.testing.assert_allclose(np.concatenate([out1, out2], 1), full, atol=1e-5)
    np.testing.assert_allclose(ev, fresh, atol=1e-6)
    assert not np.allclose(out2, fresh, atol=1e-4)  # the carry made a difference


# ---------------------------------------------------------------- tasks from configs

@pytest.mark.slow
@pytest.mark.parametrize("name", [c for c in CONFIGS if c != "citeseer_gcn"])  # cora's path
def test_task_builds_from_config(name):
    if not DATA[name].exists():
        pytest.skip(f"{DATA[name]} not available")
    config = _config(name, data_dir=str(DATA[name]), **TINY[name])
    task = build_task(config)
    batch = task.train_batch(jnp.int32(3), jax.random.key(0))
    variables = jax.jit(lambda k: task.model.init({"params": k}, task.sample_inputs,
                                                  train=False))(jax.random.key(0))
    out = jax.jit(lambda v, x: task.model.apply(v, x, train=False))(variables, batch["inputs"])
    labels = batch["labels"]
    assert out.shape[:labels.ndim] == labels.shape
    if name.endswith("_gcn"):
        assert task.steps_per_epoch == 1 and task.eval_splits == ("val", "test")
        assert int(batch["mask"].sum()) == task.info["num_train"]
        counts = [int(next(task.eval_batches(s))["mask"].sum()) for s in task.eval_splits]
        assert counts == [500, 1000]
    if task.metric == "perplexity":
        assert out.shape[-1] == task.info["vocab_size"]
        assert batch["inputs"].shape == (config.batch_size, config.seq_len)
        np.testing.assert_array_equal(batch["inputs"][:, 1:], batch["labels"][:, :-1])
        total = sum(float(b["mask"].sum()) for b in task.eval_batches("test"))
        assert total == task.info["eval_tokens_test"] == config.max_eval_tokens
    if name == "sst2_transformer":
        total = sum(float(b["mask"].sum()) for b in task.eval_batches("test"))
        assert total == 872


@pytest.mark.slow
@_needs(PTB / "ptb.test.txt")
def test_windowed_perplexity_equals_direct_loss():
    """One window over the first 30 test predictions: the task's eval equals a direct
    mean cross-entropy of the model on that segment (masks and padding exact)."""
    config = _config("ptb_lstm", data_dir=str(PTB), carry_state=False,
                     **{**TINY["ptb_lstm"], "eval_seq_len": 30, "eval_stride": 30,
                        "max_eval_tokens": 30})
    task = build_task(config)
    state = create_train_state(task.model, optax.sgd(0.1), jax.random.key(0),
                               task.sample_inputs, train=False)
    eval_step = make_eval_step(task.model, loss_fn=task.loss_fn)
    got = aggregate([eval_step(state, b, jnp.float32(32)) for b in task.eval_batches("test")])
    stream = np.asarray(text_data.load_ptb(str(PTB)).test[:31])
    logits = jax.jit(task.model.apply)({"params": state.params}, jnp.asarray(stream[None, :30]))
    ce = optax.softmax_cross_entropy_with_integer_labels(logits[0], jnp.asarray(stream[1:]))
    assert got["count"] == 30
    np.testing.assert_allclose(got["loss"], float(ce.mean()), rtol=1e-5)
    np.testing.assert_allclose(got["perplexity"], math.exp(float(ce.mean())), rtol=1e-4)


# ---------------------------------------------------------------- runner end to end

def _run(tmp_path, config):
    from cpt_jax.runner.job import train_and_evaluate
    summary = train_and_evaluate(config, str(tmp_path / "run"), progress=False)
    on_disk = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert on_disk["steps"] == summary["steps"] == config.num_steps
    return summary


@pytest.mark.slow
@_needs(PLANETOID / "ind.cora.x")
def test_runner_cora_cpt_end_to_end(tmp_path):
    config = _config("cora_gcn", data_dir=str(PLANETOID), num_steps=4, log_every=1,
                     **{"precision.num_cycles": 2})
    s = _run(tmp_path, config)
    assert s["num_compiles"] == 1 and s["num_quantized_ops"] == 2
    for key in ("final_test_accuracy", "final_val_accuracy", "final_test_accuracy_fp32"):
        assert 0.0 <= s[key] <= 1.0
    # cost relative to fp32 = cost relative to static 8/8 x (8*8 + 2*8*8) / 3 / 32^2
    assert 0.0 < s["relative_cost_static8"] < 1.0
    np.testing.assert_allclose(s["relative_cost_fp32"],
                               s["relative_cost_static8"] * 192 / 3 / 1024, rtol=1e-6)
    assert 3.0 <= s["mean_bits"] <= 8.0
    # bits follow the schedule once per step (= epoch): 3 at the start of each cycle
    lines = [json.loads(l) for l in (tmp_path / "run" / "metrics.jsonl").read_text().split("\n")
             if l.strip()]
    bits = [r["bits"] for r in lines if "bits" in r]
    assert bits[0] == 3.0 and bits[2] == 3.0 and len(bits) == 4


@pytest.mark.slow
@_needs(PTB / "ptb.train.txt")
def test_runner_ptb_lstm_end_to_end(tmp_path):
    config = _config("ptb_lstm", data_dir=str(PTB), num_steps=3, log_every=1,
                     **TINY["ptb_lstm"], **{"precision.num_cycles": 1})
    s = _run(tmp_path, config)
    assert s["metric"] == "perplexity" and s["num_compiles"] == 1
    # every Dense is quantized (ih, hh of each layer, decoder); none kept fp32
    assert s["num_quantized_ops"] >= 5 and s["num_full_precision_ops"] == 0
    for key in ("final_test_perplexity", "final_valid_perplexity",
                "final_test_perplexity_fp32"):
        assert math.isfinite(s[key]) and s[key] > 1.0, (key, s[key])
    np.testing.assert_allclose(s["final_test_perplexity"], math.exp(s["final_test_loss"]),
                               rtol=1e-5)
    assert s["task_info"]["carry_state"] is True
