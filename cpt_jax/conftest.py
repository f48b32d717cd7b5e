"""Doctest namespace: every docstring example may use `jax`, `jnp`, `np`, `nn`, `optax`, `cpt_jax`.

Run the examples with ``python -m pytest -q --doctest-modules cpt_jax``.
"""
import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import cpt_jax

# What a test computes must not depend on the machine it runs on: compute="auto" takes
# integer GEMMs only where this host's CPU is in the table of cpt_jax.providers.int_platforms
# (AMX); tests pin "none" (fake quantization) and test the integer path with compute="int".
os.environ.setdefault("CPT_JAX_INT_GEMM", "none")


@pytest.fixture(autouse=True)
def _doctest_names(doctest_namespace):
    doctest_namespace.update(jax=jax, jnp=jnp, np=np, nn=nn, optax=optax, cpt_jax=cpt_jax)

