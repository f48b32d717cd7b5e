"""Rules: which config a product gets, by a regex on its path.

``rules`` are ``(regex, target)`` pairs, matched with `re.search` against a
product's path, first match wins; a target is a `QuantConfig` or a preset name
(``"mxfp8"``), or None / ``"full_precision"`` to keep the product in fp32. `LAST_PRODUCT` matches the last
product in call order (the classifier, whatever it is called).
"""
from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from cpt_jax.quant_config import FULL_PRECISION, QuantConfig, get_preset

Rule = tuple[str, Any]


def as_config(target: Any, where: str = "config") -> Any:
    """A config from a preset name (`cpt_jax.get_preset`: ``"mxfp8"``), or the value as
    given (a `QuantConfig`, None); ``"full_precision"`` is None (fp32).

    Raises ValueError naming `where` and the known presets for an unknown name.

    Example:
      >>> as_config("mxfp8") == cpt_jax.get_preset("mxfp8"), as_config("full_precision")
      (True, None)
    """
    if not isinstance(target, str):
        return target
    if target == FULL_PRECISION:
        return None
    try:
        return get_preset(target)
    except ValueError as exc:
        raise ValueError(f"{where}: {exc} (or {FULL_PRECISION!r} for fp32)") from None


def normalize_rules(rules) -> tuple:
    """``((regex, QuantConfig | None), ...)`` from a list or dict of rules, validated.

    A target ``"full_precision"`` becomes None, a preset name its `QuantConfig`
    (`as_config`). Raises ValueError naming the bad rule.
    """
    if rules is None:
        return ()
    if isinstance(rules, dict):
        rules = tuple(rules.items())
    out = []
    for i, rule in enumerate(rules):
        if not (isinstance(rule, (tuple, list)) and len(rule) == 2 and isinstance(rule[0], str)):
            raise ValueError(f"rules[{i}] must be a (regex, target) pair, got {rule!r}")
        pattern, target = rule
        try:
            re.compile(pattern)
        except re.error as exc:
            raise ValueError(f"rules[{i}] has an invalid regex {pattern!r}: {exc}") from exc
        target = as_config(target, f"rules[{i}] target")
        if target is not None and not isinstance(target, QuantConfig):
            raise ValueError(f"rules[{i}] target must be a QuantConfig, a preset name, None or "
                             f"{FULL_PRECISION!r}, got {target!r}")
        out.append((pattern, target))
    return tuple(out)


LAST_PRODUCT = "<last product>"
"""Rule pattern matching the last product in call order (the head, whatever its name)."""


def resolve_config(path: str, rules: Sequence[Rule], default: QuantConfig | None,
                   last: str | None = None):
    """The config of the product at `path`: the first rule whose regex finds it (`re.search`).

    The pattern `LAST_PRODUCT` matches the product whose path is `last` (the last
    product of the model's call, found by a trace).

    Example:
      >>> resolve_config("head", [("head", None)], cpt_jax.CPT_CONFIG) is None
      True
      >>> resolve_config("Dense_1", [(LAST_PRODUCT, None)], cpt_jax.CPT_CONFIG,
      ...                last="Dense_1") is None
      True
    """
    for pattern, target in rules:
        if pattern == LAST_PRODUCT:
            if path == last:
                return target
        elif re.search(pattern, path):
            return target
    return default


def rule_matches(pattern: str, paths: Sequence[str], last: str | None = None) -> bool:
    """Whether a rule's pattern matches any of `paths` (`LAST_PRODUCT`: `last` in them)."""
    if pattern == LAST_PRODUCT:
        return last is not None and last in paths
    return any(re.search(pattern, p) for p in paths)


__all__ = ["LAST_PRODUCT", "Rule", "as_config", "normalize_rules", "resolve_config", "rule_matches"]
