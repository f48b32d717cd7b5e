"""The API reference's pages, written from the package's own name lists.

`write_api_pages` writes ``docs/api/<module>.rst`` for `cpt_jax` and each of its
public subpackages and modules (a name without a leading underscore): the module's
docstring, then an autosummary table with ``:toctree:`` over its public names, so
Sphinx's autosummary writes one page per symbol (``docs/api/generated/<module>.<name>``).
The public names are the module's ``__all__``; a module without one contributes the
functions, classes and UPPER_CASE constants it defines itself. A module named in an
``__all__`` (``cpt_jax.schedules`` in ``cpt_jax.__all__``) gets its own page instead.
Nothing is kept by hand: a name added to an ``__all__`` gets its page at the next build.

``docs/conf.py`` calls `write_api_pages` before every build; ``python docs/apigen.py
--check docs/_build/html`` checks that every name of ``cpt_jax.__all__`` has a page in a
built site (CI runs it after ``sphinx-build``).
"""
from __future__ import annotations

import argparse
import ast
import importlib
import inspect
import os
import pkgutil
import sys
import types

PACKAGE = "cpt_jax"
API_DIR = "api"
GENERATED = "generated"
SKIP = ("conftest",)  # the doctests' fixtures, not API


def public_modules(package: str = PACKAGE) -> list[str]:
    """`package` and its public first-level subpackages and modules, sorted."""
    root = importlib.import_module(package)
    names = [package]
    for info in pkgutil.iter_modules(root.__path__):
        if not info.name.startswith("_") and info.name not in SKIP:
            names.append(f"{package}.{info.name}")
    return names


def public_names(module: types.ModuleType) -> list[str]:
    """The module's ``__all__``, or (without one) the public functions, classes and
    UPPER_CASE constants it defines itself."""
    listed = getattr(module, "__all__", None)
    if listed is not None:
        return list(listed)
    out = []
    for name, value in vars(module).items():
        if name.startswith("_") or isinstance(value, types.ModuleType):
            continue
        defined_here = getattr(value, "__module__", None) == module.__name__
        if (inspect.isfunction(value) or inspect.isclass(value)) and defined_here:
            out.append(name)
        elif name.isupper() and not callable(value):
            out.append(name)
    return out


Page = tuple[list[str], dict[str, str], list[str]]
"""One module's page: ``(symbols documented here, {name: its page elsewhere}, modules)``."""


def _key(value) -> object:
    """What makes two exported names one object: its identity, except for values
    Python may share between unrelated names (numbers, strings, the empty tuple)."""
    if value is None or isinstance(value, (bool, int, float, str, bytes)):
        return None
    if isinstance(value, tuple) and not value:
        return None
    return id(value)


def _documents(module_name: str, name: str) -> bool:
    """Whether `module_name`'s source documents the module-level attribute `name`:
    a string right after its assignment or a ``#:`` comment before it (where autodoc
    reads a constant's text)."""
    module = importlib.import_module(module_name)
    try:
        source = inspect.getsource(module)
    except (OSError, TypeError):
        return False
    lines = source.splitlines()
    body = ast.parse(source).body
    for stmt, after in zip(body, body[1:] + [None]):
        targets = (stmt.targets if isinstance(stmt, ast.Assign)
                   else [stmt.target] if isinstance(stmt, ast.AnnAssign) else [])
        if not any(isinstance(t, ast.Name) and t.id == name for t in targets):
            continue
        documented_after = (isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                            and isinstance(after.value.value, str))
        comment_before = stmt.lineno > 1 and lines[stmt.lineno - 2].strip().startswith("#:")
        if documented_after or comment_before:
            return True
    return False


def _home(value, name: str, candidates: list[str]) -> str:
    """The page that documents `value` among the modules exporting it (subpackages
    first): for a constant the one whose source documents it; else the deepest one
    its ``__module__`` is in; else the first."""
    if not (inspect.isclass(value) or inspect.isroutine(value)):
        for module in candidates:
            if _documents(module, name):
                return module
    defined = getattr(value, "__module__", None) or ""
    inside = [m for m in candidates if defined == m or defined.startswith(m + ".")]
    return max(inside, key=len) if inside else candidates[0]


def _exports(package: str) -> dict[str, list[tuple[str, object]]]:
    """``{module: [(name, value), ...]}`` of every public module (recursively through
    the modules an ``__all__`` names), subpackages before the package itself."""
    out: dict[str, list[tuple[str, object]]] = {}
    todo = public_modules(package)[1:] + [package]
    while todo:
        name = todo.pop(0)
        if name in out:
            continue
        module = importlib.import_module(name)
        out[name] = [(item, getattr(module, item)) for item in public_names(module)]
        todo += [v.__name__ for _, v in out[name] if isinstance(v, types.ModuleType)]
    return out


def plan(package: str = PACKAGE) -> dict[str, Page]:
    """``{module: (symbols, links, submodules)}``: every public module's page. Each
    exported object is documented once, on its home page (`_home`); the other modules
    exporting it link there (``links``: ``{name: home.name}``)."""
    exports = _exports(package)
    exporters: dict[object, list[str]] = {}
    for module, items in exports.items():
        for _, value in items:
            key = _key(value)
            if key is not None and not isinstance(value, types.ModuleType):
                exporters.setdefault(key, []).append(module)
    pages: dict[str, Page] = {}
    for module, items in exports.items():
        symbols, links, submodules = [], {}, []
        for name, value in items:
            key = _key(value)
            if isinstance(value, types.ModuleType):
                submodules.append(value.__name__)
                continue
            home = module if key is None else _home(value, name, exporters[key])
            if home == module:
                symbols.append(name)
            else:
                links[name] = f"{home}.{_home_name(exports[home], value, name)}"
        pages[module] = (symbols, links, submodules)
    return pages


def _home_name(items: list[tuple[str, object]], value, name: str) -> str:
    """`value`'s name on its home page (re-exports may rename it)."""
    for item, other in items:
        if other is value and item == name:
            return item
    return next(item for item, other in items if other is value)


def module_page(name: str, page: Page) -> str:
    """The reST of one module's page."""
    symbols, links, submodules = page
    lines = [name, "=" * len(name), "", f".. automodule:: {name}", "   :no-members:", "",
             f".. currentmodule:: {name}", ""]
    if submodules:
        lines += ["Modules", "-------", "", ".. toctree::", "   :maxdepth: 1", ""]
        lines += [f"   {sub}" for sub in submodules] + [""]
    if symbols:
        lines += ["Names", "-----", "", ".. autosummary::", f"   :toctree: {GENERATED}",
                  "   :nosignatures:", ""]
        lines += [f"   {symbol}" for symbol in symbols] + [""]
    if links:
        lines += ["Also exported here", "------------------", "",
                  f"Documented where they are defined; ``{name}.NAME`` is the same object.",
                  "", ".. autosummary::", "   :nosignatures:", ""]
        # autosummary wants names inside the page's module relative to it
        lines += [f"   ~{target.removeprefix(name + '.')}" for target in links.values()] + [""]
    return "\n".join(lines)


def index_page(pages: dict[str, Page]) -> str:
    """``api/index``: the package's page and one page per public subpackage."""
    lines = ["API reference", "=============", "",
             f"One page per public name of ``{PACKAGE}`` and of each public subpackage "
             "(its ``__all__``), written by ``docs/apigen.py`` at every build.", "",
             ".. toctree::", "   :maxdepth: 1", ""]
    top = sorted((m for m in pages if m.count(".") <= 1), key=lambda m: (m != PACKAGE, m))
    return "\n".join(lines + [f"   {m}" for m in top] + [""])


def aliases(pages: dict[str, Page]) -> dict[str, str]:
    """``{module.name: home.name}`` of every re-export, what a cross-reference to
    ``cpt_jax.NAME`` resolves to (``docs/conf.py``'s missing-reference handler)."""
    return {f"{module}.{name}": target for module, (_, links, _) in pages.items()
            for name, target in links.items()}


def _write_if_changed(path: str, text: str) -> None:
    if os.path.isfile(path):
        with open(path) as f:
            if f.read() == text:
                return
    with open(path, "w") as f:
        f.write(text)


def write_api_pages(docs_dir: str, package: str = PACKAGE) -> dict[str, Page]:
    """Write ``docs_dir/api/*.rst`` (pages of modules gone are removed); return the
    `plan`."""
    pages = plan(package)
    out = os.path.join(docs_dir, API_DIR)
    os.makedirs(out, exist_ok=True)
    wanted = {f"{m}.rst" for m in pages} | {"index.rst"}
    for stale in set(os.listdir(out)) - wanted:
        if stale.endswith(".rst"):
            os.remove(os.path.join(out, stale))
    for name, page in pages.items():
        _write_if_changed(os.path.join(out, f"{name}.rst"), module_page(name, page))
    _write_if_changed(os.path.join(out, "index.rst"), index_page(pages))
    return pages


def expected_pages(package: str = PACKAGE) -> dict[str, str]:
    """``{"cpt_jax.NAME": html path relative to the site}`` for every name of the
    package's ``__all__``: its object's page (where it is documented, `plan`), or a
    module's own page."""
    root = importlib.import_module(package)
    pages = plan(package)
    links = aliases(pages)
    out = {}
    for name in root.__all__:
        value = getattr(root, name)
        full = f"{package}.{name}"
        if isinstance(value, types.ModuleType):
            out[full] = f"{API_DIR}/{value.__name__}.html"
        else:
            out[full] = f"{API_DIR}/{GENERATED}/{links.get(full, full)}.html"
    return out


def missing_pages(site: str, package: str = PACKAGE) -> list[str]:
    """The names of ``__all__`` whose page is not in the built `site`."""
    return sorted(name for name, page in expected_pages(package).items()
                  if not os.path.isfile(os.path.join(site, page)))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", metavar="SITE", help="a built html site to check")
    args = parser.parse_args(argv)
    if args.check:
        missing = missing_pages(args.check)
        if missing:
            print(f"{len(missing)} names of {PACKAGE}.__all__ have no page in {args.check}: "
                  + ", ".join(missing), file=sys.stderr)
            return 1
        print(f"every name of {PACKAGE}.__all__ ({len(expected_pages())}) has a page")
        return 0
    pages = write_api_pages(os.path.dirname(os.path.abspath(__file__)))
    print(f"{len(pages)} module pages, {sum(len(p[0]) for p in pages.values())} symbol pages")
    return 0


if __name__ == "__main__":
    sys.exit(main())
