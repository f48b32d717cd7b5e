"""Rounding to integers: half to even, or stochastic with a fusible counter-based dither.

``"nearest"`` is ``round(v)``, half to even; ``"stochastic"`` is ``floor(v + U[0, 1))``,
unbiased (``E[q(v)] = v``). ``U`` is `dither_noise`: per element a 32-bit hash of
(element index, two seed words drawn once from the key), about 17 integer ops
computed inside the quantizer's fused loop, against ~120 for threefry2x32
(`uniform_noise`, ``jax.random.uniform`` bit for bit, kept for callers who need it).
The rounding keys stay a pure function of (seed, step, product): only how a key
becomes one uniform per element changed.
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


_WEYL = np.uint32(0x9E3779B9)  # 2^32 / golden ratio, odd: i -> i * _WEYL is a bijection


def _mix32(x: Array) -> Array:
    """A bijective 32-bit finalizer (xor-shift-multiply, Wellons' "lowbias32" constants):
    every input bit flips each output bit with probability ~1/2."""
    x = x ^ (x >> np.uint32(16))
    x = x * np.uint32(0x7FEB352D)
    x = x ^ (x >> np.uint32(15))
    x = x * np.uint32(0x846CA68B)
    return x ^ (x >> np.uint32(16))


def dither_bits(key: Array, shape: tuple) -> Array:
    """32 pseudo-random bits per element of `shape`, as fusible elementwise ops:

        s0, s1 = jax.random.bits(key, (2,), uint32)          # once per tensor
        b_i = mix32(mix32(i * 0x9E3779B9 + s0) ^ s1)         # i: row-major index

    For a fixed key ``i -> b_i`` is a bijection (no two elements of a tensor of
    ``< 2^32`` elements share their bits); different keys (steps, products, seeds are
    folded into the key) give unrelated seed words. Any PRNG implementation.

    Example:
      >>> b = dither_bits(jax.random.key(0), (1000,))
      >>> b.dtype, int(jnp.unique(b).size)
      (dtype('uint32'), 1000)
    """
    shape = tuple(int(d) for d in shape)
    seed = jax.random.bits(key, (2,), jnp.uint32)
    index = jnp.zeros(shape, jnp.uint32)
    stride = 1
    for d in reversed(range(len(shape))):
        index = index + jax.lax.broadcasted_iota(jnp.uint32, shape, d) * np.uint32(stride)
        stride *= shape[d]
    return _mix32(_mix32(index * _WEYL + seed[0]) ^ seed[1])


def dither_noise(key: Array, shape: tuple, dtype=jnp.float32) -> Array:
    """The stochastic-rounding dither ``U[0, 1)``: `dither_bits` to a float exactly.

        U_i = (b_i >> (32 - r)) * 2^-r,   r = min(mantissa bits + 1, 32)

    (24 bits for float32, 8 for bfloat16): every value a multiple of ``2^-r``,
    representable in `dtype`, so ``floor(v + U)`` is unbiased up to ``2^-r`` of a
    step. Tensors of ``>= 2^32`` elements use ``jax.random.uniform``.

    Example:
      >>> u = dither_noise(jax.random.key(0), (100_000,))
      >>> bool(u.min() >= 0.0), bool(u.max() < 1.0), round(float(u.mean()), 2)
      (True, True, 0.5)
    """
    shape = tuple(int(d) for d in shape)
    dtype = jnp.dtype(dtype)
    size = int(np.prod(shape)) if shape else 1
    if size >= 2 ** 32:
        return jax.random.uniform(key, shape, dtype=dtype)
    resolution = min(jnp.finfo(dtype).nmant + 1, 32)
    bits = dither_bits(key, shape) >> np.uint32(32 - resolution)
    return bits.astype(dtype) * jnp.asarray(2.0 ** -resolution, dtype)


def round_to_integer(v: Array, rounding: str, key: Array | None) -> Array:
    """`v` rounded to integers: ``round(v)`` half to even, or ``floor(v + U[0, 1))``.

    Stochastic rounding is unbiased, ``E[q(v)] = v``; its noise is `dither_noise`
    of `key` (which `check_rounding` has required).

    Example:
      >>> round_to_integer(jnp.array([0.5, 1.5, 2.7]), "nearest", None)
      Array([0., 2., 3.], dtype=float32)
    """
    if rounding == "nearest":
        return jnp.round(v)  # half to even
    noise = dither_noise(typing.cast(Array, key), v.shape, dtype=v.dtype)
    return jnp.floor(v + noise)


def check_rounding(rounding: str, key: Array | None) -> None:
    """Raise ValueError for an unknown rounding or stochastic rounding without a key."""
    if rounding not in ROUNDINGS:
        raise ValueError(f"rounding must be one of {ROUNDINGS}, got {rounding!r}")
    if rounding == "stochastic" and key is None:
        raise ValueError("rounding='stochastic' needs a PRNG `key` (got key=None)")
