"""An LSTM language model in the style of Zaremba et al. (2014), "medium".

A plain float Flax Linen model whose every matmul is an ``nn.Dense`` -- the LSTM
input projection (x -> 4H), the recurrent projection (h -> 4H) and the decoder
-- so a model-level quantization transform intercepting ``nn.Dense`` quantizes
all of them. The gate nonlinearities and the cell update stay full precision.

Simplification of Zaremba: the state starts at zeros in every segment unless the
caller passes ``initial_carry`` (and asks for ``return_carry=True`` to get the
final one); the default train step does not carry state across BPTT segments.

Example:
    >>> model = LSTMLanguageModel(vocab_size=10000)
    >>> tokens = jnp.zeros((20, 35), jnp.int32)
    >>> v = model.init(jax.random.key(0), tokens)
    >>> model.apply(v, tokens, train=True,
    ...             rngs={"dropout": jax.random.key(1)}).shape
    (20, 35, 10000)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

__all__ = ["LSTMCell", "LSTMLayer", "LSTMLanguageModel"]

Carry = tuple  # (c, h), each (batch, hidden)


class LSTMCell(nn.Module):
    """One LSTM step whose recurrent matmul is an ``nn.Dense`` named ``hh``.

    Takes the precomputed input projection ``xp_t = W_ih x_t + b`` (4H) and

        i, f, g, o = split(xp_t + W_hh h_{t-1}, 4)
        c_t = sigmoid(f) * c_{t-1} + sigmoid(i) * tanh(g)
        h_t = sigmoid(o) * tanh(c_t)

    Call: ``cell(carry, xp_t) -> (new_carry, h_t)`` with ``carry = (c, h)``.

    Example:
        >>> cell = LSTMCell(hidden=4)
        >>> c0 = (jnp.zeros((2, 4)), jnp.zeros((2, 4)))
        >>> v = cell.init(jax.random.key(0), c0, jnp.zeros((2, 16)))
        >>> cell.apply(v, c0, jnp.ones((2, 16)))[1].shape
        (2, 4)
    """

    hidden: int
    kernel_init: Callable = nn.initializers.lecun_normal()

    @nn.compact
    def __call__(self, carry: Carry, xp: jax.Array) -> tuple[Carry, jax.Array]:
        c, h = carry
        gates = xp + nn.Dense(4 * self.hidden, use_bias=False,
                              kernel_init=self.kernel_init, name="hh")(h)
        i, f, g, o = jnp.split(gates, 4, axis=-1)
        c = nn.sigmoid(f) * c + nn.sigmoid(i) * jnp.tanh(g)
        h = nn.sigmoid(o) * jnp.tanh(c)
        return (c, h), h


class LSTMLayer(nn.Module):
    """One LSTM layer over a whole sequence (batch-major, (B, T, D)).

    The input projection ``W_ih x_t + b`` is one ``nn.Dense`` named ``ih``
    applied to all time steps at once (one (B*T, D) x (D, 4H) matmul); the
    recurrence runs ``LSTMCell`` (its ``hh`` Dense) over time with ``nn.scan``
    (``use_scan=True``, one compiled step) or an unrolled Python loop
    (``use_scan=False``; same parameters and numbers, for interceptors or
    collections that do not go through ``nn.scan``). In the scan, ``params`` are
    broadcast and every other variable collection is carried step to step, so a
    quantizer's running statistics update sequentially as in the loop; every rng
    stream but ``params`` is split per step (fresh noise each step). ``init``
    always runs the loop (the parameter tree is the same), so variables that an
    interceptor creates on first use get created outside the scan.

    Call: ``layer(x, carry=None) -> (outputs (B, T, H), final carry)``.
    """

    hidden: int
    use_scan: bool = True
    kernel_init: Callable = nn.initializers.lecun_normal()
    bias_init: Callable = nn.initializers.zeros

    @nn.compact
    def __call__(self, x: jax.Array, carry: Carry | None = None
                 ) -> tuple[jax.Array, Carry]:
        batch = x.shape[0]
        if carry is None:
            zeros = jnp.zeros((batch, self.hidden), x.dtype)
            carry = (zeros, zeros)
        xp = nn.Dense(4 * self.hidden, kernel_init=self.kernel_init,
                      bias_init=self.bias_init, name="ih")(x)
        if self.use_scan and not self.is_initializing():
            scan = nn.scan(LSTMCell,
                           variable_broadcast="params",
                           variable_carry=nn.DenyList("params"),
                           split_rngs={"params": False, True: True},
                           in_axes=1, out_axes=1)
            carry, ys = scan(self.hidden, kernel_init=self.kernel_init,
                             name="cell")(carry, xp)
            return ys, carry
        cell = LSTMCell(self.hidden, kernel_init=self.kernel_init, name="cell")
        ys = []
        for t in range(x.shape[1]):
            carry, y = cell(carry, xp[:, t])
            ys.append(y)
        return jnp.stack(ys, axis=1), carry


class LSTMLanguageModel(nn.Module):
    """Zaremba-style word LM: embed -> dropout -> LSTM x L -> dropout -> decoder.

    Dropout (rate ``dropout``, rng name "dropout") is on the non-recurrent
    connections only: after the embedding, between layers and before the
    decoder. All parameters are initialized uniformly in
    ``[-init_scale, init_scale]`` (Zaremba medium: 650 units, 2 layers, dropout
    0.5, init 0.05, SGD lr 1, clip 5, 39 epochs, batch 20, 35 steps).
    Quantizable matmuls (``nn.Dense``): ``lstm_l/ih``, ``lstm_l/cell/hh`` and
    ``decoder``; the embedding lookup is a gather (full precision).

    Call: ``model.apply(variables, tokens (B, T) int, train=False,
    initial_carry=None, return_carry=False)`` -> logits (B, T, vocab), or
    ``(logits, carry)`` with ``carry`` a tuple of ``(c, h)`` per layer when
    ``return_carry``. Without ``initial_carry`` the state starts at zeros.

    Example:
        >>> m = LSTMLanguageModel(vocab_size=50, embed=8, hidden=8)
        >>> x = jnp.zeros((2, 5), jnp.int32)
        >>> v = m.init(jax.random.key(0), x)
        >>> logits, carry = m.apply(v, x, return_carry=True)
        >>> logits.shape, len(carry)
        ((2, 5, 50), 2)
    """

    vocab_size: int
    embed: int = 650
    hidden: int = 650
    num_layers: int = 2
    dropout: float = 0.5
    init_scale: float = 0.05
    use_scan: bool = True

    @nn.compact
    def __call__(self, inputs: jax.Array, train: bool = False,
                 initial_carry: Sequence[Carry] | None = None,
                 return_carry: bool = False) -> Any:
        if inputs.ndim != 2:
            raise ValueError(f"inputs must be (batch, time) token ids, got "
                             f"shape {inputs.shape}")
        if initial_carry is not None and len(initial_carry) != self.num_layers:
            raise ValueError(f"initial_carry has {len(initial_carry)} layers, "
                             f"num_layers={self.num_layers}")
        init = nn.initializers.uniform(2 * self.init_scale)

        def uniform(key, shape, dtype=jnp.float32):
            return init(key, shape, dtype) - jnp.asarray(self.init_scale, dtype)

        x = nn.Embed(self.vocab_size, self.embed, embedding_init=uniform,
                     name="embed")(inputs)
        x = nn.Dropout(self.dropout, deterministic=not train)(x)
        carries = []
        for layer in range(self.num_layers):
            carry0 = None if initial_carry is None else initial_carry[layer]
            x, carry = LSTMLayer(self.hidden, use_scan=self.use_scan,
                                 kernel_init=uniform, bias_init=uniform,
                                 name=f"lstm_{layer}")(x, carry0)
            carries.append(carry)
            x = nn.Dropout(self.dropout, deterministic=not train)(x)
        logits = nn.Dense(self.vocab_size, kernel_init=uniform,
                          bias_init=uniform, name="decoder")(x)
        if return_carry:
            return logits, tuple(carries)
        return logits
