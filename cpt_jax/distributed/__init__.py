"""Distributed training: data parallel over a mesh, multi-process start-up, gossip.

==================  ==========================================================
module              what
==================  ==========================================================
``mesh``            data parallel training over a `jax.sharding.Mesh` (one host
                    or many): `make_mesh`, `shard_batch`, `shard_state`, FSDP
``initialize``      one `initialize` (with the CPU collectives setting) and
                    `initialize_from_environment` for multi-process runs
``gossip``          decentralized training: gossip over a ring (`shard_map` +
                    `ppermute`) with quantized communication
==================  ==========================================================
"""
from cpt_jax.distributed._startup import initialize, initialize_from_environment
from cpt_jax.distributed.mesh import (
    global_batch_from_local,
    local_batch_slice,
    make_mesh,
    mesh_from_config,
    replicate,
    shard_batch,
    shard_state,
)

__all__ = (
    "initialize",
    "global_batch_from_local",
    "initialize_from_environment",
    "local_batch_slice",
    "make_mesh",
    "mesh_from_config",
    "replicate",
    "shard_batch",
    "shard_state",
)
