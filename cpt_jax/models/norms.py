"""Normalization layers for the image models: BatchNorm, EvoNorm-S0, Range-EvoNorm.

All layers take channels-last input ``(batch, *spatial, channels)`` (NHWC for
images, ``(batch, channels)`` also works) and are plain float Flax modules; they are
never quantized here.

* ``nn.BatchNorm`` with PyTorch's defaults (momentum 0.1 in PyTorch = 0.9 in Flax,
  epsilon 1e-5), statistics in the ``batch_stats`` collection.
* :class:`EvoNormS0` (Liu et al. 2020), a normalization-activation layer:
  ``y = gamma * x * sigmoid(v x) / sqrt(var_group(x) + eps) + beta``.
* :class:`RangeEvoNorm` (Aketi, Kodge, Roy 2022): EvoNorm-S0 with the group standard
  deviation replaced by a range estimate that is cheap and robust in low precision:
  ``y = gamma * x * sigmoid(v x) / (r * C(m) + eps) + beta``.

Both EvoNorms are stateless (no ``batch_stats``) and batch independent, so train and
eval give the same output; they accept (and ignore) ``use_running_average`` so they
can be called where an ``nn.BatchNorm`` is called.

:func:`make_norm` turns a name (``'batch' | 'evonorm' | 'range_evonorm' | 'none'``)
into a :class:`NormSpec`, a frozen, hashable factory the models call as
``spec(train=train, name='norm1')(x)``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

__all__ = [
    "NORM_NAMES",
    "EvoNormS0",
    "Identity",
    "NormSpec",
    "RangeEvoNorm",
    "group_layout",
    "make_norm",
    "range_chunks",
    "range_constant",
]

NORM_NAMES: tuple[str, ...] = ("batch", "evonorm", "range_evonorm", "none")
"""Names accepted by :func:`make_norm`."""


def range_constant(m: int) -> float:
    """Scale C(m) that turns the mean range of chunks of m samples into a std.

    ``C(m) = 0.5 * 0.35 * (1 + sqrt(pi * ln 4)) / sqrt(2 ln m)``, from Banner et
    al. (2018) "Scalable methods for 8-bit training", as used by Range-EvoNorm. For a
    Gaussian, ``E[max - min]`` of m samples is about ``sigma / C(m)``.

    Args:
      m: number of elements in one chunk, ``m >= 2`` (``ln 1 = 0``).

    Example:
      >>> round(range_constant(128), 4)
      0.1734
    """
    if not isinstance(m, (int,)) or isinstance(m, bool) or m < 2:
        raise ValueError(f"m (elements per chunk) must be an integer >= 2, got {m!r}")
    return 0.5 * 0.35 * (1.0 + math.sqrt(math.pi * math.log(4.0))) / math.sqrt(
        2.0 * math.log(m))


def range_chunks(n: int, chunks: int) -> tuple[int, int]:
    """Number of chunks k and chunk size m used for a group of n elements.

    If ``chunks`` divides ``n`` (the normal case, e.g. every layer of a CIFAR
    ResNet-20 on 32x32 images), ``k = chunks`` and ``m = n / chunks``, as in the
    authors' code. Otherwise (the authors' code fails there) ``k`` is the largest
    divisor of ``n`` with ``k <= chunks`` and ``m = n / k >= 2``, so all chunks stay
    equal and C(m) stays finite. ``n < 2`` has no range and raises ``ValueError``.

    Example:
      >>> range_chunks(2048, 16), range_chunks(24, 16), range_chunks(8, 16)
      ((16, 128), (12, 2), (4, 2))
    """
    if chunks < 1:
        raise ValueError(f"chunks must be >= 1, got {chunks}")
    if n < 2:
        raise ValueError(
            "Range-EvoNorm needs at least 2 elements per group (channels/groups * "
            f"spatial size), got {n}")
    for k in range(min(chunks, n // 2), 0, -1):
        if n % k == 0:
            return k, n // k
    raise AssertionError("unreachable: k = 1 always divides n")  # pragma: no cover


def group_layout(x: jax.Array, groups: int) -> jax.Array:
    """Reshape channels-last ``x`` to ``(B, groups, n)`` in PyTorch NCHW order.

    Group ``g`` holds channels ``g*C/groups .. (g+1)*C/groups - 1`` at all spatial
    positions, flattened channel-major then row-major (``(C/groups, H, W)``), which is
    the memory order of PyTorch's ``x.reshape(B, groups, -1)`` on an NCHW tensor.

    Example:
      >>> group_layout(jnp.zeros((2, 4, 4, 16)), 8).shape
      (2, 8, 32)
    """
    b, c = x.shape[0], x.shape[-1]
    _check_groups(groups, c)
    spatial = x.shape[1:-1]
    y = x.reshape((b, *spatial, groups, c // groups))
    # (B, *S, G, Cg) -> (B, G, Cg, *S)
    nd = len(spatial)
    y = jnp.transpose(y, (0, nd + 1, nd + 2, *range(1, nd + 1)))
    return y.reshape((b, groups, -1))


def _check_groups(groups: int, channels: int) -> None:
    if groups < 1 or channels % groups != 0:
        raise ValueError(
            f"groups must be >= 1 and divide the number of channels ({channels}), "
            f"got groups={groups}")


def _gate(x: jax.Array, v: jax.Array, hard_sigmoid: bool) -> jax.Array:
    """``sigmoid(v x)``, or ``relu6(v x + 3) / 6`` when ``hard_sigmoid``."""
    z = v * x
    return jax.nn.hard_sigmoid(z) if hard_sigmoid else jax.nn.sigmoid(z)


def _per_group_to_channels(s: jax.Array, x_shape: tuple[int, ...],
                           groups: int) -> jax.Array:
    """Broadcast a ``(B, G)`` statistic to ``x_shape`` (channels last)."""
    b, c = x_shape[0], x_shape[-1]
    s = jnp.repeat(s, c // groups, axis=1)  # (B, C), channel c -> group c // Cg
    return s.reshape((b,) + (1,) * (len(x_shape) - 2) + (c,))


class EvoNormS0(nn.Module):
    """EvoNorm-S0 normalization-activation layer (sample based, no running stats).

    ``y = gamma * x * sigmoid(v x) / sqrt(var_group(x) + eps) + beta``

    The variance is taken per example and per group of ``C / groups`` consecutive
    channels, over all spatial positions and the group's channels (biased, as
    PyTorch's ``var(unbiased=False)``). ``gamma`` (``scale``), ``beta`` (``bias``)
    and ``v`` are per channel, initialised to 1, 0, 1. With ``hard_sigmoid`` the gate
    is ``relu6(v x + 3) / 6`` (the 8-bit variant).

    Attributes:
      groups: number of channel groups; must divide the channel count.
      eps: added to the variance.
      hard_sigmoid: use the hard sigmoid gate.

    Example:
      >>> x = jnp.ones((2, 4, 4, 16))
      >>> layer = EvoNormS0()
      >>> y, _ = layer.init_with_output(jax.random.key(0), x)
      >>> y.shape
      (2, 4, 4, 16)
    """

    groups: int = 8
    eps: float = 1e-5
    hard_sigmoid: bool = False
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array,
                 use_running_average: bool | None = None) -> jax.Array:
        """Apply the layer; ``use_running_average`` is accepted and ignored."""
        del use_running_average  # stateless: train and eval are the same
        if x.ndim < 2:
            raise ValueError(f"x must have a batch and a channel axis, got shape {x.shape}")
        c = x.shape[-1]
        _check_groups(self.groups, c)
        gamma = self.param("scale", nn.initializers.ones, (c,), self.param_dtype)
        beta = self.param("bias", nn.initializers.zeros, (c,), self.param_dtype)
        v = self.param("v", nn.initializers.ones, (c,), self.param_dtype)
        var = jnp.var(group_layout(x, self.groups), axis=-1)  # (B, G)
        std = jnp.sqrt(_per_group_to_channels(var, x.shape, self.groups) + self.eps)
        return gamma * (x * _gate(x, v, self.hard_sigmoid)) / std + beta


class RangeEvoNorm(nn.Module):
    """Range-EvoNorm: EvoNorm-S0 with a range estimate in place of the group std.

    ``y = gamma * x * sigmoid(v x) / (r * C(m) + eps) + beta``,
    ``r = mean_chunks(max) - mean_chunks(min)``,
    ``C(m) = 0.5*0.35*(1 + sqrt(pi ln 4)) / sqrt(2 ln m)`` (:func:`range_constant`).

    Groups and chunks, per example: the channels are split into ``groups`` groups of
    ``C / groups`` consecutive channels; a group's ``n = C/groups * H * W`` elements,
    ordered channel-major then row-major (the NCHW memory order the authors' PyTorch
    code reshapes, see :func:`group_layout`), are split into ``chunks`` contiguous
    chunks of ``m = n / chunks`` elements. ``r`` is the mean over the chunks of the
    chunk maxima minus the mean of the chunk minima, one value per example and group.
    If ``chunks`` does not divide ``n``, the largest divisor ``k <= chunks`` of ``n``
    with ``n / k >= 2`` is used instead (:func:`range_chunks`). The range is taken of
    ``x`` (not of the gated ``x sigmoid(v x)``), gradients flow through max and min.
    With ``hard_sigmoid`` the gate is ``relu6(v x + 3) / 6`` (the 8-bit variant).

    Note: the authors' float ``RangeEN_full`` divides by ``1 / (r C + eps)`` (i.e.
    multiplies by ``r C + eps``); their quantized ``RangeEN`` and the paper divide by
    ``r C + eps``, which is what this layer does.

    Attributes:
      groups: number of channel groups; must divide the channel count.
      chunks: number of chunks per group (upper bound, see above).
      eps: added to the scaled range.
      hard_sigmoid: use the hard sigmoid gate.

    Example:
      >>> x = jax.random.normal(jax.random.key(0), (2, 8, 8, 16))
      >>> y, params = RangeEvoNorm(hard_sigmoid=True).init_with_output(
      ...     jax.random.key(1), x)
      >>> y.shape, sorted(params["params"])
      ((2, 8, 8, 16), ['bias', 'scale', 'v'])
    """

    groups: int = 8
    chunks: int = 16
    eps: float = 1e-5
    hard_sigmoid: bool = False
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array,
                 use_running_average: bool | None = None) -> jax.Array:
        """Apply the layer; ``use_running_average`` is accepted and ignored."""
        del use_running_average  # stateless: train and eval are the same
        if x.ndim < 2:
            raise ValueError(f"x must have a batch and a channel axis, got shape {x.shape}")
        c = x.shape[-1]
        _check_groups(self.groups, c)
        gamma = self.param("scale", nn.initializers.ones, (c,), self.param_dtype)
        beta = self.param("bias", nn.initializers.zeros, (c,), self.param_dtype)
        v = self.param("v", nn.initializers.ones, (c,), self.param_dtype)
        g = group_layout(x, self.groups)  # (B, G, n)
        k, m = range_chunks(g.shape[-1], self.chunks)
        g = g.reshape(g.shape[:2] + (k, m))
        r = jnp.mean(jnp.max(g, axis=-1), axis=-1) - jnp.mean(jnp.min(g, axis=-1), axis=-1)
        denom = r * range_constant(m) + self.eps  # (B, G)
        denom = _per_group_to_channels(denom, x.shape, self.groups)
        return gamma * (x * _gate(x, v, self.hard_sigmoid)) / denom + beta


class Identity(nn.Module):
    """No normalization: ``y = x`` (for ``make_norm('none')``).

    Example:
      >>> Identity().apply({}, jnp.ones(3))
      Array([1., 1., 1.], dtype=float32)
    """

    @nn.compact
    def __call__(self, x: jax.Array,
                 use_running_average: bool | None = None) -> jax.Array:
        """Return ``x`` unchanged."""
        del use_running_average
        return x


@dataclasses.dataclass(frozen=True)
class NormSpec:
    """A normalization choice; calling it builds the Flax module for one layer.

    ``spec(train=train, name='norm1')`` returns a module to call as ``module(x)``:

    * ``'batch'``: ``nn.BatchNorm(use_running_average=not train, momentum, epsilon)``
      (batch statistics in ``batch_stats``; PyTorch defaults 0.9 / 1e-5).
    * ``'evonorm'``: :class:`EvoNormS0` (``groups``, ``epsilon``, ``hard_sigmoid``).
    * ``'range_evonorm'``: :class:`RangeEvoNorm` (also ``chunks``).
    * ``'none'``: :class:`Identity`.

    ``includes_activation`` is True for the EvoNorms: they are normalization-
    activation layers and replace a BatchNorm+ReLU pair, so models skip the ReLU
    that follows a norm when it is set.

    Example:
      >>> spec = make_norm("range_evonorm", hard_sigmoid=True)
      >>> spec.includes_activation, type(spec(train=True)).__name__
      (True, 'RangeEvoNorm')
    """

    kind: str = "batch"
    momentum: float = 0.9
    epsilon: float = 1e-5
    groups: int = 8
    chunks: int = 16
    hard_sigmoid: bool = False

    def __post_init__(self) -> None:
        if self.kind not in NORM_NAMES:
            raise ValueError(f"norm must be one of {NORM_NAMES}, got {self.kind!r}")
        if not 0.0 <= self.momentum < 1.0:
            raise ValueError(f"momentum must be in [0, 1), got {self.momentum}")
        if not self.epsilon > 0.0:
            raise ValueError(f"epsilon must be > 0, got {self.epsilon}")
        if self.groups < 1:
            raise ValueError(f"groups must be >= 1, got {self.groups}")
        if self.chunks < 1:
            raise ValueError(f"chunks must be >= 1, got {self.chunks}")
        if self.hard_sigmoid and self.kind not in ("evonorm", "range_evonorm"):
            raise ValueError(
                f"hard_sigmoid applies to 'evonorm' and 'range_evonorm' only, got "
                f"norm={self.kind!r}")

    @property
    def includes_activation(self) -> bool:
        """Whether the layer applies its own nonlinearity (EvoNorms)."""
        return self.kind in ("evonorm", "range_evonorm")

    @property
    def has_shift(self) -> bool:
        """Whether the layer adds a learned per-channel shift (all but 'none')."""
        return self.kind != "none"

    def __call__(self, *, train: bool, name: str | None = None) -> nn.Module:
        """Build the norm module for one layer (``train`` matters for 'batch' only)."""
        if self.kind == "batch":
            return nn.BatchNorm(use_running_average=not train, momentum=self.momentum,
                                epsilon=self.epsilon, name=name)
        if self.kind == "evonorm":
            return EvoNormS0(groups=self.groups, eps=self.epsilon,
                             hard_sigmoid=self.hard_sigmoid, name=name)
        if self.kind == "range_evonorm":
            return RangeEvoNorm(groups=self.groups, chunks=self.chunks, eps=self.epsilon,
                                hard_sigmoid=self.hard_sigmoid, name=name)
        return Identity(name=name)


def make_norm(name: str | NormSpec = "batch", **kwargs: Any) -> NormSpec:
    """Norm factory from a name: 'batch' | 'evonorm' | 'range_evonorm' | 'none'.

    Keyword arguments are :class:`NormSpec` fields (``momentum``, ``epsilon``,
    ``groups``, ``chunks``, ``hard_sigmoid``). A :class:`NormSpec` is returned as is
    (with ``kwargs`` applied by ``dataclasses.replace``).

    Example:
      >>> norm = make_norm("evonorm", groups=4)
      >>> layer = norm(train=False, name="norm1")
      >>> (layer.groups, layer.name)
      (4, 'norm1')
    """
    if isinstance(name, NormSpec):
        return dataclasses.replace(name, **kwargs) if kwargs else name
    if not isinstance(name, str) or name not in NORM_NAMES:
        raise ValueError(f"norm must be one of {NORM_NAMES}, got {name!r}")
    fields = {f.name for f in dataclasses.fields(NormSpec)} - {"kind"}
    unknown = set(kwargs) - fields
    if unknown:
        raise ValueError(f"unknown norm option(s) {sorted(unknown)}; allowed: {sorted(fields)}")
    return NormSpec(kind=name, **kwargs)
