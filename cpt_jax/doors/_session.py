"""One top-level call of a quantized model: an interception session, the last product
(`LAST_PRODUCT`) it resolves with, and rules that matched nothing warned (once per
model and pattern).

The last product of a call is remembered per kind of call (`call_signature`: the
method and the structure of its inputs), from the products the calls themselves
record. Only a kind of call never seen before, whose rules need it, is traced
first on an isolated copy (`last_product`): abstractly, in fp32, on the model's
state passed into the trace (an NNX model is split outside and merged inside, so
the copy's variables belong to the trace and nothing of the model is mutated).
"""
from __future__ import annotations

import dataclasses
import sys
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax

from cpt_jax import context
from cpt_jax.interception import Interception, intercepting, rule_matches
from cpt_jax.providers import default_provider

Array = jax.Array


class UnmatchedRuleWarning(UserWarning):
    """A rule of `cpt_jax.quantize_model` whose pattern matched no product of a call."""


def warn_unmatched_rules(rules, paths, last: str | None = None,
                         warned: set | None = None) -> None:
    """Warn for every rule whose pattern matched none of the product `paths`
    (`UnmatchedRuleWarning`); with `warned` (the model's set, ``Interception.warned``)
    once per pattern: a pattern warned about is added and not warned again.

    Example:
      >>> import warnings
      >>> with warnings.catch_warnings(record=True) as caught:
      ...   warnings.simplefilter("always")
      ...   seen = set()
      ...   for _ in range(2):
      ...     warn_unmatched_rules([("head", None)], ["Dense_0"], warned=seen)
      >>> len(caught)
      1
    """
    paths = list(dict.fromkeys(paths))
    if not paths:
        return
    for pattern, _ in rules:
        key = ("rule", pattern)
        if (warned is not None and key in warned) or rule_matches(pattern, paths, last):
            continue
        if warned is not None:
            warned.add(key)
        warnings.warn(f"cpt_jax rule {pattern!r} matches no product; the products are: "
                      f"{paths}", UnmatchedRuleWarning, stacklevel=4)


def _leaf_key(leaf: Any) -> Any:
    if hasattr(leaf, "shape") and hasattr(leaf, "dtype"):
        return ("array", len(leaf.shape), str(leaf.dtype))
    try:
        hash(leaf)
    except TypeError:
        return ("object", type(leaf).__qualname__)
    return leaf


def call_signature(method: Any, args: Sequence, kwargs: dict) -> tuple:
    """What decides which products a call computes: the method, and its inputs'
    structure (arrays by rank and dtype, other values by value).

    Example:
      >>> call_signature("__call__", (jnp.ones((2, 3)),), {"train": True}) == call_signature(
      ...     "__call__", (jnp.zeros((5, 3)),), {"train": True})
      True
    """
    name = method if isinstance(method, str) or method is None else getattr(
        method, "__qualname__", repr(method))
    leaves, treedef = jax.tree_util.tree_flatten((tuple(args), dict(kwargs)))
    return (name, str(treedef), tuple(_leaf_key(leaf) for leaf in leaves))


class Door:
    """One top-level call: an interception session; dead rules warned at exit; the
    call's last product remembered for its kind of call."""

    def __init__(self, env: Interception, entry, root_name: str, root=None,
                 update_state: bool = True, warn: bool = True, signature: Any = None):
        self.env, self.warn, self.signature = env, warn, signature
        self._cm = intercepting(env, entry, root_name, root, update_state)

    def __enter__(self):
        self.session = self._cm.__enter__()
        return self.session

    def __exit__(self, *exc):
        out = self._cm.__exit__(*exc)
        if exc[0] is None:
            self._remember_last()
            if self.warn:
                warn_unmatched_rules(self.env.rules, self.session.seen, self.env.last,
                                     self.env.warned)
        return out

    def _remember_last(self) -> None:
        seen = self.session.seen
        if self.signature is None or not seen or not self.env.needs_last:
            return
        used, last = self.env.last, seen[-1]
        self.env.lasts[self.signature] = last
        if used is not None and used != last:
            warnings.warn(f"cpt_jax: this call's last product is {last!r}, but it was "
                          f"resolved with {used!r} as the last (the rule LAST_PRODUCT); the "
                          f"next call of this kind uses {last!r}", UserWarning, stacklevel=3)


def last_product(run: Callable, root_name: str, *operands) -> str | None:
    """The path of the last product ``run(*operands)`` computes: an abstract fp32
    trace, `operands` (the model's state) passed into it, so the trace can mutate
    nothing of the model."""
    def side(*operands):
        with Door(Interception((), None, default=default_provider), sys._getframe(), root_name,
                  warn=False):
            return run(*operands)

    with context.recording(isolated=True) as records, context.full_precision():
        jax.eval_shape(side, *operands)
    return records[-1].name if records else None


def call_env(env: Interception, run: Callable | None, root_name: str, signature: Any = None,
             operands: tuple = ()) -> Interception:
    """The model's `Interception` for one call, with the call's last product when a
    rule needs it: remembered for its kind of call (`call_signature`), else found by
    `last_product` on ``run(*operands)``."""
    if not env.needs_last:
        return env
    last = env.lasts.get(signature) if signature is not None else None
    if last is None and run is not None:
        last = last_product(run, root_name, *operands)
        if last is not None and signature is not None:
            env.lasts[signature] = last
    return dataclasses.replace(env, last=last)
