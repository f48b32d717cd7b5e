"""Small image models for quick experiments: an MLP and a small CNN.

Plain float Flax models built from ``nn.Dense`` / ``nn.Conv`` (so the model-level
quantization transform can intercept every matmul and conv); the last layer is an
``nn.Dense`` named ``classifier``. Inputs are channels-last images, e.g. sklearn
digits ``(B, 8, 8, 1)`` or MNIST ``(B, 28, 28, 1)``.
"""

from __future__ import annotations

from collections.abc import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp  # noqa: F401  (used by the doctests)

from cpt_jax.models.norms import NormSpec, make_norm
from cpt_jax.models.resnet import kaiming_normal_fan_out, torch_linear_init

__all__ = ["MLP", "SmallCNN"]


class MLP(nn.Module):
    """Multilayer perceptron on the flattened input.

    ``h_0 = flatten(x)``, ``h_i = dropout(relu(W_i h_{i-1} + b_i))`` for each width
    in ``hidden`` (layers ``dense1``, ``dense2``, ...), logits ``= classifier(h)``.

    Attributes:
      hidden: widths of the hidden layers (may be empty: logistic regression).
      num_classes: outputs of the classifier.
      dropout_rate: dropout after each hidden ReLU in training (rng ``dropout``).

    Example:
      >>> model = MLP(hidden=(32,), num_classes=10)
      >>> x = jnp.zeros((4, 8, 8, 1))
      >>> variables = model.init(jax.random.key(0), x)
      >>> model.apply(variables, x).shape
      (4, 10)
    """

    hidden: Sequence[int] = (256, 128)
    num_classes: int = 10
    dropout_rate: float = 0.0

    def __post_init__(self) -> None:
        if any(h < 1 for h in self.hidden):
            raise ValueError(f"hidden widths must be >= 1, got {tuple(self.hidden)}")
        if self.num_classes < 1:
            raise ValueError(f"num_classes must be >= 1, got {self.num_classes}")
        if not 0.0 <= self.dropout_rate < 1.0:
            raise ValueError(f"dropout_rate must be in [0, 1), got {self.dropout_rate}")
        super().__post_init__()

    @nn.compact
    def __call__(self, x: jax.Array, train: bool = False) -> jax.Array:
        """Logits for ``x`` of shape ``(B, ...)``."""
        y = x.reshape((x.shape[0], -1))
        for i, h in enumerate(self.hidden):
            y = nn.relu(nn.Dense(h, kernel_init=torch_linear_init, name=f"dense{i + 1}")(y))
            if self.dropout_rate > 0.0:
                y = nn.Dropout(self.dropout_rate, deterministic=not train)(y)
        return nn.Dense(self.num_classes, kernel_init=torch_linear_init,
                        name="classifier")(y)


class SmallCNN(nn.Module):
    """Small CNN: blocks conv3x3 -> norm -> ReLU -> 2x2 max pool, then a dense head.

    Block i (``conv{i}``, ``norm{i}``) has ``features[i]`` channels, 'SAME' padding;
    the 2x2/2 max pool is skipped once a spatial side is 1. Then flatten and
    ``Dense(num_classes)`` named ``classifier``. On digits (8x8): 8 -> 4 -> 2; on
    MNIST (28x28): 28 -> 14 -> 7. EvoNorm variants replace norm + ReLU.

    Attributes:
      features: channels of each conv block.
      num_classes: outputs of the classifier.
      norm: 'batch' | 'evonorm' | 'range_evonorm' | 'none', or a ``NormSpec``.

    Example:
      >>> model = SmallCNN(num_classes=10)
      >>> x = jnp.zeros((2, 28, 28, 1))
      >>> variables = model.init(jax.random.key(0), x)
      >>> logits, _ = model.apply(variables, x, train=True, mutable=["batch_stats"])
      >>> logits.shape
      (2, 10)
    """

    features: Sequence[int] = (32, 64)
    num_classes: int = 10
    norm: str | NormSpec = "batch"

    def __post_init__(self) -> None:
        if len(self.features) < 1 or any(f < 1 for f in self.features):
            raise ValueError(f"features must be positive channel counts, got "
                             f"{tuple(self.features)}")
        if self.num_classes < 1:
            raise ValueError(f"num_classes must be >= 1, got {self.num_classes}")
        make_norm(self.norm)
        super().__post_init__()

    @nn.compact
    def __call__(self, x: jax.Array, train: bool = False) -> jax.Array:
        """Logits for NHWC images ``x`` of shape ``(B, H, W, C)``."""
        norm = make_norm(self.norm)
        y = x
        for i, f in enumerate(self.features):
            y = nn.Conv(f, (3, 3), padding="SAME", use_bias=not norm.has_shift,
                        kernel_init=kaiming_normal_fan_out, name=f"conv{i + 1}")(y)
            y = norm(train=train, name=f"norm{i + 1}")(y)
            if not norm.includes_activation:
                y = nn.relu(y)
            if y.shape[1] >= 2 and y.shape[2] >= 2:
                y = nn.max_pool(y, (2, 2), strides=(2, 2))
        y = y.reshape((y.shape[0], -1))
        return nn.Dense(self.num_classes, kernel_init=torch_linear_init,
                        name="classifier")(y)
