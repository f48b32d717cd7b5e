"""Where a product is computed: the Flax module (Linen or NNX) running it, and its operands.

When `cpt_jax.interception._operations` sees a product, it asks this module three questions,
all answered from the Python stack and the module's variables, for Linen and NNX
alike:

* **which module** (`locate`): the innermost stack frame whose ``self`` is a bound
  Linen module or an NNX module; the outermost frame of the same ``self`` is the
  *call*; the user method's name (``attend``, ``encode``) is read from the frames.
  Its **name** is the module's full path (`CallSite.path`):

  ==========================  ===================================================
  module                      name
  ==========================  ===================================================
  Linen                       its scope path (``decoder/layers_0/attn``)
  Linen under               the parent's name plus its own (``ffn/wi``: two
  ``nn.share_scope``          children sharing the parent's scope stay apart)
  NNX                         the path `quantize_model` wrote on it
                              (`NNX_PATH_ATTRIBUTE`), else its attribute path in
                              the NNX module running it (a module added later)
  NNX inside                  the Linen path of the ``nnx.bridge.ToLinen`` plus the
  ``nnx.bridge.ToLinen``      NNX attribute path inside it (``decoder/layers/0/mlp``),
                              as its NNX twin names it; a bridge that appends the
                              NNX submodule's name to its own scope path while it
                              runs (MaxText's ``ToLinen``) is read at its own path,
                              so no segment repeats (``attn/query``, never
                              ``attn/query/query``)
  Linen inside                the NNX path of the ``nnx.bridge.ToNNX`` plus the
  ``nnx.bridge.ToNNX``        Linen path inside it
  ==========================  ===================================================

  `CallSite.owner` is where the module's variables are (its scope path; for a
  bridged module the same joined path).
* **can the interception reach it** (`CallSite.unreachable`): a product traced
  inside a Pallas kernel body, or inside the user's own ``custom_vjp`` /
  ``custom_jvp`` function (whose backward rule is the user's), is not one cpt_jax
  can quantize forward *and* backward.
* **which operand is a weight** (`operand_param`): an operand that is a parameter
  of the model, or derived from one by single-input operations (transpose,
  reshape, dtype cast, sharding constraint, ...), found through the tracers'
  producing equations under ``jit``; its parameter path is kept.

The JAX internals these answers read (tracer fields, JAX's file layout) are in
`cpt_jax.interception._jax_internals`.
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
import numpy as np
from flax import nnx

from cpt_jax.interception._jax_internals import (
    producer_inputs,
    unreachable_marker,
    wrapped_value,
)

NNX_PATH_ATTRIBUTE = "_cpt_jax_path"
"""The attribute `quantize_model` sets on every submodule of an NNX model: its path."""

_FLAX_DIR = os.path.dirname(flax.__file__)
_CPT_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_CPT_MODELS = os.path.join(_CPT_DIR, "models") + os.sep
_LIBRARY_DIRS = (os.path.dirname(jax.__file__) + os.sep, _FLAX_DIR + os.sep, _CPT_DIR + os.sep)
_WRAPPER_FILES = frozenset(os.path.join(_FLAX_DIR, "linen", name)
                           for name in ("module.py", "transforms.py"))
_MAX_CHAIN = 64


@dataclasses.dataclass(frozen=True)
class CallSite:
    """The module call a product belongs to.

    Attributes:
      module: the bound Linen module or NNX module (None: outside any module).
      path: its full ``/``-joined name (module docstring; the root: its class name).
      call: the frame object of the module call (its identity keys the op counters).
      method: the name of the module's method that computed the product.
      unreachable: ``"pallas"`` / ``"custom_vjp"`` when the product is traced where
        cpt_jax cannot quantize it, ``"shape"`` inside a ``jax.eval_shape`` the model
        calls (shape inference, not a computation), else None.
      owner: where the module's variables are (``""``: the root).
      prefix: the path of the Flax bridge the module runs inside (``""``: none).
    """

    module: Any
    path: str
    call: Any
    method: str
    unreachable: str | None = None
    owner: str = ""
    prefix: str = ""


def is_module(obj: Any) -> bool:
    """A bound Linen module or an NNX module."""
    if isinstance(obj, nnx.Module):
        return True
    return isinstance(obj, nn.Module) and getattr(obj, "scope", None) is not None


def _linen_segments(module: nn.Module) -> tuple[str, ...]:
    """The module's scope path, less any segments a wrapper appended to it while the
    module runs (MaxText's ``ToLinen`` appends each NNX submodule's name to the
    current Linen module's scope path during that submodule's call): a module whose
    bound parent has its own scope is at ``parent's path + (name,)``."""
    path = tuple(str(p) for p in module.path)
    parent = getattr(module, "parent", None)
    if (isinstance(parent, nn.Module) and parent.scope is not None and module.name
            and module.scope is not parent.scope):
        own = _linen_segments(parent) + (str(module.name),)
        if len(path) > len(own) and path[:len(own)] == own:
            return own
    return path


def _linen_scope_path(module: nn.Module) -> str:
    try:
        return "/".join(_linen_segments(module))
    except Exception:  # unbound Linen module
        return getattr(module, "name", None) or ""


def _linen_extension(module: nn.Module) -> str:
    """The segments a wrapper appended to the module's scope path (`_linen_segments`),
    ``""`` for none: the path of the NNX submodule running inside it."""
    try:
        path = tuple(str(p) for p in module.path)
        return "/".join(path[len(_linen_segments(module)):])
    except Exception:  # unbound Linen module
        return ""


def _linen_name(module: nn.Module) -> str:
    """The scope path, or under ``nn.share_scope`` the parent's name plus its own."""
    parent = getattr(module, "parent", None)
    scope = getattr(module, "scope", None)
    if (isinstance(parent, nn.Module) and scope is not None and module.name
            and scope is getattr(parent, "scope", None)):
        return join(_linen_name(parent), module.name)
    return _linen_scope_path(module)


def join(*parts: str) -> str:
    """``"a/b"`` from the non-empty parts."""
    return "/".join(p for p in parts if p)


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
        path = _linen_name(module)
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
    return _linen_scope_path(module)


def _frame_self(frame: types.FrameType) -> Any:
    code = frame.f_code
    if not code.co_argcount or code.co_varnames[0] != "self":
        return None
    obj = frame.f_locals.get("self")
    return obj if is_module(obj) else None


def _frames(start: types.FrameType, stop: types.FrameType | None) -> Iterator[types.FrameType]:
    frame = start
    while frame is not None and frame is not stop:
        yield frame
        frame = frame.f_back


# --------------------------------------------------------------------------- names

def _nnx_paths(root: nnx.Module, cache: dict) -> dict[int, str]:
    """``{id(submodule): attribute path}`` of an NNX module's graph (cached per root)."""
    entry = cache.get(id(root))
    if entry is None or entry[0] is not root:
        paths = {id(node): "/".join(str(p) for p in path)
                 for path, node in nnx.iter_graph(root) if isinstance(node, nnx.Module)}
        entry = cache[id(root)] = (root, paths)
    return entry[1]


def _next_other(chain: list, i: int, kind: type) -> int | None:
    """The index of the first module in `chain` after `i` that is a `kind`."""
    for j in range(i + 1, len(chain)):
        if isinstance(chain[j], kind):
            return j
    return None


def _qualified(chain: list, i: int, cache: dict) -> tuple[str, str, str]:
    """``(prefix, name, owner)`` of ``chain[i]`` (the module chain, innermost first):
    the path of the bridge it runs inside, and its own name and variable path below
    that bridge (module docstring)."""
    module = chain[i]
    if isinstance(module, nnx.Module):
        if hasattr(module, NNX_PATH_ATTRIBUTE):
            path = getattr(module, NNX_PATH_ATTRIBUTE)
            return "", path, path
        j = _next_other(chain, i, nn.Module)
        root = [m for m in chain[i:j] if isinstance(m, nnx.Module)][-1]
        relative = _nnx_paths(root, cache).get(id(module))
        if relative is None:  # not in the graph: the path a bridge says, else its class
            relative = (j is not None and _linen_extension(chain[j])) or type(module).__name__
        if j is not None:
            prefix = join(*_qualified(chain, j, cache)[:2])
        else:
            prefix = getattr(root, NNX_PATH_ATTRIBUTE, "")
        return prefix, relative, relative
    j = _next_other(chain, i, nnx.Module)
    prefix = join(*_qualified(chain, j, cache)[:2]) if j is not None else ""
    return prefix, _linen_name(module), _linen_scope_path(module)


def locate(start: types.FrameType, stop: types.FrameType | None,
           cache: dict | None = None) -> CallSite:
    """The `CallSite` of a product whose caller's frame is `start`, looking up the
    stack until the interception's entry frame `stop` (`cache`: the caller's memo
    of NNX graph paths, kept for one model call)."""
    unreachable, owners, frames = None, [], []
    for frame in _frames(start, stop):
        unreachable = unreachable or unreachable_marker(frame.f_code)
        owner = _frame_self(frame)
        if owner is not None:
            owners.append(owner)
            frames.append(frame)
    if not owners:
        return CallSite(None, "", None, "__call__", unreachable)
    module, call, method = owners[0], None, "__call__"
    for owner, frame in zip(owners, frames):
        if owner is not module:
            break  # the module's caller: the call is complete
        call = frame
        if frame.f_code.co_filename not in _WRAPPER_FILES:
            method = frame.f_code.co_name
    chain = [m for k, m in enumerate(owners) if k == 0 or m is not owners[k - 1]]
    prefix, name, owner_path = _qualified(chain, 0, {} if cache is None else cache)
    return CallSite(module, join(prefix, name) or type(module).__name__, call, method,
                    unreachable, join(prefix, owner_path), prefix)


def _is_machinery(frame: types.FrameType) -> bool:
    """A frame of JAX's, Flax's or cpt_jax's own code that is not a module's method."""
    filename = frame.f_code.co_filename
    library = filename.startswith(_LIBRARY_DIRS) and not filename.startswith(_CPT_MODELS)
    return library and _frame_self(frame) is None


def callers(call: types.FrameType, stop: types.FrameType | None) -> tuple:
    """The frames from a module call out to `stop` (taken while the call runs: a
    generator's frame loses its caller once suspended)."""
    return tuple(_frames(call, stop))


def same_call(a: tuple, b: tuple) -> bool:
    """Whether two module calls, given by their `callers`, are one call of the model
    traced twice (Flax's ``nn.scan`` traces its body once for the broadcast
    variables, then in the loop): their innermost common caller is transformation
    machinery. A common caller in the model (a module's method, a user function)
    called the module twice: two calls."""
    ancestors = {id(f) for f in a}
    for frame in b:
        if id(frame) in ancestors:
            return _is_machinery(frame)
    return False


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
        inner = wrapped_value(x)
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
            inputs = producer_inputs(v)
            if inputs is not None and len(inputs) == 1:
                stack.append(inputs[0])


def _flat(tree: Any, prefix: str) -> Iterator[tuple[str, Any]]:
    if isinstance(tree, Mapping):
        for key, value in tree.items():
            yield from _flat(value, f"{prefix}/{key}" if prefix else str(key))
    else:
        yield prefix, _unbox(tree)


def _linen_params(module: nn.Module, prefix: str) -> Iterator[tuple[str, Any]]:
    if module.scope is None:
        return
    yield from _flat(module.variables.get("params", {}), join(prefix, _linen_scope_path(module)))


def _nnx_params(module: nnx.Module, prefix: str) -> Iterator[tuple[str, Any]]:
    base = getattr(module, NNX_PATH_ATTRIBUTE, prefix)
    for path, node in nnx.iter_graph(module):
        if isinstance(node, nnx.Param):
            yield join(base, "/".join(str(p) for p in path)), node.get_raw_value()


def _linen_root(module: nn.Module) -> nn.Module:
    while isinstance(getattr(module, "parent", None), nn.Module):
        module = module.parent
    return module


def param_index(module: Any, root: Any = None, prefix: str = "") -> dict[int, str]:
    """``{id(value): parameter path}`` of the parameters `module` can reach (its own,
    its children's, its ancestors'), at every transformation level; `prefix` is
    the path of a bridge the module runs inside (`CallSite.owner` minus its own).

    Example:
      >>> layer = nn.Dense(2).bind(nn.Dense(2).init(jax.random.key(0), jnp.ones((1, 3))))
      >>> sorted(param_index(layer).values())
      ['bias', 'kernel']
    """
    modules = [module]
    if isinstance(module, nn.Module):
        modules.append(_linen_root(module))
    if root is not None and isinstance(root, nnx.Module):
        modules.append(root)
    index: dict[int, str] = {}
    for m in modules:
        walk = _linen_params if isinstance(m, nn.Module) else _nnx_params
        for path, value in walk(m, prefix if m is not root else ""):
            for v in _unwrapped(value):
                index.setdefault(id(v), path)
    return index


def param_values(module: Any, root: Any = None, prefix: str = "") -> dict[str, Any]:
    """``{parameter path: its value}`` of the parameters `module` can reach (as
    `param_index`), each value unwrapped from the transformations around it.

    Example:
      >>> layer = nn.Dense(2).bind(nn.Dense(2).init(jax.random.key(0), jnp.ones((1, 3))))
      >>> sorted((k, v.shape) for k, v in param_values(layer).items())
      [('bias', (2,)), ('kernel', (3, 2))]
    """
    modules = [module]
    if isinstance(module, nn.Module):
        modules.append(_linen_root(module))
    if root is not None and isinstance(root, nnx.Module):
        modules.append(root)
    values: dict[str, Any] = {}
    for m in modules:
        walk = _linen_params if isinstance(m, nn.Module) else _nnx_params
        for path, value in walk(m, prefix if m is not root else ""):
            values.setdefault(path, list(_unwrapped(value))[-1])
    return values


def is_concrete(x: Any) -> bool:
    """Whether `x` (below the JVP / batch tracers around it) is a concrete array:
    eager execution, no trace to follow.

    Example:
      >>> is_concrete(jnp.ones(2)), jax.jit(lambda x: jnp.float32(is_concrete(x)))(1.0).item()
      (True, 0.0)
    """
    v = list(_unwrapped(x))[-1]
    return isinstance(v, (jax.Array, np.ndarray)) and not isinstance(v, jax.core.Tracer)


def rearranged_param(x: Any, values: dict[str, Any]) -> str | None:
    """Eagerly, the path of the parameter whose elements `x` holds in another order
    (a transpose or reshape of it, in `x`'s dtype), or None.

    Under a trace `operand_param` follows the equations from a parameter to a
    product's operand (a router weight ``w.T.reshape(...)`` is the weight ``w``);
    eagerly there are none, so the values tell: `x` has the size of a (non-constant)
    parameter and the same elements, compared sorted (after equal extremes). None
    under a trace, whose operands `operand_param` links.

    Example:
      >>> w = jnp.arange(6.0).reshape(2, 3)
      >>> rearranged_param(w.T.reshape(3, 1, 2), {"w": w}), rearranged_param(w.T + 1, {"w": w})
      ('w', None)
    """
    v = list(_unwrapped(x))[-1]
    if not is_concrete(v):
        return None
    candidates = [(path, p) for path, p in values.items()
                  if getattr(p, "size", -1) == v.size and is_concrete(p)]
    if not candidates:
        return None
    xs = np.asarray(v).ravel()
    lo, hi = xs.min(initial=np.inf), xs.max(initial=-np.inf)
    for path, p in candidates:
        ps = np.asarray(p).astype(xs.dtype).ravel()
        if lo == hi or ps.min() != lo or ps.max() != hi:
            continue
        if np.array_equal(np.sort(xs), np.sort(ps)):
            return path
    return None


def operand_param(x: Any, index: dict[int, str]) -> str | None:
    """The path of the parameter `x` is (or is derived from by single-input
    operations), or None for an activation."""
    for v in _producers(x):
        path = index.get(id(v))
        if path is not None:
            return path
    return None


__all__ = ["CallSite", "NNX_PATH_ATTRIBUTE", "absolute_path", "is_module", "join", "locate",
           "module_path", "operand_param", "param_index", "param_values", "rearranged_param",
           "is_concrete", "callers", "same_call"]
