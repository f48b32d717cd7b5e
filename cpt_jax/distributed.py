"""Multi-host start-up: `jax.distributed.initialize` from the environment when asked.

Set ``CPT_JAX_COORDINATOR=host:port``, ``CPT_JAX_NUM_PROCESSES`` and
``CPT_JAX_PROCESS_ID`` (or run on a TPU pod / SLURM, where JAX finds them itself and
``CPT_JAX_DISTRIBUTED=1`` is enough). Single-process runs do nothing.
"""
from __future__ import annotations

import os

import jax

_initialized = False


def maybe_initialize() -> bool:
    """Call `jax.distributed.initialize` once if the environment asks for it."""
    global _initialized
    if _initialized:
        return True
    coordinator = os.environ.get("CPT_JAX_COORDINATOR")
    if coordinator:
        jax.distributed.initialize(
            coordinator_address=coordinator,
            num_processes=int(os.environ["CPT_JAX_NUM_PROCESSES"]),
            process_id=int(os.environ["CPT_JAX_PROCESS_ID"]))
        _initialized = True
    elif os.environ.get("CPT_JAX_DISTRIBUTED") == "1":
        jax.distributed.initialize()
        _initialized = True
    return _initialized
