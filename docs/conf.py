"""Sphinx configuration: the guides (docs/*.md, MyST) and the API reference.

Build (warnings are errors, as in CI)::

    pip install -e ".[docs]"
    sphinx-build -W --keep-going -b html docs docs/_build/html

The API pages are written from each module's ``__all__`` by ``docs/apigen.py``
before every build (``docs/api/`` is generated, not kept in git).
"""
import inspect
import os
import sys

DOCS = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(DOCS))  # the checkout's cpt_jax
sys.path.insert(0, DOCS)
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import apigen  # noqa: E402

import cpt_jax  # noqa: E402

project = "cpt_jax"
author = "the cpt_jax authors"
copyright = "the cpt_jax authors, Apache-2.0"  # noqa: A001 - Sphinx's name
release = cpt_jax.__version__
version = release

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",
    "myst_parser",
]
source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "_templates", "README.md"]
templates_path = ["_templates"]

# autodoc / autosummary: one page per public name (apigen.py), signatures in the page.
autosummary_generate = True
autosummary_imported_members = True
autodoc_default_options = {"members": False}
autodoc_typehints = "signature"
autodoc_member_order = "bysource"
autodoc_inherit_docstrings = False
autoclass_content = "class"
# The project's docstrings are Google style (Args/Returns/Raises/Example).
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_ivar = True
napoleon_use_rtype = False
# `name` in a docstring is a reference to a Python object.
default_role = "py:obj"

myst_heading_anchors = 3

html_theme = "alabaster"
html_title = f"cpt_jax {release}"


ALIASES: dict[str, str] = {}
"""``{cpt_jax.NAME: where it is documented}`` (`apigen.aliases`), filled at build."""

BUILTIN_DOCS = {inspect.getdoc(t) for t in (dict, list, tuple, set, frozenset, str, int,
                                            float, bool, bytes, type(None))}


def _write_api_pages(app, config):
    ALIASES.update(apigen.aliases(apigen.write_api_pages(DOCS)))


def _resolve_alias(app, env, node, contnode):
    """A reference to a re-export (``cpt_jax.AffineInt``) resolves to the page where
    the object is documented (``cpt_jax.formats.AffineInt``)."""
    target = ALIASES.get(node.get("reftarget", ""))
    if node.get("refdomain") != "py" or target is None:
        return None
    return env.get_domain("py").resolve_xref(env, node["refdoc"], app.builder,
                                             node["reftype"], target, node, contnode)


def _drop_builtin_docstring(app, what, name, obj, options, lines):
    """A constant without its own text does not show its type's docstring (dict's)."""
    if "\n".join(lines).strip() in BUILTIN_DOCS:
        lines[:] = []


def setup(app):
    app.connect("missing-reference", _resolve_alias)
    app.connect("autodoc-process-docstring", _drop_builtin_docstring)
    # before Sphinx lists the source files (a fresh checkout has no docs/api/ yet) and
    # autosummary reads them for the names to generate
    app.connect("config-inited", _write_api_pages)
