"""Routing JAX's product functions through cpt_jax while a quantized model runs.

`cpt_jax.interception._operations` sees every product a model computes by taking over the
JAX functions that compute them, for as long as at least one quantized model is
running in some thread (a reference count; the originals are back afterwards):

==========  ====================================================================
patch       how
==========  ====================================================================
code        the function object's ``__code__`` is replaced by a stub calling the
            dispatcher, so *every* alias runs it: ``jax.lax.dot_general``,
            ``from jax.lax import dot_general``, Flax's ``lax.dot_general`` and
            the calls inside ``jnp.matmul`` / ``jnp.einsum`` alike (Qwix's
            technique, ``qwix/_src/interception.py``)
attribute   a jitted function (``jnp.matmul``, whose ``PjitFunction`` takes no new
            code) is replaced, in every ``jax``/``flax`` module that holds it, by
            a stub; ``x @ w`` reaches ``jnp.matmul`` through such an attribute
==========  ====================================================================

The stub calls ``dispatch(name, args, kwargs)``, installed by `set_dispatcher`; the
dispatcher decides (per thread) whether to intercept or to run `original(name)`.
This module knows nothing about products: it only swaps functions.
"""
from __future__ import annotations

import contextlib
import dataclasses
import inspect
import sys
import threading
import types
from collections.abc import Callable, Iterator
from typing import Any

from cpt_jax.interception._jax_internals import Target, python_body

DISPATCH_GLOBAL = "__cpt_jax_dispatch__"
"""The global name the code stubs call (set in each patched function's module)."""


@dataclasses.dataclass
class _Patch:
    target: Target
    function: Any                      # the object found at module.attr
    original: Callable                 # runs the original implementation
    restore: Callable[[], None] = lambda: None


class PatchError(RuntimeError):
    """Taking over a JAX function failed; every target installed so far was restored."""


_LOCK = threading.RLock()
_STATE = {"users": 0}
_PATCHES: dict[str, _Patch] = {}
_DISPATCHER: list[Callable | None] = [None]
_TEMPLATE = "def {fn}(*args, **kwargs):\n    return {dispatch}({name!r}, args, kwargs)\n"
_STUBS: dict[tuple[str, str], types.CodeType] = {}
_HOLDERS: dict[int, tuple[Any, list[tuple[Any, str]]]] = {}


def set_dispatcher(dispatch: Callable[[str, tuple, dict], Any]) -> None:
    """Set ``dispatch(name, args, kwargs)``, called by every stub while patched."""
    _DISPATCHER[0] = dispatch


def _dispatch(name: str, args: tuple, kwargs: dict) -> Any:
    dispatch = _DISPATCHER[0]
    if dispatch is None:
        return original(name)(*args, **kwargs)
    return dispatch(name, args, kwargs)


def original(name: str) -> Callable:
    """The original implementation of target `name` (while it is patched)."""
    patch = _PATCHES.get(name)
    if patch is None:
        raise KeyError(f"{name!r} is not a patched target")
    return patch.original


def python_implementation(name: str) -> Callable:
    """The Python body of a jitted target (``PjitFunction.__wrapped__``), else the original."""
    patch = _PATCHES[name]
    body = python_body(patch.function)
    return patch.original if body is patch.function else body


def _copy_function(fn: types.FunctionType) -> types.FunctionType:
    """A new function object running `fn`'s current code (survives a code swap)."""
    copy = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__,
                              fn.__closure__)
    copy.__kwdefaults__ = fn.__kwdefaults__
    copy.__qualname__, copy.__module__, copy.__doc__ = fn.__qualname__, fn.__module__, fn.__doc__
    return copy


def _stub_code(name: str, fn_name: str) -> types.CodeType:
    """``def fn_name(*args, **kwargs): return __cpt_jax_dispatch__(name, args, kwargs)``."""
    key = (name, fn_name)
    if key not in _STUBS:
        source = _TEMPLATE.format(fn=fn_name, dispatch=DISPATCH_GLOBAL, name=name)
        namespace: dict = {}
        exec(compile(source, __file__, "exec"), namespace)
        _STUBS[key] = namespace[fn_name].__code__
    return _STUBS[key]


def is_stub(fn: Any) -> bool:
    """Whether `fn` is one of cpt_jax's stubs (a patched function, never an original)."""
    code = getattr(fn, "__code__", None)
    return (code is not None and code.co_filename == __file__) or bool(
        getattr(fn, "__cpt_jax_stub__", False))


def _holders(obj: Any) -> list[tuple[Any, str]]:
    """Every ``(module, attribute)`` of a loaded jax/flax module holding `obj` (found
    once per object: modules imported later keep the original)."""
    cached = _HOLDERS.get(id(obj))
    if cached is not None and cached[0] is obj:
        return cached[1]
    found = []
    for mod_name, module in list(sys.modules.items()):
        if module is None or mod_name.split(".")[0] not in ("jax", "flax"):
            continue
        for attr, value in list(vars(module).items()):
            if value is obj:
                found.append((module, attr))
    _HOLDERS[id(obj)] = (obj, found)
    return found


def _patch_code(target: Target, fn: types.FunctionType) -> _Patch:
    keep = _copy_function(fn)
    saved, had_signature = fn.__code__, "__signature__" in fn.__dict__
    signature = inspect.signature(fn)  # callers inspect it (Flax filters kwargs by it)

    def restore():
        # The module keeps ``__cpt_jax_dispatch__``: a call another thread has just
        # entered may still read it (it runs the original when nothing is patched).
        fn.__code__ = saved
        if not had_signature:
            fn.__dict__.pop("__signature__", None)

    try:
        fn.__globals__[DISPATCH_GLOBAL] = _dispatch
        fn.__code__ = _stub_code(target.name, fn.__name__)
        if not had_signature:
            fn.__signature__ = signature  # type: ignore[attr-defined]
    except BaseException:
        restore()
        raise
    return _Patch(target, fn, keep, restore)


def _patch_attributes(target: Target, fn: Any) -> _Patch:
    holders = _holders(fn)

    def stub(*args, **kwargs):
        return _dispatch(target.name, args, kwargs)

    stub.__name__ = stub.__qualname__ = getattr(fn, "__name__", target.attr)
    stub.__wrapped__ = python_body(fn)  # type: ignore[attr-defined]
    stub.__cpt_jax_stub__ = True  # type: ignore[attr-defined]
    done: list[tuple[Any, str]] = []

    def restore():
        for module, attr in done:
            setattr(module, attr, fn)

    try:
        for module, attr in holders:
            setattr(module, attr, stub)
            done.append((module, attr))
    except BaseException:
        restore()
        raise
    return _Patch(target, fn, fn, restore)


def _install(target: Target) -> _Patch | None:
    fn = target.resolve()
    if fn is None:
        return None  # absent from this JAX/Flax version
    if is_stub(fn):
        raise PatchError(f"{target.module}.{target.attr} is already a cpt_jax stub: an "
                         f"earlier install was not undone")
    if isinstance(fn, types.FunctionType) and not fn.__code__.co_freevars:
        return _patch_code(target, fn)
    return _patch_attributes(target, fn)


def _restore_all(patches: list[_Patch]) -> list[BaseException]:
    """Restore `patches` in reverse order; every one is tried, the errors returned."""
    errors = []
    for patch in reversed(patches):
        try:
            patch.restore()
        except BaseException as exc:  # keep restoring the others
            errors.append(exc)
    return errors


def _install_all(targets) -> None:
    """All of `targets` installed, or none: on any exception every target installed so
    far is restored (in reverse order) and the error re-raised."""
    installed: list[_Patch] = []
    try:
        for target in targets:
            patch = _install(target)
            if patch is not None:
                installed.append(patch)
    except BaseException:
        _restore_all(installed)
        raise
    _PATCHES.clear()
    _PATCHES.update((p.target.name, p) for p in installed)


def _uninstall_all() -> None:
    errors = _restore_all(list(_PATCHES.values()))
    # Keep the entries: `original` stays valid for calls still in flight.
    if errors:
        raise PatchError(f"restoring JAX's functions failed: {errors[0]!r}") from errors[0]


@contextlib.contextmanager
def patched(targets) -> Iterator[None]:
    """Take over `targets` for the duration of the block (reference-counted across
    threads and nesting: the first entry installs, the last exit restores). The
    install is all-or-nothing: a failure leaves JAX as it was and raises."""
    with _LOCK:
        if _STATE["users"] == 0:
            _install_all(targets)
        _STATE["users"] += 1
    try:
        yield
    finally:
        with _LOCK:
            _STATE["users"] -= 1
            if _STATE["users"] == 0:
                _uninstall_all()


def is_patched() -> bool:
    """Whether the targets are currently taken over (by some thread)."""
    return _STATE["users"] > 0


__all__ = ["DISPATCH_GLOBAL", "PatchError", "Target", "is_patched", "is_stub",
           "original", "patched", "python_implementation", "set_dispatcher"]
