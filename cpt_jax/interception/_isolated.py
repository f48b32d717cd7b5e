"""A call of an NNX model that a trace can run without touching the model."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from flax import nnx


def isolated_call(model: nnx.Module, method: Any, args, kwargs) -> tuple[Callable, tuple]:
    """``(run, operands)``: ``run(*operands)`` calls `method` on a copy of `model`.

    The model and the graph nodes among the arguments (an ``nnx.Rngs`` passed as
    ``rngs=``) are split here and merged inside whatever trace runs ``run`` (e.g.
    ``jax.eval_shape(run, *operands)``), so the copy's variables belong to that
    trace: the call may update them (batch statistics, RNG counts, a layer run
    through ``nnx.split`` / ``jax.checkpoint`` / ``nnx.update``) and nothing of the
    model changes.

    Args:
      model: the NNX model.
      method: a method name, or a function called as ``method(model, *args, **kwargs)``.
      args, kwargs: the call's arguments.

    Returns:
      ``(run, operands)``.

    Example:
      >>> layer = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
      >>> run, operands = isolated_call(layer, "__call__", (jnp.ones((4, 3)),), {})
      >>> jax.eval_shape(run, *operands).shape
      (4, 2)
    """
    graphdef, state = nnx.split((model, tuple(args), dict(kwargs)))

    def run(state):
        copy, a, k = nnx.merge(graphdef, state)
        return method(copy, *a, **k) if callable(method) else getattr(copy, method)(*a, **k)

    return run, (state,)


__all__ = ["isolated_call"]
