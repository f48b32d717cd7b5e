"""Language data: PTB (word LM), tiny-shakespeare (char LM), SST-2 (classification).

Each loader reads the raw files from ``data_dir`` (offline) or, where a TFDS
builder exists and ``data_dir`` is None, goes through ``tensorflow_datasets``
(imported lazily; it needs the internet the first time, and TensorFlow for these
text builders). Token arrays come back as device arrays (``jnp`` int32) so the
batching helpers below can slice them inside a jitted train step.

Batching helpers are pure functions of ``(step[, key])`` and jittable (``step``
may be a tracer; ``batch_size`` and ``seq_len`` are static Python ints):

* :func:`lm_batch_at_step` -- truncated-BPTT segments in the "batchify" layout.
* :func:`classification_batch_at_step` -- shuffled mini-batches, a fresh
  permutation per epoch from ``fold_in(key, epoch)``.

Example:
    >>> ptb = load_ptb("/work/shared/datasets/ptb")
    >>> x, y = lm_batch_at_step(ptb.train, 0, batch_size=20, seq_len=35)
    >>> x.shape, bool((x[:, 1:] == y[:, :-1]).all())
    ((20, 35), True)
"""

from __future__ import annotations

import collections
import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from cpt_jax.data.sources import load_tfds_arrays

__all__ = [
    "LMData", "SST2Data", "load_ptb", "load_tiny_shakespeare", "load_sst2",
    "tokenize", "build_vocab", "encode_sentences", "lm_steps_per_epoch",
    "lm_batch_at_step", "classification_steps_per_epoch",
    "classification_batch_at_step", "iterate_batches", "PAD", "UNK", "EOS",
]

PAD, UNK, EOS = "<pad>", "<unk>", "<eos>"


@struct.dataclass
class LMData:
    """A language-modelling corpus: three 1-D int32 token streams and a vocab.

    ``vocab[i]`` is the string of token id ``i`` (a word for PTB, a character
    for tiny-shakespeare); ``vocab`` is static (not a pytree leaf).

    Example:
        >>> d = load_tiny_shakespeare("/work/shared/datasets/tinyshakespeare")
        >>> "".join(d.vocab[int(i)] for i in d.train[:5])
        'First'
    """

    train: Any
    valid: Any
    test: Any
    vocab: tuple = struct.field(pytree_node=False)

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)


@struct.dataclass
class SST2Data:
    """SST-2 as padded arrays.

    ``train`` and ``validation`` are dicts of equal-length arrays (keys as the
    runner's batches, ``inputs``/``labels``):
    ``inputs`` (N, max_len) int32 token ids (0 = ``<pad>``, 1 = ``<unk>``),
    ``token_mask`` (N, max_len) bool (True on real tokens), ``lengths`` (N,)
    int32 and ``labels`` (N,) int32 in {0, 1}. ``vocab`` is static.
    """

    train: Any
    validation: Any
    vocab: tuple = struct.field(pytree_node=False)

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)


# ----------------------------------------------------------------------------
# File helpers
# ----------------------------------------------------------------------------


def _read_text(path: str, expected: str = "UTF-8 text") -> str:
    """The file's text; a one-line error naming `path` and `expected` for a missing,
    empty or non-UTF-8 (binary, or cut inside a character) file."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"data file not found: {path!r}")
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text (byte {e.start}: {e.reason}), a binary or "
                         f"truncated file; expected {expected}") from e
    if not text.strip():
        raise ValueError(f"{path}: empty file ({len(text)} characters); expected {expected}")
    return text


def _tfds_load(name: str, split: str, data_dir: str | None, keys: Sequence[str],
               local_hint: str) -> dict:
    """One TFDS split as numpy: a prepared directory (no TensorFlow), else tfds.load.

    Raises `DatasetUnavailableError` (a RuntimeError) naming the three options.
    """
    return load_tfds_arrays(name, split, data_dir, keys, local_hint=local_hint)


def _as_str(x: Any) -> str:
    return x.decode("utf-8") if isinstance(x, (bytes, np.bytes_)) else str(x)


# ----------------------------------------------------------------------------
# PTB (word level)
# ----------------------------------------------------------------------------


def _ptb_words(text: str) -> list[str]:
    words: list[str] = []
    for line in text.splitlines():
        words.extend(line.split())
        words.append(EOS)
    return words


PTB_TEXT = "UTF-8 text, one sentence of space-separated words per line (Mikolov's PTB)"
SHAKESPEARE_TEXT = "the tiny-shakespeare UTF-8 text (Karpathy's input.txt, ~1.1 MB)"


def load_ptb(data_dir: str) -> LMData:
    """Penn Treebank, Mikolov's word-level version (10,000 words incl. ``<eos>``).

    Each line of ``ptb.{train,valid,test}.txt`` is split on whitespace and
    ends with ``<eos>``, as in Zaremba et al. and PyTorch's word_language_model.
    The vocab is the train words in order of first appearance (so ids are
    deterministic); valid/test words outside it map to ``<unk>``. There is no
    TFDS builder for PTB, so ``data_dir`` is required.

    Example:
        >>> ptb = load_ptb("/work/shared/datasets/ptb")
        >>> ptb.vocab_size, ptb.train.shape
        (10000, (929589,))
    """
    if data_dir is None:
        raise ValueError("data_dir=None: PTB has no TFDS builder; pass the "
                         "folder holding ptb.{train,valid,test}.txt")
    splits = {s: _ptb_words(_read_text(os.path.join(data_dir, f"ptb.{s}.txt"), PTB_TEXT))
              for s in ("train", "valid", "test")}
    vocab = tuple(dict.fromkeys(splits["train"]))
    index = {w: i for i, w in enumerate(vocab)}
    unk = index.get(UNK)

    def encode(words: list[str], split: str) -> jax.Array:
        ids = [index.get(w, unk) for w in words]
        if unk is None and any(i is None for i in ids):
            unknown = sorted({w for w, i in zip(words, ids) if i is None})
            raise ValueError(f"{os.path.join(data_dir, f'ptb.{split}.txt')}: words outside "
                             f"the train vocab ({', '.join(unknown[:3])}) and no <unk> in "
                             f"ptb.train.txt to map them to; expected {PTB_TEXT}")
        return jnp.asarray(np.asarray(ids, dtype=np.int32))

    return LMData(train=encode(splits["train"], "train"),
                  valid=encode(splits["valid"], "valid"),
                  test=encode(splits["test"], "test"), vocab=vocab)


# ----------------------------------------------------------------------------
# tiny-shakespeare (char level)
# ----------------------------------------------------------------------------


def _split_90_5_5(text: str) -> tuple[str, str, str]:
    """The TFDS ``tiny_shakespeare`` split, by characters: 90% / 5% / 5%."""
    i = int(len(text) * 0.9)
    train, rest = text[:i], text[i:]
    j = int(len(rest) * 0.5)
    return train, rest[:j], rest[j:]


def load_tiny_shakespeare(data_dir: str | None = None) -> LMData:
    """Karpathy's tiny-shakespeare, character level (65 distinct characters).

    Split: the TFDS ``tiny_shakespeare`` one -- the first 90% of the characters
    train, the next 5% validation, the last 5% test (1,003,854 / 55,770 / 55,770
    characters). The vocab is the sorted set of all characters in the text.
    With ``data_dir`` holding ``input.txt`` that file is read; otherwise TFDS
    ``tiny_shakespeare`` (a prepared ``data_dir`` through ``tfds.data_source``,
    no TensorFlow; else ``tfds.load`` when TensorFlow imports; a
    ``DatasetUnavailableError``, a ``RuntimeError``, names the options).

    Example:
        >>> d = load_tiny_shakespeare("/work/shared/datasets/tinyshakespeare")
        >>> d.vocab_size, d.train.shape, d.valid.shape
        (65, (1003854,), (55770,))
    """
    if data_dir is None or not os.path.isfile(os.path.join(data_dir, "input.txt")):
        parts = tuple(_as_str(_tfds_load("tiny_shakespeare", s, data_dir, ("text",),
                                         "input.txt")["text"][0])
                      for s in ("train", "validation", "test"))
    else:
        path = os.path.join(data_dir, "input.txt")
        parts = _split_90_5_5(_read_text(path, SHAKESPEARE_TEXT))
        if not all(parts):
            raise ValueError(f"{path}: {sum(map(len, parts))} characters, too few for the "
                             f"90/5/5 split; expected {SHAKESPEARE_TEXT}")
    vocab = tuple(sorted(set("".join(parts))))
    index = {c: i for i, c in enumerate(vocab)}

    def encode(s: str) -> jax.Array:
        return jnp.asarray(np.fromiter((index[c] for c in s), dtype=np.int32,
                                       count=len(s)))

    return LMData(train=encode(parts[0]), valid=encode(parts[1]),
                  test=encode(parts[2]), vocab=vocab)


# ----------------------------------------------------------------------------
# SST-2 (sentence classification)
# ----------------------------------------------------------------------------


def tokenize(sentence: str) -> list[str]:
    """Lower-case, split on whitespace (SST-2 text is already tokenized).

    Example:
        >>> tokenize("A Gorgeous , witty film ")
        ['a', 'gorgeous', ',', 'witty', 'film']
    """
    return sentence.lower().split()


def build_vocab(sentences: Sequence[str], vocab_size: int) -> tuple[str, ...]:
    """``(<pad>, <unk>)`` + the ``vocab_size - 2`` most frequent tokens.

    Ties in frequency are broken alphabetically, so the vocab is deterministic;
    it is shorter than ``vocab_size`` when there are fewer distinct tokens.

    Example:
        >>> build_vocab(["b a", "a c"], 4)
        ('<pad>', '<unk>', 'a', 'b')
    """
    if int(vocab_size) < 3:
        raise ValueError(f"vocab_size={vocab_size} must be >= 3 "
                         "(<pad>, <unk> and at least one word)")
    counts = collections.Counter(t for s in sentences for t in tokenize(s))
    counts.pop(PAD, None)
    counts.pop(UNK, None)
    top = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    return (PAD, UNK) + tuple(w for w, _ in top[: int(vocab_size) - 2])


def encode_sentences(sentences: Sequence[str], vocab: Sequence[str],
                     max_len: int) -> dict[str, np.ndarray]:
    """Token ids padded/truncated to ``max_len``: ``inputs``, ``token_mask``, ``lengths``.

    Example:
        >>> e = encode_sentences(["a b z"], ("<pad>", "<unk>", "a", "b"), 4)
        >>> e["inputs"].tolist(), e["lengths"].tolist()
        ([[2, 3, 1, 0]], [3])
    """
    if int(max_len) < 1:
        raise ValueError(f"max_len={max_len} must be >= 1")
    index = {w: i for i, w in enumerate(vocab)}
    unk = index[UNK]
    tokens = np.zeros((len(sentences), int(max_len)), dtype=np.int32)
    lengths = np.zeros((len(sentences),), dtype=np.int32)
    for n, s in enumerate(sentences):
        ids = [index.get(t, unk) for t in tokenize(s)][: int(max_len)]
        tokens[n, : len(ids)] = ids
        lengths[n] = len(ids)
    mask = np.arange(int(max_len))[None, :] < lengths[:, None]
    return {"inputs": tokens, "token_mask": mask, "lengths": lengths}


GLUE_TSV = "a GLUE tsv: a header naming 'sentence' and 'label', then one row per sentence"


def _glue_row(path: str, number: int, cols: list[str], si: int, li: int,
              width: int) -> tuple[str, int]:
    """``(sentence, label)`` of row `number` (1-based line) of a GLUE tsv."""
    if len(cols) != width:
        raise ValueError(f"{path}:{number}: {len(cols)} tab-separated columns, the header has "
                         f"{width} (a truncated or malformed row); expected {GLUE_TSV}")
    if cols[li].strip() not in ("0", "1"):
        raise ValueError(f"{path}:{number}: label {cols[li]!r}, expected 0 or 1; "
                         f"expected {GLUE_TSV}")
    return cols[si], int(cols[li])


def _read_glue_tsv(path: str) -> tuple[list[str], np.ndarray]:
    lines = _read_text(path, GLUE_TSV).splitlines()
    header = lines[0].split("\t")
    if "sentence" not in header or "label" not in header:
        raise ValueError(f"{path}: header {header[:4]} must name the columns "
                         f"'sentence' and 'label'; expected {GLUE_TSV}")
    si, li = header.index("sentence"), header.index("label")
    rows = [_glue_row(path, n, line.split("\t"), si, li, len(header))
            for n, line in enumerate(lines[1:], start=2) if line.strip()]
    if not rows:
        raise ValueError(f"{path}: a header and no rows; expected {GLUE_TSV}")
    sentences, labels = zip(*rows)
    return list(sentences), np.asarray(labels, dtype=np.int32)


def load_sst2(data_dir: str | None = None, max_len: int = 64,
              vocab_size: int = 20000) -> SST2Data:
    """GLUE SST-2: 67,349 train and 872 dev sentences, labels in {0, 1}.

    Reads ``train.tsv`` and ``dev.tsv`` (GLUE layout, header
    ``sentence\\tlabel``) from ``data_dir``, or else ``glue/sst2`` through TFDS
    (splits ``train``, ``validation``; see :mod:`cpt_jax.data.sources`). Tokens: lower-cased
    whitespace words (:func:`tokenize`), vocab from train (:func:`build_vocab`:
    ``<pad>`` = 0, ``<unk>`` = 1, then by frequency), padded/truncated to
    ``max_len``. Use ``data.vocab_size`` (<= ``vocab_size``) for the model.

    Example:
        >>> d = load_sst2("/work/shared/datasets/glue/SST-2", max_len=64)
        >>> d.train["inputs"].shape, d.validation["labels"].shape
        ((67349, 64), (872,))
    """
    if data_dir is None or not os.path.isfile(os.path.join(data_dir, "train.tsv")):
        raw = {}
        for split, tfds_split in (("train", "train"),
                                  ("validation", "validation")):
            ex = _tfds_load("glue/sst2", tfds_split, data_dir, ("sentence", "label"),
                            "train.tsv and dev.tsv")
            raw[split] = ([_as_str(s) for s in ex["sentence"]],
                          np.asarray(ex["label"], dtype=np.int32))
    else:
        raw = {"train": _read_glue_tsv(os.path.join(data_dir, "train.tsv")),
               "validation": _read_glue_tsv(os.path.join(data_dir, "dev.tsv"))}
    vocab = build_vocab(raw["train"][0], vocab_size)

    def arrays(split: str) -> dict[str, jax.Array]:
        sentences, labels = raw[split]
        out = encode_sentences(sentences, vocab, max_len)
        out["labels"] = labels
        return {k: jnp.asarray(v) for k, v in out.items()}

    return SST2Data(train=arrays("train"), validation=arrays("validation"),
                    vocab=vocab)


# ----------------------------------------------------------------------------
# Batching: pure functions of (step[, key]), jittable
# ----------------------------------------------------------------------------


def _check_positive(name: str, value: int) -> int:
    if not isinstance(value, (int, np.integer)) or int(value) < 1:
        raise ValueError(f"{name}={value!r} must be a Python int >= 1 "
                         "(static under jit)")
    return int(value)


def lm_steps_per_epoch(num_tokens: int, *, batch_size: int,
                       seq_len: int) -> int:
    """Number of full BPTT segments per epoch: ``(num_tokens // B - 1) // T``.

    Example:
        >>> lm_steps_per_epoch(929589, batch_size=20, seq_len=35)
        1327
    """
    batch_size = _check_positive("batch_size", batch_size)
    seq_len = _check_positive("seq_len", seq_len)
    steps = (int(num_tokens) // batch_size - 1) // seq_len
    if steps < 1:
        raise ValueError(
            f"num_tokens={num_tokens} is too short for batch_size={batch_size} "
            f"and seq_len={seq_len}: need at least batch_size*(seq_len+1) = "
            f"{batch_size * (seq_len + 1)} tokens")
    return steps


def lm_batch_at_step(tokens: jax.Array, step: jax.Array | int, *,
                     batch_size: int, seq_len: int
                     ) -> tuple[jax.Array, jax.Array]:
    """Inputs and next-token targets of step ``step`` (truncated BPTT).

    "Batchify" layout (Zaremba et al.; PyTorch word_language_model): the stream
    is cut to ``L = len(tokens) // B`` tokens per row and reshaped to ``(B, L)``,
    row b being the contiguous stream ``tokens[b*L:(b+1)*L]``. With
    ``S = (L - 1) // T`` full segments per epoch and ``i = (step mod S) * T``:

        inputs  = data[:, i     : i + T]
        targets = data[:, i + 1 : i + T + 1]

    so consecutive steps continue each row's stream, and step ``S`` wraps to the
    start (a new epoch). The last ``L - 1 - S*T`` tokens of a row are unused.

    Args:
      tokens: (num_tokens,) int token ids (keep it a device array).
      step: int or traced int scalar.
      batch_size, seq_len: static Python ints.

    Returns:
      ``(inputs, targets)``, both (batch_size, seq_len) with the dtype of tokens.

    Example:
        >>> t = jnp.arange(22)
        >>> x, y = lm_batch_at_step(t, 1, batch_size=2, seq_len=3)
        >>> x.tolist(), y.tolist()
        ([[3, 4, 5], [14, 15, 16]], [[4, 5, 6], [15, 16, 17]])
    """
    if jnp.ndim(tokens) != 1:
        raise ValueError(f"tokens must be 1-D, got shape {jnp.shape(tokens)}")
    steps = lm_steps_per_epoch(tokens.shape[0], batch_size=batch_size,
                               seq_len=seq_len)
    length = tokens.shape[0] // batch_size
    data = jnp.reshape(tokens[: length * batch_size], (batch_size, length))
    start = (jnp.asarray(step, dtype=jnp.int32) % steps) * seq_len
    window = jax.lax.dynamic_slice_in_dim(data, start, seq_len + 1, axis=1)
    return window[:, :-1], window[:, 1:]


def _num_examples(data: Mapping[str, Any]) -> int:
    leaves = jax.tree_util.tree_leaves(data)
    if not leaves:
        raise ValueError("data has no arrays")
    n = leaves[0].shape[0]
    if any(leaf.shape[0] != n for leaf in leaves):
        raise ValueError("all arrays in data must share the leading dimension; "
                         f"got {[leaf.shape for leaf in leaves]}")
    return int(n)


def classification_steps_per_epoch(data: Mapping[str, Any],
                                   batch_size: int) -> int:
    """``N // batch_size`` full batches per epoch (the remainder is dropped).

    Example:
        >>> classification_steps_per_epoch({"x": jnp.zeros((10, 2))}, 4)
        2
    """
    batch_size = _check_positive("batch_size", batch_size)
    n = _num_examples(data)
    if n < batch_size:
        raise ValueError(f"batch_size={batch_size} exceeds the {n} examples")
    return n // batch_size


def classification_batch_at_step(data: Mapping[str, Any],
                                 step: jax.Array | int, key: jax.Array,
                                 batch_size: int) -> Any:
    """The shuffled mini-batch of step ``step`` (a pure, jittable function).

    With ``S = N // batch_size`` steps per epoch, ``e = step // S`` and
    ``perm_e = permutation(fold_in(key, e), N)``:

        batch = tree_map(lambda x: x[perm_e[(step mod S)*B : (step mod S + 1)*B]], data)

    Every epoch visits ``S * B`` distinct examples in a fresh order; the same
    ``(key, step)`` always gives the same batch.

    Example:
        >>> d = {"x": jnp.arange(10), "label": jnp.arange(10) % 2}
        >>> b = classification_batch_at_step(d, 3, jax.random.key(0), 4)
        >>> b["x"].shape
        (4,)
    """
    steps = classification_steps_per_epoch(data, batch_size)
    n = _num_examples(data)
    step = jnp.asarray(step, dtype=jnp.int32)
    perm = jax.random.permutation(jax.random.fold_in(key, step // steps), n)
    idx = jax.lax.dynamic_slice_in_dim(perm, (step % steps) * batch_size,
                                       batch_size)
    return jax.tree_util.tree_map(lambda x: jnp.take(x, idx, axis=0), data)


def iterate_batches(data: Mapping[str, Any], batch_size: int) -> Iterator[Any]:
    """Sequential, unshuffled batches for evaluation (the last may be smaller).

    Example:
        >>> [b["x"].tolist() for b in iterate_batches({"x": jnp.arange(5)}, 2)]
        [[0, 1], [2, 3], [4]]
    """
    batch_size = _check_positive("batch_size", batch_size)
    n = _num_examples(data)
    for start in range(0, n, batch_size):
        yield jax.tree_util.tree_map(lambda x, start=start: x[start:start + batch_size], data)
