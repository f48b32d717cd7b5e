"""Data parallelism over a `jax.sharding.Mesh` (XLA SPMD), used by the runner.

The same jitted train step runs on one device or many: the batch is sharded along the
mesh's ``"data"`` axis, the train state is replicated, and XLA inserts the gradient
all-reduce. Bits stay traced, so a cyclic run still compiles once.
"""
from __future__ import annotations

from typing import Any, Optional

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

DATA_AXIS = "data"


def make_mesh(num_devices: Optional[int] = None, devices=None) -> Mesh:
    """A 1-D mesh ``("data",)`` over `num_devices` (default: all) devices."""
    devices = list(devices if devices is not None else jax.devices())
    if num_devices is not None:
        if not 1 <= num_devices <= len(devices):
            raise ValueError(
                f"num_devices={num_devices} must be in [1, {len(devices)}] (devices available)")
        devices = devices[:num_devices]
    return Mesh(np.array(devices), (DATA_AXIS,))


def mesh_from_config(config) -> Optional[Mesh]:
    """The data-parallel mesh for a run: None on one device or with ``num_devices=1``."""
    requested = int(config.get("num_devices", 0) or 0)
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


def replicate(tree: Any, mesh: Mesh) -> Any:
    """Place every leaf of `tree` fully replicated on `mesh`."""
    return jax.device_put(tree, NamedSharding(mesh, P()))


def shard_batch(batch: Any, mesh: Mesh) -> Any:
    """Shard every leaf of `batch` along its leading (batch) axis over ``"data"``."""
    return jax.device_put(batch, NamedSharding(mesh, P(DATA_AXIS)))
