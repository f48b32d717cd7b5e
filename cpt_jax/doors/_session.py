"""One top-level call of a quantized model: an interception session, the last product
(`LAST_PRODUCT`) found by a side trace, rules that matched nothing warned."""
from __future__ import annotations

import dataclasses
import sys
import warnings
from collections.abc import Callable

import jax

from cpt_jax import context
from cpt_jax.interception import Interception, intercepting, rule_matches
from cpt_jax.providers import default_provider

Array = jax.Array


def warn_unmatched_rules(rules, paths, last: str | None = None) -> None:
    """Warn for every rule whose pattern matched none of the product `paths`."""
    paths = list(dict.fromkeys(paths))
    if not paths:
        return
    for pattern, _ in rules:
        if not rule_matches(pattern, paths, last):
            warnings.warn(f"cpt_jax rule {pattern!r} matches no product; the products are: "
                          f"{paths}", UserWarning, stacklevel=4)


class Door:
    """One top-level call: an `op_interception` session; dead rules warned at exit."""

    def __init__(self, env: Interception, entry, root_name: str, root=None,
                 update_state: bool = True, warn: bool = True):
        self.env, self.warn = env, warn
        self._cm = intercepting(env, entry, root_name, root, update_state)

    def __enter__(self):
        self.session = self._cm.__enter__()
        return self.session

    def __exit__(self, *exc):
        out = self._cm.__exit__(*exc)
        if exc[0] is None and self.warn:
            warn_unmatched_rules(self.env.rules, self.session.seen, self.env.last)
        return out


def last_product(run: Callable, root_name: str) -> str | None:
    """The path of the last product ``run()`` computes (an fp32 abstract side trace)."""
    def side():
        with Door(Interception((), None, default=default_provider), sys._getframe(), root_name,
                  warn=False):
            return run()

    with context.recording(isolated=True) as records, context.full_precision():
        jax.eval_shape(side)
    return records[-1].name if records else None


def call_env(env: Interception, run: Callable | None, root_name: str) -> Interception:
    """The model's `Interception` for one call (with the last product when a rule needs it)."""
    if not env.needs_last or run is None:
        return env
    return dataclasses.replace(env, last=last_product(run, root_name))
