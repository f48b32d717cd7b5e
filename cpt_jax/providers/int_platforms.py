"""Where integer GEMMs are faster than float32: the decision behind ``compute="auto"``.

``QuantConfig(compute="auto")`` (the default) runs a product's three GEMMs on int8
codes (`cpt_jax.providers.integer`) only on the platforms this table names, and fake
quantization elsewhere, in one program (``lax.platform_dependent``: the choice is made
for the platform the step is compiled for). ``compute="int"`` runs integers everywhere;
``compute="fake"`` nowhere.

=========  ================================  ==========================================
platform   integers under ``"auto"``          measured (``benchmarks/int_gemm.py``)
=========  ================================  ==========================================
``cpu``    the CPU has AMX-INT8 (Linux       Xeon with AMX, XLA's int8 dot (YNNPACK):
           ``/proc/cpuinfo`` flag            6-10x float32 (issue 44); AMD EPYC
           ``amx_int8``)                     (Zen, AVX2, no VNNI): 0.8-0.95x, slower
``cuda``   no                                not measured yet (no GPU lent)
``rocm``   no                                not measured
``tpu``    no                                not measured
=========  ================================  ==========================================

A platform enters the table when a measurement shows integer GEMMs faster there;
never on a guess ("never where they are slower"). AVX512-VNNI without AMX is not
measured and stays fake.

``CPT_JAX_INT_GEMM`` overrides the table for a process: ``none`` (fake everywhere),
or platforms separated by commas (``cpu``, ``cpu,cuda``); unset or ``auto``: the
table. The test suite sets ``none`` so that what a test computes does not depend on
the machine it runs on.
"""
from __future__ import annotations

import functools
import os

PLATFORMS = ("cpu", "cuda", "rocm", "tpu")
"""The platforms ``lax.platform_dependent`` tells apart."""

ENV = "CPT_JAX_INT_GEMM"
"""The environment variable that overrides the table (module docstring)."""

FAST_CPU_FLAGS = frozenset({"amx_int8"})
"""CPU feature flags with which XLA's int8 GEMM was measured faster than float32."""


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The host CPU's feature flags (Linux ``/proc/cpuinfo``; empty where unreadable).

    Example:
      >>> isinstance(cpu_flags(), frozenset)
      True
    """
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def integer_gemm_platforms(flags: frozenset[str] | None = None,
                           env: str | None = None) -> tuple[str, ...]:
    """The platforms where ``compute="auto"`` runs integer GEMMs (module docstring).

    Args:
      flags: the CPU's feature flags (default: `cpu_flags` of this host).
      env: the override (default: ``os.environ["CPT_JAX_INT_GEMM"]``).

    Returns:
      A tuple of `PLATFORMS` names, possibly empty.

    Example:
      >>> integer_gemm_platforms(frozenset({"avx2", "amx_int8"}), env="auto")
      ('cpu',)
      >>> integer_gemm_platforms(frozenset({"avx2", "fma"}), env="auto")
      ()
      >>> integer_gemm_platforms(frozenset(), env="cpu,cuda"), integer_gemm_platforms(env="none")
      (('cpu', 'cuda'), ())
    """
    env = os.environ.get(ENV, "auto") if env is None else env
    choice = env.strip().lower()
    if choice in ("", "auto"):
        flags = cpu_flags() if flags is None else flags
        return ("cpu",) if FAST_CPU_FLAGS & flags else ()
    if choice == "none":
        return ()
    names = tuple(p.strip() for p in choice.split(",") if p.strip())
    unknown = [p for p in names if p not in PLATFORMS]
    if unknown:
        raise ValueError(f"{ENV}={env!r}: unknown platform(s) {unknown}; use 'auto', 'none' "
                         f"or a comma-separated subset of {PLATFORMS}")
    return names


__all__ = ["ENV", "FAST_CPU_FLAGS", "PLATFORMS", "cpu_flags", "integer_gemm_platforms"]
