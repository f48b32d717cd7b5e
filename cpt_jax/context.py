"""The precision context: how traced bit-widths reach every quantized op.

``with precision(bits, grad_bits, rng):`` entered *inside* the jitted function sets
the forward and backward widths (possibly tracers) for every quantized op traced in
its body, the way `nn.logical_axis_rules` reaches layers. Outside any context,
quantized ops compute in full precision, so `init` and plain `apply` just work.

A context is part of JAX's jit-cache key while it is active (`static_identity`: its
widths when they are numbers, "traced" when they are tracers): a function jitted
outside a context and called inside one, or the reverse, is traced again for the
context in force, never reused with the other's widths. A context entered outside
the jitted function therefore compiles the function once per width (and warns,
`StalePrecisionWarning`); entered inside with traced widths, a cyclic run compiles once.

Widths: each product computes at ``clip(floor(bits + offset), 1, 32)``
(`effective_bits`): a fractional width is floored (3.99 -> 3), a traced width below
1 computes at 1 bit (a number below 1 is a ValueError when the context is entered;
`cpt_jax.training` counts the clamped steps), ``>= 32`` is full precision.

The context also hands each op its own PRNG key for stochastic rounding:
``key_i = fold_in(rng, i)`` for the i-th quantized op traced in the context (op
order is fixed by the model, so keys are reproducible); an op traced inside a
loop body (``nn.scan``) also folds in a per-iteration salt (`loop_salt`). Pass a fresh `rng` each
step (e.g. ``fold_in(state.rng, state.step)``).
"""
from __future__ import annotations

import contextlib
import dataclasses
import threading
import warnings
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import get_opaque_trace_state

from cpt_jax import formats

Array = jax.Array


@dataclasses.dataclass
class PrecisionState:
    """The widths in force: forward `bits`, backward `grad_bits` (None: errors in fp32)."""

    bits: Any
    grad_bits: Any = None
    rng: Array | None = None
    _next_op: int = 0
    warned: bool = False
    trace: Any = None
    salt: Array | None = None

    def next_key(self) -> Array | None:
        """A fresh key for the next op: ``fold_in(rng, i)`` (``fold_in(fold_in(rng, i),
        salt)`` inside a loop body, see `loop_salt`); None without an rng."""
        if self.rng is None:
            return None
        key = jax.random.fold_in(self.rng, self._next_op)
        self._next_op += 1
        if self.salt is not None:
            key = jax.random.fold_in(key, self.salt)
        return key


def _trace_state():
    return get_opaque_trace_state(convention="cpt_jax")


_CACHE_KEY: list = []
_CACHE_KEY_LOCK = threading.Lock()


def prepare_cache_key() -> None:
    """Make the precision context's part of JAX's jit-cache key (a
    `jax.make_user_context`: `static_identity` while a context is active, None
    outside), once, outside any trace.

    Not at import (importing cpt_jax changes no jit key); called by the first eager
    `precision`, `cpt_jax.quantize_model` and the first eager product. Never inside a
    trace: a user context made while a step is traced changes every key, so the step
    would compile twice. (Until it exists, no trace was made under a keyed context.)
    """
    if _CACHE_KEY or _is_staging():
        return
    with _CACHE_KEY_LOCK:
        if not _CACHE_KEY:
            _CACHE_KEY.append(jax.make_user_context(None))


def _keyed(identity: tuple | None) -> contextlib.AbstractContextManager:
    """The block keyed on `identity` in JAX's jit caches (nothing before the key exists)."""
    return _CACHE_KEY[0](identity) if _CACHE_KEY else contextlib.nullcontext()


def _identity_part(value: Any) -> Any:
    """None, ``"traced"`` for a tracer, else the value itself (hashable)."""
    if value is None:
        return None
    if isinstance(value, jax.core.Tracer):
        return "traced"
    array = np.asarray(value, np.float32)
    return array.item() if array.ndim == 0 else (array.shape, array.tobytes())


def static_identity(state: PrecisionState | None) -> tuple | None:
    """What a trace made under `state` keeps of it: its key in JAX's jit caches.

    ``("precision", bits, grad_bits, rng)``, each a number (a constant of any trace
    made under the context), ``"traced"`` (a tracer: the context was entered inside
    the function being traced) or None; the rng only as present or not (a concrete
    rng in a trace is refused, `check_traced_precision`). None: full precision.

    Example:
      >>> static_identity(PrecisionState(bits=jnp.float32(4)))
      ('precision', 4.0, None, None)
    """
    if state is None:
        return None
    rng = None if state.rng is None else "rng"
    return ("precision", _identity_part(state.bits), _identity_part(state.grad_bits), rng)


def loop_salt(state: PrecisionState, x: Array) -> Array | None:
    """Per-iteration salt of the keys of a product traced in a nested trace, else None.

    A product inside a ``lax.scan`` body (``nn.scan``, ``nnx.scan``) is traced once
    for all iterations, so ``fold_in(rng, i)`` alone would round every iteration
    with the same key. When the product is traced in another trace than the one
    the `precision` context was entered in, its keys also fold in ``salt =
    bitcast_uint32(sum(x))`` of its input `x`, which differs per iteration.
    Products traced where the context was entered keep ``fold_in(rng, i)``.
    """
    if state.rng is None or state.trace == _trace_state():
        return None
    total = jnp.sum(jnp.asarray(x, jnp.float32))
    return jax.lax.bitcast_convert_type(total, jnp.uint32)


class _Local(threading.local):
    def __init__(self):
        self.stack: list[PrecisionState] = []
        self.recorders: list[list] = []
        self.in_quant_call: int = 0
        self.tags: int = 0
        self.eager_calls: list[bool] = []


_LOCAL = _Local()


@contextlib.contextmanager
def precision(bits, grad_bits=None, rng: Array | None = None) -> Iterator[PrecisionState]:
    """Set the bit-widths of every quantized op traced inside the block.

    Args:
      bits: forward bits of weights and activations (a number or a traced scalar);
        whole bits: each product computes at ``clip(floor(bits + offset), 1, 32)``
        (`effective_bits`: 3.99 computes at 3; a traced width below 1 at 1, counted
        by the training step's ``metrics["bits_clamped"]``; a number below 1 is a
        ValueError here); ``>= 32`` means full precision.
      grad_bits: bits of the errors (cotangents of each quantized op's output), or
        None to leave errors in full precision (same rules as `bits`).
      rng: PRNG key for stochastic rounding (needed when an error or other tensor is
        rounded stochastically and `grad_bits` is set).

    Enter the context inside the jitted function, with the widths traced: one
    compilation serves every width. Entered around a jitted function, the widths
    are constants of its trace: the function is traced again for each width (the
    context is part of the jit-cache key, `static_identity`, so no trace is reused
    with other widths) and a `StalePrecisionWarning` says so; a concrete `rng` there
    is a ValueError.

    Example:
      >>> model = cpt_jax.quantize_model(nn.Dense(4))
      >>> params = model.init(jax.random.key(0), jnp.ones((2, 3)))
      >>> @jax.jit
      ... def f(params, x, bits):
      ...   with precision(bits, grad_bits=8, rng=jax.random.key(1)):
      ...     return model.apply(params, x)
    """
    formats.check_bits(bits, "bits")
    if grad_bits is not None:
        formats.check_bits(grad_bits, "grad_bits")
    state = PrecisionState(
        bits=jnp.asarray(bits, jnp.float32),
        grad_bits=None if grad_bits is None else jnp.asarray(grad_bits, jnp.float32),
        rng=rng, trace=_trace_state())
    prepare_cache_key()
    _LOCAL.stack.append(state)
    try:
        with _keyed(static_identity(state)):
            yield state
    finally:
        _LOCAL.stack.pop()


@contextlib.contextmanager
def full_precision() -> Iterator[None]:
    """Run the block in full precision even inside an outer `precision` context."""
    _LOCAL.stack.append(None)
    try:
        with _keyed(None):
            yield None
    finally:
        _LOCAL.stack.pop()


def current_precision() -> PrecisionState | None:
    """The innermost precision state, or None (full precision)."""
    return _LOCAL.stack[-1] if _LOCAL.stack else None


# --------------------------------------------------------------------------- recording

@contextlib.contextmanager
def recording(isolated: bool = False) -> Iterator[list]:
    """Collect an `OpRecord` for every quantizable op traced inside the block.

    Args:
      isolated: hide the block's records from outer recorders (a side trace).
    """
    records: list = []
    outer = _LOCAL.recorders
    _LOCAL.recorders = [records] if isolated else outer + [records]
    try:
        yield records
    finally:
        _LOCAL.recorders = outer


def recording_tag() -> str | None:
    """A fresh named-scope tag for the next recorded op, or None when not recording.

    `cost.trace_ops` finds each op's equations by it (scan trip counts).
    """
    if not _LOCAL.recorders:
        return None
    _LOCAL.tags += 1
    return f"cpt_op{_LOCAL.tags}"


def record(op: Any) -> None:
    """Append `op` to every active recorder (no-op when none is active)."""
    for records in _LOCAL.recorders:
        records.append(op)


@contextlib.contextmanager
def quant_call_guard() -> Iterator[None]:
    """Mark the block as inside a quantized call: interceptors then let calls through.

    Used by `cpt_jax.interception` when a layer is re-run as a clone on quantized
    operands, so the clone's own call is not intercepted again.
    """
    _LOCAL.in_quant_call += 1
    try:
        yield
    finally:
        _LOCAL.in_quant_call -= 1


def inside_quant_call() -> bool:
    """True inside `quant_call_guard` (an interceptor must not re-enter)."""
    return _LOCAL.in_quant_call > 0


def effective_bits(base, offset: float) -> Array:
    """A product's width: ``clip(floor(base + offset), 1, 32)`` (float32, traceable).

    Widths are whole bits: a fractional width is floored (3.99 computes at 3 bits, as
    the integer grids always did), a width below 1 (a traced schedule's 0) computes at
    1 bit rather than on an empty grid, ``>= 32`` is full precision.

    Example:
      >>> float(effective_bits(4, -1.0)), float(effective_bits(31, 4.0))
      (3.0, 32.0)
      >>> float(effective_bits(3.99, 0.0)), float(effective_bits(0.0, 0.0))
      (3.0, 1.0)
    """
    return jnp.clip(jnp.floor(jnp.asarray(base, jnp.float32) + offset), 1.0, 32.0)


class StalePrecisionWarning(UserWarning):
    """A `precision` context entered outside a traced (jitted) function: its widths are
    constants of the trace, so the function compiles once per width."""


def _is_staging() -> bool:
    # Inside jit / eval_shape / scan tracing, a fresh constant is a tracer.
    return isinstance(jnp.zeros((), jnp.float32), jax.core.Tracer)


@contextlib.contextmanager
def model_call() -> Iterator[None]:
    """Mark the block as one call of a quantized model, eager or staged as it starts.

    Inside an eager model call, staging seen by a product is the model's own
    (``jax.jit`` helpers, ``lax.scan`` bodies, ``jax.checkpoint``): each is traced
    inside the call with the context's current widths, so `check_traced_precision`
    does not warn there, and the context's jit-cache key is lifted (`static_identity`
    None): the interception's epoch already keeps a trace holding a product from
    being reused, and JAX's eager caches then serve every width (an eager loop over
    widths compiles the model's helpers once, not once per width).
    """
    eager = not _is_staging()
    _LOCAL.eager_calls.append(eager)
    try:
        with _keyed(None) if eager else contextlib.nullcontext():
            yield
    finally:
        _LOCAL.eager_calls.pop()


def check_traced_precision(state: PrecisionState, where: str) -> None:
    """Warn once per context when its widths are constants of a traced function.

    ``with precision(3): f(x)`` around a jitted ``f`` traces ``f`` with the widths
    baked in as constants. The context's `static_identity` is part of JAX's jit-cache
    key, so a call under other widths, or under none, traces ``f`` again (never a
    stale reuse), but every width is a compilation of its own: a
    `StalePrecisionWarning` says so, once per context. A concrete `rng` cannot be
    keyed (a fresh key per call would compile every call): a trace would reuse its
    first key, so it is a ValueError. A context entered inside the traced function
    has traced widths and is silent. (Eager `jax.grad`/`vmap` do not stage, so they
    do not warn; neither does staging inside an eager call of a quantized model,
    `model_call`.)
    """
    if state.warned or isinstance(state.bits, jax.core.Tracer) or not _is_staging():
        return
    if _LOCAL.eager_calls and _LOCAL.eager_calls[-1]:
        return  # staged inside an eager model call (`model_call`)
    state.warned = True
    fix = ("Enter `with cpt_jax.precision(bits, grad_bits, rng)` inside the jitted function "
           "and pass bits (and rng) as arguments")
    if state.rng is not None and not isinstance(state.rng, jax.core.Tracer):
        raise ValueError(
            f"cpt_jax.precision(rng=...) was entered outside the function being traced "
            f"(product {where!r}): its rng would be a constant of the trace, reused by every "
            f"later call. {fix}.")
    warnings.warn(
        f"cpt_jax.precision was entered outside the function being traced (product "
        f"{where!r}): its widths are constants of this trace, so the function is traced "
        f"and compiled again for every other width (and again outside the context). "
        f"{fix}: one compilation for all widths.", StalePrecisionWarning, stacklevel=3)
