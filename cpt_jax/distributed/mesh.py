"""Data parallelism over a `jax.sharding.Mesh` (XLA SPMD), one host or many.

The same jitted train step (`cpt_jax.training.make_train_step`) runs on one device or
many: the global batch is sharded along the mesh's ``"data"`` axis, the train state
is replicated (or, with ``strategy="fsdp"``, its large leaves are sharded along
``"data"`` too, ZeRO-3 style), and XLA inserts the collectives (gradient all-reduce,
BatchNorm and quantizer statistics over the global batch, parameter all-gathers).
Nothing about the precision changes: the bits are evaluated on the traced step inside
the compiled function, so a cyclic run still compiles once, and

    step_on_mesh(state, global_batch) == step_on_one_device(state, global_batch)

up to float reassociation of the reductions (tested in ``tests/test_parallel.py``).

Multi-host (several processes, each with its local devices): start every process
with `cpt_jax.distributed.initialize` (or `initialize_from_environment` from the
``CPT_JAX_*`` environment variables), build the mesh over ``jax.devices()`` (all
processes' devices), let each process load only its rows of the global batch
(`local_batch_slice`) and assemble the global `jax.Array` with
`global_batch_from_local` (``jax.make_array_from_process_local_data``). See
``docs/scale_out.md``.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

DATA_AXIS = "data"
STRATEGIES = ("replicate", "fsdp")


def make_mesh(num_devices: int | None = None, devices=None,
              axis_name: str = DATA_AXIS) -> Mesh:
    """A 1-D mesh ``(axis_name,)`` over `num_devices` (default: all) devices.

    With several processes, ``jax.devices()`` lists every process's devices (process
    0's first), so the mesh is global and process ``p`` owns a contiguous block of it.

    Args:
      num_devices: how many devices (the first ones of `devices`); None: all.
      devices: the devices to use (default ``jax.devices()``).
      axis_name: the mesh axis name.

    Returns:
      A 1-D `Mesh` of shape ``{axis_name: num_devices}``.

    Example:
      >>> mesh = make_mesh(1)            # make_mesh(8) needs >= 8 devices
      >>> dict(mesh.shape)
      {'data': 1}
    """
    devices = list(devices if devices is not None else jax.devices())
    if num_devices is not None:
        if not 1 <= num_devices <= len(devices):
            raise ValueError(
                f"num_devices={num_devices} must be in [1, {len(devices)}] (devices available)")
        devices = devices[:num_devices]
    return Mesh(np.array(devices), (axis_name,))


def mesh_from_config(config) -> Mesh | None:
    """The data-parallel mesh for a run: None on one device or with ``num_devices=1``.

    ``config.num_devices`` (0: all devices) picks how many devices;
    ``config.batch_size`` (the global batch) must be divisible by that number.

    Args:
      config: the run's ConfigDict (``num_devices``, ``batch_size``).

    Returns:
      A data-parallel `Mesh` (`make_mesh`), or None for one device.

    Example:
      >>> import ml_collections
      >>> print(mesh_from_config(ml_collections.ConfigDict({"batch_size": 64,
      ...                                                   "num_devices": 1})))
      None
    """
    requested = int(config.num_devices)
    available = jax.device_count()
    if requested > available:
        raise ValueError(
            f"config.num_devices={requested} but only {available} devices are available")
    n = requested or available
    if n <= 1:
        return None
    if int(config.batch_size) % n:
        raise ValueError(
            f"config.batch_size={config.batch_size} must be divisible by the {n} devices of "
            f"the data-parallel mesh")
    return make_mesh(n)


def _is_multiprocess(mesh: Mesh) -> bool:
    return not all(d.process_index == jax.process_index() for d in mesh.devices.flat)


def _put_global(x: Any, sharding: NamedSharding) -> jax.Array:
    """Place a value that every process holds in full onto a (multi-process) sharding."""
    if not _is_multiprocess(sharding.mesh):
        return jax.device_put(x, sharding)
    if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        data = _put_global(jax.random.key_data(x), NamedSharding(
            sharding.mesh, P(*sharding.spec, *([None] * (jax.random.key_data(x).ndim
                                                          - len(sharding.spec))))))
        return jax.random.wrap_key_data(data, impl=jax.random.key_impl(x))
    host = np.asarray(jax.device_get(x))
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def replicate(tree: Any, mesh: Mesh) -> Any:
    """Place every leaf of `tree` fully replicated on `mesh` (``PartitionSpec()``).

    Works across processes as long as every process passes the same values (e.g. a
    train state initialized from the same seed).

    Example:
      >>> state = replicate({"w": jnp.ones((4, 2))}, make_mesh(1))
      >>> tuple(state["w"].sharding.spec)
      ()
    """
    sharding = NamedSharding(mesh, P())
    return jax.tree_util.tree_map(lambda x: _put_global(x, sharding), tree)


def shard_batch(batch: Any, mesh: Mesh) -> Any:
    """Shard every leaf of `batch` along its leading (batch) axis over ``"data"``.

    `batch` is the *global* batch, the same on every process (the runner's
    ``task.train_batch(step, key)`` is a pure function of the step). With several
    processes each keeps only the rows of its own devices. When each process loads
    only its own rows, use `global_batch_from_local` instead.

    Args:
      batch: a pytree of arrays with the global batch on axis 0 (divisible by the mesh).
      mesh: the data-parallel mesh.

    Returns:
      The same pytree, each leaf a `jax.Array` sharded ``PartitionSpec("data")``.

    Example:
      >>> x, y = jnp.ones((8, 3)), jnp.zeros((8,), jnp.int32)   # B % n == 0
      >>> batch = shard_batch({"inputs": x, "labels": y}, make_mesh(1))
      >>> tuple(batch["inputs"].sharding.spec)
      ('data',)
    """
    sharding = NamedSharding(mesh, P(DATA_AXIS))
    return jax.tree_util.tree_map(lambda x: _put_global(x, sharding), batch)


def local_batch_slice(global_batch_size: int, mesh: Mesh) -> slice:
    """The rows ``[start, stop)`` of a global batch that this process's devices hold.

    For a batch sharded as ``PartitionSpec("data")`` over `mesh`, process ``p`` owns
    the rows of its addressable devices; with `make_mesh` (devices in process order)
    that is the contiguous block ``[p * B / n_proc, (p + 1) * B / n_proc)``.

    Example:
      >>> local_batch_slice(64, make_mesh(1))   # one process: every row
      slice(0, 64, None)
    """
    n = mesh.shape[DATA_AXIS] if DATA_AXIS in mesh.shape else mesh.devices.size
    if global_batch_size < 1 or global_batch_size % n:
        raise ValueError(f"global_batch_size={global_batch_size} must be a positive multiple "
                         f"of the {n} devices along {DATA_AXIS!r}")
    sharding = NamedSharding(mesh, P(DATA_AXIS))
    rows = []
    for index in sharding.addressable_devices_indices_map((global_batch_size,)).values():
        s = index[0]
        rows.append((s.start or 0, global_batch_size if s.stop is None else s.stop))
    start, stop = min(r[0] for r in rows), max(r[1] for r in rows)
    if sum(b - a for a, b in set(rows)) != stop - start:
        raise ValueError("this process's devices do not hold a contiguous block of the "
                         "batch; build the mesh with make_mesh() (devices in process order)")
    return slice(start, stop)


def global_batch_from_local(local_batch: Any, mesh: Mesh) -> Any:
    """Assemble per-process local batches into one global batch sharded over ``"data"``.

    Each process passes its own rows (``local_batch_slice`` of the global batch, with
    leading size ``B / process_count``); the result is a global `jax.Array` per leaf of
    shape ``(B, ...)``, built by ``jax.make_array_from_process_local_data``. On a
    single process it is `shard_batch`.

    Example:
      >>> mesh = make_mesh(1)
      >>> x, y = np.ones((64, 3), np.float32), np.zeros((64,), np.int32)
      >>> rows = local_batch_slice(64, mesh)
      >>> batch = global_batch_from_local({"inputs": x[rows], "labels": y[rows]}, mesh)
      >>> batch["inputs"].shape                                   # global shape
      (64, 3)
    """
    sharding = NamedSharding(mesh, P(DATA_AXIS))

    def one(x):
        x = np.asarray(jax.device_get(x))
        return jax.make_array_from_process_local_data(sharding, x)

    return jax.tree_util.tree_map(one, local_batch)


# --------------------------------------------------------------------------- FSDP

def fsdp_spec(shape: Sequence[int], num_shards: int, min_size: int = 1024) -> P:
    """The `PartitionSpec` that shards one leaf FSDP-style along ``"data"``.

    The largest axis divisible by `num_shards` is sharded (the last such axis on a
    tie); leaves with fewer than `min_size` elements, or with no divisible axis, are
    replicated (``P()``).

    Example:
      >>> tuple(fsdp_spec((3, 3, 16, 32), 8))
      (None, None, None, 'data')
      >>> tuple(fsdp_spec((10,), 8))
      ()
    """
    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1, got {num_shards}")
    if math.prod(shape) < min_size or num_shards == 1:
        return P()
    best = None
    for axis, size in enumerate(shape):
        if size % num_shards == 0 and (best is None or size >= shape[best]):
            best = axis
    if best is None:
        return P()
    return P(*([None] * best + [DATA_AXIS]))


def state_shardings(tree: Any, mesh: Mesh, strategy: str = "replicate",
                    min_size: int = 1024) -> Any:
    """A `NamedSharding` per leaf: all replicated, or FSDP (`fsdp_spec`) per leaf.

    ``strategy="fsdp"`` shards parameters, optimizer state and batch statistics (any
    leaf of at least `min_size` elements with an axis divisible by the mesh size);
    scalars (step, rng) stay replicated.

    Example:
      >>> state = {"kernel": jnp.ones((64, 32)), "step": jnp.zeros((), jnp.int32)}
      >>> shardings = state_shardings(state, make_mesh(1), "fsdp")
      >>> sorted(shardings)
      ['kernel', 'step']
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    n = mesh.shape[DATA_AXIS]

    def one(x):
        if strategy == "replicate":
            return NamedSharding(mesh, P())
        return NamedSharding(mesh, fsdp_spec(np.shape(x), n, min_size))

    return jax.tree_util.tree_map(one, tree)


def shard_state(state: Any, mesh: Mesh, strategy: str = "replicate",
                min_size: int = 1024) -> Any:
    """Place a train state on `mesh`: replicated, or FSDP-sharded along ``"data"``.

    With ``"fsdp"`` each device keeps ``1/n`` of every large leaf; the jitted step
    all-gathers the parameters where it needs them and reduce-scatters gradients
    (XLA SPMD), and the result equals the replicated step.

    Args:
      state: the train state (any pytree).
      mesh: the data-parallel mesh.
      strategy: ``"replicate"`` or ``"fsdp"``.
      min_size: leaves smaller than this stay replicated under FSDP.

    Returns:
      The state placed per `state_shardings`.

    Example:
      >>> mesh = make_mesh(1)
      >>> state = shard_state({"kernel": jnp.ones((64, 32))}, mesh, "fsdp")
      >>> state["kernel"].shape       # then: train_step(state, shard_batch(batch, mesh))
      (64, 32)
    """
    shardings = state_shardings(state, mesh, strategy, min_size)
    return jax.tree_util.tree_map(_put_global, state, shardings)


# --------------------------------------------------------------------------- multi-host
