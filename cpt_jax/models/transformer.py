"""Small pre-LN Transformers: a causal LM, a sentence classifier, and the block.

Plain float Flax Linen models. The query/key/value/output projections, the MLP
projections and the output heads are ``nn.Dense``; the attention score and value
products (``q @ k^T`` and ``softmax(.) @ v``) go through the einsum-class fields
``qk_attn_weights_einsum_cls`` / ``attn_weights_value_einsum_cls`` (Flax's
convention for ``nn.MultiHeadDotProductAttention``, ``jnp.einsum`` when unset), so
`cpt_jax.quantize_model` quantizes them as ``.../query_key`` and
``.../weights_value``. Softmax, LayerNorm and the residual adds stay fp32.

Example:
    >>> lm = TransformerLM(vocab_size=65)
    >>> x = jnp.zeros((8, 128), jnp.int32)
    >>> v = lm.init(jax.random.key(0), x)
    >>> lm.apply(v, x, train=True, rngs={"dropout": jax.random.key(1)}).shape
    (8, 128, 65)
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

__all__ = ["MultiHeadAttention", "MlpBlock", "TransformerBlock",
           "TransformerLM", "TransformerClassifier", "causal_mask",
           "padding_mask"]

_NEG_INF = -1e9


def causal_mask(length: int) -> jax.Array:
    """(1, 1, T, T) bool, True where query t may attend key s (s <= t).

    Example:
        >>> causal_mask(3)[0, 0].astype(int).tolist()
        [[1, 0, 0], [1, 1, 0], [1, 1, 1]]
    """
    return jnp.tril(jnp.ones((length, length), dtype=bool))[None, None]


def padding_mask(mask: jax.Array) -> jax.Array:
    """(B, T) token mask -> (B, 1, 1, T) attention mask (attend real keys only).

    Example:
        >>> padding_mask(jnp.array([[True, False]])).shape
        (1, 1, 1, 2)
    """
    return mask.astype(bool)[:, None, None, :]


class MultiHeadAttention(nn.Module):
    """Multi-head self-attention with ``nn.Dense`` projections.

        q, k, v = x W_q, x W_k, x W_v           (Dense "query", "key", "value")
        A = softmax(q k^T / sqrt(d_head) + mask_bias)   (qk_attn_weights_einsum_cls)
        y = (A v) W_o                             (attn_weights_value_einsum_cls; Dense "out")

    Call: ``attn(x (B, T, D), mask=None, train=False) -> (B, T, D)``; ``mask``
    is bool, broadcastable to (B, H, T, T), True = may attend. The two einsum-class
    fields take a zero-argument callable returning an einsum function, as in
    ``nn.MultiHeadDotProductAttention`` (None: ``jnp.einsum``).
    """

    num_heads: int
    dropout: float = 0.0
    qk_attn_weights_einsum_cls: Any = None
    attn_weights_value_einsum_cls: Any = None

    @nn.compact
    def __call__(self, x: jax.Array, mask: jax.Array | None = None,
                 train: bool = False) -> jax.Array:
        d_model = x.shape[-1]
        if d_model % self.num_heads:
            raise ValueError(f"d_model={d_model} must be divisible by "
                             f"num_heads={self.num_heads}")
        d_head = d_model // self.num_heads
        batch, length = x.shape[0], x.shape[1]
        qk = self.qk_attn_weights_einsum_cls() if self.qk_attn_weights_einsum_cls else jnp.einsum
        wv = (self.attn_weights_value_einsum_cls() if self.attn_weights_value_einsum_cls
              else jnp.einsum)

        def heads(name: str) -> jax.Array:
            y = nn.Dense(d_model, name=name)(x)
            return y.reshape(batch, length, self.num_heads, d_head)

        q, k, v = heads("query"), heads("key"), heads("value")
        scores = qk("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(
            jnp.asarray(d_head, x.dtype))
        if mask is not None:
            scores = jnp.where(mask, scores, jnp.asarray(_NEG_INF, scores.dtype))
        probs = nn.softmax(scores, axis=-1)
        probs = nn.Dropout(self.dropout, deterministic=not train)(probs)
        y = wv("bhqk,bkhd->bqhd", probs, v)
        return nn.Dense(d_model, name="out")(y.reshape(batch, length, d_model))


class MlpBlock(nn.Module):
    """``Dense(mlp_dim) -> gelu -> dropout -> Dense(d_model)`` ("fc1", "fc2")."""

    mlp_dim: int
    dropout: float = 0.0

    @nn.compact
    def __call__(self, x: jax.Array, train: bool = False) -> jax.Array:
        y = nn.gelu(nn.Dense(self.mlp_dim, name="fc1")(x))
        y = nn.Dropout(self.dropout, deterministic=not train)(y)
        return nn.Dense(x.shape[-1], name="fc2")(y)


class TransformerBlock(nn.Module):
    """A pre-LN Transformer block.

        x = x + dropout(MHA(LN(x), mask))
        x = x + dropout(MLP(LN(x)))

    Submodules: ``ln_attn``, ``attn`` (:class:`MultiHeadAttention`), ``ln_mlp``,
    ``mlp`` (:class:`MlpBlock`). ``d_model`` is checked against the input.

    Call: ``block(x (B, T, d_model), mask=None, train=False) -> (B, T, d_model)``.

    Example:
        >>> blk = TransformerBlock(d_model=64, num_heads=4, mlp_dim=256)
        >>> x = jnp.ones((2, 16, 64))
        >>> v = blk.init(jax.random.key(0), x, causal_mask(16))
        >>> blk.apply(v, x, causal_mask(16)).shape
        (2, 16, 64)
    """

    d_model: int
    num_heads: int
    mlp_dim: int
    dropout: float = 0.0
    attention_dropout: float = 0.0

    @nn.compact
    def __call__(self, x: jax.Array, mask: jax.Array | None = None,
                 train: bool = False) -> jax.Array:
        if x.shape[-1] != self.d_model:
            raise ValueError(f"input width {x.shape[-1]} != d_model="
                             f"{self.d_model}")
        drop = nn.Dropout(self.dropout, deterministic=not train)
        y = nn.LayerNorm(name="ln_attn")(x)
        y = MultiHeadAttention(self.num_heads, self.attention_dropout,
                               name="attn")(y, mask, train)
        x = x + drop(y)
        y = nn.LayerNorm(name="ln_mlp")(x)
        y = MlpBlock(self.mlp_dim, self.dropout, name="mlp")(y, train)
        return x + drop(y)


class _Encoder(nn.Module):
    """Token + learned position embeddings -> dropout -> blocks -> final LN."""

    vocab_size: int
    d_model: int
    num_heads: int
    num_layers: int
    mlp_dim: int
    max_len: int
    dropout: float

    def setup(self):
        self.embed = nn.Embed(self.vocab_size, self.d_model,
                              embedding_init=nn.initializers.normal(0.02))
        self.pos_embed = self.param("pos_embed", nn.initializers.normal(0.02),
                                    (self.max_len, self.d_model))
        self.blocks = [TransformerBlock(self.d_model, self.num_heads,
                                        self.mlp_dim, self.dropout,
                                        name=f"block_{i}")
                       for i in range(self.num_layers)]
        self.ln_final = nn.LayerNorm()
        self.drop = nn.Dropout(self.dropout)

    def __call__(self, tokens: jax.Array, mask: jax.Array | None,
                 train: bool) -> jax.Array:
        if tokens.ndim != 2:
            raise ValueError(f"tokens must be (batch, time), got shape "
                             f"{tokens.shape}")
        if tokens.shape[1] > self.max_len:
            raise ValueError(f"sequence length {tokens.shape[1]} exceeds "
                             f"max_len={self.max_len}")
        x = self.embed(tokens) + self.pos_embed[None, :tokens.shape[1]]
        x = self.drop(x, deterministic=not train)
        for block in self.blocks:
            x = block(x, mask, train)
        return self.ln_final(x)

    def attend(self, x: jax.Array) -> jax.Array:
        return self.embed.attend(x)


class TransformerLM(nn.Module):
    """Decoder-only causal Transformer LM (pre-LN, learned positions).

        h = LN(Blocks(Embed(x) + P))  with a causal mask,   logits = head(h)

    ``head`` is the ``nn.Dense`` ``lm_head`` (quantizable) unless
    ``tie_embeddings``, in which case it is ``h @ E^T`` with the token embedding
    ``E`` (a plain matmul, not quantized by an ``nn.Dense`` interceptor).
    Parameters live under ``encoder/...`` and ``lm_head``.

    Call: ``model.apply(variables, tokens (B, T) int, train=False)`` ->
    logits (B, T, vocab_size), position t depending only on tokens <= t.

    Example:
        >>> lm = TransformerLM(vocab_size=100, d_model=32, num_heads=2,
        ...                    num_layers=1, mlp_dim=64, max_len=16)
        >>> x = jnp.zeros((2, 16), jnp.int32)
        >>> lm.apply(lm.init(jax.random.key(0), x), x).shape
        (2, 16, 100)
    """

    vocab_size: int
    d_model: int = 128
    num_heads: int = 4
    num_layers: int = 2
    mlp_dim: int = 512
    max_len: int = 256
    dropout: float = 0.1
    tie_embeddings: bool = False

    @nn.compact
    def __call__(self, inputs: jax.Array, train: bool = False) -> jax.Array:
        encoder = _Encoder(self.vocab_size, self.d_model, self.num_heads,
                           self.num_layers, self.mlp_dim, self.max_len,
                           self.dropout, name="encoder")
        h = encoder(inputs, causal_mask(inputs.shape[1]), train)
        if self.tie_embeddings:
            return encoder.attend(h)
        return nn.Dense(self.vocab_size, name="lm_head")(h)


class TransformerClassifier(nn.Module):
    """Bidirectional Transformer encoder + masked mean pooling + ``classifier``.

        h = LN(Blocks(Embed(x) + P)) with keys masked to real tokens,
        pooled = sum_t m_t h_t / max(sum_t m_t, 1),   logits = classifier(pooled)

    The padding mask is ``mask`` if given, else ``tokens != pad_id`` (``<pad>``
    is id 0 in :func:`cpt_jax.data.text.load_sst2`). ``classifier`` is an
    ``nn.Dense`` (quantizable).

    Call: ``model.apply(variables, tokens (B, T) int, train=False, mask=None)``
    -> logits (B, num_classes).

    Example:
        >>> clf = TransformerClassifier(vocab_size=100, d_model=32, num_heads=2,
        ...                             num_layers=1, mlp_dim=64, max_len=16)
        >>> x = jnp.ones((2, 16), jnp.int32)
        >>> clf.apply(clf.init(jax.random.key(0), x), x).shape
        (2, 2)
    """

    vocab_size: int
    num_classes: int = 2
    d_model: int = 128
    num_heads: int = 4
    num_layers: int = 2
    mlp_dim: int = 512
    max_len: int = 256
    dropout: float = 0.1
    pad_id: int = 0

    @nn.compact
    def __call__(self, inputs: jax.Array, train: bool = False,
                 mask: jax.Array | None = None) -> jax.Array:
        if mask is None:
            mask = inputs != self.pad_id
        mask = mask.astype(bool)
        h = _Encoder(self.vocab_size, self.d_model, self.num_heads,
                     self.num_layers, self.mlp_dim, self.max_len,
                     self.dropout, name="encoder")(inputs, padding_mask(mask),
                                                   train)
        m = mask.astype(h.dtype)[..., None]
        pooled = (h * m).sum(axis=1) / jnp.maximum(m.sum(axis=1), 1.0)
        pooled = nn.Dropout(self.dropout, deterministic=not train)(pooled)
        return nn.Dense(self.num_classes, name="classifier")(pooled)
