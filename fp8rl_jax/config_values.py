"""Reading and checking one value of the run configuration (``fp8rl_jax.config``): each check raises
``ConfigError`` naming the key, the value and what is allowed; ``config_list`` reads a list key as a tuple."""

from __future__ import annotations

import math
from collections.abc import Sequence

import ml_collections

from fp8rl_jax.errors import ConfigError


def check(cond: bool, key: str, value, allowed: str) -> None:
    if not cond:
        raise ConfigError(f"config.{key}={value!r} is invalid; allowed: {allowed}")


def one_of(c, key: str, options: Sequence[str]) -> None:
    value = get(c, key)
    check(value in options, key, value, " | ".join(options))


def get(c, key: str):
    node = c
    for part in key.split("."):
        node = node[part]
    return node


def positive(c, key: str, allow_zero: bool = False) -> None:
    value = get(c, key)
    ok = isinstance(value, (int, float)) and (value >= 0 if allow_zero else value > 0)
    check(ok, key, value, ">= 0" if allow_zero else "> 0")


def config_list(value, kind: type = str) -> tuple:
    """A list key's value as a tuple of ``kind`` (str, int or float); ValueError on an item that is not one.

    Accepts what config files write (``("gsm8k_answer", "gsm8k_format")``, ``(11, 28)``) and what the command line
    gives: ml_collections parses ``--config.key=...`` of a tuple field with ``ast.literal_eval``, so
    ``--config.reward.weights=1,0.5`` arrives as ``(1, 0.5)`` but ``--config.reward.fns=a,b`` (not a Python
    literal) as ``("a,b",)``. Strings are therefore split on commas; blank items are dropped. A plain string
    (``"11,28"``) is read the same way.
    """
    parts = []
    for item in value if isinstance(value, (tuple, list)) else (value,):
        parts.extend(item.split(",") if isinstance(item, str) else [item])
    out = []
    for part in parts:
        if isinstance(part, str):
            if not part.strip():
                continue
            out.append(kind(part.strip()))  # int("1.5"), float("x") raise ValueError
        elif kind is str or isinstance(part, bool) or not isinstance(part, int if kind is int else (int, float)):
            raise ValueError(f"{part!r} is not a {kind.__name__}")
        else:
            out.append(kind(part))
    return tuple(out)


def listed(c, key: str, kind: type, allowed: str) -> tuple:
    value = get(c, key)
    try:
        return config_list(value, kind)
    except ValueError:
        raise ConfigError(f"config.{key}={value!r} is invalid; allowed: {allowed}") from None


def all_finite(node: ml_collections.ConfigDict, prefix: str = "") -> None:
    """Every float in the config (lists included) is finite: no key means inf or NaN."""
    for name, value in node.items():
        if isinstance(value, ml_collections.ConfigDict):
            all_finite(value, f"{prefix}{name}.")
            continue
        for v in value if isinstance(value, (tuple, list)) else (value,):
            check(not isinstance(v, float) or math.isfinite(v), f"{prefix}{name}", value, "finite numbers")
