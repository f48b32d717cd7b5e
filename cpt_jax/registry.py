"""Named tables that extensions register themselves into: one name, one value, one doc.

A `Registry` is what `cpt_jax.register_preset` and `cpt_jax.register_controller` write
to and what the main job's choices, validation, ``--help`` and the docs tables read, so
a new preset or controller is one call in one file, never a second hand-kept list:

    registry.register(name, value, doc)      # once, where the extension is defined
    registry.get(name)                       # ValueError naming the known names
    registry.view()                          # a read-only Mapping, its __doc__ the table

A name is lower case (``[a-z][a-z0-9_]*``: it is typed on the command line and joined
with commas in ``--config.precision.formats``); the doc is one or more sentences.
Registering a name again with an equal value and doc is a no-op (a module imported
twice), with another value a ValueError unless ``replace=True``.
"""
from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from typing import Any, Generic, TypeVar

T = TypeVar("T")
NAME = re.compile(r"[a-z][a-z0-9_]*")


def check_name(kind: str, name: Any) -> str:
    """`name` if it is a registrable name (``[a-z][a-z0-9_]*``), else ValueError.

    Example:
      >>> check_name("preset", "nf4")
      'nf4'
      >>> check_name("preset", "NF-4")
      Traceback (most recent call last):
      ValueError: a preset name must match [a-z][a-z0-9_]* (typed on the command line), got 'NF-4'
    """
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise ValueError(f"a {kind} name must match {NAME.pattern} (typed on the command "
                         f"line), got {name!r}")
    return name


class Registry(Generic[T]):
    """An open table ``name -> (value, doc)`` of one `kind` of extension, in
    registration order.

    Example:
      >>> r = Registry("greeting")
      >>> r.register("hello", "Hello!", "Says hello.")
      'Hello!'
      >>> r.get("hello"), r.names()
      ('Hello!', ('hello',))
      >>> r.get("bye")
      Traceback (most recent call last):
      ValueError: unknown greeting 'bye'; known: ['hello']
    """

    def __init__(self, kind: str):
        self.kind = kind
        self._entries: dict[str, tuple[T, str]] = {}

    def register(self, name: str, value: T, doc: str, *, replace: bool = False) -> T:
        """Add `value` under `name` with its `doc`; returns `value`.

        The same name with an equal value and doc again is a no-op; with another
        value a ValueError unless `replace`.
        """
        check_name(self.kind, name)
        if not isinstance(doc, str) or not doc.strip():
            raise ValueError(f"{self.kind} {name!r}: doc must be a non-empty string (what "
                             f"it is, one or two sentences), got {doc!r}")
        doc = " ".join(doc.split())
        old = self._entries.get(name)
        if old is not None and not replace and old != (value, doc):
            raise ValueError(f"{self.kind} {name!r} is already registered (as {old[0]!r}); "
                             f"pass replace=True to replace it")
        self._entries[name] = (value, doc)
        return value

    def unregister(self, name: str) -> None:
        """Remove `name` (ValueError if it is not registered)."""
        self.get(name)
        del self._entries[name]

    def get(self, name: str) -> T:
        """The value registered as `name`; ValueError naming the known names."""
        if name not in self._entries:
            raise ValueError(f"unknown {self.kind} {name!r}; known: {sorted(self._entries)}")
        return self._entries[name][0]

    def doc(self, name: str) -> str:
        """The doc registered with `name` (whitespace joined to single spaces)."""
        self.get(name)
        return self._entries[name][1]

    def names(self) -> tuple[str, ...]:
        """The registered names, in registration order."""
        return tuple(self._entries)

    def table(self, indent: str = "") -> str:
        """Each name and its doc as a reStructuredText definition list (docstrings,
        ``--help``): ````name```` on one line, the doc indented below it."""
        return "\n".join(f"{indent}``{name}``\n{indent}    {doc}"
                         for name, (_, doc) in self._entries.items())

    def view(self, intro: str = "", outro: str = "") -> RegistryView:
        """A read-only `Mapping` of the names to their values, always current; its
        ``__doc__`` is `intro`, the `table` of every registered entry, then `outro`.

        Example:
          >>> r = Registry("greeting")
          >>> view = r.view("Greetings by name:")
          >>> _ = r.register("hello", "Hello!", "Says hello.")
          >>> dict(view), "``hello``" in view.__doc__
          ({'hello': 'Hello!'}, True)
          >>> view["bye"] = "Bye!"
          Traceback (most recent call last):
          TypeError: 'RegistryView' object does not support item assignment
        """
        return RegistryView(self, intro, outro)


class RegistryView(Mapping):
    # A read-only, always current Mapping view of a Registry (`Registry.view`). Its
    # ``__doc__`` is generated from the registry (a property), so the class keeps no
    # docstring of its own: ``help(cpt_jax.PRESETS)`` lists every entry, never stale.

    def __init__(self, registry: Registry, intro: str = "", outro: str = ""):
        self._registry = registry
        self._intro = intro
        self._outro = outro

    @property
    def __doc__(self) -> str:  # type: ignore[override]
        parts = [self._intro.strip(), self._registry.table(), self._outro.strip()]
        return "\n\n".join(p for p in parts if p) + "\n"

    def __getitem__(self, name: str):
        if name not in self._registry.names():
            raise KeyError(name)
        return self._registry.get(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._registry.names())

    def __len__(self) -> int:
        return len(self._registry.names())

    def __repr__(self) -> str:
        return f"<{self._registry.kind}s: {', '.join(self._registry.names())}>"


__all__ = ["NAME", "Registry", "RegistryView", "check_name"]
