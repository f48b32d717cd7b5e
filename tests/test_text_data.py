"""Tests for cpt_jax.data.text (PTB, tiny-shakespeare, SST-2, batching)."""

from __future__ import annotations

import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cpt_jax.data import text as td

DATASETS = Path(os.environ.get(
    "CPT_JAX_DATASETS", Path(__file__).resolve().parents[2] / "shared" / "datasets"))
PTB = DATASETS / "ptb"
SHAKESPEARE = DATASETS / "tinyshakespeare"
SST2 = DATASETS / "glue" / "SST-2"


def _needs(path: Path):
    return pytest.mark.skipif(not path.exists(), reason=f"{path} not available")


@pytest.fixture(scope="module")
def ptb():
    return td.load_ptb(str(PTB))


# ---------------------------------------------------------------- PTB
@_needs(PTB / "ptb.train.txt")
def test_ptb_sizes(ptb):
    assert ptb.vocab_size == 10000
    assert ptb.train.shape == (929589,)
    assert ptb.valid.shape == (73760,) and ptb.test.shape == (82430,)
    assert ptb.train.dtype == jnp.int32
    assert int(ptb.train.max()) < 10000 and int(ptb.train.min()) >= 0
    eos = ptb.vocab.index(td.EOS)
    # one <eos> per line of the train file
    with open(PTB / "ptb.train.txt") as f:
        assert int((ptb.train == eos).sum()) == sum(1 for _ in f)
    # the first tokens decode back to the first line
    with open(PTB / "ptb.train.txt") as f:
        first = f.readline().split()
    assert [ptb.vocab[int(i)] for i in ptb.train[:len(first)]] == first


@_needs(PTB / "ptb.train.txt")
def test_ptb_batches_continue_the_stream(ptb):
    b, t = 20, 35
    batch = jax.jit(td.lm_batch_at_step, static_argnames=("batch_size", "seq_len"))
    x0, y0 = batch(ptb.train, 0, batch_size=b, seq_len=t)
    x1, y1 = batch(ptb.train, jnp.int32(1), batch_size=b, seq_len=t)
    assert x0.shape == y0.shape == (b, t)
    np.testing.assert_array_equal(x0[:, 1:], y0[:, :-1])   # targets = shift by one
    np.testing.assert_array_equal(x1[:, 0], y0[:, -1])     # next step continues
    stream = np.asarray(ptb.train)
    length = len(stream) // b
    np.testing.assert_array_equal(np.asarray(x1[3]),
                                  stream[3 * length + t: 3 * length + 2 * t])
    steps = td.lm_steps_per_epoch(len(stream), batch_size=b, seq_len=t)
    assert steps == (length - 1) // t
    xs, _ = batch(ptb.train, steps, batch_size=b, seq_len=t)  # wraps around
    np.testing.assert_array_equal(xs, x0)


def test_lm_batch_small_example_and_errors():
    tokens = jnp.arange(22)
    x, y = td.lm_batch_at_step(tokens, 1, batch_size=2, seq_len=3)
    assert x.tolist() == [[3, 4, 5], [14, 15, 16]]
    assert y.tolist() == [[4, 5, 6], [15, 16, 17]]
    # 11 tokens per row -> (11 - 1) // 3 = 3 segments; step 3 == step 0
    x3, _ = td.lm_batch_at_step(tokens, 3, batch_size=2, seq_len=3)
    assert x3.tolist() == [[0, 1, 2], [11, 12, 13]]
    with pytest.raises(ValueError, match="too short"):
        td.lm_batch_at_step(tokens, 0, batch_size=4, seq_len=10)
    with pytest.raises(ValueError, match="seq_len"):
        td.lm_batch_at_step(tokens, 0, batch_size=2, seq_len=0)
    with pytest.raises(ValueError, match="1-D"):
        td.lm_batch_at_step(tokens.reshape(2, 11), 0, batch_size=2, seq_len=3)


def test_ptb_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="ptb.train.txt"):
        td.load_ptb(str(tmp_path))


# ---------------------------------------------------------------- Shakespeare
@_needs(SHAKESPEARE / "input.txt")
def test_tiny_shakespeare():
    d = td.load_tiny_shakespeare(str(SHAKESPEARE))
    assert d.vocab_size == 65
    sizes = [d.train.shape[0], d.valid.shape[0], d.test.shape[0]]
    assert sum(sizes) == 1115394
    assert sizes == [1003854, 55770, 55770]  # TFDS 90/5/5 by characters
    text = (SHAKESPEARE / "input.txt").read_text()
    decoded = "".join(d.vocab[int(i)] for i in d.valid[:50])
    assert decoded == text[1003854:1003854 + 50]


def test_tiny_shakespeare_missing(tmp_path):
    with pytest.raises(FileNotFoundError, match="input.txt"):
        td.load_tiny_shakespeare(str(tmp_path))


# ---------------------------------------------------------------- SST-2
@_needs(SST2 / "train.tsv")
def test_sst2():
    d = td.load_sst2(str(SST2), max_len=32, vocab_size=5000)
    tr, dev = d.train, d.validation
    assert tr["inputs"].shape == (67349, 32) and dev["inputs"].shape == (872, 32)
    assert tr["inputs"].dtype == jnp.int32 and tr["labels"].dtype == jnp.int32
    assert set(np.unique(tr["labels"]).tolist()) == {0, 1}
    assert set(np.unique(dev["labels"]).tolist()) == {0, 1}
    assert d.vocab[:2] == (td.PAD, td.UNK) and d.vocab_size == 5000
    for split in (tr, dev):
        tokens, mask = np.asarray(split["inputs"]), np.asarray(split["token_mask"])
        np.testing.assert_array_equal(mask, tokens != 0)
        np.testing.assert_array_equal(mask.sum(axis=1), split["lengths"])
        assert tokens.max() < d.vocab_size
    # the first train sentence round-trips, rare words as <unk>
    words = "hide new secretions from the parental units".split()
    expected = [w if w in d.vocab else td.UNK for w in words]
    assert td.UNK in expected and expected[0] == "hide"
    decoded = [d.vocab[int(i)] for i in tr["inputs"][0][: int(tr["lengths"][0])]]
    assert decoded == expected
    assert (np.asarray(dev["inputs"]) == 1).any()  # some dev words are <unk>


def test_vocab_and_encoding():
    vocab = td.build_vocab(["b a", "A c", "c c"], 4)
    assert vocab == ("<pad>", "<unk>", "c", "a")
    e = td.encode_sentences(["a B zz c", ""], vocab, 3)
    assert e["inputs"].tolist() == [[3, 1, 1], [0, 0, 0]]
    assert e["lengths"].tolist() == [3, 0]
    with pytest.raises(ValueError, match="vocab_size"):
        td.build_vocab(["a"], 2)


def test_sst2_missing(tmp_path):
    with pytest.raises(FileNotFoundError, match="train.tsv"):
        td.load_sst2(str(tmp_path))


# ---------------------------------------------------------------- shuffling
def test_classification_batches_are_epoch_permutations():
    n, b = 23, 5
    data = {"x": jnp.arange(n), "label": jnp.arange(n) % 2}
    key = jax.random.key(0)
    fn = jax.jit(td.classification_batch_at_step, static_argnums=3)
    steps = td.classification_steps_per_epoch(data, b)
    assert steps == 4
    epoch0 = [np.asarray(fn(data, s, key, b)["x"]) for s in range(steps)]
    seen = np.concatenate(epoch0)
    assert len(set(seen.tolist())) == steps * b           # no repeats in an epoch
    batch = fn(data, 2, key, b)
    np.testing.assert_array_equal(batch["label"], batch["x"] % 2)  # rows aligned
    np.testing.assert_array_equal(batch["x"], epoch0[2])   # pure in (key, step)
    eager = td.classification_batch_at_step(data, 2, key, b)
    np.testing.assert_array_equal(eager["x"], epoch0[2])
    epoch1 = np.concatenate([np.asarray(fn(data, s, key, b)["x"])
                             for s in range(steps, 2 * steps)])
    assert not np.array_equal(epoch1, seen)                # reshuffled
    other = np.asarray(fn(data, 0, jax.random.key(1), b)["x"])
    assert not np.array_equal(other, epoch0[0])
    with pytest.raises(ValueError, match="batch_size"):
        td.classification_batch_at_step(data, 0, key, 30)
    with pytest.raises(ValueError, match="leading dimension"):
        td.classification_batch_at_step({"x": jnp.zeros(3), "y": jnp.zeros(4)},
                                        0, key, 1)


def test_iterate_batches():
    out = [b["x"].tolist() for b in td.iterate_batches({"x": jnp.arange(5)}, 2)]
    assert out == [[0, 1], [2, 3], [4]]


def test_tfds_path_gives_clear_error_offline(monkeypatch):
    import sys
    monkeypatch.setitem(sys.modules, "tensorflow_datasets", None)  # import fails
    with pytest.raises(RuntimeError, match="data_dir"):
        td.load_tiny_shakespeare(None)
    with pytest.raises(ValueError, match="TFDS"):
        td.load_ptb(None)


def test_tiny_shakespeare_through_tfds_data_source_without_tensorflow(tmp_path, monkeypatch):
    tfds = pytest.importorskip("tensorflow_datasets")

    def no_load(*args, **kwargs):
        raise AssertionError("tfds.load must not be needed for a prepared directory")

    monkeypatch.setattr(tfds, "load", no_load)
    with tfds.testing.mock_data(num_examples=1):
        d = td.load_tiny_shakespeare(str(tmp_path))  # no input.txt there: TFDS
        texts = [str(tfds.data_source("tiny_shakespeare", split=s, download=False)[0]["text"])
                 for s in ("train", "validation", "test")]
    assert d.vocab == tuple(sorted(set("".join(texts))))
    assert "".join(d.vocab[int(i)] for i in d.train) == texts[0]
    assert "".join(d.vocab[int(i)] for i in d.test) == texts[2]
