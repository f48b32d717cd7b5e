"""The Linen door: ``class Model(QuantizedModel, Model)``, same fields, init/apply and tree."""
from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable

import flax.linen as nn
import jax

from cpt_jax.doors._session import Door, call_env, call_signature
from cpt_jax.interception import Interception, in_session

Array = jax.Array
_APPLY_KEYWORDS = frozenset({"rngs", "method", "mutable", "capture_intermediates"})


def _signature(args: tuple, kwargs: dict, skip: int) -> tuple:
    """The call signature of ``init``/``apply`` (`skip`: the rngs / variables argument)."""
    method = kwargs.get("method") or "__call__"
    inputs = {k: v for k, v in kwargs.items() if k not in _APPLY_KEYWORDS}
    return call_signature(method, args[skip:], inputs)


class QuantizedModel:
    """Base of the Linen classes `quantize_model` builds: ``Quantized(QuantizedModel, Model)``.

    An instance *is* the user's model (same fields, methods and variable tree), so
    ``apply(..., method="encode")``, ``method=Model.encode`` and attribute access
    (``model.config``) behave as on the float model; `init`, `apply` and
    ``__call__`` run with every product intercepted. The quantization settings
    live in the class attribute ``cpt_interception`` (not a dataclass field).
    """

    cpt_interception: Interception = None

    def _door(self, entry, signature, run: Callable | None = None):
        if in_session():
            return _NULL
        name = type(self).__name__
        env = call_env(self.cpt_interception, run, name, signature)
        return Door(env, entry, name, signature=signature)

    def init(self, *args, **kwargs):
        with self._door(sys._getframe(), _signature(args, kwargs, 1),
                        lambda: super(QuantizedModel, self).init(*args, **kwargs)):
            return super().init(*args, **kwargs)

    def init_with_output(self, *args, **kwargs):
        with self._door(sys._getframe(), _signature(args, kwargs, 1),
                        lambda: super(QuantizedModel, self).init_with_output(*args, **kwargs)):
            return super().init_with_output(*args, **kwargs)

    def apply(self, *args, **kwargs):
        with self._door(sys._getframe(), _signature(args, kwargs, 1),
                        lambda: super(QuantizedModel, self).apply(*args, **kwargs)):
            return super().apply(*args, **kwargs)

    def __call__(self, *args, **kwargs):
        with self._door(sys._getframe(), call_signature("__call__", args, kwargs)):
            return super().__call__(*args, **kwargs)


class _NullDoor:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


_NULL = _NullDoor()


def _linen_base(model: nn.Module) -> type:
    base = type(model)
    if isinstance(model, QuantizedModel):
        base = next(c for c in base.__mro__[1:] if not issubclass(c, QuantizedModel)
                    and issubclass(c, nn.Module))
    return base


def quantized_linen_model(model: nn.Module, env: Interception) -> nn.Module:
    """``class Model(QuantizedModel, Model)`` carrying `env` (named as the model, so
    auto-named submodules keep the float model's names), with the model's fields."""
    base = _linen_base(model)
    cls = type(base.__name__, (QuantizedModel, base),
               {"__module__": base.__module__, "__qualname__": base.__qualname__,
                "cpt_interception": env})
    fields = {f.name: getattr(model, f.name) for f in dataclasses.fields(model)
              if f.init and f.name != "parent"}
    return cls(**fields)
