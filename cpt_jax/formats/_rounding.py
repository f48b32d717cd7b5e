"""Rounding to integers: half to even, or stochastic with fusible threefry noise.

``"nearest"`` is ``round(v)``, half to even; ``"stochastic"`` is ``floor(v + U[0, 1))``,
unbiased (``E[q(v)] = v``), with ``U`` exactly ``jax.random.uniform(key, v.shape)``
computed elementwise (`uniform_noise`) so that XLA fuses it into the quantizer.
"""
from __future__ import annotations

import typing

import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array

ROUNDINGS = ("nearest", "stochastic")


def _rotl32(v: Array, r: int) -> Array:
    return (v << np.uint32(r)) | (v >> np.uint32(32 - r))


def _threefry2x32(k1: Array, k2: Array, x0: Array, x1: Array) -> tuple[Array, Array]:
    """Threefry-2x32 (20 rounds), unrolled in `jnp` so XLA fuses it into its consumer.

    The same hash as ``jax.random``'s threefry2x32 primitive, whose CPU lowering is a
    rolled loop that materializes the counter state five times per call.
    """
    rotations = ((13, 15, 26, 6), (17, 29, 16, 24))
    ks = (k1, k2, k1 ^ k2 ^ np.uint32(0x1BD11BDA))
    x0 = x0 + ks[0]
    x1 = x1 + ks[1]
    for i in range(5):
        for r in rotations[i % 2]:
            x0 = x0 + x1
            x1 = x0 ^ _rotl32(x1, r)
        x0 = x0 + ks[(i + 1) % 3]
        x1 = x1 + ks[(i + 2) % 3] + np.uint32(i + 1)
    return x0, x1


def _threefry_key_words(key: Array) -> tuple[Array, Array] | None:
    """The two uint32 words of a threefry2x32 key, or None for any other PRNG."""
    key = jnp.asarray(key) if not hasattr(key, "dtype") else key
    if jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
        if str(jax.random.key_impl(key)) != "threefry2x32":
            return None
        data = jax.random.key_data(key)
    elif key.dtype == jnp.uint32 and key.shape == (2,):
        if str(getattr(jax.config, "jax_default_prng_impl", "threefry2x32")) != "threefry2x32":
            return None
        data = key
    else:
        return None
    if data.shape != (2,):
        return None
    return data[0], data[1]


def uniform_noise(key: Array, shape: tuple, dtype=jnp.float32) -> Array:
    """``jax.random.uniform(key, shape, dtype)``, bit for bit, as fusible elementwise ops.

    For a threefry key (JAX's default, with ``jax_threefry_partitionable``, the
    default) and float32, element ``i`` (row-major) is
    ``bitcast((b_i >> 9) | 0x3f800000) - 1`` with ``b_i = xor(threefry2x32(key,
    (0, i)))``, computed from iotas inside the consumer's loop: no random tensor is
    materialized. Any other key, dtype or a tensor of ``>= 2^32`` elements falls back
    to ``jax.random.uniform``.

    Example:
      >>> k = jax.random.key(0)
      >>> bool(jnp.all(uniform_noise(k, (3, 4)) == jax.random.uniform(k, (3, 4))))
      True
    """
    shape = tuple(int(d) for d in shape)
    words = _threefry_key_words(key)
    size = int(np.prod(shape)) if shape else 1
    if (words is None or jnp.dtype(dtype) != jnp.float32 or size >= 2 ** 32
            or not getattr(jax.config, "jax_threefry_partitionable", False)):
        return jax.random.uniform(key, shape, dtype=dtype)
    index = jnp.zeros(shape, jnp.uint32)
    stride = 1
    for d in reversed(range(len(shape))):
        index = index + jax.lax.broadcasted_iota(jnp.uint32, shape, d) * np.uint32(stride)
        stride *= shape[d]
    b0, b1 = _threefry2x32(words[0], words[1], jnp.zeros(shape, jnp.uint32), index)
    mantissa = ((b0 ^ b1) >> np.uint32(9)) | np.uint32(0x3F800000)
    return jax.lax.bitcast_convert_type(mantissa, jnp.float32) - 1.0


def round_to_integer(v: Array, rounding: str, key: Array | None) -> Array:
    """`v` rounded to integers: ``round(v)`` half to even, or ``floor(v + U[0, 1))``.

    Stochastic rounding is unbiased, ``E[q(v)] = v``; its noise is `uniform_noise`
    of `key` (which `check_rounding` has required).

    Example:
      >>> round_to_integer(jnp.array([0.5, 1.5, 2.7]), "nearest", None)
      Array([0., 2., 3.], dtype=float32)
    """
    if rounding == "nearest":
        return jnp.round(v)  # half to even
    noise = uniform_noise(typing.cast(Array, key), v.shape, dtype=v.dtype)
    return jnp.floor(v + noise)


def check_rounding(rounding: str, key: Array | None) -> None:
    """Raise ValueError for an unknown rounding or stochastic rounding without a key."""
    if rounding not in ROUNDINGS:
        raise ValueError(f"rounding must be one of {ROUNDINGS}, got {rounding!r}")
    if rounding == "stochastic" and key is None:
        raise ValueError("rounding='stochastic' needs a PRNG `key` (got key=None)")
