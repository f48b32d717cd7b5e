"""Every piece of JAX (and Flax) the interception relies on that is not public API.

The interception takes over JAX's product functions while a quantized model runs,
so it needs a few things JAX does not promise to keep. They all live here, each
with the public alternative used wherever one exists, and `check` verifies them
on the JAX that is installed (``tests/test_jax_internals.py`` runs it, so a moved
name fails with the JAX version in the message rather than as a wrong product):

=======================  ===========================================================
what                     how it is reached
=======================  ===========================================================
the product functions    public paths (``jax.lax.dot_general``, ``jax.numpy.einsum``,
                         ``flax.linen.dot_product_attention``...): `TARGETS`; one is a
                         Flax module path not re-exported at the top
                         (``flax.nnx.nn.attention.dot_product_attention_weights``)
a jitted function's      ``PjitFunction.__wrapped__`` (what ``functools.wraps`` sets)
Python body
which trace is current   ``jax.extend.core.get_opaque_trace_state`` (public)
a jit-cache key          ``jax.make_user_context`` (public), created on the first
                         quantized call, never at import (`cache_context`)
JAX's own rules          the frames where JAX applies a primitive's rule: every
                         trace's ``process_primitive`` (JVP, batching, partial eval,
                         eager impl), ``backward_pass*`` (transposition) and the
                         lowering (``jax/_src/interpreters/mlir.py``): a product
                         function called below one is JAX computing a derivative, a
                         batched product or a lowering, not the model
                         (`called_by_jax_rule`)
unreachable products     the files of Pallas (``jax/_src/pallas/``), custom
                         derivatives (``jax/_src/custom_derivatives.py``) and
                         ``jax.eval_shape`` (``jax/_src/api.py``)
weights under tracing    a JVP / linearize tracer's ``primal``, a batch tracer's
                         ``val``, a jit tracer's producing equation
                         ``parent.in_tracers`` (`wrapped_value`, `producer_inputs`)
the mesh axes a value    ``jax.typeof(x).manual_axis_type.varying`` (``.vma`` before
varies over              JAX 0.8), read by `cpt_jax.ops.varying.varying_axes` (below
                         the interception, which the quantized ops cannot import;
                         checked here)
=======================  ===========================================================
"""
from __future__ import annotations

import dataclasses
import importlib
import inspect
import os
import threading
import types
from collections.abc import Callable
from typing import Any

import jax
from jax.extend.core import get_opaque_trace_state

JAX_VERSION = jax.__version__


@dataclasses.dataclass(frozen=True)
class Target:
    """A JAX/Flax function cpt_jax takes over: `name` (the dispatcher's key), the
    public `module` it is reached from and its `attr` there."""

    name: str
    module: str
    attr: str

    def resolve(self) -> Any | None:
        """The function object, or None where this JAX/Flax version lacks it."""
        try:
            module = importlib.import_module(self.module)
        except ImportError:
            return None
        return getattr(module, self.attr, None)


T = Target
TARGETS = (
    T("dot_general", "jax.lax", "dot_general"),
    T("conv_general_dilated", "jax.lax", "conv_general_dilated"),
    T("ragged_dot_general", "jax.lax", "ragged_dot_general"),
    T("einsum", "jax.numpy", "einsum"),
    T("tensordot", "jax.numpy", "tensordot"),
    T("matmul", "jax.numpy", "matmul"),
    T("dot", "jax.numpy", "dot"),
    T("inner", "jax.numpy", "inner"),
    T("vdot", "jax.numpy", "vdot"),
    T("matvec", "jax.numpy", "matvec"),
    T("vecmat", "jax.numpy", "vecmat"),
    T("take", "jax.numpy", "take"),
    T("conv_general_dilated_patches", "jax.lax", "conv_general_dilated_patches"),
    T("conv_general_dilated_local", "jax.lax", "conv_general_dilated_local"),
    T("jax_attention", "jax.nn", "dot_product_attention"),
    T("linen_attention", "flax.linen", "dot_product_attention"),
    T("linen_attention_weights", "flax.linen", "dot_product_attention_weights"),
    T("nnx_attention", "flax.nnx", "dot_product_attention"),
    T("nnx_attention_weights", "flax.nnx.nn.attention", "dot_product_attention_weights"),
)
"""The JAX and Flax functions taken over while a quantized model runs."""

OPTIONAL_TARGETS = frozenset({"matvec", "vecmat"})
"""Targets a supported JAX may lack (``jnp.matvec`` / ``vecmat`` are recent)."""


def python_body(fn: Any) -> Callable:
    """The Python function behind a jitted one (``jax.jit(f).__wrapped__ is f``), else `fn`."""
    return getattr(fn, "__wrapped__", fn)


# --------------------------------------------------------------------------- traces

def trace_state() -> Any:
    """An opaque token of the current trace (equal tokens: the same trace)."""
    return get_opaque_trace_state(convention="cpt_jax")


_CONTEXT: list = []
_CONTEXT_LOCK = threading.Lock()


def cache_context() -> Callable[[Any], Any]:
    """The jit-cache-sensitive context of the interception (`jax.make_user_context`).

    ``with cache_context()(value):`` makes every trace and compilation JAX caches
    inside the block key on `value` (thread-locally). It is created on the first
    quantized call, not at import: until then no jit key in the process changes, and
    outside quantized calls its value is None, so other code's caches hit as before.
    """
    with _CONTEXT_LOCK:
        if not _CONTEXT:
            _CONTEXT.append(jax.make_user_context(None))
        return _CONTEXT[0]


# --------------------------------------------------------------------------- frames

_JAX_DIR = os.path.dirname(jax.__file__) + os.sep
_SRC = os.path.join(os.path.dirname(jax.__file__), "_src")
_LOWERING_FILE = os.path.join(_SRC, "interpreters", "mlir.py")
RULE_CALLERS = ("process_primitive", "backward_pass")
"""Prefixes of the names of JAX functions that apply primitives' rules (every
trace's ``process_primitive``; ``backward_pass`` / ``backward_pass3``)."""
PALLAS_DIR = os.path.join(_SRC, "pallas") + os.sep
CUSTOM_DERIVATIVES_FILE = os.path.join(_SRC, "custom_derivatives.py")
EVAL_SHAPE = (os.path.join(_SRC, "api.py"), "eval_shape")

_CPT_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_CPT_MODEL_DIR = os.path.join(_CPT_DIR, "models") + os.sep
_CPT_OPS_DIR = os.path.join(_CPT_DIR, "ops") + os.sep


def _is_library(filename: str) -> bool:
    """JAX itself or cpt_jax's own machinery (not its example models)."""
    return filename.startswith(_JAX_DIR) or (filename.startswith(_CPT_DIR)
                                             and not filename.startswith(_CPT_MODEL_DIR))


def called_by_jax_rule(frame: types.FrameType | None) -> bool:
    """Whether the call whose caller's frame is `frame` was made by JAX's own rules.

    Walking out from the caller, through JAX's and cpt_jax's own frames, a frame
    where JAX applies a primitive's rule (`RULE_CALLERS`, or the lowering) before any
    frame of the model (user code, Flax) means JAX is computing a derivative (e.g.
    ``ragged_dot``'s JVP rule calls ``ragged_dot_general``), a transposition, a
    batched product or a lowering: it is computed as JAX defines it, never
    intercepted. (Tracing a function, ``jit``'s or ``vmap``'s, applies no rule: the
    products of a function JAX's own code vmaps are the model's.)
    """
    while frame is not None:
        code = frame.f_code
        filename = code.co_filename
        if filename == _LOWERING_FILE or (filename.startswith(_SRC)
                                          and code.co_name.startswith(RULE_CALLERS)):
            return True
        if filename.startswith(_CPT_OPS_DIR):
            return True  # cpt_jax's own quantized product (a custom_vjp rule traced late)
        if not _is_library(filename):
            return False
        frame = frame.f_back
    return False


def unreachable_marker(code: types.CodeType) -> str | None:
    """``"pallas"`` / ``"custom_vjp"`` / ``"shape"`` for a frame that makes the
    products below it unreachable (a Pallas kernel body, the user's custom
    derivative function, ``jax.eval_shape``), else None."""
    filename = code.co_filename
    if filename.startswith(PALLAS_DIR):
        return "pallas"
    if filename == CUSTOM_DERIVATIVES_FILE:
        return "custom_vjp"
    if (filename, code.co_name) == EVAL_SHAPE:
        return "shape"
    return None


# --------------------------------------------------------------------------- tracers

_WRAPPED_ATTRIBUTES = ("primal", "val")


def wrapped_value(x: Any) -> Any | None:
    """The value a tracer wraps one level down: a JVP / linearize tracer's
    ``primal``, a batch tracer's ``val``; None for anything else."""
    if not isinstance(x, jax.core.Tracer):
        return None
    for attr in _WRAPPED_ATTRIBUTES:
        inner = getattr(x, attr, None)
        if inner is not None:
            return inner
    return None


def producer_inputs(x: Any) -> tuple | None:
    """The inputs of the equation that produced a jit tracer `x` (None if unknown)."""
    if not isinstance(x, jax.core.Tracer):
        return None
    parent = getattr(x, "parent", None)
    inputs = getattr(parent, "in_tracers", None)
    return None if inputs is None else tuple(inputs)


# --------------------------------------------------------------------------- checks

def _check_targets() -> list[str]:
    missing = [f"{t.module}.{t.attr}" for t in TARGETS
               if t.resolve() is None and t.name not in OPTIONAL_TARGETS]
    return [f"product function {name} not found" for name in missing]


def _check_files() -> list[str]:
    problems = []
    for path in (PALLAS_DIR, CUSTOM_DERIVATIVES_FILE, EVAL_SHAPE[0], _LOWERING_FILE):
        if not os.path.exists(path):
            problems.append(f"JAX file {path} not found")
    if inspect.unwrap(jax.eval_shape).__code__.co_filename != EVAL_SHAPE[0]:
        problems.append(f"jax.eval_shape is no longer defined in {EVAL_SHAPE[0]}")
    return problems


def _check_rule_callers() -> list[str]:
    """The functions `called_by_jax_rule` recognizes still apply the rules."""
    problems = []
    for module_name, owner in (("jax._src.interpreters.ad", "JVPTrace"),
                               ("jax._src.interpreters.batching", "BatchTrace"),
                               ("jax._src.core", "EvalTrace")):
        cls = getattr(importlib.import_module(module_name), owner, None)
        if cls is None or not hasattr(cls, "process_primitive"):
            problems.append(f"{module_name}.{owner}.process_primitive not found")
    ad = importlib.import_module("jax._src.interpreters.ad")
    if not any(name.startswith("backward_pass") for name in vars(ad)):
        problems.append("jax._src.interpreters.ad.backward_pass* not found")
    return problems


def _check_tracers() -> list[str]:
    import jax.numpy as jnp
    seen: dict[str, Any] = {}

    def probe(x):
        seen["jvp"] = wrapped_value(x)
        return x

    jax.jvp(probe, (jnp.ones(2),), (jnp.ones(2),))
    jax.vmap(lambda x: seen.setdefault("batch", wrapped_value(x)))(jnp.ones((2, 2)))

    def jitted(x):
        seen["jit"] = producer_inputs(jnp.sin(x))
        return x

    jax.make_jaxpr(jitted)(jnp.ones(2))
    problems = []
    if seen.get("jvp") is None:
        problems.append("a JVP tracer no longer has .primal")
    if seen.get("batch") is None:
        problems.append("a batch tracer no longer has .val")
    if not seen.get("jit"):
        problems.append("a jit tracer no longer has .parent.in_tracers")
    return problems


def _check_varying_axes() -> list[str]:
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, PartitionSpec

    from cpt_jax.ops.varying import varying_axes
    seen: list = []

    def body(x, y):
        seen.append((varying_axes(x), varying_axes(y)))
        return x

    mesh = Mesh(np.array(jax.devices()[:1]), ("cpt_jax_check",))
    spec = PartitionSpec("cpt_jax_check")
    jax.eval_shape(jax.shard_map(body, mesh=mesh, in_specs=(spec, PartitionSpec()),
                                 out_specs=spec), jnp.ones(1), jnp.ones(1))
    if seen != [(frozenset({"cpt_jax_check"}), frozenset())]:
        return [f"a value's varying mesh axes are no longer read (ops.varying): {seen}"]
    return []


def check() -> list[str]:
    """Every internal this module relies on, checked on the installed JAX: a list of
    problems, each naming the JAX version (empty when all hold).

    Example:
      >>> check()
      []
    """
    problems = (_check_targets() + _check_files() + _check_rule_callers() + _check_tracers()
                + _check_varying_axes())
    if not hasattr(jax, "make_user_context"):
        problems.append("jax.make_user_context not found")
    return [f"jax {JAX_VERSION}: {p}" for p in problems]


__all__ = ["CUSTOM_DERIVATIVES_FILE", "EVAL_SHAPE", "JAX_VERSION", "OPTIONAL_TARGETS",
           "PALLAS_DIR", "TARGETS", "Target", "cache_context", "called_by_jax_rule", "check",
           "producer_inputs", "python_body", "trace_state", "unreachable_marker",
           "wrapped_value"]
