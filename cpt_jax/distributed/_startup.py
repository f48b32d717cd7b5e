"""Multi-process start-up: one `initialize`, with the CPU collectives a CPU run needs.

`initialize(coordinator_address, num_processes, process_id)` calls
`jax.distributed.initialize` after choosing the cross-process CPU collectives
(``jax_cpu_collectives_implementation``: ``"gloo"`` over TCP by default, or
``"mpi"``; it does nothing on GPU/TPU). `initialize_from_environment` (what the main
job calls) reads ``CPT_JAX_COORDINATOR=host:port``, ``CPT_JAX_NUM_PROCESSES`` and
``CPT_JAX_PROCESS_ID`` (or, on a TPU pod / SLURM where JAX finds them itself,
``CPT_JAX_DISTRIBUTED=1``); a single-process run does nothing.
"""
from __future__ import annotations

import os
from collections.abc import Sequence

import jax

_STATE = {"initialized": False}


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, *,
               local_device_ids: Sequence[int] | None = None,
               cpu_collectives: str | None = "gloo") -> None:
    """`jax.distributed.initialize`, with cross-process CPU collectives enabled, once.

    Args:
      coordinator_address: ``"host:port"`` of process 0 (None on TPU pods / SLURM).
      num_processes, process_id: this run's size and this process's rank.
      local_device_ids: the devices this process uses (default: all).
      cpu_collectives: ``"gloo"``, ``"mpi"`` or None (leave JAX's setting).

    Example (two processes on one machine)::

      initialize("127.0.0.1:12355", num_processes=2, process_id=rank)
      mesh = cpt_jax.distributed.make_mesh()     # 2 devices, one per process
    """
    if _STATE["initialized"]:
        return
    if cpu_collectives:
        jax.config.update("jax_cpu_collectives_implementation", cpu_collectives)
    jax.distributed.initialize(coordinator_address=coordinator_address,
                               num_processes=num_processes, process_id=process_id,
                               local_device_ids=local_device_ids)
    _STATE["initialized"] = True


def initialize_from_environment() -> bool:
    """`initialize` from the ``CPT_JAX_*`` environment variables if they ask for it.

    Returns:
      Whether this process runs as part of a multi-process run.

    Example:
      >>> import os; "CPT_JAX_COORDINATOR" in os.environ or initialize_from_environment()
      False
    """
    if _STATE["initialized"]:
        return True
    coordinator = os.environ.get("CPT_JAX_COORDINATOR")
    if coordinator:
        initialize(coordinator, int(os.environ["CPT_JAX_NUM_PROCESSES"]),
                   int(os.environ["CPT_JAX_PROCESS_ID"]))
    elif os.environ.get("CPT_JAX_DISTRIBUTED") == "1":
        initialize()
    return _STATE["initialized"]


__all__ = ["initialize", "initialize_from_environment"]
