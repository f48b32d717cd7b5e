"""Shared pieces of the low-precision optimizers: bit-widths, `LPQuant`, `quantize_tree`.

A bit-width (`BitsLike`) is a number, a traced scalar, a schedule ``count -> bits``
or None (no quantization); ``>= 32`` is full precision. `quantize_tree` quantizes
every floating leaf ``i`` of a pytree with the key ``fold_in(key, i)``; `LPQuant`
bundles ``(bits, fmt, rounding)`` for one kind of optimizer tensor. The four
quantizers of one optimizer draw from independent streams
``stream(key, t, role) = fold_in(fold_in(key, t), role)``.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from cpt_jax import formats
from cpt_jax.formats import BlockFloat, Format, quantize

Array = jax.Array
Params = Any
BitsLike = int | float | Array | Callable[[Array], Any] | None
"""A bit-width: a number, a (traced) scalar, a schedule ``count -> bits``, or None
(no quantization). ``>= 32`` is full precision."""


def as_key(seed: Any) -> Array:
    """A PRNG key from an int seed, a raw uint32[2] key or a typed key."""
    if isinstance(seed, jax.Array) and jnp.issubdtype(seed.dtype, jax.dtypes.prng_key):
        return seed
    arr = jnp.asarray(seed)
    if arr.dtype == jnp.uint32 and arr.shape == (2,):
        return arr
    if arr.shape != () or not jnp.issubdtype(arr.dtype, jnp.integer):
        raise ValueError(f"seed must be an int or a PRNG key, got {seed!r}")
    return jax.random.PRNGKey(arr)


def check_bits_like(bits: BitsLike, name: str) -> None:
    """ValueError unless `bits` is None, a schedule or a valid width (`formats.check_bits`)."""
    if bits is None or callable(bits):
        return
    formats.check_bits(bits, name)


def resolve_bits(bits: BitsLike, count: Array) -> Any:
    """Evaluate a schedule at ``count``; numbers and arrays pass through."""
    if callable(bits):
        return jnp.asarray(bits(count), jnp.float32)
    return bits


def is_float(x: Any) -> bool:
    """Whether `x` is an array with a floating-point dtype."""
    return hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating)


def quantize_tree(tree: Any, bits: Any, fmt: Format = BlockFloat(), *,
                  rounding: str = "stochastic", key: Array | None = None) -> Any:
    """Quantize every floating-point leaf of a pytree, each as its own tensor.

    Leaf ``i`` (in ``jax.tree_util`` order) uses the key ``fold_in(key, i)``, so
    leaves get independent rounding noise. Non-float leaves pass through; ``bits``
    None or ``>= 32`` leaves the tree unchanged.

    Example:
      >>> from cpt_jax.formats import FixedPoint
      >>> t = {"w": jnp.array([0.3, -1.2]), "b": jnp.array([0.05])}
      >>> quantize_tree(t, 4, FixedPoint(frac_bits=2), rounding="nearest")
      {'b': Array([0.], dtype=float32), 'w': Array([ 0.25, -1.25], dtype=float32)}
    """
    if bits is None:
        return tree
    formats.check_format(fmt)
    formats.check_rounding(rounding, key)
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    out = []
    for i, leaf in enumerate(leaves):
        if not is_float(leaf):
            out.append(leaf)
            continue
        k = jax.random.fold_in(key, i) if rounding == "stochastic" else None
        out.append(quantize(leaf, bits, fmt, rounding=rounding, key=k))
    return jax.tree_util.tree_unflatten(treedef, out)


@dataclasses.dataclass(frozen=True)
class LPQuant:
    """How one kind of optimizer tensor is quantized: ``Q(x) = quantize(x, bits, fmt)``.

    Attributes:
      bits: word length: a number, a traced scalar, or a schedule ``count -> bits``
        evaluated on the optimizer's step count. ``>= 32`` is full precision.
      fmt: a `cpt_jax` format (`BlockFloat`, `FixedPoint`, `SymmetricInt`, ...).
      rounding: ``"stochastic"`` (``floor(v + U)``, SWALP's choice) or ``"nearest"``.

    Example:
      >>> swalp_8bit = LPQuant(8, BlockFloat())           # SWALP's 8-bit block float
      >>> growing = LPQuant(lambda t: 4 + 4 * (t > 100))  # 4 bits, then 8
      >>> w = {"w": jnp.array([0.3, -1.2])}
      >>> growing(w, jnp.asarray(0), jax.random.key(0))["w"].shape
      (2,)
    """

    bits: Any = 8
    fmt: Format = BlockFloat()
    rounding: str = "stochastic"

    def __post_init__(self):
        if self.bits is None:
            raise ValueError("LPQuant.bits must be a number, an array or a schedule, got None "
                             "(pass quant=None to the optimizer to skip quantization)")
        check_bits_like(self.bits, "LPQuant.bits")
        formats.check_format(self.fmt)
        if self.rounding not in formats.ROUNDINGS:
            raise ValueError(
                f"LPQuant.rounding must be one of {formats.ROUNDINGS}, got {self.rounding!r}")

    def __call__(self, tree: Any, count: Array, key: Array) -> Any:
        return quantize_tree(tree, resolve_bits(self.bits, count), self.fmt,
                             rounding=self.rounding, key=key)


def quant_or_none(bits: BitsLike, fmt: Format, rounding: str, name: str) -> LPQuant | None:
    """``LPQuant(bits, fmt, rounding)``, or None when `bits` is None (no quantization)."""
    if bits is None:
        return None
    check_bits_like(bits, name)
    return LPQuant(bits, fmt, rounding)


# Independent random streams of the four quantizers of one optimizer (`stream`'s role).
GRAD_STREAM, ACC_STREAM, WEIGHT_STREAM, MOMENTUM_STREAM = 0, 1, 2, 3


def stream(key: Array, count: Array, role: int) -> Array:
    """The key of quantizer `role` at step `count`: ``fold_in(fold_in(key, count), role)``."""
    return jax.random.fold_in(jax.random.fold_in(key, count), role)


def apply_updates(params: Params, updates: Params) -> Params:
    """``params + updates`` (`optax.apply_updates`)."""
    return optax.apply_updates(params, updates)


def updates_to(target: Params, params: Params) -> Params:
    """The optax update ``u = target - params`` (so ``params + u == target``)."""
    return jax.tree_util.tree_map(
        lambda t, p: (jnp.asarray(t) - jnp.asarray(p)).astype(jnp.asarray(p).dtype),
        target, params)


def momentum_leaves(state: Any, quant: LPQuant, count: Array, key: Array,
                     fields: Sequence[str]) -> Any:
    """Quantize the floating leaves of `state` that sit under a field in `fields`."""
    leaves_with_path, treedef = jax.tree_util.tree_flatten_with_path(state)
    bits = resolve_bits(quant.bits, count)
    out = []
    for i, (path, leaf) in enumerate(leaves_with_path):
        names = {getattr(k, "name", None) for k in path} | {getattr(k, "key", None)
                                                            for k in path}
        if is_float(leaf) and names & set(fields):
            k = jax.random.fold_in(key, i) if quant.rounding == "stochastic" else None
            leaf = quantize(leaf, bits, quant.fmt, rounding=quant.rounding, key=k)
        out.append(leaf)
    return jax.tree_util.tree_unflatten(treedef, out)




def check_positive(x: Any, name: str, allow_zero: bool = False) -> None:
    """ValueError unless `x` is a finite number > 0 (>= 0 with `allow_zero`); tracers pass."""
    if isinstance(x, jax.core.Tracer):
        return
    try:
        v = float(np.asarray(x))
    except Exception as exc:  # noqa: BLE001
        raise ValueError(f"{name} must be a number, got {x!r}") from exc
    if not np.isfinite(v) or v < 0 or (v == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{name} must be finite and {bound}, got {x!r}")


def check_int(x: Any, name: str, minimum: int) -> None:
    """ValueError unless `x` is an int (not a bool) >= `minimum`."""
    if not isinstance(x, (int, np.integer)) or isinstance(x, bool) or x < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {x!r}")
