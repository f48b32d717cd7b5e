"""Graph and language tasks for the runner: Cora/CiteSeer, PTB, tiny-shakespeare, SST-2.

The task builders of these domains (`cpt_jax.runner.tasks` lists them):

* ``"cora"``, ``"citeseer"``: full-batch node classification with a 2-layer GCN
  (Kipf & Welling) or GraphSAGE. **One step is one epoch** (the whole graph), so
  the precision schedule advances once per epoch, as in Wolfe & Kyrillidis. The
  batch is ``{"inputs": graph, "labels": labels, "mask": train_mask}`` (the loss
  and accuracy are over the 140/120 labelled training nodes); dropout is active in
  training; evaluation splits ``("val", "test")`` use the Planetoid masks.
* ``"ptb"``: word-level language modelling (10k words) with the Zaremba-style
  LSTM (``model="lstm_lm"``) in truncated BPTT (``seq_len`` x ``batch_size``
  segments of the batchified stream). With ``config.carry_state`` (default on)
  the LSTM state is carried from one segment to the next, as in Zaremba et al.:
  it lives in the ``batch_stats`` collection of `CarriedStateLM`, so the runner's
  state (and its checkpoints) hold it and the step stays a pure function.
* ``"tiny_shakespeare"``: character-level language modelling with the causal
  `TransformerLM` (``model="transformer_lm"``; random windows would also do, the
  batchified stream is used as for PTB).
* ``"sst2"``: GLUE SST-2 sentence classification with a `TransformerClassifier`
  trained from scratch (no pretrained weights can be reached offline). GLUE's test
  labels are hidden, so the split reported as ``"test"`` is the GLUE dev set
  (872 sentences), as is usual for GLUE.

Language models report ``metric="perplexity"`` = ``exp(mean next-token loss)``.
Their evaluation is exact and deterministic: `lm_eval_windows` cuts the split's
token stream into windows of ``eval_seq_len`` tokens with stride ``eval_stride``
so that every next-token prediction (up to ``max_eval_tokens`` of them, 0 = all)
is scored exactly once, each with at least ``eval_seq_len - eval_stride`` tokens
of context (less only at the very start of the stream).

Example:
    >>> from cpt_jax.runner.tasks import build_task
    >>> from experiments.configs import cora_gcn
    >>> config = cora_gcn.get_config()
    >>> config.data_dir = "/work/shared/datasets/planetoid"
    >>> task = build_task(config)
    >>> task.steps_per_epoch, task.eval_splits
    (1, ('val', 'test'))
"""
from __future__ import annotations

import functools
import math
from collections.abc import Iterator
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from cpt_jax.data import graph as graph_data
from cpt_jax.data import text as text_data
from cpt_jax.models import get_model
from cpt_jax.runner.task import Task

BUILDERS: dict[str, Any] = {}
"""Dataset name -> task builder, for `cpt_jax.runner.tasks`."""


def _builds(*datasets: str):
    def wrap(builder):
        for name in datasets:
            BUILDERS[name] = builder
        return builder
    return wrap

__all__ = [
    "CarriedStateLM",
    "lm_eval_windows",
    "padded_batches",
    "node_classification_task",
    "language_model_task",
    "sentence_classification_task",
    "GRAPH_MODELS",
    "LM_MODELS",
]

Batch = dict[str, Any]

GRAPH_MODELS = ("gcn", "graphsage")
"""``config.model`` values accepted by the node-classification tasks."""

LM_MODELS = ("lstm_lm", "transformer_lm")
"""``config.model`` values accepted by the language-modelling tasks."""

_NO_TFDS = {"cora": "Planetoid (ind.cora.* files)", "citeseer": "Planetoid (ind.citeseer.* files)",
            "ptb": "PTB (ptb.{train,valid,test}.txt)"}


# --------------------------------------------------------------------------- helpers

def _data_dir(config) -> str | None:
    """``config.data_dir`` or None when empty (TFDS) -- a `ValueError` for datasets
    that have no TFDS builder, telling the user to pass ``--config.data_dir``."""
    data_dir = config.get("data_dir", None) or None
    if data_dir is None and config.dataset in _NO_TFDS:
        raise ValueError(
            f"config.data_dir is empty but {config.dataset!r} has no TFDS builder: pass "
            f"--config.data_dir=DIR, the folder holding the {_NO_TFDS[config.dataset]} files "
            f"(e.g. ../shared/datasets/{'planetoid' if config.dataset != 'ptb' else 'ptb'})")
    return data_dir


def _tfds_or_files(loader, data_dir: str | None, name: str, **kwargs):
    """Call `loader`; a TFDS failure (offline) becomes a `ValueError` naming the fix."""
    try:
        return loader(data_dir, **kwargs)
    except RuntimeError as exc:
        raise ValueError(
            f"{exc} Pass --config.data_dir=DIR with the raw files of {name!r} to work "
            f"offline.") from exc


def _model_kwargs(config) -> dict:
    kwargs = config.get("model_kwargs", None)
    return dict(kwargs) if kwargs else {}


def _positive(config, field: str, default: int) -> int:
    value = config.get(field, default)
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"config.{field}={value!r} must be an integer >= 1")
    return int(value)


def _non_negative(config, field: str, default: int) -> int:
    value = config.get(field, default)
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise ValueError(f"config.{field}={value!r} must be an integer >= 0")
    return int(value)


def padded_batches(data: dict[str, np.ndarray], batch_size: int) -> Iterator[Batch]:
    """Sequential batches of exactly `batch_size` rows: the last one is padded by
    repeating row 0 with ``mask`` 0, so one compiled eval step serves every batch.

    ``data`` holds equal-length arrays; ``data["mask"]`` (optional, default ones) is
    multiplied into the padding mask, so sums over ``mask`` stay exact.

    Example:
        >>> bs = list(padded_batches({"x": np.arange(5)}, 2))
        >>> [b["x"].tolist() for b in bs], [b["mask"].tolist() for b in bs]
        ([[0, 1], [2, 3], [4, 0]], [[1.0, 1.0], [1.0, 1.0], [1.0, 0.0]])
    """
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size} must be >= 1")
    n = len(next(iter(data.values())))
    if n == 0:
        raise ValueError("padded_batches: data is empty")
    mask = np.asarray(data.get("mask", np.ones(n, np.float32)), np.float32)
    for start in range(0, n, batch_size):
        stop = min(start + batch_size, n)
        idx = np.arange(start, start + batch_size)
        real = idx < stop
        idx = np.where(real, idx, 0)
        batch = {k: jnp.asarray(np.asarray(v)[idx]) for k, v in data.items() if k != "mask"}
        m = mask[idx] * real.reshape((-1,) + (1,) * (mask.ndim - 1))
        batch["mask"] = jnp.asarray(m, jnp.float32)
        yield batch


# --------------------------------------------------------------------------- graphs

@_builds(*graph_data.PLANETOID_NAMES)
def node_classification_task(config) -> Task:
    """Full-batch node classification on Cora or CiteSeer (public Planetoid split).

    One step = one epoch over the whole graph: ``batch = {"inputs": graph,
    "labels": labels, "mask": train_mask}``; ``loss = sum_i m_i CE_i / sum_i m_i``
    over the labelled training nodes. Eval splits ``("val", "test")`` (500 / 1000
    nodes), each one batch with its mask. ``config.model``: ``"gcn"`` (Kipf's GCN:
    feature transforms ``dense_0``, ``dense_1`` quantizable, the sparse aggregation
    ``A_hat @ .`` full precision) or ``"graphsage"``.

    Config fields read: dataset, data_dir (required), model, model_kwargs.

    Example:
        >>> from experiments.configs import cora_gcn
        >>> cora_config = cora_gcn.get_config()
        >>> cora_config.data_dir = "/work/shared/datasets/planetoid"
        >>> task = node_classification_task(cora_config)
        >>> batch = task.train_batch(0, jax.random.key(0))
        >>> int(batch["mask"].sum())
        140
    """
    data_dir = _data_dir(config)
    g = graph_data.load_planetoid(config.dataset, data_dir)
    name = config.get("model", "gcn")
    if name not in GRAPH_MODELS:
        raise ValueError(f"config.model={name!r} is not a graph model; choose one of "
                         f"{list(GRAPH_MODELS)} for dataset {config.dataset!r}")
    if name == "gcn":
        model = get_model("gcn", num_classes=g.num_classes, **_model_kwargs(config))
    else:
        from cpt_jax.models.gcn import GraphSAGE
        model = GraphSAGE(num_classes=g.num_classes, **_model_kwargs(config))
    graph = {"features": g.features, "senders": g.senders, "receivers": g.receivers,
             "edge_weight": g.edge_weight}
    masks = {"train": g.train_mask, "val": g.val_mask, "test": g.test_mask}
    train = {"inputs": graph, "labels": g.labels, "mask": g.train_mask.astype(jnp.float32)}

    def train_batch(step, key):
        del step, key  # full batch: the same graph every epoch
        return train

    def eval_batches(split: str):
        if split not in ("val", "test"):
            raise ValueError(f"unknown eval split {split!r}; choose 'val' or 'test'")
        yield {"inputs": graph, "labels": g.labels,
               "mask": masks[split].astype(jnp.float32)}

    counts = {k: int(np.asarray(v).sum()) for k, v in masks.items()}
    return Task(name=config.dataset, model=model, sample_inputs=graph,
                train_batch=train_batch, eval_batches=eval_batches,
                num_train_examples=counts["train"], steps_per_epoch=1,
                eval_splits=("val", "test"),
                info={"num_nodes": g.num_nodes, "num_edges": int(g.senders.shape[0]),
                      "num_features": int(g.features.shape[1]),
                      "num_classes": g.num_classes, "num_train": counts["train"],
                      "num_val": counts["val"], "num_test": counts["test"],
                      "step": "one full-batch epoch"})


# --------------------------------------------------------------------------- language

class CarriedStateLM(nn.Module):
    """An LSTM LM whose state is carried across truncated-BPTT segments (Zaremba).

    The carry ``(c_l, h_l)`` of every layer is a ``batch_stats`` variable of shape
    (batch_size, hidden): in training (``train=True`` with that batch size) the
    segment starts from it and the final carry (``stop_gradient``) is written back,
    so consecutive steps over the batchified stream continue each row's state. In
    evaluation (``train=False``) or for another batch size the state starts at zeros
    (the evaluation windows give the context instead, see `lm_eval_windows`).

    The wrapped model is the submodule ``lm`` (paths ``lm/lstm_0/ih``, ``lm/decoder``).

    Example:
        >>> from cpt_jax.models.lstm import LSTMLanguageModel
        >>> m = CarriedStateLM(LSTMLanguageModel(50, embed=8, hidden=8), batch_size=2)
        >>> v = m.init(jax.random.key(0), jnp.zeros((2, 5), jnp.int32))
        >>> sorted(v["batch_stats"])
        ['c_0', 'c_1', 'h_0', 'h_1']
    """

    lm: nn.Module
    batch_size: int

    @nn.compact
    def __call__(self, tokens: jax.Array, train: bool = False) -> jax.Array:
        shape = (self.batch_size, self.lm.hidden)
        cs = [self.variable("batch_stats", f"c_{l}", jnp.zeros, shape, jnp.float32)
              for l in range(self.lm.num_layers)]
        hs = [self.variable("batch_stats", f"h_{l}", jnp.zeros, shape, jnp.float32)
              for l in range(self.lm.num_layers)]
        if not train or tokens.shape[0] != self.batch_size:
            return self.lm(tokens, train=train)
        carry = tuple((c.value, h.value) for c, h in zip(cs, hs))
        logits, new_carry = self.lm(tokens, train=True, initial_carry=carry, return_carry=True)
        if not self.is_initializing() and self.is_mutable_collection("batch_stats"):
            for (c_new, h_new), c, h in zip(new_carry, cs, hs):
                c.value = jax.lax.stop_gradient(c_new)
                h.value = jax.lax.stop_gradient(h_new)
        return logits


def lm_eval_windows(tokens, *, window: int, stride: int,
                    max_tokens: int = 0) -> dict[str, np.ndarray]:
    """Windows scoring every next-token prediction of a stream exactly once.

    With ``x_j = t_j`` and target ``y_j = t_{j+1}`` for ``j < M`` (``M = len(t) - 1``,
    or ``max_tokens`` if smaller and > 0), window ``k`` (``k < ceil(M / S)``) has the
    inputs ``x[s_k : s_k + W]`` with ``s_k = min(max((k+1) S - W, 0), M - W)`` and
    scores (``mask`` 1) only the targets ``j in [k S, min((k+1) S, M))``. Every
    target is scored once, with at least ``min(j, W - S)`` tokens of context.
    ``W`` is clipped to ``M`` for short streams.

    Returns ``{"inputs", "labels"}`` int32 and ``"mask"`` float32, each (K, W).

    Example:
        >>> w = lm_eval_windows(np.arange(8), window=4, stride=2)
        >>> w["inputs"].tolist(), w["mask"].tolist()[1]
        ([[0, 1, 2, 3], [0, 1, 2, 3], [2, 3, 4, 5], [3, 4, 5, 6]], [0.0, 0.0, 1.0, 1.0])
    """
    t = np.asarray(tokens)
    if t.ndim != 1 or t.shape[0] < 2:
        raise ValueError(f"tokens must be a 1-D stream of >= 2 tokens, got shape {t.shape}")
    if window < 1 or stride < 1 or stride > window:
        raise ValueError(f"need 1 <= stride <= window, got window={window}, stride={stride}")
    if max_tokens < 0:
        raise ValueError(f"max_tokens={max_tokens} must be >= 0 (0: the whole stream)")
    m = t.shape[0] - 1
    if max_tokens:
        m = min(m, int(max_tokens))
    w = min(int(window), m)
    s = min(int(stride), w)
    k = np.arange(math.ceil(m / s))
    start = np.minimum(np.maximum((k + 1) * s - w, 0), m - w)
    idx = start[:, None] + np.arange(w)[None, :]
    lo, hi = (k * s)[:, None], np.minimum((k + 1) * s, m)[:, None]
    return {"inputs": t[idx].astype(np.int32), "labels": t[idx + 1].astype(np.int32),
            "mask": ((idx >= lo) & (idx < hi)).astype(np.float32)}


_LM_LOADERS = {"ptb": lambda d: text_data.load_ptb(d),
               "tiny_shakespeare": lambda d: text_data.load_tiny_shakespeare(d)}


def _language_model(config, name: str, vocab_size: int, *, batch_size: int,
                    max_len: int) -> tuple:
    """``(model, carry_state)``: the LM of ``config.model``, wrapped in `CarriedStateLM`
    when ``config.carry_state`` (default for ``lstm_lm``)."""
    kwargs = _model_kwargs(config)
    if name == "transformer_lm":
        kwargs.setdefault("max_len", max_len)
        if kwargs["max_len"] < max_len:
            raise ValueError(f"config.model_kwargs.max_len={kwargs['max_len']} must be >= "
                             f"seq_len and eval_seq_len (the longer is {max_len})")
    model = get_model(name, num_classes=vocab_size, **kwargs)
    carry = bool(config.get("carry_state", name == "lstm_lm"))
    if carry:
        if name != "lstm_lm":
            raise ValueError(f"config.carry_state=True needs model 'lstm_lm', got {name!r}")
        model = CarriedStateLM(model, batch_size=batch_size)
    return model, carry


def _lm_eval_settings(config, seq_len: int) -> tuple:
    """(eval_seq_len, eval_stride, max_eval_tokens, eval_batch_size, eval_splits), checked."""
    eval_len = _positive(config, "eval_seq_len", 2 * seq_len)
    stride = _positive(config, "eval_stride", seq_len)
    if stride > eval_len:
        raise ValueError(f"config.eval_stride={stride} must be <= config.eval_seq_len="
                         f"{eval_len}")
    max_tokens = _non_negative(config, "max_eval_tokens", 0)
    eval_bs = int(config.get("eval_batch_size", 0) or 64)
    splits = tuple(config.get("eval_splits", None) or ("valid", "test"))
    for split in splits:
        if split not in ("train", "valid", "test"):
            raise ValueError(f"config.eval_splits has {split!r}; allowed: train, valid, test")
    return eval_len, stride, max_tokens, eval_bs, splits


@_builds(*_LM_LOADERS)
def language_model_task(config) -> Task:
    """Next-token language modelling on PTB (words) or tiny-shakespeare (characters).

    Training batches: step ``t`` takes the ``t mod S``-th ``(batch_size, seq_len)``
    segment of the batchified train stream (`text_data.lm_batch_at_step`), labels the
    next tokens; ``loss = mean_{b,t} CE``. ``config.model``: ``"lstm_lm"`` (with
    ``config.carry_state``: the state carried across segments, `CarriedStateLM`) or
    ``"transformer_lm"`` (``max_len`` = the longer of ``seq_len`` and
    ``eval_seq_len`` unless given in model_kwargs). Evaluation: `lm_eval_windows` over
    the splits of ``config.eval_splits`` (default ``("valid", "test")``), metric
    ``perplexity = exp(sum CE / count)``.

    Config fields read: dataset, data_dir, model, model_kwargs, batch_size, seq_len,
    eval_seq_len (default 2 * seq_len), eval_stride (default seq_len),
    max_eval_tokens (0: all), eval_batch_size, carry_state, eval_splits.

    Example:
        >>> from experiments.configs import ptb_lstm
        >>> ptb_config = ptb_lstm.get_config()
        >>> ptb_config.data_dir = "/work/shared/datasets/ptb"
        >>> task = language_model_task(ptb_config)
        >>> task.train_batch(0, jax.random.key(0))["inputs"].shape
        (20, 35)
    """
    data_dir = _data_dir(config)
    data = _tfds_or_files(_LM_LOADERS[config.dataset], data_dir, config.dataset)
    name = config.get("model", "lstm_lm")
    if name not in LM_MODELS:
        raise ValueError(f"config.model={name!r} is not a language model; choose one of "
                         f"{list(LM_MODELS)} for dataset {config.dataset!r}")
    batch_size = _positive(config, "batch_size", 20)
    seq_len = _positive(config, "seq_len", 35)
    eval_len, stride, max_tokens, eval_bs, splits = _lm_eval_settings(config, seq_len)
    # lm_steps_per_epoch raises a clear ValueError when the stream is too short.
    steps_per_epoch = text_data.lm_steps_per_epoch(int(data.train.shape[0]),
                                                   batch_size=batch_size, seq_len=seq_len)
    model, carry = _language_model(config, name, data.vocab_size, batch_size=batch_size,
                                   max_len=max(seq_len, eval_len))
    train_tokens = data.train
    # The stream is an argument (not a closed-over constant baked into the program).
    segment = jax.jit(functools.partial(text_data.lm_batch_at_step, batch_size=batch_size,
                                        seq_len=seq_len))

    def train_batch(step, key):
        del key  # the data order is a pure function of the step
        x, y = segment(train_tokens, step)
        return {"inputs": x, "labels": y}

    windows: dict[str, dict[str, np.ndarray]] = {}

    def eval_batches(split: str):
        if split not in splits:
            raise ValueError(f"unknown eval split {split!r}; this task has {splits}")
        if split not in windows:
            windows[split] = lm_eval_windows(np.asarray(getattr(data, split)),
                                             window=eval_len, stride=stride,
                                             max_tokens=max_tokens)
        return padded_batches(windows[split], eval_bs)

    def scored(split: str) -> int:
        n = int(getattr(data, split).shape[0]) - 1
        return min(n, max_tokens) if max_tokens else n

    return Task(name=config.dataset, model=model,
                sample_inputs=jnp.zeros((batch_size, seq_len), jnp.int32),
                train_batch=train_batch, eval_batches=eval_batches,
                num_train_examples=int(data.train.shape[0]), steps_per_epoch=steps_per_epoch,
                metric="perplexity", eval_splits=splits,
                info={"vocab_size": data.vocab_size, "train_tokens": int(data.train.shape[0]),
                      "seq_len": seq_len, "eval_seq_len": eval_len, "eval_stride": stride,
                      "carry_state": carry,
                      **{f"eval_tokens_{s}": scored(s) for s in splits}})


@_builds("sst2")
def sentence_classification_task(config) -> Task:
    """GLUE SST-2 (binary sentiment) with a `TransformerClassifier` from scratch.

    Batches ``{"inputs": tokens (B, max_len), "labels": (B,)}`` drawn by
    `text_data.classification_batch_at_step` (a fresh permutation per epoch from
    ``fold_in(key, epoch)``); the padding mask is ``tokens != <pad>`` inside the
    model. The reported split ``"test"`` is the GLUE dev set (872 sentences; GLUE's
    test labels are hidden), evaluated in padded batches with ``mask``.

    Config fields read: dataset, data_dir (empty: TFDS ``glue/sst2``), model,
    model_kwargs, batch_size, eval_batch_size, max_len, vocab_size.

    Example:
        >>> from experiments.configs import sst2_transformer
        >>> sst2_config = sst2_transformer.get_config()
        >>> sst2_config.data_dir = "/work/shared/datasets/glue/SST-2"
        >>> task = sentence_classification_task(sst2_config)
        >>> task.metric, task.eval_splits
        ('accuracy', ('test',))
    """
    data_dir = config.get("data_dir", None) or None
    max_len = _positive(config, "max_len", 64)
    vocab_size = _positive(config, "vocab_size", 20000)
    data = _tfds_or_files(text_data.load_sst2, data_dir, "sst2", max_len=max_len,
                          vocab_size=vocab_size)
    name = config.get("model", "transformer_classifier")
    if name != "transformer_classifier":
        raise ValueError(f"config.model={name!r}: sst2 needs 'transformer_classifier'")
    kwargs = _model_kwargs(config)
    kwargs.setdefault("max_len", max_len)
    model = get_model(name, num_classes=2, vocab_size=data.vocab_size, **kwargs)
    batch_size = _positive(config, "batch_size", 64)
    train = {"inputs": data.train["inputs"], "labels": data.train["labels"]}
    steps_per_epoch = text_data.classification_steps_per_epoch(train, batch_size)
    eval_bs = int(config.get("eval_batch_size", 0) or 256)
    dev = {"inputs": np.asarray(data.validation["inputs"]),
           "labels": np.asarray(data.validation["labels"])}

    draw = jax.jit(functools.partial(text_data.classification_batch_at_step,
                                     batch_size=batch_size))

    def train_batch(step, key):
        return draw(train, step, key)

    def eval_batches(split: str):
        if split != "test":
            raise ValueError(f"unknown eval split {split!r}; sst2 has 'test' (GLUE dev)")
        return padded_batches(dev, eval_bs)

    return Task(name="sst2", model=model, sample_inputs=jnp.zeros((batch_size, max_len),
                                                                  jnp.int32),
                train_batch=train_batch, eval_batches=eval_batches,
                num_train_examples=int(train["labels"].shape[0]),
                steps_per_epoch=steps_per_epoch, eval_splits=("test",),
                info={"vocab_size": data.vocab_size, "max_len": max_len,
                      "num_train": int(train["labels"].shape[0]),
                      "num_test": int(dev["labels"].shape[0]),
                      "test_split": "GLUE SST-2 dev (test labels are hidden)",
                      "pretrained": False})
