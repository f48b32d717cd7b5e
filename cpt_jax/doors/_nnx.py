"""The NNX door: the model quantized in place, every public method intercepted."""
from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any

import jax
from flax import nnx

from cpt_jax.doors._session import Door, call_env, call_signature
from cpt_jax.interception import NNX_PATH_ATTRIBUTE, Interception, in_session, isolated_call

Array = jax.Array


class QuantizedNNXModel:
    """Marker base of the NNX classes `quantize_model` builds, ``class
    Model(Model, QuantizedNNXModel)``: every public method and ``__call__`` of the
    model's classes run with every product intercepted.

    ``model.eval()`` freezes the providers' state (e.g. running activation ranges
    are used, not updated), ``model.train()`` (the default) updates it.
    """

    __slots__ = ()
    cpt_interception: Interception = None
    _cpt_jax_frozen: bool = False


def _mode_setter(name: str, frozen: bool) -> Callable:
    def set_mode(self, **attributes):
        self._cpt_jax_frozen = frozen
        return getattr(super(type(self), self), name)(**attributes)

    set_mode.__name__ = name
    return set_mode


def _nnx_door(method: Callable) -> Callable:
    """`method` of an NNX model, run as one intercepted call."""
    @functools.wraps(method)
    def door(self, *args, **kwargs):
        if in_session():
            return method(self, *args, **kwargs)
        name = _nnx_base(type(self)).__name__
        env = type(self).cpt_interception
        signature = call_signature(method.__name__, args, kwargs)
        if env.needs_last and signature not in env.lasts:
            run, operands = isolated_call(self, method, args, kwargs)
            env = call_env(env, run, name, signature, operands)
        else:
            env = call_env(env, None, name, signature)
        with Door(env, sys._getframe(), name, root=self, signature=signature,
                  update_state=not getattr(self, "_cpt_jax_frozen", False)):
            return method(self, *args, **kwargs)

    return door


def _nnx_base(cls: type) -> type:
    return next(c for c in cls.__mro__ if not issubclass(c, QuantizedNNXModel))


_NNX_BASES = frozenset(nnx.Module.__mro__)


def _is_method(value: Any) -> bool:
    return callable(value) and not isinstance(value, (type, staticmethod, classmethod, property))


def _nnx_methods(base: type) -> dict:
    """The public methods (and ``__call__``) of the model's classes, ``nnx.Module``'s
    own (``train``, ``iter_modules``, ...) left out."""
    methods = {}
    for cls in reversed(base.__mro__):
        if cls in _NNX_BASES:
            continue
        for name, value in vars(cls).items():
            if _is_method(value) and (name == "__call__" or not name.startswith("_")):
                methods[name] = value
    return methods


def quantized_nnx_model(model: nnx.Module, env: Interception) -> nnx.Module:
    for path, module in nnx.iter_modules(model):
        if isinstance(module, nnx.bridge.ToNNX):
            continue  # its attributes are its Linen variables: named by its path when run
        setattr(module, NNX_PATH_ATTRIBUTE, "/".join(str(p) for p in path))
    base = _nnx_base(type(model))
    wrapped = {name: _nnx_door(fn) for name, fn in _nnx_methods(base).items()}
    # (base, marker): NNX objects only take a class whose layout starts with theirs.
    cls = type(base.__name__, (base, QuantizedNNXModel),
               {"__module__": base.__module__, "__qualname__": base.__qualname__,
                "cpt_interception": env, "train": _mode_setter("train", False),
                "eval": _mode_setter("eval", True), **wrapped})
    model.__class__ = cls
    return model
