"""``--help`` for a config file: every ``--config.FIELD``, its default and its comment.

The descriptions are the config files' own comments: ``p.max_bits = 8  # ...`` (and
the comment lines that continue it, aligned below) in ``experiments/configs/
default.py``, where ``p`` is ``config.precision`` (`get_precision_config`) and ``o``
``config.optimizer`` (`get_optimizer_config`), overridden by the comments of the
config file given (``config.precision.num_cycles = 32  # ...``).

Example:
  >>> text = config_help("experiments/configs/default.py")
  >>> print([line for line in text.splitlines() if "--config.num_steps=" in line][0])
    --config.num_steps=1500                   training steps (the schedules' length)
"""
from __future__ import annotations

import ast
import importlib.util
import io
import os
import tokenize

ROOTS = {"config": "", "p": "precision.", "o": "optimizer."}
"""Variable -> field prefix in the config files (`default.get_precision_config` builds
``config.precision`` as ``p``, `default.get_optimizer_config` ``config.optimizer`` as ``o``)."""

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_FILE = os.path.join(HERE, "configs", "default.py")


def _dotted(node) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name) or node.id not in ROOTS:
        return None
    return ROOTS[node.id] + ".".join(reversed(parts))


def field_comments(path: str) -> dict[str, str]:
    """``{field: one-line description}`` from the comments of assignments in `path`.

    Example:
      >>> field_comments(DEFAULT_FILE)["precision.grad_bits"]
      'backward (error) bits; >= 32 keeps errors in fp32'
    """
    source = open(path).read()
    comments: dict[int, tuple[int, str]] = {}
    code_lines: set[int] = set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = (tok.start[1], tok.string.lstrip("#").strip())
        elif tok.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT,
                              tokenize.DEDENT, tokenize.ENDMARKER):
            code_lines.add(tok.start[0])
    out = {}
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Assign) and len(node.targets) == 1):
            continue
        field = _dotted(node.targets[0])
        if field is None or not field:
            continue
        lines = range(node.lineno, node.end_lineno + 1)
        found = [comments[n] for n in lines if n in comments]
        if not found:
            continue
        column, text = found[0]
        parts = [text]
        n = node.end_lineno + 1
        while n in comments and n not in code_lines and comments[n][0] == column:
            parts.append(comments[n][1])  # an aligned comment line continues it
            n += 1
        out[field] = " ".join(p for p in parts if p)
    return out


def load_config(value: str):
    """The ConfigDict of ``--config=PATH[:ARG]`` (``get_config()`` or ``get_config(ARG)``)."""
    path, _, arg = value.partition(":")
    spec = importlib.util.spec_from_file_location("cpt_config_for_help", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return (module.get_config(arg) if arg else module.get_config()), path


def flatten(config, prefix: str = "") -> dict:
    """``{dotted field: value}`` of a ConfigDict (subtrees with fields are walked; an
    empty one is a field of its own)."""
    out = {}
    for key, value in config.items():
        if hasattr(value, "items") and len(value):
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[prefix + key] = value
    return out


def _show(value) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if hasattr(value, "items"):
        return "{}"
    if isinstance(value, str):
        return value if value and " " not in value else repr(value)
    return str(value)


def registry_help() -> dict[str, str]:
    """``{field: text}`` for the fields the registries own: the choices of the quantizer
    (presets) and the controller, and every registered controller's own fields. Read
    when ``--help`` runs (after the config file, which may import and so register a
    user's presets and controllers), appended to the field's comment.

    Example:
      >>> registry_help()["precision.quantizer"].startswith("one of: cpt | int8")
      True
    """
    from cpt_jax.controllers import controller_fields, controller_names
    from cpt_jax.quant_config import PRESETS

    out = {"precision.quantizer": "one of: " + " | ".join(PRESETS),
           "precision.controller": "one of: " + " | ".join(controller_names())}
    out.update({f"precision.{name}": field.help for name, field in controller_fields().items()})
    return out


def config_help(value: str) -> str:
    """The help text of the config ``--config=value``: one line per field."""
    config, path = load_config(value)
    comments = field_comments(DEFAULT_FILE)
    if os.path.abspath(path) != DEFAULT_FILE:
        comments.update(field_comments(path))
    for field, text in registry_help().items():
        comments[field] = f"{comments[field]}; {text}" if comments.get(field) else text
    lines = [f"config fields of --config={value} (override with --config.FIELD=VALUE; "
             f"the defaults shown are this config's):"]
    for field, default in flatten(config).items():
        left = f"  --config.{field}={_show(default)}"
        text = comments.get(field, "")
        if not text and field.startswith("model_kwargs."):
            text = f"keyword argument {field.split('.', 1)[1]!r} of the model"
        lines.append(f"{left:<43} {text}" if len(left) < 43 else f"{left}\n{'':<43} {text}")
    return "\n".join(lines)
