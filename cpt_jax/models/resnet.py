"""ResNets with basic blocks: the CIFAR ResNet-(6n+2) family and an ImageNet ResNet-18.

Plain float Flax models: every convolution is an ``nn.Conv`` and the classifier an
``nn.Dense``, so a model-level transform (``cpt_jax.quantize_model``) can quantize
them by intercepting those modules. Inputs are NHWC floats.

Module names (for quantization rules by regex on the module path)::

    stem_conv, stem_norm,
    stage{s}_block{b}/{conv1, norm1, conv2, norm2, shortcut_conv, shortcut_norm},
    classifier

Block (``norm='batch'``): ``relu(bn2(conv2(relu(bn1(conv1(x))))) + shortcut(x))``,
with ``shortcut(x) = bn(conv1x1(x))`` when the shape changes (stride 2 or new width,
"option B", as CPT's code) and ``x`` otherwise. EvoNorm variants are
normalization-activation layers: each replaces a BatchNorm (including the shortcut's)
and the ReLU directly after it; the ReLU after the residual add is kept.

Initialisation as PyTorch ResNets: convolutions Kaiming normal, fan_out,
``std = sqrt(2 / (k*k*out_channels))``; norms gamma 1, beta 0; the classifier
PyTorch's ``nn.Linear`` default ``U(-1/sqrt(fan_in), 1/sqrt(fan_in))`` weights and
zero bias.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from cpt_jax.models.norms import NormSpec, make_norm

__all__ = [
    "BasicBlock",
    "CifarResNet",
    "ResNet18",
    "kaiming_normal_fan_out",
    "resnet",
    "resnet20",
    "resnet38",
    "resnet74",
    "resnet110",
    "torch_linear_init",
    "cpt_linear_init",
    "CLASSIFIER_INITS",
]

Initializer = Callable[..., jax.Array]

kaiming_normal_fan_out: Initializer = nn.initializers.variance_scaling(
    2.0, "fan_out", "normal")
"""PyTorch ``kaiming_normal_(mode='fan_out', nonlinearity='relu')``:
``N(0, 2 / (kh * kw * out_channels))``, untruncated."""

torch_linear_init: Initializer = nn.initializers.variance_scaling(
    1.0 / 3.0, "fan_in", "uniform")
"""PyTorch ``nn.Linear`` default weights: ``U(-1/sqrt(fan_in), 1/sqrt(fan_in))``."""


def cpt_linear_init(key: jax.Array, shape: tuple, dtype=jnp.float32) -> jax.Array:
    """CPT's classifier init (its CIFAR ResNets): ``W ~ N(0, sqrt(2 / (fan_in * fan_out)))``.

    Example:
      >>> w = cpt_linear_init(jax.random.key(0), (64, 10))
      >>> round(float(w.std()) * (64 * 10 / 2) ** 0.5, 1)
      1.0
    """
    fan_in, fan_out = int(shape[-2]), int(shape[-1])
    return jax.random.normal(key, shape, dtype) * jnp.sqrt(2.0 / (fan_in * fan_out)).astype(dtype)


CLASSIFIER_INITS: dict = {"torch": torch_linear_init, "cpt": cpt_linear_init}
"""Classifier kernel inits by name: PyTorch's ``nn.Linear`` default, or CPT's."""


def _pad(kernel: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """PyTorch-style symmetric padding ``kernel // 2`` on both spatial axes."""
    p = kernel // 2
    return ((p, p), (p, p))


def _act(y: jax.Array, norm: NormSpec) -> jax.Array:
    """ReLU after a norm, unless the norm has its own activation (EvoNorms)."""
    return y if norm.includes_activation else nn.relu(y)


class BasicBlock(nn.Module):
    """ResNet basic block: two 3x3 convs, projection shortcut on a shape change.

    ``y = relu(N2(conv2(act(N1(conv1(x))))) + s(x))``, ``s(x) = Ns(conv1x1(x))``
    if ``strides != 1`` or the width changes, else ``s(x) = x``.

    Example:
      >>> blk = BasicBlock(features=32, strides=2, norm=make_norm("batch"))
      >>> v = blk.init(jax.random.key(0), jnp.ones((1, 8, 8, 16)))
      >>> blk.apply(v, jnp.ones((1, 8, 8, 16))).shape
      (1, 4, 4, 32)
    """

    features: int
    strides: int = 1
    norm: NormSpec = NormSpec()

    @nn.compact
    def __call__(self, x: jax.Array, train: bool = False) -> jax.Array:
        """Apply the block to NHWC ``x``."""
        use_bias = not self.norm.has_shift
        conv = lambda f, k, s, name: nn.Conv(  # noqa: E731
            f, (k, k), strides=(s, s), padding=_pad(k), use_bias=use_bias,
            kernel_init=kaiming_normal_fan_out, name=name)
        y = conv(self.features, 3, self.strides, "conv1")(x)
        y = _act(self.norm(train=train, name="norm1")(y), self.norm)
        y = conv(self.features, 3, 1, "conv2")(y)
        y = self.norm(train=train, name="norm2")(y)
        shortcut = x
        if self.strides != 1 or x.shape[-1] != self.features:
            shortcut = conv(self.features, 1, self.strides, "shortcut_conv")(x)
            shortcut = self.norm(train=train, name="shortcut_norm")(shortcut)
        return nn.relu(y + shortcut)


def _check_depth(depth: Any) -> int:
    if (not isinstance(depth, int) or isinstance(depth, bool) or depth < 8
            or (depth - 2) % 6 != 0):
        raise ValueError(
            f"depth must be 6n+2 with n >= 1 (8, 14, 20, 32, 38, 44, 56, 74, 110, ...), "
            f"got depth={depth!r}")
    return (depth - 2) // 6


class CifarResNet(nn.Module):
    """CIFAR ResNet-(6n+2) of He et al. (2016, sec. 4.2), with 1x1 conv shortcuts.

    3x3 conv (``width``) -> norm -> ReLU -> 3 stages of n basic blocks with ``width``,
    ``2*width``, ``4*width`` channels (stride 2 at the first block of stages 2 and 3)
    -> global average pool -> ``Dense(num_classes)`` named ``classifier``.
    ResNet-20/38/74/110 (n = 3/6/12/18) have 272,474 / 564,122 / 1,147,418 /
    1,730,714 parameters with 10 classes (0.27M for ResNet-20; He et al.'s option-A
    figures are slightly lower, they have no shortcut convs).

    Attributes:
      depth: 6n + 2 (ValueError otherwise).
      num_classes: outputs of the classifier.
      width: channels of the first stage (16 in the paper).
      norm: 'batch' | 'evonorm' | 'range_evonorm' | 'none', or a ``NormSpec``.
      classifier_init: 'torch' (PyTorch's ``nn.Linear`` default) or 'cpt'
        (``N(0, sqrt(2 / (in * out)))``, CPT's code); see `CLASSIFIER_INITS`.

    Example:
      >>> model = CifarResNet(depth=20, num_classes=10)
      >>> x = jnp.zeros((2, 32, 32, 3))
      >>> variables = model.init(jax.random.key(0), x)
      >>> logits, updates = model.apply(variables, x, train=True,
      ...                               mutable=["batch_stats"])
      >>> logits.shape
      (2, 10)
    """

    depth: int = 20
    num_classes: int = 10
    width: int = 16
    norm: str | NormSpec = "batch"
    classifier_init: str = "torch"

    def __post_init__(self) -> None:
        _check_depth(self.depth)
        if self.classifier_init not in CLASSIFIER_INITS:
            raise ValueError(f"classifier_init={self.classifier_init!r} must be one of "
                             f"{sorted(CLASSIFIER_INITS)}")
        if self.width < 1:
            raise ValueError(f"width must be >= 1, got {self.width}")
        if self.num_classes < 1:
            raise ValueError(f"num_classes must be >= 1, got {self.num_classes}")
        make_norm(self.norm)  # validates the name early
        super().__post_init__()

    @nn.compact
    def __call__(self, x: jax.Array, train: bool = False) -> jax.Array:
        """Logits for NHWC images ``x`` of shape ``(B, H, W, C)``."""
        n = _check_depth(self.depth)
        norm = make_norm(self.norm)
        y = nn.Conv(self.width, (3, 3), padding=_pad(3), use_bias=not norm.has_shift,
                    kernel_init=kaiming_normal_fan_out, name="stem_conv")(x)
        y = _act(norm(train=train, name="stem_norm")(y), norm)
        for s, mult in enumerate((1, 2, 4)):
            for b in range(n):
                strides = 2 if (s > 0 and b == 0) else 1
                y = BasicBlock(self.width * mult, strides, norm,
                               name=f"stage{s + 1}_block{b + 1}")(y, train)
        y = jnp.mean(y, axis=(1, 2))
        return nn.Dense(self.num_classes, kernel_init=CLASSIFIER_INITS[self.classifier_init],
                        name="classifier")(y)


def resnet(depth: int, num_classes: int = 10, **kwargs: Any) -> CifarResNet:
    """CIFAR ResNet of any depth 6n+2. Example: ``resnet(56, num_classes=100)``."""
    return CifarResNet(depth=depth, num_classes=num_classes, **kwargs)


def resnet20(num_classes: int = 10, **kwargs: Any) -> CifarResNet:
    """CIFAR ResNet-20 (n=3, 0.27M parameters). Example: ``resnet20(norm='evonorm')``."""
    return CifarResNet(depth=20, num_classes=num_classes, **kwargs)


def resnet38(num_classes: int = 10, **kwargs: Any) -> CifarResNet:
    """CIFAR ResNet-38 (n=6, 0.56M parameters). Example: ``resnet38(100)``."""
    return CifarResNet(depth=38, num_classes=num_classes, **kwargs)


def resnet74(num_classes: int = 10, **kwargs: Any) -> CifarResNet:
    """CIFAR ResNet-74 (n=12, 1.15M parameters). Example: ``resnet74(100)``."""
    return CifarResNet(depth=74, num_classes=num_classes, **kwargs)


def resnet110(num_classes: int = 10, **kwargs: Any) -> CifarResNet:
    """CIFAR ResNet-110 (n=18, 1.73M parameters). Example: ``resnet110(10)``."""
    return CifarResNet(depth=110, num_classes=num_classes, **kwargs)


class ResNet18(nn.Module):
    """ImageNet ResNet-18 (He et al. 2016, torchvision layout), basic blocks.

    7x7/2 conv 64 (``stem_conv``) -> norm -> ReLU -> 3x3/2 max pool (padding 1) ->
    stages of ``stage_sizes`` = [2, 2, 2, 2] basic blocks with 64, 128, 256, 512
    channels (stride 2 from stage 2 on, 1x1 conv + norm shortcuts ``shortcut_conv``)
    -> global average pool -> ``Dense(num_classes)`` named ``classifier``.
    11,689,512 parameters with 1000 classes (as torchvision's resnet18);
    ``stage_sizes=(3, 4, 6, 3)`` gives ResNet-34.

    Attributes:
      num_classes: outputs of the classifier.
      width: channels of the stem and first stage (64).
      norm: 'batch' | 'evonorm' | 'range_evonorm' | 'none', or a ``NormSpec``.
      stage_sizes: blocks per stage.

    Example:
      >>> model = ResNet18(num_classes=10)
      >>> x = jnp.zeros((1, 32, 32, 3))
      >>> variables = model.init(jax.random.key(0), x)
      >>> model.apply(variables, x).shape
      (1, 10)
    """

    num_classes: int = 1000
    width: int = 64
    norm: str | NormSpec = "batch"
    stage_sizes: Sequence[int] = (2, 2, 2, 2)

    def __post_init__(self) -> None:
        if self.width < 1:
            raise ValueError(f"width must be >= 1, got {self.width}")
        if self.num_classes < 1:
            raise ValueError(f"num_classes must be >= 1, got {self.num_classes}")
        if len(self.stage_sizes) < 1 or any(s < 1 for s in self.stage_sizes):
            raise ValueError(f"stage_sizes must be positive block counts, got "
                             f"{tuple(self.stage_sizes)}")
        make_norm(self.norm)
        super().__post_init__()

    @nn.compact
    def __call__(self, x: jax.Array, train: bool = False) -> jax.Array:
        """Logits for NHWC images ``x`` of shape ``(B, H, W, C)``."""
        norm = make_norm(self.norm)
        y = nn.Conv(self.width, (7, 7), strides=(2, 2), padding=_pad(7),
                    use_bias=not norm.has_shift, kernel_init=kaiming_normal_fan_out,
                    name="stem_conv")(x)
        y = _act(norm(train=train, name="stem_norm")(y), norm)
        y = nn.max_pool(y, (3, 3), strides=(2, 2), padding=((1, 1), (1, 1)))
        for s, blocks in enumerate(self.stage_sizes):
            for b in range(blocks):
                strides = 2 if (s > 0 and b == 0) else 1
                y = BasicBlock(self.width * 2 ** s, strides, norm,
                               name=f"stage{s + 1}_block{b + 1}")(y, train)
        y = jnp.mean(y, axis=(1, 2))
        return nn.Dense(self.num_classes, kernel_init=torch_linear_init,
                        name="classifier")(y)
