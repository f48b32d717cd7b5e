"""Node-classification data: the Planetoid citation graphs (Cora, CiteSeer).

The loader reads the Planetoid pickle files ``ind.<name>.{x,y,tx,ty,allx,ally,
graph,test.index}`` exactly as Kipf & Welling's ``gcn/utils.py`` does and returns
one :class:`GraphData` pytree with the graph as an edge list (``senders``,
``receivers``, ``edge_weight``), ready for sparse ``jax.ops.segment_sum``
aggregation (see :mod:`cpt_jax.models.gcn`).

There is no TFDS builder for Planetoid, so only the local-file path exists.

Example:
    >>> g = load_planetoid("cora", "/work/shared/datasets/planetoid")
    >>> g.num_nodes, g.features.shape[1], g.num_classes
    (2708, 1433, 7)
    >>> int(g.train_mask.sum()), int(g.val_mask.sum()), int(g.test_mask.sum())
    (140, 500, 1000)
"""

from __future__ import annotations

import os
import pickle
import warnings
from typing import Any

import jax.numpy as jnp
import numpy as np
import scipy.sparse as sp
from flax import struct

__all__ = ["GraphData", "load_planetoid", "load_ogbn_arxiv", "PLANETOID_NAMES",
           "gcn_norm_edges"]

PLANETOID_NAMES = ("cora", "citeseer")
_PLANETOID_PARTS = ("x", "y", "tx", "ty", "allx", "ally", "graph")


@struct.dataclass
class GraphData:
    """A whole graph for full-batch node classification (a frozen pytree).

    N nodes, F features, E directed edges including one self-loop per node.

    Attributes:
      features: (N, F) float32, row-normalized bag-of-words.
      labels: (N,) int32 class ids (0 for the CiteSeer nodes without a label;
        those are in no mask).
      senders, receivers: (E,) int32; message ``h[senders[e]]`` goes to
        ``receivers[e]``. Edges are symmetric: (i, j) present iff (j, i) is.
      edge_weight: (E,) float32, the symmetric GCN normalization
        ``w_ij = 1 / sqrt(d_i d_j)`` of ``A + I`` with ``d = rowsum(A + I)``,
        i.e. the non-zeros of ``D^-1/2 (A + I) D^-1/2``.
      train_mask, val_mask, test_mask: (N,) bool.
      num_classes, num_nodes: Python ints (static, not pytree leaves).

    Example:
        >>> import jax
        >>> g = load_planetoid("cora", "/work/shared/datasets/planetoid")
        >>> float(jax.jit(lambda g: g.features.sum())(g))  # a pytree under jit
        2708.0
    """

    features: Any
    labels: Any
    senders: Any
    receivers: Any
    edge_weight: Any
    train_mask: Any
    val_mask: Any
    test_mask: Any
    num_classes: int = struct.field(pytree_node=False)
    num_nodes: int = struct.field(pytree_node=False)


def _check_file(path: str) -> str:
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"Planetoid file not found: {path!r} (expected the files "
            "ind.<name>.{x,y,tx,ty,allx,ally,graph,test.index} in data_dir)")
    return path


# What each Planetoid pickle holds (Kipf & Welling's files).
_PLANETOID_EXPECTED = {
    "x": "a scipy.sparse feature matrix (train rows x features)",
    "tx": "a scipy.sparse feature matrix (test rows x features)",
    "allx": "a scipy.sparse feature matrix (labelled + unlabelled rows x features)",
    "y": "a one-hot numpy label matrix (train rows x classes)",
    "ty": "a one-hot numpy label matrix (test rows x classes)",
    "ally": "a one-hot numpy label matrix (allx rows x classes)",
    "graph": "a dict {node: [neighbour nodes]}",
}


def _load_pickle(path: str) -> Any:
    part = path.rsplit(".", 1)[-1]
    expected = f"expected the Planetoid pickle ind.<name>.{part}: {_PLANETOID_EXPECTED[part]}"
    try:
        with open(_check_file(path), "rb") as f, warnings.catch_warnings():
            # The pickles name old scipy.sparse modules (a DeprecationWarning).
            warnings.simplefilter("ignore", DeprecationWarning)
            value = pickle.load(f, encoding="latin1")
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError,
            ImportError, IndexError, KeyError) as e:
        raise ValueError(f"{path}: cannot unpickle the file, it is empty, truncated or "
                         f"corrupt ({type(e).__name__}: {e}); {expected}") from e
    problem = _planetoid_part_problem(part, value)
    if problem:
        raise ValueError(f"{path}: {problem}; {expected}")
    return value


def _planetoid_part_problem(part: str, value: Any) -> str | None:
    """What is wrong with the unpickled `value` of Planetoid file `part` (None: fine)."""
    if part == "graph":
        return None if isinstance(value, dict) and value else (
            f"holds a {type(value).__name__}" + (" (empty)" if isinstance(value, dict) else ""))
    if part in ("x", "tx", "allx") and not sp.issparse(value):
        return f"holds a {type(value).__name__}, not a sparse matrix"
    if part in ("y", "ty", "ally") and not (isinstance(value, np.ndarray) and value.ndim == 2):
        return f"holds a {type(value).__name__}" + (
            f" of shape {value.shape}" if isinstance(value, np.ndarray) else "")
    data = value.data if sp.issparse(value) else value
    if not np.issubdtype(np.asarray(data).dtype, np.number):
        return f"holds values of dtype {np.asarray(data).dtype}"
    bad = int(np.size(data) - np.count_nonzero(np.isfinite(data)))
    return f"holds {bad} non-finite (NaN or Inf) values" if bad else None


def _check_planetoid_shapes(prefix: str, parts: dict) -> None:
    """Rows of each feature matrix match its labels; all feature widths agree."""
    for xs, ys in (("x", "y"), ("tx", "ty"), ("allx", "ally")):
        if parts[xs].shape[0] != parts[ys].shape[0]:
            raise ValueError(f"{prefix}{ys}: {parts[ys].shape[0]} label rows for the "
                             f"{parts[xs].shape[0]} feature rows of {prefix}{xs}")
    widths = {k: parts[k].shape[1] for k in ("x", "tx", "allx")}
    if len(set(widths.values())) > 1:
        raise ValueError(f"{prefix}{{x,tx,allx}}: feature widths {widths} differ")


def _read_test_index(path: str) -> np.ndarray:
    """The node ids of ``ind.<name>.test.index``, one integer per line."""
    try:
        with open(path) as f:
            ids = [int(line) for line in f if line.strip()]
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: {type(e).__name__}: {e}; expected one node id (an "
                         f"integer) per line") from e
    if not ids:
        raise ValueError(f"{path}: empty file; expected one node id (an integer) per line")
    return np.array(ids, dtype=np.int64)


def _row_normalize(features: sp.spmatrix) -> np.ndarray:
    """Kipf's ``preprocess_features``: ``X_ij / sum_k X_ik`` (zero rows stay 0)."""
    dense = np.asarray(features.todense(), dtype=np.float64)
    rowsum = dense.sum(axis=1, keepdims=True)
    with np.errstate(divide="ignore"):
        inv = np.where(rowsum > 0, 1.0 / rowsum, 0.0)
    return (dense * inv).astype(np.float32)


def gcn_norm_edges(senders: np.ndarray, receivers: np.ndarray,
                   num_nodes: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Symmetrize, dedupe, drop self-loops, add one self-loop per node, normalize.

    Returns ``(senders, receivers, edge_weight)`` for ``A_hat = D^-1/2 (A + I)
    D^-1/2`` with ``A`` the simple undirected graph of the given edges and
    ``d_i = 1 + deg_A(i)``; edges are sorted by (receiver, sender).

    Example:
        >>> s, r, w = gcn_norm_edges(np.array([0]), np.array([1]), 3)
        >>> s.tolist(), r.tolist()
        ([0, 1, 0, 1, 2], [0, 0, 1, 1, 2])
    """
    senders = np.asarray(senders, dtype=np.int64)
    receivers = np.asarray(receivers, dtype=np.int64)
    if senders.shape != receivers.shape:
        raise ValueError(f"senders {senders.shape} and receivers "
                         f"{receivers.shape} must have the same shape")
    if senders.size and (min(senders.min(), receivers.min()) < 0 or
                         max(senders.max(), receivers.max()) >= num_nodes):
        raise ValueError(f"edge endpoints must lie in [0, {num_nodes - 1}]")
    s = np.concatenate([senders, receivers])
    r = np.concatenate([receivers, senders])
    keep = s != r
    adj = sp.coo_matrix((np.ones(keep.sum()), (r[keep], s[keep])),
                        shape=(num_nodes, num_nodes)).tocsr()
    adj.data[:] = 1.0  # dedupe: duplicates were summed by tocsr
    adj = (adj + sp.eye(num_nodes, format="csr")).tocoo()
    deg = np.asarray(adj.sum(axis=1)).ravel()
    order = np.lexsort((adj.col, adj.row))
    recv, send = adj.row[order], adj.col[order]
    weight = 1.0 / np.sqrt(deg[recv] * deg[send])
    return (send.astype(np.int32), recv.astype(np.int32),
            weight.astype(np.float32))


def _pad_isolated_test_nodes(tx, ty: np.ndarray, test_idx_range: np.ndarray):
    """CiteSeer's isolated test nodes: zero feature rows and all-zero label rows."""
    lo, hi = int(test_idx_range.min()), int(test_idx_range.max())
    tx_ext = sp.lil_matrix((hi - lo + 1, tx.shape[1]))
    tx_ext[test_idx_range - lo, :] = tx
    ty_ext = np.zeros((hi - lo + 1, ty.shape[1]), dtype=ty.dtype)
    ty_ext[test_idx_range - lo, :] = ty
    return tx_ext.tocsr(), ty_ext


def _adjacency_lists(graph: dict, num_nodes: int, key: str) -> tuple[np.ndarray, np.ndarray]:
    """(senders, receivers) of the Planetoid adjacency dict ``{node: [neighbours]}``."""
    send, recv = [], []
    for node, neighbours in graph.items():
        send.extend([node] * len(neighbours))
        recv.extend(neighbours)
    if max(len(graph), max(send) + 1, max(recv) + 1) > num_nodes:
        raise ValueError(f"ind.{key}.graph refers to more nodes than the "
                         f"{num_nodes} feature rows")
    return np.array(send), np.array(recv)


def load_planetoid(name: str, data_dir: str) -> GraphData:
    """Load Cora or CiteSeer with the standard public (Planetoid) split.

    As Kipf & Welling's ``load_data``: features = ``vstack(allx, tx)`` with the
    test rows put back in the order of ``test.index``; CiteSeer's isolated test
    nodes (indices missing from ``test.index``) get zero feature rows and no
    label. Split: train = ``range(len(y))`` (20 per class), val =
    ``range(len(y), len(y) + 500)``, test = the 1000 ``test.index`` nodes.
    Features are row-normalized (``X / rowsum(X)``). The adjacency is the
    simple undirected graph of ``graph`` (duplicate edges and the few self-loops
    in the files removed, as PyG does) plus ``I``, normalized symmetrically
    (see :func:`gcn_norm_edges`).

    Args:
      name: "cora" or "citeseer" (case-insensitive).
      data_dir: folder holding the ``ind.<name>.*`` files.

    Raises:
      ValueError: unknown ``name``.
      FileNotFoundError: a file is missing (the message names it).

    Example:
        >>> g = load_planetoid("citeseer", "/work/shared/datasets/planetoid")
        >>> g.num_nodes, g.num_classes
        (3327, 6)
    """
    key = str(name).lower()
    if key not in PLANETOID_NAMES:
        raise ValueError(f"name={name!r} is not a Planetoid dataset here; "
                         f"allowed: {PLANETOID_NAMES}")
    prefix = os.path.join(os.fspath(data_dir), f"ind.{key}.")
    for part in _PLANETOID_PARTS + ("test.index",):
        _check_file(prefix + part)
    loaded = {p: _load_pickle(prefix + p) for p in _PLANETOID_PARTS}
    _check_planetoid_shapes(prefix, loaded)
    x, y, tx, ty, allx, ally, graph = (loaded[p] for p in _PLANETOID_PARTS)
    test_idx_reorder = _read_test_index(prefix + "test.index")
    test_idx_range = np.sort(test_idx_reorder)

    tx, ty = sp.csr_matrix(tx), np.asarray(ty)
    if key == "citeseer":
        tx, ty = _pad_isolated_test_nodes(tx, ty, test_idx_range)

    features = sp.vstack((sp.csr_matrix(allx), tx)).tolil()
    features[test_idx_reorder, :] = features[test_idx_range, :]
    onehot = np.vstack((np.asarray(ally), ty))
    onehot[test_idx_reorder, :] = onehot[test_idx_range, :]
    num_nodes, num_classes = onehot.shape
    labels = np.argmax(onehot, axis=1).astype(np.int32)

    send, recv = _adjacency_lists(graph, num_nodes, key)
    senders, receivers, weight = gcn_norm_edges(send, recv, num_nodes)

    def mask(idx) -> np.ndarray:
        m = np.zeros(num_nodes, dtype=bool)
        m[np.asarray(idx)] = True
        return m

    return GraphData(
        features=jnp.asarray(_row_normalize(features)),
        labels=jnp.asarray(labels),
        senders=jnp.asarray(senders),
        receivers=jnp.asarray(receivers),
        edge_weight=jnp.asarray(weight),
        train_mask=jnp.asarray(mask(range(len(y)))),
        val_mask=jnp.asarray(mask(range(len(y), len(y) + 500))),
        test_mask=jnp.asarray(mask(test_idx_range)),
        num_classes=int(num_classes),
        num_nodes=int(num_nodes),
    )


def _read_csv(path: str, dtype) -> np.ndarray:
    """A headerless (optionally gzipped) csv of numbers as a 2-D array."""
    _check_file(path)
    return np.loadtxt(path, delimiter=",", dtype=dtype, ndmin=2)


def load_ogbn_arxiv(data_dir: str) -> GraphData:
    """ogbn-arxiv (169,343 papers, 128-d features, 40 classes) from OGB's files.

    ``data_dir`` is the OGB dataset folder (``.../ogbn_arxiv``) holding
    ``raw/{node-feat,node-label,edge}.csv.gz`` and
    ``split/time/{train,valid,test}.csv.gz`` as OGB downloads them (the ``ogb``
    package itself is not needed). The directed citation edges are made
    undirected (OGB's GCN example does ``to_symmetric``), plus self-loops,
    normalized as :func:`gcn_norm_edges`; features are used as given (no
    row-normalization); masks are OGB's time split. Wolfe & Kyrillidis train a
    2-layer GCN (hidden 512) on it, full batch.

    Raises:
      FileNotFoundError: a file is missing (the message names it).

    Example:
        >>> g = load_ogbn_arxiv("/data/ogbn_arxiv")  # doctest: +SKIP
        >>> g.num_nodes, g.num_classes  # doctest: +SKIP
        (169343, 40)
    """
    root = os.fspath(data_dir)
    raw = os.path.join(root, "raw")
    split = os.path.join(root, "split", "time")
    paths = {name: os.path.join(raw, f"{name}.csv.gz")
             for name in ("node-feat", "node-label", "edge")}
    paths.update({name: os.path.join(split, f"{name}.csv.gz")
                  for name in ("train", "valid", "test")})
    for path in paths.values():
        _check_file(path)
    features = _read_csv(paths["node-feat"], np.float32)
    labels = _read_csv(paths["node-label"], np.int64).ravel()
    edges = _read_csv(paths["edge"], np.int64)
    num_nodes = features.shape[0]
    if labels.shape[0] != num_nodes:
        raise ValueError(f"node-label has {labels.shape[0]} rows, node-feat "
                         f"{num_nodes}")
    senders, receivers, weight = gcn_norm_edges(edges[:, 0], edges[:, 1],
                                                num_nodes)

    def mask(name: str) -> jnp.ndarray:
        m = np.zeros(num_nodes, dtype=bool)
        m[_read_csv(paths[name], np.int64).ravel()] = True
        return jnp.asarray(m)

    return GraphData(
        features=jnp.asarray(features),
        labels=jnp.asarray(labels.astype(np.int32)),
        senders=jnp.asarray(senders),
        receivers=jnp.asarray(receivers),
        edge_weight=jnp.asarray(weight),
        train_mask=mask("train"), val_mask=mask("valid"), test_mask=mask("test"),
        num_classes=int(labels.max()) + 1,
        num_nodes=int(num_nodes),
    )
