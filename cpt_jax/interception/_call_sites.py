"""Where a product is computed: the Flax module (Linen or NNX) running it, and its operands.

When `cpt_jax.interception._operations` sees a product, it asks this module three questions,
all answered from the Python stack and the module's variables, for Linen and NNX
alike:

* **which module** (`locate`): the innermost stack frame whose ``self`` is a bound
  Linen module or an NNX module. Its path (Linen ``module.path``; NNX: the path
  `quantize_model` wrote on each submodule, `NNX_PATH_ATTRIBUTE`) names the
  product; the outermost frame of the same ``self`` is the *call* (a module called
  twice makes two calls: their products get the same names); the user method's
  name (``attend``, ``encode``) is read from the frames.
* **can the interception reach it** (`CallSite.unreachable`): a product traced
  inside a Pallas kernel body, or inside the user's own ``custom_vjp`` /
  ``custom_jvp`` function (whose backward rule is the user's), is not one cpt_jax
  can quantize forward *and* backward.
* **which operand is a weight** (`operand_param`): an operand that is a parameter
  of the model, or derived from one by single-input operations (transpose,
  reshape, dtype cast, sharding constraint, ...), found through the tracers'
  producing equations under ``jit``; its parameter path is kept.
"""
from __future__ import annotations

import dataclasses
import os
import types
from collections.abc import Iterator, Mapping
from typing import Any

import flax
import flax.linen as nn
import jax
from flax import nnx

NNX_PATH_ATTRIBUTE = "_cpt_jax_path"
"""The attribute `quantize_model` sets on every submodule of an NNX model: its path."""

_FLAX_DIR = os.path.dirname(flax.__file__)
_WRAPPER_FILES = frozenset(os.path.join(_FLAX_DIR, "linen", name)
                           for name in ("module.py", "transforms.py"))
_JAX_DIR = os.path.dirname(jax.__file__)
_PALLAS_DIR = os.path.join(_JAX_DIR, "_src", "pallas")
_CUSTOM_DERIVATIVES = os.path.join(_JAX_DIR, "_src", "custom_derivatives.py")
_JAX_API = os.path.join(_JAX_DIR, "_src", "api.py")
_MAX_CHAIN = 64


@dataclasses.dataclass(frozen=True)
class CallSite:
    """The module call a product belongs to.

    Attributes:
      module: the bound Linen module or NNX module (None: outside any module).
      path: its ``/``-joined path (the root: its class name).
      call: the frame object of the module call (its identity keys the op counters).
      method: the name of the module's method that computed the product.
      unreachable: ``"pallas"`` / ``"custom_vjp"`` when the product is traced where
        cpt_jax cannot quantize it, ``"shape"`` inside a ``jax.eval_shape`` the model
        calls (shape inference, not a computation), else None.
    """

    module: Any
    path: str
    call: Any
    method: str
    unreachable: str | None = None


def is_module(obj: Any) -> bool:
    """A bound Linen module or an NNX module."""
    if isinstance(obj, nnx.Module):
        return True
    return isinstance(obj, nn.Module) and getattr(obj, "scope", None) is not None


def module_path(module: Any) -> str:
    """``"encoder/layers_0/attn"``: a bound Linen module's path, an NNX module's
    `NNX_PATH_ATTRIBUTE`; the root module (empty path) is named by its class.

    Example:
      >>> class Net(nn.Module):
      ...   @nn.compact
      ...   def __call__(self, x):
      ...     return nn.Dense(2, name="head")(x)
      >>> module_path(Net())  # an unbound module: its class
      'Net'
    """
    if isinstance(module, nnx.Module):
        path = getattr(module, NNX_PATH_ATTRIBUTE, "")
    else:
        try:
            path = "/".join(str(p) for p in module.path)
        except Exception:  # unbound Linen module
            path = getattr(module, "name", None) or ""
    return path or type(module).__name__


def absolute_path(module: Any) -> str:
    """The module's path in the variable tree: `module_path` but ``""`` for the root.

    Example:
      >>> absolute_path(None)
      ''
    """
    if module is None:
        return ""
    if isinstance(module, nnx.Module):
        return getattr(module, NNX_PATH_ATTRIBUTE, "")
    try:
        return "/".join(str(p) for p in module.path)
    except Exception:  # unbound Linen module
        return ""


def _frame_self(frame: types.FrameType) -> Any:
    code = frame.f_code
    if not code.co_argcount or code.co_varnames[0] != "self":
        return None
    obj = frame.f_locals.get("self")
    return obj if is_module(obj) else None


def _unreachable_marker(code: types.CodeType) -> str | None:
    filename = code.co_filename
    if filename.startswith(_PALLAS_DIR):
        return "pallas"
    if filename == _CUSTOM_DERIVATIVES:
        return "custom_vjp"
    if filename == _JAX_API and code.co_name == "eval_shape":
        return "shape"  # shape inference inside the model (e.g. nn.ConvLocal's)
    return None


def _frames(start: types.FrameType, stop: types.FrameType | None) -> Iterator[types.FrameType]:
    frame = start
    while frame is not None and frame is not stop:
        yield frame
        frame = frame.f_back


def locate(start: types.FrameType, stop: types.FrameType | None) -> CallSite:
    """The `CallSite` of a product whose caller's frame is `start`, looking up the
    stack until the interception's entry frame `stop`."""
    module, call, method, unreachable, closed = None, None, "__call__", None, False
    for frame in _frames(start, stop):
        unreachable = unreachable or _unreachable_marker(frame.f_code)
        if closed:
            continue
        owner = _frame_self(frame)
        if owner is None:
            continue
        if module is None:
            module = owner
        if owner is not module:
            closed = True  # the module's caller: the call is complete
            continue
        call = frame
        if frame.f_code.co_filename not in _WRAPPER_FILES:
            method = frame.f_code.co_name
    if module is None:
        return CallSite(None, "", None, method, unreachable)
    return CallSite(module, module_path(module), call, method, unreachable)


# --------------------------------------------------------------------------- params

def _unbox(value: Any) -> Any:
    """The array inside Flax's partitioning boxes, without applying a constraint."""
    if isinstance(value, nn.meta.AxisMetadata):
        inner = getattr(value, "value", None)
        return inner if inner is not None else value.unbox()
    return value


def _unwrapped(x: Any) -> Iterator[Any]:
    """`x` and the values it wraps: a JVP / linearize tracer's primal, a batch
    tracer's value (each level of the transformations around a traced value)."""
    for _ in range(_MAX_CHAIN):
        yield x
        inner = None
        for attr in ("primal", "val"):
            if isinstance(x, jax.core.Tracer):
                inner = getattr(x, attr, None)
                if inner is not None:
                    break
        if inner is None:
            return
        x = inner


def _producers(x: Any) -> Iterator[Any]:
    """`x`, its wrapped values, and (under jit) the inputs of the single-input
    equations that produced them, back to where the chain ends."""
    stack, seen = [x], 0
    while stack and seen < _MAX_CHAIN:
        value = stack.pop()
        seen += 1
        for v in _unwrapped(value):
            yield v
            parent = getattr(v, "parent", None) if isinstance(v, jax.core.Tracer) else None
            inputs = getattr(parent, "in_tracers", None)
            if inputs is not None and len(inputs) == 1:
                stack.append(inputs[0])


def _flat(tree: Any, prefix: str) -> Iterator[tuple[str, Any]]:
    if isinstance(tree, Mapping):
        for key, value in tree.items():
            yield from _flat(value, f"{prefix}/{key}" if prefix else str(key))
    else:
        yield prefix, _unbox(tree)


def _linen_params(module: nn.Module) -> Iterator[tuple[str, Any]]:
    if module.scope is None:
        return
    yield from _flat(module.variables.get("params", {}), "/".join(str(p) for p in module.path))


def _nnx_params(module: nnx.Module) -> Iterator[tuple[str, Any]]:
    prefix = getattr(module, NNX_PATH_ATTRIBUTE, "")
    for path, node in nnx.iter_graph(module):
        if isinstance(node, nnx.Param):
            key = "/".join(str(p) for p in path)
            yield "/".join(p for p in (prefix, key) if p), node.get_raw_value()


def _linen_root(module: nn.Module) -> nn.Module:
    while isinstance(getattr(module, "parent", None), nn.Module):
        module = module.parent
    return module


def param_index(module: Any, root: Any = None) -> dict[int, str]:
    """``{id(value): parameter path}`` of the parameters `module` can reach (its own,
    its children's, its ancestors'), at every transformation level.

    Example:
      >>> layer = nn.Dense(2).bind(nn.Dense(2).init(jax.random.key(0), jnp.ones((1, 3))))
      >>> sorted(param_index(layer).values())
      ['bias', 'kernel']
    """
    modules = [module]
    if isinstance(module, nn.Module):
        modules.append(_linen_root(module))
        walk = _linen_params
    else:
        walk = _nnx_params
    if root is not None and isinstance(root, nnx.Module):
        modules.append(root)
    index: dict[int, str] = {}
    for m in modules:
        for path, value in walk(m):
            for v in _unwrapped(value):
                index.setdefault(id(v), path)
    return index


def operand_param(x: Any, index: dict[int, str]) -> str | None:
    """The path of the parameter `x` is (or is derived from by single-input
    operations), or None for an activation."""
    for v in _producers(x):
        path = index.get(id(v))
        if path is not None:
            return path
    return None


__all__ = ["CallSite", "NNX_PATH_ATTRIBUTE", "absolute_path", "is_module", "locate", "module_path",
           "operand_param", "param_index"]
