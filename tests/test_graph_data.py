"""Tests for cpt_jax.data.graph (Planetoid Cora / CiteSeer)."""

from __future__ import annotations

import gzip
import os
from pathlib import Path

import numpy as np
import pytest

from cpt_jax.data.graph import GraphData, gcn_norm_edges, load_ogbn_arxiv, load_planetoid

DATASETS = Path(os.environ.get(
    "CPT_JAX_DATASETS", Path(__file__).resolve().parents[2] / "shared" / "datasets"))
PLANETOID = DATASETS / "planetoid"
needs_data = pytest.mark.skipif(not (PLANETOID / "ind.cora.x").exists(),
                                reason="Planetoid files not available")


@pytest.fixture(scope="module")
def cora() -> GraphData:
    return load_planetoid("cora", str(PLANETOID))


@pytest.fixture(scope="module")
def citeseer() -> GraphData:
    return load_planetoid("CiteSeer", str(PLANETOID))


def _check_graph(g: GraphData) -> None:
    s, r = np.asarray(g.senders), np.asarray(g.receivers)
    w = np.asarray(g.edge_weight)
    # one self-loop per node, no duplicate edges, symmetric
    assert np.array_equal(np.sort(s[s == r]), np.arange(g.num_nodes))
    pairs = set(zip(s.tolist(), r.tolist()))
    assert len(pairs) == len(s)
    assert all((b, a) in pairs for a, b in pairs)
    # weights are 1/sqrt(d_i d_j) with d the degree in A + I
    deg = np.bincount(r, minlength=g.num_nodes).astype(np.float64)
    np.testing.assert_allclose(w, 1.0 / np.sqrt(deg[s] * deg[r]), rtol=1e-6)
    # row-normalized features (non-empty rows sum to one)
    rows = np.asarray(g.features).sum(axis=1)
    nonzero = rows > 0
    np.testing.assert_allclose(rows[nonzero], 1.0, atol=1e-5)
    # disjoint masks, 20 train nodes per class
    tr, va, te = (np.asarray(m) for m in (g.train_mask, g.val_mask, g.test_mask))
    assert not (tr & va).any() and not (tr & te).any() and not (va & te).any()
    counts = np.bincount(np.asarray(g.labels)[tr], minlength=g.num_classes)
    assert counts.tolist() == [20] * g.num_classes
    assert np.asarray(g.labels).max() < g.num_classes


@needs_data
def test_cora_statistics(cora):
    g = cora
    assert (g.num_nodes, g.num_classes) == (2708, 7)
    assert g.features.shape == (2708, 1433) and g.features.dtype == np.float32
    assert g.labels.shape == (2708,) and g.labels.dtype == np.int32
    assert (int(g.train_mask.sum()), int(g.val_mask.sum()),
            int(g.test_mask.sum())) == (140, 500, 1000)
    assert np.asarray(g.train_mask)[:140].all()
    assert np.asarray(g.val_mask)[140:640].all()
    s, r = np.asarray(g.senders), np.asarray(g.receivers)
    assert (s != r).sum() == 10556 and (s == r).sum() == 2708
    assert g.senders.dtype == np.int32 and g.edge_weight.dtype == np.float32
    _check_graph(g)
    assert (np.asarray(g.features).sum(axis=1) > 0).all()


@needs_data
def test_citeseer_statistics(citeseer):
    g = citeseer
    assert (g.num_nodes, g.num_classes) == (3327, 6)
    assert g.features.shape[0] == 3327
    assert (int(g.train_mask.sum()), int(g.val_mask.sum()),
            int(g.test_mask.sum())) == (120, 500, 1000)
    _check_graph(g)
    # isolated test-range nodes (Kipf's fix): zero feature rows, in no mask
    empty = np.asarray(g.features).sum(axis=1) == 0
    assert empty.sum() >= 1
    in_mask = np.asarray(g.train_mask | g.val_mask | g.test_mask)
    assert not (empty & np.asarray(g.test_mask)).any()
    assert in_mask.sum() == 1620


def test_gcn_norm_edges_matches_dense():
    rng = np.random.default_rng(0)
    n = 7
    s = rng.integers(0, n, 15)
    r = rng.integers(0, n, 15)
    send, recv, w = gcn_norm_edges(s, r, n)
    a = np.zeros((n, n))
    a[r, s] = 1.0
    a[s, r] = 1.0
    np.fill_diagonal(a, 0.0)
    a_hat = a + np.eye(n)
    d = a_hat.sum(axis=1)
    expected = a_hat / np.sqrt(np.outer(d, d))
    got = np.zeros((n, n))
    got[recv, send] = w
    np.testing.assert_allclose(got, expected, rtol=1e-6)


def test_gcn_norm_edges_rejects_out_of_range():
    with pytest.raises(ValueError, match="edge endpoints"):
        gcn_norm_edges(np.array([0]), np.array([5]), 3)


def test_unknown_name():
    with pytest.raises(ValueError, match="pubmed"):
        load_planetoid("pubmed", str(PLANETOID))


@needs_data
def test_missing_file_is_named(tmp_path):
    for f in PLANETOID.glob("ind.cora.*"):
        if not f.name.endswith(".graph"):
            (tmp_path / f.name).symlink_to(f)
    with pytest.raises(FileNotFoundError, match=r"ind\.cora\.graph"):
        load_planetoid("cora", str(tmp_path))


def test_missing_dir(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"ind\.cora\.x"):
        load_planetoid("cora", str(tmp_path / "nowhere"))


def _write_csv_gz(path: Path, rows) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(path, "wt") as f:
        for row in rows:
            f.write(",".join(str(v) for v in np.atleast_1d(row)) + "\n")


def test_ogbn_arxiv_layout_on_a_tiny_fake(tmp_path):
    rng = np.random.default_rng(0)
    n = 6
    feats = rng.normal(size=(n, 3)).round(3)
    _write_csv_gz(tmp_path / "raw" / "node-feat.csv.gz", feats)
    _write_csv_gz(tmp_path / "raw" / "node-label.csv.gz", [0, 2, 1, 2, 0, 1])
    _write_csv_gz(tmp_path / "raw" / "edge.csv.gz", [(0, 1), (2, 1), (3, 4)])
    _write_csv_gz(tmp_path / "split" / "time" / "train.csv.gz", [0, 1, 2])
    _write_csv_gz(tmp_path / "split" / "time" / "valid.csv.gz", [3])
    with pytest.raises(FileNotFoundError, match=r"test\.csv\.gz"):
        load_ogbn_arxiv(str(tmp_path))
    _write_csv_gz(tmp_path / "split" / "time" / "test.csv.gz", [4, 5])
    g = load_ogbn_arxiv(str(tmp_path))
    assert (g.num_nodes, g.num_classes) == (6, 3)
    np.testing.assert_allclose(g.features, feats, rtol=1e-6)
    assert np.asarray(g.train_mask).tolist() == [1, 1, 1, 0, 0, 0]
    assert int(g.val_mask.sum()) == 1 and int(g.test_mask.sum()) == 2
    s, r = np.asarray(g.senders), np.asarray(g.receivers)
    assert len(s) == 6 + 2 * 3  # self-loops + both directions
    assert (1, 0) in set(zip(s.tolist(), r.tolist()))
