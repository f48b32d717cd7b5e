"""The NNX door: the model quantized in place, every public method intercepted."""
from __future__ import annotations

import dataclasses
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

    Every submodule is given such a class too (``cpt_root`` False): called directly
    (``qmodel.encoder(x)``), it runs quantized under the same rules, its products
    named by their path in the model (``encoder/...``). ``model.eval()`` freezes the
    providers' state of the module and its submodules (e.g. running activation
    ranges are used, not updated), ``model.train()`` (the default) updates it.
    """

    __slots__ = ()
    cpt_interception: Interception = None
    cpt_root: bool = True
    _cpt_jax_frozen: bool = False


def _mode_setter(name: str, frozen: bool) -> Callable:
    def set_mode(self, **attributes):
        for _, module in nnx.iter_modules(self):
            if isinstance(module, QuantizedNNXModel):
                module._cpt_jax_frozen = frozen
        return getattr(super(type(self), self), name)(**attributes)

    set_mode.__name__ = name
    return set_mode


def submodule_env(env: Interception) -> Interception:
    """A submodule called on its own: `LAST_PRODUCT` is the model's last product when
    the model's own calls agree on it (else it matches nothing there)."""
    if not env.needs_last:
        return env
    lasts = set(env.lasts.values())
    return dataclasses.replace(env, last=lasts.pop() if len(lasts) == 1 else None)


def _door_for(module, method: Callable, args, kwargs) -> Door:
    """The `Door` of one top-level call of `method` on `module` (the model or one of
    its submodules, `QuantizedNNXModel.cpt_root`)."""
    env = type(module).cpt_interception
    update = not getattr(module, "_cpt_jax_frozen", False)
    frame = sys._getframe(1)  # the door's frame: the module's frames lie below it
    if not type(module).cpt_root:
        name = getattr(module, NNX_PATH_ATTRIBUTE, "") or _nnx_base(type(module)).__name__
        return Door(submodule_env(env), frame, name, root=module, update_state=update,
                    warn=False)
    name = _nnx_base(type(module)).__name__
    signature = call_signature(method.__name__, args, kwargs)
    if env.needs_last and signature not in env.lasts:
        run, operands = isolated_call(module, method, args, kwargs)
        env = call_env(env, run, name, signature, operands)
    else:
        env = call_env(env, None, name, signature)
    return Door(env, frame, name, root=module, signature=signature, update_state=update)


def _nnx_door(method: Callable) -> Callable:
    """`method` of an NNX model (or submodule), run as one intercepted call. (Its
    first parameter is not named ``self``: the interception's call sites skip it.)"""
    @functools.wraps(method)
    def door(module, *args, **kwargs):
        if in_session():
            return method(module, *args, **kwargs)
        with _door_for(module, method, args, kwargs):
            return method(module, *args, **kwargs)

    return door


def _nnx_base(cls: type) -> type:
    return next(c for c in cls.__mro__ if not issubclass(c, QuantizedNNXModel))


_NNX_BASES = frozenset(nnx.Module.__mro__)
_CONTAINERS = tuple(c for c in (getattr(nnx, "List", None), getattr(nnx, "Dict", None)) if c)
"""NNX's containers: no products of their own (their items are quantized)."""


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


def _quantized_class(base: type, env: Interception, root: bool) -> type:
    """``class Base(Base, QuantizedNNXModel)`` carrying `env`, its methods behind doors."""
    wrapped = {name: _nnx_door(fn) for name, fn in _nnx_methods(base).items()}
    # (base, marker): NNX objects only take a class whose layout starts with theirs.
    return type(base.__name__, (base, QuantizedNNXModel),
                {"__module__": base.__module__, "__qualname__": base.__qualname__,
                 "cpt_interception": env, "cpt_root": root,
                 "train": _mode_setter("train", False), "eval": _mode_setter("eval", True),
                 **wrapped})


def quantized_nnx_model(model: nnx.Module, env: Interception) -> nnx.Module:
    """Quantize `model` in place: its class and every submodule's (but Flax's bridges
    and containers) made a `QuantizedNNXModel` carrying `env`, each submodule's path
    written on it (`NNX_PATH_ATTRIBUTE`)."""
    classes: dict[type, type] = {}
    for path, module in nnx.iter_modules(model):
        if isinstance(module, nnx.bridge.ToNNX):
            continue  # its attributes are its Linen variables: named by its path when run
        setattr(module, NNX_PATH_ATTRIBUTE, "/".join(str(p) for p in path))
        if module is model or isinstance(module, _CONTAINERS):
            continue
        base = _nnx_base(type(module))
        if base not in classes:
            classes[base] = _quantized_class(base, env, root=False)
        module.__class__ = classes[base]
    model.__class__ = _quantized_class(_nnx_base(type(model)), env, root=True)
    return model
