"""Model zoo of cpt_jax: plain float Flax Linen models, quantized later by a transform.

Every model is called as ``model.apply(variables, x, train=bool, mutable=[...])``;
BatchNorm statistics live in ``batch_stats``, dropout uses the rng ``dropout``, the
final layer is an ``nn.Dense`` named ``classifier``.

:func:`get_model` builds a model by name::

    mlp, cnn, resnet20, resnet38, resnet74, resnet110, resnet (depth=...), resnet18

and, once their modules exist, ``gcn`` (``cpt_jax.models.gcn.GCN``), ``lstm_lm``
(``cpt_jax.models.lstm.LSTMLanguageModel``), ``transformer_lm`` and
``transformer_classifier`` (``cpt_jax.models.transformer``), imported lazily.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable
from typing import Any

import flax.linen as nn

from cpt_jax.models.norms import (
    NORM_NAMES,
    EvoNormS0,
    Identity,
    NormSpec,
    RangeEvoNorm,
    make_norm,
    range_chunks,
    range_constant,
)
from cpt_jax.models.resnet import (
    BasicBlock,
    CifarResNet,
    ResNet18,
    resnet,
    resnet20,
    resnet38,
    resnet74,
    resnet110,
)
from cpt_jax.models.small import MLP, SmallCNN

__all__ = [
    "BasicBlock",
    "CifarResNet",
    "EvoNormS0",
    "Identity",
    "MLP",
    "MODEL_NAMES",
    "NORM_NAMES",
    "NormSpec",
    "RangeEvoNorm",
    "ResNet18",
    "SmallCNN",
    "get_model",
    "make_norm",
    "range_chunks",
    "range_constant",
    "resnet",
    "resnet20",
    "resnet38",
    "resnet74",
    "resnet110",
]


def _resnet_any_depth(*, num_classes: int, **kwargs: Any) -> nn.Module:
    if "depth" not in kwargs:
        raise ValueError("get_model('resnet') needs depth=6n+2, e.g. depth=56")
    return CifarResNet(num_classes=num_classes, **kwargs)


_BUILTIN: dict[str, Callable[..., nn.Module]] = {
    "mlp": MLP,
    "cnn": SmallCNN,
    "resnet20": lambda **kw: CifarResNet(depth=20, **kw),
    "resnet38": lambda **kw: CifarResNet(depth=38, **kw),
    "resnet74": lambda **kw: CifarResNet(depth=74, **kw),
    "resnet110": lambda **kw: CifarResNet(depth=110, **kw),
    "resnet": _resnet_any_depth,
    "resnet18": ResNet18,
}

# name -> (module, class); imported on first use so the registry works before these
# modules are written.
_LAZY: dict[str, tuple[str, str]] = {
    "gcn": ("cpt_jax.models.gcn", "GCN"),
    "lstm_lm": ("cpt_jax.models.lstm", "LSTMLanguageModel"),
    "transformer_lm": ("cpt_jax.models.transformer", "TransformerLM"),
    "transformer_classifier": ("cpt_jax.models.transformer", "TransformerClassifier"),
}

MODEL_NAMES: tuple[str, ...] = tuple(_BUILTIN) + tuple(_LAZY)
"""All names :func:`get_model` knows (the lazy ones need their module to exist)."""


def _load_lazy(name: str) -> type:
    module_name, class_name = _LAZY[name]
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        # Only a missing module is "not available"; a broken import inside an
        # existing module is re-raised as is.
        if isinstance(e, ModuleNotFoundError) and e.name == module_name:
            raise ValueError(
                f"model {name!r} needs {module_name}, which is not available yet") from e
        raise
    try:
        return getattr(module, class_name)
    except AttributeError as e:
        raise ValueError(f"model {name!r}: {module_name} has no {class_name}") from e


def get_model(name: str, *, num_classes: int, **kwargs: Any) -> nn.Module:
    """Build a model by name: ``get_model(name, num_classes=k, **model_kwargs)``.

    ``kwargs`` go to the model class (e.g. ``norm='range_evonorm'``, ``width=32``,
    ``hidden=(64,)``); 'resnet' needs ``depth``. For the lazily imported models,
    ``num_classes`` is passed as ``num_classes`` if the class has that field, else as
    ``vocab_size`` (language models).

    Raises:
      ValueError: unknown name (the message lists :data:`MODEL_NAMES`), or a lazy
        model whose module does not exist yet.

    Example:
      >>> model = get_model("resnet", depth=56, num_classes=100, norm="evonorm")
      >>> (model.depth, model.num_classes, model.norm)
      (56, 100, 'evonorm')
    """
    if name in _BUILTIN:
        return _BUILTIN[name](num_classes=num_classes, **kwargs)
    if name in _LAZY:
        cls = _load_lazy(name)
        fields = ({f.name for f in dataclasses.fields(cls)}
                  if dataclasses.is_dataclass(cls) else set())
        key = "vocab_size" if ("num_classes" not in fields and "vocab_size" in fields) \
            else "num_classes"
        return cls(**{key: num_classes}, **kwargs)
    raise ValueError(f"unknown model name {name!r}; valid names: {', '.join(MODEL_NAMES)}")
