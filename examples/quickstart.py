"""cpt_jax in your own Flax code: an unmodified model, CPT schedule, one compile."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

import cpt_jax


class MLP(nn.Module):                                  # your model, untouched
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(128)(x))
        return nn.Dense(10, name="classifier")(x)

model = cpt_jax.quantize_model(MLP(), rules=cpt_jax.CPT_RULES)   # classifier stays fp32
bits = cpt_jax.cyclic("cos_growth", min_bits=3, max_bits=8, num_cycles=4, total_steps=400)
params = model.init(jax.random.key(0), jnp.ones((1, 64)))
tx = optax.sgd(0.1, momentum=0.9); opt_state = tx.init(params)

@jax.jit
def train_step(params, opt_state, x, y, step):
    def loss_fn(p):
        with cpt_jax.precision(bits(step), grad_bits=8, rng=jax.random.key(step)):
            logits = model.apply(p, x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

from sklearn.datasets import load_digits

X, Y = load_digits(return_X_y=True); X = jnp.asarray(X / 16.0, jnp.float32); Y = jnp.asarray(Y)
for step in range(400):
    i = (step * 64) % 1728
    params, opt_state, loss = train_step(params, opt_state, X[i:i + 64], Y[i:i + 64], step)
print(f"loss {loss:.3f}, compiles: {train_step._cache_size()}, "
      f"cost vs static 8/8: {cpt_jax.run_cost(bits, cpt_jax.constant(8), 400)['relative_cost_static8']:.2f}")
