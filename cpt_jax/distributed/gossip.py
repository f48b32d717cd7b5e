"""Decentralized (gossip) low-precision training: P peers on a ring, one per device.

Each peer i holds its own parameters x_i, optimizer state, BatchNorm statistics and
data shard. One step of every peer, all peers in parallel under ``jax.shard_map``
over a mesh axis ``"peers"`` (one peer per device: 8 CPU devices simulated with
``XLA_FLAGS=--xla_force_host_platform_device_count=8``, a TPU v3-8 or 8 GPUs):

1. local step (the step of `cpt_jax.training.make_train_step`, with the precision
   schedule evaluated on the traced step inside a `cpt_jax.precision` context):
   ``x_i^{t+1/2} = x_i^t - lr * NesterovSGD(grad f_i(Q_b(x_i^t)))``;
2. gossip with the two ring neighbours through ``lax.ppermute`` (Aketi et al. 2022),
   mixing matrix ``W = w I + (1-w)/2 (S + S^T)`` with S the cyclic shift, w = 1/3:

   * exact (``Compression("none")``): ``x_i <- (x_{i-1} + x_i + x_{i+1}) / 3``,
     sending all parameters in fp32;
   * compressed, CHOCO-Gossip (Koloskova et al. 2019), ``Compression("int8")`` or
     ``Compression("topk")``: each peer keeps a public copy x^_i (known to its
     neighbours) and ``s_i = sum_j W_ij x^_j``:
     ``q_i = C(x_i^{t+1/2} - x^_i)`` is sent to both neighbours,
     ``x^_i += q_i``, ``s_i += sum_j W_ij q_j``,
     ``x_i^{t+1} = x_i^{t+1/2} + gamma (s_i - x^_i)``.
     C is int8 codes with one fp32 scale per tensor (``scale = max|d| / 127``,
     nearest rounding) or top-k (k largest |d| as fp32 values + int32 indices).

Both gossips keep the peers' average exactly (W is doubly stochastic; CHOCO adds
``gamma (W - I) x^`` whose columns sum to 0), up to float rounding. Only trainable
parameters are gossiped; optimizer momentum and BatchNorm statistics stay local.

Bytes sent are counted from the payload shapes (`gossip_bytes_per_step`): per peer
and step, 2 neighbours x (4 bytes per parameter for fp32; 1 byte per parameter + 4
per tensor for int8; 8 bytes per kept entry for top-k). The consensus distance
``(1/P) sum_i ||x_i - xbar||^2`` is computed by `consensus_distance` (outside the
step: it needs an all-reduce a real decentralized system would not run every step).
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from cpt_jax.schedules import PrecisionSchedule
from cpt_jax.training import (
    LossFn,
    TrainState,
    classification_loss,
    create_train_state,
    train_step_body,
)

Array = jax.Array
PEER_AXIS = "peers"
"""The mesh axis of the peers (the decentralized ring; `cpt_jax.data.peers` shards
its peer batches along it)."""
COMPRESSIONS = ("none", "int8", "topk")


# --------------------------------------------------------------------------- topology

def make_peer_mesh(num_peers: int, devices=None, axis_name: str = PEER_AXIS) -> Mesh:
    """A 1-D mesh with one peer per device along `axis_name`.

    Example:
      >>> mesh = make_peer_mesh(1)     # make_peer_mesh(8) needs 8 devices
      >>> dict(mesh.shape)
      {'peers': 1}
    """
    devices = list(devices if devices is not None else jax.devices())
    if not isinstance(num_peers, int) or not 1 <= num_peers <= len(devices):
        raise ValueError(
            f"num_peers={num_peers!r} must be an integer in [1, {len(devices)}] (one peer per "
            f"device; on CPU set XLA_FLAGS=--xla_force_host_platform_device_count=N before "
            f"importing jax)")
    return Mesh(np.array(devices[:num_peers]), (axis_name,))


def _check_self_weight(self_weight: float) -> None:
    if not 0.0 < float(self_weight) <= 1.0:
        raise ValueError(f"self_weight must be in (0, 1], got {self_weight}")


def ring_mixing_matrix(num_peers: int, self_weight: float = 1.0 / 3.0) -> np.ndarray:
    """The ring gossip matrix ``W = w I + (1 - w)/2 (S + S^T)``, S the cyclic shift.

    W is symmetric and doubly stochastic; with w = 1/3 each peer averages itself and
    its two neighbours equally. For P = 2 both neighbours are the same peer
    (``W = [[w, 1-w], [1-w, w]]``); for P = 1, ``W = [[1]]``.

    Example:
      >>> ring_mixing_matrix(4).round(3)
      array([[0.333, 0.333, 0.   , 0.333],
             [0.333, 0.333, 0.333, 0.   ],
             [0.   , 0.333, 0.333, 0.333],
             [0.333, 0.   , 0.333, 0.333]])
    """
    if not isinstance(num_peers, (int, np.integer)) or num_peers < 1:
        raise ValueError(f"num_peers must be an integer >= 1, got {num_peers!r}")
    _check_self_weight(self_weight)
    if num_peers == 1:
        return np.ones((1, 1))
    shift = np.roll(np.eye(num_peers), 1, axis=1)
    return self_weight * np.eye(num_peers) + (1 - self_weight) / 2 * (shift + shift.T)


# --------------------------------------------------------------------------- compression

@dataclasses.dataclass(frozen=True)
class Compression:
    """What a peer sends to its neighbours each step.

    Attributes:
      kind: ``"none"`` (exact gossip of fp32 parameters), ``"int8"`` (CHOCO with
        the differences as signed integer codes, ``bits`` wide, stored in int8, one
        fp32 scale per tensor) or ``"topk"`` (CHOCO with the ``fraction`` largest
        entries of each tensor's difference, fp32 values + int32 indices).
      bits: width of the integer codes for ``"int8"``, in [2, 8]: codes in
        ``[-(2^(bits-1)-1), 2^(bits-1)-1]``, ``scale = max|d| / (2^(bits-1)-1)``.
      fraction: kept fraction for ``"topk"``, in (0, 1]; ``k = ceil(fraction * n)``.
      gamma: CHOCO consensus step size in (0, 1].

    Example:
      >>> c = Compression("int8")
      >>> payload = c.encode(jnp.array([0.5, -1.0, 0.25]))
      >>> payload["codes"].tolist(), [round(float(v), 4) for v in c.decode(payload, jnp.zeros(3))]
      ([64, -127, 32], [0.5039, -1.0, 0.252])
    """

    kind: str = "none"
    bits: int = 8
    fraction: float = 0.01
    gamma: float = 1.0

    def __post_init__(self) -> None:
        if self.kind not in COMPRESSIONS:
            raise ValueError(f"Compression.kind must be one of {COMPRESSIONS}, got {self.kind!r}")
        if not isinstance(self.bits, int) or not 2 <= self.bits <= 8:
            raise ValueError(f"Compression.bits must be an integer in [2, 8], got {self.bits!r}")
        if not 0.0 < float(self.fraction) <= 1.0:
            raise ValueError(f"Compression.fraction must be in (0, 1], got {self.fraction}")
        if not 0.0 < float(self.gamma) <= 1.0:
            raise ValueError(f"Compression.gamma must be in (0, 1], got {self.gamma}")

    @property
    def choco(self) -> bool:
        """Whether the gossip is CHOCO (compressed differences) rather than exact."""
        return self.kind != "none"

    def encode(self, x: Array) -> dict[str, Array]:
        """The message for one tensor ``x`` (for CHOCO, ``x`` is a difference).

        none: ``{"values": x}``; int8: ``{"codes": int8, "scale": f32[]}``;
        topk: ``{"values": f32[k], "indices": int32[k]}``.
        """
        x = jnp.asarray(x, jnp.float32)
        if self.kind == "none":
            return {"values": x}
        if self.kind == "int8":
            qmax = float(2 ** (self.bits - 1) - 1)
            amax = jnp.max(jnp.abs(x)) if x.size else jnp.float32(0)
            scale = jnp.where(amax > 0, amax / qmax, 1.0).astype(jnp.float32)
            codes = jnp.clip(jnp.round(x / scale), -qmax, qmax).astype(jnp.int8)
            return {"codes": codes, "scale": scale}
        flat = x.reshape(-1)
        k = self.topk_size(flat.size)
        _, indices = lax.top_k(jnp.abs(flat), k)
        return {"values": flat[indices], "indices": indices.astype(jnp.int32)}

    def decode(self, payload: dict[str, Array], like: Array) -> Array:
        """Rebuild the (approximate) tensor, shaped like `like`, from a message."""
        if self.kind == "none":
            return payload["values"]
        if self.kind == "int8":
            return payload["codes"].astype(jnp.float32) * payload["scale"]
        flat = jnp.zeros((math.prod(like.shape),), jnp.float32)
        return flat.at[payload["indices"]].set(payload["values"]).reshape(like.shape)

    def topk_size(self, n: int) -> int:
        """``k = min(n, max(1, ceil(fraction * n)))`` entries kept by top-k."""
        return int(min(n, max(1, math.ceil(self.fraction * n))))

    def payload_bytes(self, shape: Sequence[int]) -> int:
        """Bytes of one message for a float tensor of `shape` (from the payload's dtypes).

        Example:
          >>> Compression("int8").payload_bytes((3, 3, 16, 32)), Compression().payload_bytes((10,))
          (4612, 40)
        """
        spec = jax.eval_shape(self.encode, jax.ShapeDtypeStruct(tuple(shape), jnp.float32))
        return int(sum(math.prod(a.shape) * a.dtype.itemsize
                       for a in jax.tree_util.tree_leaves(spec)))


def _num_sends(num_peers: int) -> int:
    return 0 if num_peers == 1 else 2


def gossip_bytes_per_step(params: Any, compression: Compression, num_peers: int) -> int:
    """Bytes one peer sends in one gossip step: ``2 * sum_tensors payload_bytes``.

    `params` is one peer's parameter tree (or its shapes). Every peer sends the same
    message to its left and its right neighbour (two ``ppermute``); P = 1 sends
    nothing. Multiply by P and the number of steps for a run's total.

    Example:
      >>> gossip_bytes_per_step({"w": jnp.zeros((100,))}, Compression(), 8)
      800
    """
    leaves = jax.tree_util.tree_leaves(params)
    return _num_sends(num_peers) * sum(compression.payload_bytes(np.shape(x)) for x in leaves)


# --------------------------------------------------------------------------- state

@flax.struct.dataclass
class PeerState:
    """The state of all peers, every leaf stacked along a leading peer axis (P, ...).

    ``train``: each peer's `TrainState` (params, batch_stats, optimizer, rng, step);
    ``public``: CHOCO public copies x^_i of the params (None for exact gossip);
    ``mixed``: ``s_i = sum_j W_ij x^_j`` (None for exact gossip).
    """

    train: TrainState
    public: Any = None
    mixed: Any = None

    @property
    def params(self) -> Any:
        """The peers' parameters, stacked (P, ...)."""
        return self.train.params


def init_peer_state(model: nn.Module, optimizer: optax.GradientTransformation, rng: Array,
                    sample_inputs: Any, num_peers: int,
                    compression: Compression = Compression(), **init_kwargs) -> PeerState:
    """All peers start from the same parameters (``create_train_state(model, ..., rng)``),
    each with its own rng stream ``fold_in(state.rng, i)``. CHOCO's public copies start
    at x^_i = x_0 and ``s_i = sum_j W_ij x^_j = x_0`` (valid because every peer starts
    at x_0; for peers that start apart use x^ = s = 0, CHOCO's own initialization).

    Args:
      model: the (quantized) Flax model.
      optimizer: the optax optimizer (each peer has its own state).
      rng: PRNG key of the shared initialization.
      sample_inputs: one peer's batch of inputs.
      num_peers: P.
      compression: the gossip's compression (CHOCO keeps public copies).
      **init_kwargs: passed to ``model.init`` (e.g. ``train=False``).

    Returns:
      A `PeerState` whose leaves are stacked ``(P, ...)``.

    Example:
      >>> from cpt_jax import quantize_model
      >>> from cpt_jax.data.peers import make_peer_image_data, peer_batch_at_step
      >>> from cpt_jax.models import MLP
      >>> qmodel = quantize_model(MLP(hidden=(16,), num_classes=10))
      >>> x = jnp.zeros((16, 8, 8, 1))                     # a batch of 8x8 images
      >>> state = init_peer_state(qmodel, optax.sgd(0.1), jax.random.key(0), x, 8,
      ...                         train=False)
      >>> jax.tree_util.tree_leaves(state.params)[0].shape[0]
      8
    """
    if not isinstance(num_peers, int) or num_peers < 1:
        raise ValueError(f"num_peers must be an integer >= 1, got {num_peers!r}")
    one = create_train_state(model, optimizer, rng, sample_inputs, **init_kwargs)
    stack = lambda x: jnp.broadcast_to(x, (num_peers,) + jnp.shape(x))  # noqa: E731
    train = jax.tree_util.tree_map(stack, one.replace(rng=None))
    rngs = jax.vmap(lambda i: jax.random.fold_in(one.rng, i))(jnp.arange(num_peers))
    train = train.replace(rng=rngs)
    if compression.choco:  # distinct buffers: the step donates all three trees
        return PeerState(train=train, public=_copy_tree(train.params),
                         mixed=_copy_tree(train.params))
    return PeerState(train=train)


def _copy_tree(tree: Any) -> Any:
    return jax.tree_util.tree_map(lambda v: jnp.array(v, copy=True), tree)


def shard_peers(tree: Any, mesh: Mesh, axis_name: str = PEER_AXIS) -> Any:
    """Place a stacked (P, ...) tree with peer i's slice on device i of `mesh`.

    Example:
      >>> stacked = {"w": jnp.ones((1, 3))}              # (P, ...) with P = 1 peer
      >>> state = shard_peers(stacked, make_peer_mesh(1))
      >>> tuple(state["w"].sharding.spec)
      ('peers',)
    """
    return jax.device_put(tree, NamedSharding(mesh, P(axis_name)))


def average_peers(tree: Any) -> Any:
    """The average over the peer axis: ``xbar = (1/P) sum_i x_i`` (leaf by leaf).

    Example:
      >>> average_peers({"w": jnp.array([[1.0], [3.0]])})["w"]
      Array([2.], dtype=float32)
    """
    return jax.tree_util.tree_map(lambda x: jnp.mean(x, axis=0), tree)


@jax.jit
def consensus_distance(params: Any) -> Array:
    """``(1/P) sum_i ||x_i - xbar||^2``, the norm over all parameters of a peer.

    Example:
      >>> consensus_distance({"w": jnp.array([[1.0, 0.0], [3.0, 0.0]])})
      Array(1., dtype=float32)
    """
    leaves = jax.tree_util.tree_leaves(params)
    total = jnp.float32(0.0)
    for x in leaves:
        d = x - jnp.mean(x, axis=0, keepdims=True)
        total = total + jnp.sum(d.astype(jnp.float32) ** 2) / x.shape[0]
    return total


# --------------------------------------------------------------------------- gossip

def _ring_exchange(tree: Any, axis_name: str, num_peers: int):
    """(x_{i-1}, x_{i+1}) for peer i: two ``ppermute`` of the same message."""
    to_right = [(i, (i + 1) % num_peers) for i in range(num_peers)]
    to_left = [(i, (i - 1) % num_peers) for i in range(num_peers)]
    return lax.ppermute(tree, axis_name, to_right), lax.ppermute(tree, axis_name, to_left)


def _gossip_local(params, public, mixed, compression: Compression, axis_name: str,
                  num_peers: int, self_weight: float):
    """One peer's gossip (inside shard_map, leaves without the peer axis)."""
    if num_peers == 1:
        return params, public, mixed
    w_self, w_nb = self_weight, (1.0 - self_weight) / 2.0
    if not compression.choco:
        left, right = _ring_exchange(params, axis_name, num_peers)
        new = jax.tree_util.tree_map(lambda x, l, r: w_self * x + w_nb * (l + r),
                                     params, left, right)
        return new, public, mixed
    treedef = jax.tree_util.tree_structure(params)
    x_leaves = treedef.flatten_up_to(params)
    h_leaves = treedef.flatten_up_to(public)
    s_leaves = treedef.flatten_up_to(mixed)
    messages = [compression.encode(x - h) for x, h in zip(x_leaves, h_leaves)]
    left, right = _ring_exchange(messages, axis_name, num_peers)
    new_x, new_h, new_s = [], [], []
    for x, h, s, m, ml, mr in zip(x_leaves, h_leaves, s_leaves, messages, left, right):
        q = compression.decode(m, x)
        h = h + q
        s = s + w_self * q + w_nb * (compression.decode(ml, x) + compression.decode(mr, x))
        new_x.append(x + compression.gamma * (s - h))
        new_h.append(h)
        new_s.append(s)
    unflat = treedef.unflatten
    return unflat(new_x), unflat(new_h), unflat(new_s)


def _squeeze(tree):
    return jax.tree_util.tree_map(lambda x: x[0], tree)


def _unsqueeze(tree):
    return jax.tree_util.tree_map(lambda x: x[None], tree)


def make_gossip(mesh: Mesh, compression: Compression = Compression(), *,
                self_weight: float = 1.0 / 3.0, axis_name: str = PEER_AXIS):
    """A jitted ``gossip(params, public, mixed) -> (params, public, mixed)`` on stacked trees.

    The gossip of the decentralized step alone (for tests and analysis). With exact
    gossip `public` and `mixed` are passed through (use None).

    Example:
      >>> gossip = make_gossip(make_peer_mesh(1))         # make_peer_mesh(8): 8 devices
      >>> x = jax.random.normal(jax.random.key(0), (1, 5))
      >>> y, _, _ = gossip(x, None, None)                 # y == W @ x
      >>> bool(jnp.allclose(y, jnp.asarray(ring_mixing_matrix(1), jnp.float32) @ x))
      True
    """
    _check_self_weight(self_weight)
    num_peers = mesh.shape[axis_name]

    def body(params, public, mixed):
        out = _gossip_local(_squeeze(params), _squeeze(public), _squeeze(mixed), compression,
                            axis_name, num_peers, self_weight)
        return _unsqueeze(out)

    spec = P(axis_name)
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec, spec, spec),
                                 out_specs=(spec, spec, spec)))


class DecentralizedStep:
    """A jitted ``step(peer_state, peer_batch) -> (peer_state, metrics)``; see
    `make_decentralized_step`. ``num_compiles`` counts traces (one per run)."""

    def __init__(self, fn: Callable, donate: bool, counter: list):
        self._fn = jax.jit(fn, donate_argnums=(0,) if donate else ())
        self._counter = counter

    def __call__(self, state: PeerState, batch: Any):
        return self._fn(state, batch)

    def lower(self, state: PeerState, batch: Any):
        """``jax.jit(...).lower`` of the step (to inspect its HLO or jaxpr)."""
        return self._fn.lower(state, batch)

    @property
    def num_compiles(self) -> int:
        """How many times the step was traced."""
        return self._counter[0]


def make_decentralized_step(model: nn.Module, optimizer: optax.GradientTransformation,
                            mesh: Mesh,
                            precision_schedule: PrecisionSchedule | None = None,
                            grad_schedule: PrecisionSchedule | None = None, *,
                            compression: Compression = Compression(),
                            self_weight: float = 1.0 / 3.0,
                            loss_fn: LossFn = classification_loss, nonfinite: str = "skip",
                            apply_kwargs: dict | None = None, donate: bool = True,
                            axis_name: str = PEER_AXIS) -> DecentralizedStep:
    """One decentralized step of all peers: local low-precision step, then ring gossip.

    Per peer i (in parallel, ``jax.shard_map`` over `axis_name` of `mesh`):

        b_t = precision_schedule(t), g_t = grad_schedule(t)       (traced, on device)
        x_i^{t+1/2}, opt_i = local step of `make_train_step` on peer i's batch
        x_i^{t+1} = gossip(x^{t+1/2})_i                           (see module docstring)

    `peer_batch` is a dict of arrays with a leading peer axis (P, B, ...), e.g. from
    `cpt_jax.data.peers.peer_batch_at_step`. Metrics come back per peer, shape (P,): ``loss``,
    ``accuracy``, ``finite``, ``bits``... (the local step's, before gossip).

    Example:
      >>> from cpt_jax import quantize_model
      >>> from cpt_jax.data.peers import make_peer_image_data, peer_batch_at_step
      >>> from cpt_jax.models import MLP
      >>> qmodel = quantize_model(MLP(hidden=(16,), num_classes=10))
      >>> x = jnp.zeros((16, 8, 8, 1))                     # a batch of 8x8 images
      >>> rng = np.random.default_rng(0)
      >>> images = rng.integers(0, 17, (40, 8, 8, 1)).astype(np.uint8)
      >>> labels, parts = np.arange(40) % 10, [np.arange(0, 24), np.arange(24, 40)]
      >>> data = make_peer_image_data(images, labels, parts, mean=[8.0], std=[4.0],
      ...                             pixel_max=16.0)
      >>> from cpt_jax.schedules import constant
      >>> tx = optax.sgd(0.05, 0.9, nesterov=True)
      >>> mesh = make_peer_mesh(1)                  # one peer per device (8 on a v3-8)
      >>> step = make_decentralized_step(qmodel, tx, mesh, constant(8), constant(8),
      ...                                compression=Compression("int8"))
      >>> state = shard_peers(init_peer_state(qmodel, tx, jax.random.key(0), x, 1,
      ...                                     Compression("int8"), train=False), mesh)
      >>> data = make_peer_image_data(images, labels, [np.arange(40)], mean=[8.0],
      ...                             std=[4.0], pixel_max=16.0, mesh=mesh)
      >>> batch = peer_batch_at_step(data, 0, jax.random.key(1), batch_size=16)
      >>> state, metrics = step(state, batch)
      >>> metrics["loss"].shape, float(metrics["bits"][0]), int(state.train.step[0])
      ((1,), 8.0, 1)
    """
    if axis_name not in mesh.shape:
        raise ValueError(f"mesh has no axis {axis_name!r}; its axes are {tuple(mesh.shape)}")
    _check_self_weight(self_weight)
    if nonfinite not in ("skip", "ignore"):
        raise ValueError(f"nonfinite must be 'skip' or 'ignore', got {nonfinite!r}")
    num_peers = mesh.shape[axis_name]
    apply_kwargs = dict(apply_kwargs or {})
    counter = [0]

    def body(state: PeerState, batch):
        local = _squeeze(state)
        b = _squeeze(batch)
        t = local.train.step
        bits = None if precision_schedule is None else precision_schedule(t)
        grad_bits = (None if (grad_schedule is None or bits is None) else grad_schedule(t))
        train, metrics = train_step_body(model, optimizer, loss_fn, local.train, b, bits,
                                         grad_bits, nonfinite, None, apply_kwargs, [0])
        params, public, mixed = _gossip_local(train.params, local.public, local.mixed,
                                              compression, axis_name, num_peers, self_weight)
        new = PeerState(train=train.replace(params=params), public=public, mixed=mixed)
        return _unsqueeze(new), _unsqueeze(metrics)

    spec = P(axis_name)
    mapped = jax.shard_map(body, mesh=mesh, in_specs=(spec, spec), out_specs=(spec, spec))

    def fn(state, batch):
        counter[0] += 1
        return mapped(state, batch)

    return DecentralizedStep(fn, donate, counter)


def ppermute_bytes(jaxpr) -> int:
    """Bytes moved by all ``ppermute`` ops of a (closed) jaxpr, per participant.

    Walks nested jaxprs (jit, shard_map, cond, ...); inside ``shard_map`` the shapes
    are per peer, so this is what one peer sends in one call. Used to check that
    `gossip_bytes_per_step` is what the compiled step really sends.

    Example:
      >>> from jax.sharding import PartitionSpec
      >>> send = jax.shard_map(lambda v: jax.lax.ppermute(v, PEER_AXIS, [(0, 0)]),
      ...                      mesh=make_peer_mesh(1), in_specs=PartitionSpec(PEER_AXIS),
      ...                      out_specs=PartitionSpec(PEER_AXIS))
      >>> ppermute_bytes(jax.make_jaxpr(send)(jnp.zeros((1, 100), jnp.int8)))   # 100 int8
      100
    """
    total = 0

    def walk(jx):
        nonlocal total
        for eqn in jx.eqns:
            if eqn.primitive.name == "ppermute":
                total += sum(math.prod(v.aval.shape) * v.aval.dtype.itemsize
                             for v in eqn.invars)
            for p in eqn.params.values():
                for item in (p if isinstance(p, (list, tuple)) else (p,)):
                    if hasattr(item, "eqns"):
                        walk(item)
                    elif hasattr(item, "jaxpr") and hasattr(item.jaxpr, "eqns"):
                        walk(item.jaxpr)

    walk(jaxpr.jaxpr if hasattr(jaxpr, "jaxpr") else jaxpr)
    return total




# --------------------------------------------------------------------------- evaluation

def make_peer_eval(eval_step: Callable) -> Callable:
    """``peer_eval(train_states, batch, bits) -> sums (P,)``: `eval_step` (from
    `cpt_jax.training.make_eval_step`) of every peer's own model on the same batch.

    Example:
      >>> from cpt_jax import quantize_model
      >>> from cpt_jax.data.peers import make_peer_image_data, peer_batch_at_step
      >>> from cpt_jax.models import MLP
      >>> qmodel = quantize_model(MLP(hidden=(16,), num_classes=10))
      >>> x = jnp.zeros((16, 8, 8, 1))                     # a batch of 8x8 images
      >>> from cpt_jax.training import make_eval_step
      >>> state = init_peer_state(qmodel, optax.sgd(0.1), jax.random.key(0), x, 2, train=False)
      >>> test_batch = {"inputs": x, "labels": jnp.zeros((16,), jnp.int32)}
      >>> peer_eval = make_peer_eval(make_eval_step(qmodel))
      >>> sums = peer_eval(state.train, test_batch, jnp.float32(8))
      >>> sums["correct"].shape, sums["count"].tolist()       # one entry per peer
      ((2,), [16.0, 16.0])
    """
    return jax.jit(jax.vmap(eval_step, in_axes=(0, None, None)))


def averaged_train_state(train: TrainState) -> TrainState:
    """A single `TrainState` holding the peers' average params and batch statistics
    (step, optimizer state and rng of peer 0), to evaluate the consensus model.

    Example:
      >>> from cpt_jax import quantize_model
      >>> from cpt_jax.data.peers import make_peer_image_data, peer_batch_at_step
      >>> from cpt_jax.models import MLP
      >>> qmodel = quantize_model(MLP(hidden=(16,), num_classes=10))
      >>> x = jnp.zeros((16, 8, 8, 1))                     # a batch of 8x8 images
      >>> from cpt_jax.training import make_eval_step
      >>> state = init_peer_state(qmodel, optax.sgd(0.1), jax.random.key(0), x, 2, train=False)
      >>> batch = {"inputs": x, "labels": jnp.zeros((16,), jnp.int32)}
      >>> consensus = averaged_train_state(state.train)     # peers start equal: = peer 0
      >>> sums = make_eval_step(qmodel)(consensus, batch, jnp.float32(32))
      >>> float(sums["count"])
      16.0
    """
    first = jax.tree_util.tree_map(lambda x: x[0], train)
    return first.replace(params=average_peers(train.params),
                         batch_stats=average_peers(train.batch_stats))
