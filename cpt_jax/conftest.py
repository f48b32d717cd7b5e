"""Doctest namespace: every docstring example may use `jax`, `jnp`, `np`, `nn`, `optax`, `cpt_jax`.

Run the examples with ``python -m pytest -q --doctest-modules cpt_jax``.
"""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import cpt_jax


@pytest.fixture(autouse=True)
def _doctest_names(doctest_namespace):
    doctest_namespace.update(jax=jax, jnp=jnp, np=np, nn=nn, optax=optax, cpt_jax=cpt_jax)

