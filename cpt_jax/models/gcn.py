"""Graph neural networks for full-batch node classification: GCN and GraphSAGE.

Plain float Flax Linen models. Every feature transform is an ``nn.Dense`` (so a
model-level quantization transform that intercepts ``nn.Dense`` quantizes it);
the neighbourhood aggregation is a sparse full-precision sum over the edge list
with ``jax.ops.segment_sum`` (never a dense N x N matrix), as in Wolfe &
Kyrillidis, who keep graph aggregation in full precision.

Input (both models): a :class:`cpt_jax.data.graph.GraphData`, or any mapping /
object with ``features`` (N, F), ``senders`` (E,), ``receivers`` (E,) and (for
GCN) ``edge_weight`` (E,). The message of edge e goes from node
``senders[e]`` to node ``receivers[e]``. Output: logits (N, num_classes) for
every node; the training loop applies the masks.

Example:
    >>> from cpt_jax.data.graph import load_planetoid
    >>> g = load_planetoid("cora", "/work/shared/datasets/planetoid")
    >>> model = GCN(num_classes=g.num_classes)
    >>> variables = model.init(jax.random.key(0), g)
    >>> logits = model.apply(variables, g, train=True,
    ...                      rngs={"dropout": jax.random.key(1)})
    >>> logits.shape
    (2708, 7)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

__all__ = ["GCN", "GraphSAGE", "aggregate", "mean_aggregate"]


def _field(graph: Any, name: str) -> Any:
    if isinstance(graph, Mapping):
        if name not in graph:
            raise ValueError(f"graph input has no {name!r}; it needs "
                             "features, senders, receivers (and edge_weight)")
        return graph[name]
    if not hasattr(graph, name):
        raise ValueError(f"graph input {type(graph).__name__} has no {name!r}")
    return getattr(graph, name)


def aggregate(h: jax.Array, senders: jax.Array, receivers: jax.Array,
              edge_weight: jax.Array) -> jax.Array:
    """Weighted neighbourhood sum ``out_i = sum_{e: r_e = i} w_e h_{s_e}``.

    With the edges and weights of ``D^-1/2 (A + I) D^-1/2`` this is
    ``A_hat @ h`` computed sparsely in full precision (``segment_sum``).

    Example:
        >>> h = jnp.eye(2)
        >>> aggregate(h, jnp.array([0, 1]), jnp.array([1, 1]),
        ...           jnp.array([2.0, 3.0])).tolist()
        [[0.0, 0.0], [2.0, 3.0]]
    """
    messages = h[senders] * edge_weight[:, None].astype(h.dtype)
    return jax.ops.segment_sum(messages, receivers, num_segments=h.shape[0])


def mean_aggregate(h: jax.Array, senders: jax.Array,
                   receivers: jax.Array) -> jax.Array:
    """Mean over neighbours, self-loops excluded: ``mean_{j in N(i), j != i} h_j``.

    Nodes without neighbours get zeros.

    Example:
        >>> h = jnp.array([[1.0], [3.0], [5.0]])
        >>> mean_aggregate(h, jnp.array([1, 2, 0]), jnp.array([0, 0, 0])).tolist()
        [[4.0], [0.0], [0.0]]
    """
    keep = (senders != receivers).astype(h.dtype)
    total = jax.ops.segment_sum(h[senders] * keep[:, None], receivers,
                                num_segments=h.shape[0])
    count = jax.ops.segment_sum(keep, receivers, num_segments=h.shape[0])
    return total / jnp.maximum(count, 1.0)[:, None]


class GCN(nn.Module):
    """Kipf & Welling's two-layer graph convolutional network.

        H1     = relu(A_hat (dropout(X) W1) + b1)
        logits = A_hat (dropout(H1) W2) + b2,   A_hat = D^-1/2 (A + I) D^-1/2

    ``W1`` and ``W2`` are ``nn.Dense`` (names ``dense_0``, ``dense_1``, no bias,
    Glorot-uniform init as Kipf), quantizable; the aggregation ``A_hat @ .``
    (:func:`aggregate`) and the biases, added after it (as PyG's GCNConv), stay
    full precision. Kipf's recipe: hidden 16, dropout 0.5, Adam lr 0.01,
    weight decay 5e-4 on the first layer, 200 epochs.

    Attributes:
      num_classes: output classes.
      hidden: hidden width (16 in Kipf; 512 in Wolfe & Kyrillidis on arxiv).
      dropout: dropout rate on the input of each layer (rng name "dropout").
      use_bias: add a bias after each aggregation.

    Call: ``model.apply(variables, graph, train=False)`` -> (N, num_classes).

    Example:
        >>> g = {"features": jnp.ones((3, 4)), "senders": jnp.array([0, 1, 2]),
        ...      "receivers": jnp.array([0, 1, 2]),
        ...      "edge_weight": jnp.ones(3)}
        >>> model = GCN(num_classes=7)
        >>> v = model.init(jax.random.key(0), g)
        >>> model.apply(v, g).shape
        (3, 7)
    """

    num_classes: int
    hidden: int = 16
    dropout: float = 0.5
    use_bias: bool = True

    @nn.compact
    def __call__(self, inputs: Any, train: bool = False) -> jax.Array:
        x = jnp.asarray(_field(inputs, "features"), jnp.float32)
        senders = _field(inputs, "senders")
        receivers = _field(inputs, "receivers")
        weight = _field(inputs, "edge_weight")
        widths = (self.hidden, self.num_classes)
        for i, width in enumerate(widths):
            x = nn.Dropout(self.dropout, deterministic=not train)(x)
            x = nn.Dense(width, use_bias=False,
                         kernel_init=nn.initializers.glorot_uniform(),
                         name=f"dense_{i}")(x)
            x = aggregate(x, senders, receivers, weight)
            if self.use_bias:
                x = x + self.param(f"bias_{i}", nn.initializers.zeros,
                                   (width,), jnp.float32)
            if i + 1 < len(widths):
                x = nn.relu(x)
        return x


class GraphSAGE(nn.Module):
    """Two-layer GraphSAGE with the mean aggregator (Hamilton et al. 2017).

        h_i' = W_self h_i + W_neigh mean_{j in N(i)} h_j + b

    (PyG's SAGEConv with ``aggr="mean"``); relu and dropout between layers.
    ``W_self`` (``self_i``, with the bias) and ``W_neigh`` (``neigh_i``, no
    bias) are ``nn.Dense``, quantizable; the mean (:func:`mean_aggregate`, the
    self-loops of the edge list ignored) stays full precision. ``edge_weight``
    is not used.

    Example:
        >>> g = {"features": jnp.ones((3, 4)), "senders": jnp.array([0, 1]),
        ...      "receivers": jnp.array([1, 0])}
        >>> model = GraphSAGE(num_classes=7, hidden=64)
        >>> v = model.init(jax.random.key(0), g)
        >>> model.apply(v, g).shape
        (3, 7)
    """

    num_classes: int
    hidden: int = 256
    dropout: float = 0.5

    @nn.compact
    def __call__(self, inputs: Any, train: bool = False) -> jax.Array:
        x = jnp.asarray(_field(inputs, "features"), jnp.float32)
        senders = _field(inputs, "senders")
        receivers = _field(inputs, "receivers")
        widths = (self.hidden, self.num_classes)
        for i, width in enumerate(widths):
            x = nn.Dropout(self.dropout, deterministic=not train)(x)
            neigh = mean_aggregate(x, senders, receivers)
            x = (nn.Dense(width, name=f"self_{i}")(x)
                 + nn.Dense(width, use_bias=False, name=f"neigh_{i}")(neigh))
            if i + 1 < len(widths):
                x = nn.relu(x)
        return x
