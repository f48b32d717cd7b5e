"""``compute="int"`` against ``"fake"`` on model styles the tests do not train: a Linen
``nn.scan(nn.remat(block))`` stack of Flax attention, an einsum top-2 MoE, a
``lax.ragged_dot`` MoE, NNX ``MultiHeadAttention`` under ``nnx.remat``. Each trains 60
Adam steps over a cyclic width (3..8, 8-bit stochastic errors); printed per model and
path: the compiled step's int8 GEMMs and those with int32 operands (`benchmarks.hlo`),
the compiles, the first and final loss, the warnings.

    PYTHONPATH=. python scripts/int_path_models.py [linen moe ragged nnx]
"""
import sys
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import cpt_jax
from benchmarks.hlo import gemms

D, T, B, E = 32, 8, 4, 4
rng = np.random.default_rng(0)
X = jnp.asarray(rng.normal(size=(B, T, D)), jnp.float32)
Y = jnp.roll(X, 1, axis=-1)

class AttnBlock(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        h = nn.LayerNorm()(x)
        x = x + nn.SelfAttention(num_heads=4, qkv_features=D, deterministic=True)(h)
        h = nn.LayerNorm()(x)
        return x + nn.Dense(D)(nn.gelu(nn.Dense(4 * D)(h))), None

class LinenStack(nn.Module):
    @nn.compact
    def __call__(self, x):
        Stack = nn.scan(nn.remat(AttnBlock), variable_axes={"params": 0},
                        split_rngs={"params": True}, length=3)
        x, _ = Stack()(x, None)
        return nn.Dense(D)(x)

class EinsumMoE(nn.Module):
    @nn.compact
    def __call__(self, x):
        logits = nn.Dense(E, name="router")(x)
        w, idx = jax.lax.top_k(jax.nn.softmax(logits), 2)
        gate = jnp.sum(jax.nn.one_hot(idx, E) * w[..., None], axis=-2)       # (B,T,E)
        w_in = self.param("w_in", nn.initializers.lecun_normal(), (E, D, 2 * D))
        w_out = self.param("w_out", nn.initializers.lecun_normal(), (E, 2 * D, D))
        h = jax.nn.relu(jnp.einsum("btd,edf->btef", x, w_in))
        y = jnp.einsum("btef,efd->bted", h, w_out)
        return jnp.einsum("bted,bte->btd", y, gate)

class RaggedMoE(nn.Module):
    @nn.compact
    def __call__(self, x):
        flat = x.reshape(-1, D)
        expert = jnp.argmax(nn.Dense(E, name="router")(flat), -1)
        order = jnp.argsort(expert)
        sizes = jnp.bincount(expert, length=E).astype(jnp.int32)
        w = self.param("w", nn.initializers.lecun_normal(), (E, D, D))
        y = jax.lax.ragged_dot(flat[order], w, sizes)
        return jnp.zeros_like(flat).at[order].set(y).reshape(x.shape)

def _linen_step(model, tx):
    @jax.jit
    def step(params, opt, bits, seed):
        def loss(p):
            with cpt_jax.precision(bits, grad_bits=8, rng=jax.random.key(seed)):
                return jnp.mean((model.apply(p, X) - Y) ** 2)
        value, grads = jax.value_and_grad(loss)(params)
        updates, opt = tx.update(grads, opt, params)
        return optax.apply_updates(params, updates), opt, value
    return step


def linen_case(name, module):
    out = {}
    for compute in ("fake", "int"):
        model = cpt_jax.quantize_model(module, config=cpt_jax.QuantConfig(compute=compute))
        params = model.init(jax.random.key(1), X)
        tx = optax.adam(3e-3)
        opt = tx.init(params)
        step = _linen_step(model, tx)
        hlo = gemms(step.lower(params, opt, jnp.float32(6), 0).compile().as_text())
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            losses = []
            for i in range(60):
                params, opt, value = step(params, opt, jnp.float32(3 + i % 6), i)
                losses.append(float(value))
        out[compute] = dict(int8_gemms=sum(g.integer for g in hlo),
                            int32_operands=sum(g.lhs == "s32" or g.rhs == "s32" for g in hlo),
                            compiles=step._cache_size(), first=round(losses[0], 4),
                            final=round(float(np.mean(losses[-6:])), 4),
                            warnings=sorted({str(w.message)[:100] for w in caught}))
    print(name, out, flush=True)


class NNXBlock(nnx.Module):
    def __init__(self, rngs):
        self.attn = nnx.MultiHeadAttention(4, D, D, decode=False, rngs=rngs)
        self.ff = nnx.Linear(D, D, rngs=rngs)
    def __call__(self, x):
        x = x + nnx.remat(lambda m, h: m(h))(self.attn, x)
        return x + self.ff(nnx.relu(x))

def _nnx_train(x, y):
    @nnx.jit
    def train(model, optimizer, bits, seed):
        def loss(model):
            with cpt_jax.precision(bits, grad_bits=8, rng=jax.random.key(seed)):
                return jnp.mean((model(x) - y) ** 2)
        value, grads = nnx.value_and_grad(loss)(model)
        optimizer.update(model, grads)
        return value
    return train


def nnx_case():
    out = {}
    for compute in ("fake", "int"):
        model = cpt_jax.quantize_model(NNXBlock(nnx.Rngs(0)),
                                       config=cpt_jax.QuantConfig(compute=compute))
        optimizer = nnx.Optimizer(model, optax.adam(3e-3), wrt=nnx.Param)
        train = _nnx_train(X, Y)
        losses = [float(train(model, optimizer, jnp.float32(3 + i % 6), i)) for i in range(60)]
        out[compute] = dict(first=round(losses[0], 4), final=round(float(np.mean(losses[-6:])), 4))
    print("nnx_mha_remat", out, flush=True)


def main(which):
    cases = {"linen": lambda: linen_case("linen_scan_remat_attention", LinenStack()),
             "moe": lambda: linen_case("einsum_top2_moe", EinsumMoE()),
             "ragged": lambda: linen_case("ragged_dot_moe", RaggedMoE()),
             "nnx": nnx_case}
    for name in which or list(cases):
        cases[name]()


if __name__ == "__main__":
    main(sys.argv[1:])
