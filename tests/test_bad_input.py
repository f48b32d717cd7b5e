"""Bad input, tried systematically through the main job's command line (in process).

Each local dataset format (npz, idx.gz, Planetoid pickles, PTB and tiny-shakespeare
text, GLUE tsv) gets a truncated, an empty and a wrong-typed file (and NaN/Inf values
where the format holds floats); then a checkpoint of another model or program, config
fields of the wrong type. Every case must give exit code 2 and exactly one line
``error: ...`` naming the file or the field and what was expected, with the workdir's
earlier files untouched and nothing new in it. The table in docs/reliability.md lists
the same cases. Small synthetic files: no shared datasets needed.
"""
from __future__ import annotations

import gzip
import hashlib
import os
import pickle
import struct

import numpy as np
import pytest
import scipy.sparse as sp

COMMON = ["--config.num_steps=2", "--config.eval_every=0", "--config.tensorboard=false",
          "--config.plots=false", "--progress=false", "--config.precision.num_cycles=1"]
CONFIGS = {"cifar10": "default", "mnist": "default", "cora": "cora_gcn", "ptb": "ptb_lstm",
           "tiny_shakespeare": "shakespeare_transformer", "sst2": "sst2_transformer"}
EXTRA = {"tiny_shakespeare": ["--config.optimizer.warmup_steps=0"],
         "sst2": ["--config.optimizer.warmup_steps=0"]}


# --------------------------------------------------------------------------- valid files

def _cifar10(d):
    rng = np.random.default_rng(0)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        np.savez(d / f"{name}.npz", image=rng.integers(0, 256, (8, 32, 32, 3), dtype=np.uint8),
                 label=np.arange(8, dtype=np.uint8))
    return "data_batch_1.npz"


def _idx(array, magic):
    return (struct.pack(">I", magic) + b"".join(struct.pack(">I", n) for n in array.shape)
            + array.tobytes())


def _mnist(d):
    rng = np.random.default_rng(0)
    for split, n in (("train", 64), ("t10k", 16)):
        images = rng.integers(0, 256, (n, 28, 28), dtype=np.uint8)
        (d / f"{split}-images-idx3-ubyte.gz").write_bytes(gzip.compress(_idx(images, 2051)))
        labels = (np.arange(n) % 10).astype(np.uint8)
        (d / f"{split}-labels-idx1-ubyte.gz").write_bytes(gzip.compress(_idx(labels, 2049)))
    return "train-images-idx3-ubyte.gz"


def _planetoid(d):
    """A 30-node 'cora' in Kipf's layout: 7 train, 10 val-or-unlabelled, 13 test rows."""
    rng = np.random.default_rng(0)

    def features(n):
        return sp.csr_matrix(rng.integers(0, 2, (n, 12)).astype(np.float32))

    def onehot(n):
        return np.eye(7, dtype=np.int64)[np.arange(n) % 7]

    parts = {"x": features(7), "y": onehot(7), "allx": features(17), "ally": onehot(17),
             "tx": features(13), "ty": onehot(13),
             "graph": {i: [(i + 1) % 30, (i + 7) % 30] for i in range(30)}}
    for part, value in parts.items():
        with open(d / f"ind.cora.{part}", "wb") as f:
            pickle.dump(value, f)
    (d / "ind.cora.test.index").write_text("\n".join(str(i) for i in range(17, 30)))
    return "ind.cora.x"


def _ptb(d):
    for split in ("train", "valid", "test"):
        (d / f"ptb.{split}.txt").write_text(" the cat sat on the mat <unk> \n" * 40)
    return "ptb.train.txt"


def _shakespeare(d):
    (d / "input.txt").write_text("First Citizen:\nBefore we proceed any further.\n" * 60)
    return "input.txt"


def _sst2(d):
    for split in ("train", "dev"):
        (d / f"{split}.tsv").write_text("sentence\tlabel\n" + "a good film \t1\n"
                                        "a bad film \t0\n" * 20)
    return "train.tsv"


VALID = {"cifar10": _cifar10, "mnist": _mnist, "cora": _planetoid, "ptb": _ptb,
         "tiny_shakespeare": _shakespeare, "sst2": _sst2}


# --------------------------------------------------------------------------- bad files

def _truncate(path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _wrong_type(dataset, path):
    if dataset == "cifar10":  # a zip archive of float pixels
        np.savez(path, image=np.zeros((8, 32, 32, 3), np.float32), label=np.zeros(8, np.int64))
    elif dataset == "mnist":  # a labels file where the images should be
        path.write_bytes(gzip.compress(_idx(np.zeros(64, np.uint8), 2049)))
    elif dataset == "cora":  # a pickled list
        path.write_bytes(pickle.dumps([1, 2, 3]))
    elif dataset == "sst2":  # a label that is not 0/1
        path.write_text("sentence\tlabel\na good film\tpositive\n")
    else:  # binary, not UTF-8 text
        path.write_bytes(bytes(range(256)) * 8)


def _non_finite(dataset, path):
    assert dataset == "cora"
    x = sp.lil_matrix(pickle.loads(path.read_bytes()))
    x[0, 0], x[1, 1] = np.nan, np.inf
    path.write_bytes(pickle.dumps(sp.csr_matrix(x)))


CASES = [(d, kind) for d in VALID for kind in ("truncated", "empty", "wrong_type")]
CASES.append(("cora", "non_finite"))
EXPECTED = {  # a piece of the one line each case must print
    ("cifar10", "truncated"): "truncated or corrupt", ("cifar10", "empty"): "empty file",
    ("cifar10", "wrong_type"): "'image' has dtype float32",
    ("mnist", "truncated"): "truncated or corrupt", ("mnist", "empty"): "0 bytes",
    ("mnist", "wrong_type"): "IDX magic number 2049",
    ("cora", "truncated"): "truncated or corrupt", ("cora", "empty"): "empty, truncated",
    ("cora", "wrong_type"): "holds a list, not a sparse matrix",
    ("cora", "non_finite"): "holds 2 non-finite (NaN or Inf) values",
    ("ptb", "truncated"): "not UTF-8 text", ("ptb", "empty"): "empty file",
    ("ptb", "wrong_type"): "not UTF-8 text",
    ("tiny_shakespeare", "truncated"): "not UTF-8 text",
    ("tiny_shakespeare", "empty"): "empty file",
    ("tiny_shakespeare", "wrong_type"): "not UTF-8 text",
    ("sst2", "truncated"): "tab-separated columns", ("sst2", "empty"): "empty file",
    ("sst2", "wrong_type"): "label 'positive', expected 0 or 1",
}


def _snapshot(workdir):
    """{relative path: sha256} of every file under `workdir`."""
    out = {}
    for root, _, files in os.walk(workdir):
        for name in files:
            path = os.path.join(root, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, workdir)] = hashlib.sha256(f.read()).hexdigest()
    return out


def _earlier_run(workdir):
    """A workdir holding an earlier run's files (which a failed command must not touch)."""
    workdir.mkdir()
    (workdir / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n')
    (workdir / "summary.json").write_text('{"steps": 1}\n')
    return _snapshot(workdir)


def _one_error_line(code, err):
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, err
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in err
    return lines[0]


@pytest.mark.parametrize("dataset,kind", CASES, ids=[f"{d}-{k}" for d, k in CASES])
def test_a_bad_data_file_is_one_line_naming_it(tmp_path, train_cli, dataset, kind):
    data = tmp_path / "data"
    data.mkdir()
    bad = data / VALID[dataset](data)
    if kind == "truncated":
        if dataset == "ptb":  # text cut inside a two-byte character
            bad.write_bytes("the caf\u00e9 sat\n".encode()[:8])
        elif dataset == "tiny_shakespeare":
            bad.write_bytes("First Citizen \u00e9".encode()[:-1])
        elif dataset == "sst2":  # the last row lost its label column
            bad.write_text("sentence\tlabel\na good film\t1\na bad fi")
        else:
            _truncate(bad)
    elif kind == "empty":
        bad.write_bytes(b"")
    elif kind == "wrong_type":
        _wrong_type(dataset, bad)
    else:
        _non_finite(dataset, bad)
    workdir = tmp_path / "run"
    before = _earlier_run(workdir)
    code, err = train_cli(f"--workdir={workdir}",
                          f"--config=experiments/configs/{CONFIGS[dataset]}.py", *COMMON,
                          f"--config.dataset={dataset}", f"--config.data_dir={data}",
                          *EXTRA.get(dataset, []))
    line = _one_error_line(code, err)
    assert bad.name in line and "expected" in line, line
    assert EXPECTED[(dataset, kind)] in line, line
    assert _snapshot(workdir) == before  # nothing written over, nothing added


@pytest.mark.slow
def test_a_checkpoint_of_another_model_is_refused_and_nothing_changes(tmp_path, train_cli):
    workdir = tmp_path / "run"
    flags = ["--config=experiments/configs/default.py", *COMMON, "--config.model=mlp"]
    code, err = train_cli(f"--workdir={workdir}", *flags)
    assert code == 0, err
    before = _snapshot(workdir)
    code, err = train_cli(f"--workdir={workdir}", *flags, "--config.model=cnn")
    line = _one_error_line(code, err)
    assert "config.model='cnn' (checkpoint: 'mlp')" in line and "--workdir" in line
    assert _snapshot(workdir) == before


def test_another_programs_checkpoints_are_refused_and_left_alone(tmp_path, train_cli):
    import orbax.checkpoint as ocp

    workdir = tmp_path / "run"
    with ocp.CheckpointManager(str(workdir / "checkpoints")) as foreign:
        foreign.save(5, args=ocp.args.StandardSave({"w": np.zeros(3, np.float32)}))
        foreign.wait_until_finished()
    before = _snapshot(workdir)
    code, err = train_cli(f"--workdir={workdir}", "--config=experiments/configs/default.py",
                          *COMMON, "--config.model=mlp")
    line = _one_error_line(code, err)
    assert "checkpoints/5 is not a cpt_jax checkpoint" in line and "--workdir" in line
    assert _snapshot(workdir) == before


@pytest.mark.parametrize("flag,expected", [
    ("--config.num_steps=1.5", "(expected an integer)"),
    ("--config.optimizer.learning_rate=fast", "(expected a number)"),
    ("--config.augment=maybe", "(expected true or false)"),
    ("--config.nonfinite=3", "choose one of ['skip', 'ignore', 'stop']"),
    ("--config.precision.keep_full_precision=5", "must be a regex string"),
    ("--config.data_dir=5", "is not a directory"),
])
def test_a_config_field_of_the_wrong_type_is_one_line_naming_it(tmp_path, train_cli, flag,
                                                                expected):
    workdir = tmp_path / "run"
    before = _earlier_run(workdir)
    code, err = train_cli(f"--workdir={workdir}", "--config=experiments/configs/default.py",
                          *COMMON, flag)
    line = _one_error_line(code, err)
    field = flag.split("=")[0].removeprefix("--")
    assert field in line and expected in line, line
    assert _snapshot(workdir) == before


@pytest.mark.parametrize("flag,field", [
    ("--config.precision.keep_full_precision=('clasifier',)", "keep_full_precision[0]='clasifier'"),
    ("--config.precision.bit_offsets=(('dense9', 1),)", "bit_offsets[0]='dense9'"),
])
def test_a_rule_pattern_matching_no_layer_is_one_line_naming_it(tmp_path, train_cli, flag, field):
    """A typo in a layer pattern would quantize the layer it meant (issue 43, item 5)."""
    workdir = tmp_path / "run"
    before = _earlier_run(workdir)
    code, err = train_cli(f"--workdir={workdir}", "--config=experiments/configs/default.py",
                          *COMMON, "--config.model=mlp", flag)
    line = _one_error_line(code, err)
    assert f"config.precision.{field} matches no product" in line, line
    assert "'classifier'" in line and "'dense1'" in line, line   # the model's products
    assert _snapshot(workdir) == before
