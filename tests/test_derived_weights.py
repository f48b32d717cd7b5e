"""A weight used transposed and reshaped before its product (a MoE router, as Gemma's:
``w.T.reshape(...)``) is the same weight eagerly and under jit (issue 41).

Under a trace the interception follows the equations from the parameter to the
operand; eagerly there are none, and the router's weight was taken for an activation
(one per-tensor grid) while ``jax.jit`` and `cpt_jax.count_ops` quantized it as a
weight (a grid per output channel): the two gave outputs 1.2 apart at 4 bits.
"""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import cpt_jax
from cpt_jax import context

EXPERTS, D_MODEL = 8, 16


class LinenRouter(nn.Module):
    """Router logits from a weight stored (experts, d_model), used transposed and split
    into (d_model, groups, experts per group)."""

    @nn.compact
    def __call__(self, x):
        w = self.param("router", nn.initializers.normal(1.0), (EXPERTS, D_MODEL))
        return jnp.einsum("btd,dgk->btgk", x, w.T.reshape(D_MODEL, 2, EXPERTS // 2))


class NNXRouter(nnx.Module):
    def __init__(self, rngs):
        self.router = nnx.Param(jax.random.normal(rngs.params(), (EXPERTS, D_MODEL)))

    def __call__(self, x):
        return x @ self.router[...].T


def _inputs():
    return jnp.asarray(np.random.default_rng(0).normal(size=(2, 5, D_MODEL)), jnp.float32)


def _eager_products(run, *args):
    with context.recording() as records:
        out = run(*args)
    return out, [r.product for r in records]


@pytest.mark.parametrize("door", ["linen", "nnx"])
def test_a_transposed_router_weight_is_a_weight_eagerly_and_under_jit(door):
    x = _inputs()
    if door == "linen":
        model = cpt_jax.quantize_model(LinenRouter())
        variables = LinenRouter().init(jax.random.key(0), x)

        def run(v, x):
            with cpt_jax.precision(4):
                return model.apply(v, x)
        args, counted = (variables, x), cpt_jax.count_ops(model, variables, x)
    else:
        model = cpt_jax.quantize_model(NNXRouter(nnx.Rngs(0)))

        def run(m, x):
            with cpt_jax.precision(4):
                return m(x)
        args, counted = (model, x), cpt_jax.count_ops(model, x)
    eager, recorded = _eager_products(run, *args)
    jitted = (nnx.jit(run) if door == "nnx" else jax.jit(run))(*args)
    # One product; its right operand the weight "router", a grid per output channel
    # (the product's last free axis), in count_ops and in the eager run alike.
    assert len(counted) == 1 and len(recorded) == 1
    weight = counted[0].product.rhs
    assert (weight.role, weight.param) == ("weight", "router")
    assert weight.channel_axis == (2 if door == "linen" else 1)
    assert recorded[0].rhs == weight and recorded[0].lhs == counted[0].product.lhs
    # The same grids: eager and jitted outputs equal to float32 rounding (a per-tensor
    # weight grid, as before issue 41, moved them by ~1 at 4 bits).
    np.testing.assert_allclose(np.asarray(eager), np.asarray(jitted), rtol=1e-5, atol=1e-5)


def test_an_activation_equal_to_no_parameter_stays_an_activation():
    # The eager match is exact: a transposed weight plus one is not the weight, and a
    # constant parameter (all zeros) matches nothing.
    from cpt_jax.interception import _call_sites as sites
    w = jnp.asarray(np.random.default_rng(1).normal(size=(4, 6)), jnp.float32)
    params = {"w": w, "zeros": jnp.zeros((6, 4))}
    assert sites.rearranged_param(w.T.reshape(2, 3, 4), params) == "w"
    assert sites.rearranged_param(w.T + 1.0, params) is None
    assert sites.rearranged_param(jnp.zeros((4, 6)), params) is None
    assert sites.rearranged_param(jax.jit(lambda v: v)(w.T), params) == "w"
