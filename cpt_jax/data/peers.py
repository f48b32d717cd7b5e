"""Splitting a labelled dataset over peers: IID, label skew, Dirichlet(alpha).

(Module `cpt_jax.data.peers`, formerly `cpt_jax.data.peers`.) Decentralized training
(`cpt_jax.distributed.gossip`) gives every peer its own shard of
the training set. How non-IID the shards are is set here; all functions return one
array of example indices per peer and are deterministic given ``seed``.

Label skew (``skew`` in [0, 1), the scheme of Hsieh et al. 2020 used by Aketi et
al. 2022 with skew 0, 0.6, 0.8), exactly:

1. Dominant classes: with C classes and P peers, class c is dominant for peer
   ``c mod P`` (C >= P: every class has one dominant peer, a peer has
   ``floor(C/P)`` or ``ceil(C/P)`` dominant classes); for C < P, peer p's only
   dominant class is ``p mod C``.
2. Every peer gets the same number n of examples: ``round(skew * n)`` from its
   dominant class(es) (split as evenly as possible between them) and the other
   ``n - round(skew * n)`` IID, i.e. from all C classes in proportion to the
   class frequencies of the whole training set (largest-remainder rounding, ties
   broken differently for each peer). So a peer's dominant class makes up
   ``skew + (1 - skew) * N_c / N`` of its data in all.
3. Examples are drawn without replacement (peers' shards are disjoint) from each
   class shuffled with ``seed``. n is the largest size (at most ``N // P``) for
   which no class runs out; at skew 0 that is ``N // P`` up to rounding, at high
   skew some examples of classes with several dominant-demand peers stay unused.
   Pass ``examples_per_peer`` to fix n.

Dirichlet(alpha) (Hsu et al. 2019): for each class c, proportions
``q_c ~ Dir(alpha * 1_P)`` and class c's shuffled examples are split among the
peers at the cut points ``round(cumsum(q_c) * N_c)``; every example is used, shard
sizes differ. Small alpha (0.1) is very skewed, large alpha (100) is near IID.
Draws are repeated (up to 100 times) until every peer has at least
``min_examples`` examples.
"""
from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import flax
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from cpt_jax.data import image as image_data
from cpt_jax.distributed.gossip import PEER_AXIS

Array = jax.Array

__all__ = ["PARTITIONS", "dominant_classes", "label_skew_counts", "label_skew_partition",
           "iid_partition", "dirichlet_partition", "partition", "partition_summary"]

PARTITIONS = ("iid", "label_skew", "dirichlet")


def _check_labels(labels, num_peers: int, num_classes: int | None) -> tuple[np.ndarray, int]:
    labels = np.asarray(labels)
    if labels.ndim != 1 or labels.size == 0:
        raise ValueError(f"labels must be a non-empty 1-D array, got shape {labels.shape}")
    if not np.issubdtype(labels.dtype, np.integer) or labels.min() < 0:
        raise ValueError("labels must be non-negative integers")
    c = int(labels.max()) + 1 if num_classes is None else int(num_classes)
    if labels.max() >= c:
        raise ValueError(f"labels go up to {labels.max()} but num_classes={c}")
    if not isinstance(num_peers, (int, np.integer)) or num_peers < 1:
        raise ValueError(f"num_peers must be an integer >= 1, got {num_peers!r}")
    if num_peers > labels.size:
        raise ValueError(f"num_peers={num_peers} exceeds the {labels.size} examples")
    return labels, c


def dominant_classes(num_peers: int, num_classes: int) -> list[list[int]]:
    """The dominant class(es) of each peer in `label_skew_partition`.

    Class c belongs to peer ``c mod P`` when ``C >= P``; otherwise peer p has class
    ``p mod C``.

    Example:
      >>> dominant_classes(8, 10)
      [[0, 8], [1, 9], [2], [3], [4], [5], [6], [7]]
    """
    if num_classes >= num_peers:
        return [[c for c in range(num_classes) if c % num_peers == p] for p in range(num_peers)]
    return [[p % num_classes] for p in range(num_peers)]


def _largest_remainder(total: int, weights: np.ndarray, tiebreak: np.ndarray) -> np.ndarray:
    """Integers summing to `total` proportional to `weights` (largest remainder)."""
    exact = total * weights / weights.sum()
    out = np.floor(exact).astype(np.int64)
    rest = total - int(out.sum())
    if rest > 0:
        order = np.lexsort((tiebreak, -(exact - out)))
        out[order[:rest]] += 1
    return out


def label_skew_counts(class_counts: Sequence[int], num_peers: int, skew: float,
                      examples_per_peer: int) -> np.ndarray:
    """The (P, C) matrix of how many examples of each class each peer gets.

    Row p: ``round(skew * n)`` split over peer p's dominant classes, plus
    ``n - round(skew * n)`` split over all classes in proportion to `class_counts`.

    Example:
      >>> label_skew_counts([10, 10], 2, 0.5, 4)
      array([[3, 1],
             [1, 3]])
    """
    counts = np.asarray(class_counts, np.int64)
    c = counts.size
    n = int(examples_per_peer)
    dom = dominant_classes(num_peers, c)
    k_dom = int(round(skew * n))
    out = np.zeros((num_peers, c), np.int64)
    for p in range(num_peers):
        d = np.array(dom[p])
        share = _largest_remainder(k_dom, np.ones(len(d)), np.arange(len(d)))
        out[p, d] += share
        rotate = (np.arange(c) - p) % c
        out[p] += _largest_remainder(n - k_dom, counts.astype(np.float64), rotate)
    return out


def label_skew_partition(labels, num_peers: int, skew: float, *, seed: int = 0,
                         num_classes: int | None = None,
                         examples_per_peer: int | None = None) -> list[np.ndarray]:
    """Shards with a fraction `skew` of each peer's data from its dominant class(es).

    See the module docstring for the exact scheme; ``skew=0`` is a stratified IID
    split. Returns P disjoint index arrays of equal length n, each shuffled.

    Example:
      >>> labels = np.repeat(np.arange(10), 100)
      >>> parts = label_skew_partition(labels, 8, 0.8, seed=0)
      >>> len(parts), len(parts[2]), float(np.mean(labels[parts[2]] == 2).round(2))
      (8, 104, 0.83)
    """
    labels, c = _check_labels(labels, num_peers, num_classes)
    if not 0.0 <= float(skew) < 1.0:
        raise ValueError(f"skew must be in [0, 1), got {skew}")
    class_counts = np.bincount(labels, minlength=c)
    present = class_counts > 0

    def feasible(n: int) -> bool:
        m = label_skew_counts(class_counts, num_peers, skew, n)
        return bool(np.all(m.sum(0) <= class_counts)) and bool(np.all(m[:, ~present] == 0))

    if examples_per_peer is not None:
        n = int(examples_per_peer)
        if n < 1 or not feasible(n):
            raise ValueError(
                f"examples_per_peer={examples_per_peer} is not possible: at skew={skew} some "
                f"class has too few examples for {num_peers} peers; use a smaller value")
    else:
        n = labels.size // num_peers
        while n > 0 and not feasible(n):
            n -= 1
        if n == 0:
            raise ValueError(
                f"no label-skew split with skew={skew} over {num_peers} peers: a dominant "
                f"class has no examples (classes present: {np.flatnonzero(present).tolist()})")
    counts = label_skew_counts(class_counts, num_peers, skew, n)
    rng = np.random.default_rng(seed)
    pools = [rng.permutation(np.flatnonzero(labels == k)) for k in range(c)]
    cursor = np.zeros(c, np.int64)
    parts = []
    for p in range(num_peers):
        idx = []
        for k in range(c):
            take = int(counts[p, k])
            idx.append(pools[k][cursor[k]:cursor[k] + take])
            cursor[k] += take
        parts.append(rng.permutation(np.concatenate(idx)).astype(np.int64))
    return parts


def iid_partition(labels, num_peers: int, *, seed: int = 0,
                  num_classes: int | None = None) -> list[np.ndarray]:
    """Stratified IID shards of equal size: ``label_skew_partition`` with skew 0.

    Example:
      >>> [len(p) for p in iid_partition(np.arange(20) % 2, 4)]
      [5, 5, 5, 5]
    """
    return label_skew_partition(labels, num_peers, 0.0, seed=seed, num_classes=num_classes)


def dirichlet_partition(labels, num_peers: int, alpha: float, *, seed: int = 0,
                        num_classes: int | None = None,
                        min_examples: int = 1) -> list[np.ndarray]:
    """Shards whose class proportions are drawn from Dirichlet(`alpha`) per class.

    For each class c: ``q_c ~ Dir(alpha 1_P)``, its shuffled examples are cut at
    ``round(cumsum(q_c) * N_c)``. All examples are used; shard sizes differ. Raises
    ValueError if 100 draws all leave some peer with fewer than `min_examples`.

    Example:
      >>> parts = dirichlet_partition(np.repeat(np.arange(10), 50), 4, 0.5, seed=0)
      >>> sum(len(p) for p in parts)
      500
    """
    labels, c = _check_labels(labels, num_peers, num_classes)
    if not float(alpha) > 0.0:
        raise ValueError(f"alpha must be > 0, got {alpha}")
    if min_examples < 0 or min_examples * num_peers > labels.size:
        raise ValueError(f"min_examples={min_examples} must be in [0, N/P = "
                         f"{labels.size // num_peers}]")
    rng = np.random.default_rng(seed)
    for _ in range(100):
        parts: list[list] = [[] for _ in range(num_peers)]
        for k in range(c):
            idx = rng.permutation(np.flatnonzero(labels == k))
            q = rng.dirichlet(np.full(num_peers, float(alpha)))
            cuts = np.round(np.cumsum(q)[:-1] * idx.size).astype(np.int64)
            for p, chunk in enumerate(np.split(idx, cuts)):
                parts[p].append(chunk)
        out = [rng.permutation(np.concatenate(p)).astype(np.int64) for p in parts]
        if min(len(p) for p in out) >= min_examples:
            return out
    raise ValueError(f"dirichlet_partition: no draw with alpha={alpha} gave every one of "
                     f"{num_peers} peers >= {min_examples} examples; raise alpha or lower "
                     f"min_examples")


def partition(labels, num_peers: int, kind: str = "iid", *, skew: float = 0.0,
              alpha: float = 0.5, seed: int = 0, num_classes: int | None = None,
              min_examples: int = 1) -> list[np.ndarray]:
    """Dispatch on `kind`: ``"iid"``, ``"label_skew"`` (uses `skew`), ``"dirichlet"``
    (uses `alpha`).

    Example:
      >>> labels = np.repeat(np.arange(10), 100)
      >>> parts = partition(labels, 8, "label_skew", skew=0.8)
      >>> [len(p) for p in parts]
      [104, 104, 104, 104, 104, 104, 104, 104]
    """
    if kind == "iid":
        return iid_partition(labels, num_peers, seed=seed, num_classes=num_classes)
    if kind == "label_skew":
        return label_skew_partition(labels, num_peers, skew, seed=seed, num_classes=num_classes)
    if kind == "dirichlet":
        return dirichlet_partition(labels, num_peers, alpha, seed=seed,
                                   num_classes=num_classes, min_examples=min_examples)
    raise ValueError(f"partition kind must be one of {PARTITIONS}, got {kind!r}")


def partition_summary(labels, parts: Sequence[np.ndarray],
                      num_classes: int | None = None) -> dict[str, object]:
    """Sizes, per-peer class histograms and the top-class fraction of each shard.

    Example:
      >>> labels = np.repeat(np.arange(10), 100)
      >>> parts = partition(labels, 8, "label_skew", skew=0.8)
      >>> partition_summary(labels, parts)["top_class_fraction"]
      [0.4327, 0.4327, 0.8269, 0.8269, 0.8269, 0.8269, 0.8269, 0.8269]
    """
    labels = np.asarray(labels)
    c = int(labels.max()) + 1 if num_classes is None else int(num_classes)
    hist = np.stack([np.bincount(labels[p], minlength=c) for p in parts])
    sizes = hist.sum(1)
    top = hist.max(1) / np.maximum(sizes, 1)
    return {"sizes": sizes.tolist(), "class_histogram": hist.tolist(),
            "top_class_fraction": [round(float(t), 4) for t in top],
            "num_used": int(sizes.sum()), "num_total": int(labels.size)}


@flax.struct.dataclass
class PeerImageData:
    """Every peer's training shard, stacked and padded: images (P, n_max, H, W, C).

    ``sizes[i]`` is peer i's number of examples (rows beyond it are padding);
    ``mean``/``std``/``pixel_max`` normalize as `cpt_jax.data.normalize`.
    """

    images: Array
    labels: Array
    sizes: Array
    mean: Array
    std: Array
    pixel_max: float = flax.struct.field(pytree_node=False)


def make_peer_image_data(images: Any, labels: Any, parts: Sequence[np.ndarray], mean: Any,
                         std: Any, pixel_max: float,
                         mesh: Mesh | None = None,
                         axis_name: str = PEER_AXIS) -> PeerImageData:
    """Stack the peers' shards ``images[parts[i]]`` (padded to the largest), placed
    with peer i's shard on device i of `mesh` when given.

    Example:
      >>> rng = np.random.default_rng(0)
      >>> images = rng.integers(0, 17, (40, 8, 8, 1)).astype(np.uint8)
      >>> labels, parts = np.arange(40) % 10, [np.arange(0, 24), np.arange(24, 40)]
      >>> data = make_peer_image_data(images, labels, parts, mean=[8.0], std=[4.0],
      ...                             pixel_max=16.0)
      >>> data.images.shape, data.sizes.tolist()           # padded to the largest shard
      ((2, 24, 8, 8, 1), [24, 16])
    """
    images, labels = np.asarray(images), np.asarray(labels)
    if not parts or min(len(p) for p in parts) < 1:
        raise ValueError("every peer needs at least one example")
    n_max = max(len(p) for p in parts)
    pad = lambda a, idx: np.concatenate(  # noqa: E731
        [a[idx], np.zeros((n_max - len(idx),) + a.shape[1:], a.dtype)])
    data = PeerImageData(
        images=np.stack([pad(images, p) for p in parts]),
        labels=np.stack([pad(labels, p) for p in parts]).astype(np.int32),
        sizes=np.array([len(p) for p in parts], np.int32),
        mean=np.asarray(mean, np.float32), std=np.asarray(std, np.float32),
        pixel_max=float(pixel_max))
    if mesh is None:
        return jax.tree_util.tree_map(jnp.asarray, data)
    peer = NamedSharding(mesh, P(axis_name))
    rep = NamedSharding(mesh, P())
    return PeerImageData(
        images=jax.device_put(data.images, peer), labels=jax.device_put(data.labels, peer),
        sizes=jax.device_put(data.sizes, peer), mean=jax.device_put(data.mean, rep),
        std=jax.device_put(data.std, rep), pixel_max=data.pixel_max)


_AUGMENT_STREAM = np.uint32(0xFFFFFFFF)


def _one_peer_batch(images, labels, size, mean, std, step, key, *, batch_size: int,
                    augment: bool, pixel_max: float):
    n_max = images.shape[0]
    steps_per_epoch = jnp.maximum(size // batch_size, 1)
    epoch, position = step // steps_per_epoch, step % steps_per_epoch
    # A permutation of the valid rows [0, size) of this epoch: sort uniform keys with
    # the padding rows pushed to the end.
    u = jax.random.uniform(jax.random.fold_in(key, epoch), (n_max,))
    u = jnp.where(jnp.arange(n_max) < size, u, 2.0)
    order = jnp.argsort(u)
    idx = lax.dynamic_slice(order, (position * batch_size,), (batch_size,))
    idx = jnp.where(idx < size, idx, idx % jnp.maximum(size, 1))
    x = jnp.take(images, idx, axis=0)
    y = jnp.take(labels, idx, axis=0)
    if augment:
        aug_key = jax.random.fold_in(jax.random.fold_in(key, _AUGMENT_STREAM), step)
        x = image_data.augment_cifar(x, aug_key)
    return image_data.normalize(x, mean, std, pixel_max), y


@functools.partial(jax.jit, static_argnames=("batch_size", "augment"))
def peer_batch_at_step(data: PeerImageData, step: Any, key: Array, *, batch_size: int,
                       augment: bool = False) -> dict[str, Array]:
    """Each peer's training batch of `step`: ``{"inputs": (P, B, H, W, C), "labels": (P, B)}``.

    Peer i walks through its own shard epoch by epoch: epoch e is a permutation of
    its ``sizes[i]`` rows drawn with ``fold_in(fold_in(key, i), e)``, batch
    ``step mod (sizes[i] // B)`` of it. Pure function of (data, step, key).

    Example:
      >>> rng = np.random.default_rng(0)
      >>> images = rng.integers(0, 17, (40, 8, 8, 1)).astype(np.uint8)
      >>> labels, parts = np.arange(40) % 10, [np.arange(0, 24), np.arange(24, 40)]
      >>> data = make_peer_image_data(images, labels, parts, mean=[8.0], std=[4.0],
      ...                             pixel_max=16.0)
      >>> batch = peer_batch_at_step(data, 0, jax.random.key(0), batch_size=16)
      >>> batch["inputs"].shape, batch["labels"].shape
      ((2, 16, 8, 8, 1), (2, 16))
    """
    num_peers, n_max = data.images.shape[:2]
    if not isinstance(batch_size, int) or not 1 <= batch_size <= n_max:
        raise ValueError(f"batch_size={batch_size!r} must be an integer in [1, {n_max}] (the "
                         f"largest peer shard)")
    keys = jax.vmap(lambda i: jax.random.fold_in(key, i))(jnp.arange(num_peers))
    fn = functools.partial(_one_peer_batch, batch_size=batch_size, augment=augment,
                           pixel_max=data.pixel_max)
    x, y = jax.vmap(fn, in_axes=(0, 0, 0, None, None, None, 0))(
        data.images, data.labels, data.sizes, data.mean, data.std, jnp.asarray(step), keys)
    return {"inputs": x, "labels": y}
