"""cpt_jax's own warnings never leak into the suite's summary (issue 30, point 11).

pyproject.toml turns `StalePrecisionWarning` into an error inside every test: a test
that triggers it must expect it with ``pytest.warns``; one that does not fails there
instead of printing the warning in the summary.
"""
from __future__ import annotations

import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import cpt_jax
from cpt_jax import context
from cpt_jax.context import precision


def _model_and_variables():
    qmodel = cpt_jax.quantize_model(nn.Dense(3))
    v = qmodel.init(jax.random.key(0), jnp.ones((1, 4)))
    v = jax.tree.map(lambda a: jax.random.normal(jax.random.key(1), a.shape), v)
    return qmodel, v


def test_an_unexpected_stale_precision_warning_fails_the_test():
    qmodel, v = _model_and_variables()
    f = jax.jit(qmodel.apply)
    with pytest.raises(context.StalePrecisionWarning, match="inside the jitted function"):
        with precision(8):            # outside the jitted function: stale widths
            f(v, jnp.ones((1, 4)))


def test_an_expected_stale_precision_warning_is_caught_by_pytest_warns():
    qmodel, v = _model_and_variables()
    f = jax.jit(qmodel.apply)
    with pytest.warns(context.StalePrecisionWarning, match="inside the jitted function"):
        with precision(8):
            f(v, jnp.ones((1, 4)))


@jax.jit
def _jitted_product(x, w):
    return x @ w


class _JittedHelper(nn.Module):
    @nn.compact
    def __call__(self, x):
        w = self.param("w", nn.initializers.normal(0.5), (x.shape[-1], 3))
        return _jitted_product(x, w)


def test_a_jitted_helper_inside_an_eager_model_call_is_not_stale_and_does_not_warn():
    """What leaked in test_coverage's cached-traces test: eager ``precision(bits)``
    around a model whose product is inside its own jitted helper."""
    x = jnp.asarray(np.random.default_rng(0).normal(size=(2, 4)), jnp.float32)
    qmodel = cpt_jax.quantize_model(_JittedHelper())
    v = qmodel.init(jax.random.key(0), x)
    outs = []
    with warnings.catch_warnings():
        warnings.simplefilter("error", context.StalePrecisionWarning)
        for bits in (2.0, 3.0):
            with precision(bits):
                outs.append(np.asarray(qmodel.apply(v, x)))
    assert not np.allclose(outs[0], outs[1])   # each call at its own widths
