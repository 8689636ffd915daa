"""Import paths in the config (`model.target`, `norm.target`) resolved to callables, refused in one line.

A target is `module:callable` (or `module.callable`); the callable must accept the keyword arguments gaexp
calls it with. Nothing is imported until a config names it.
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
from typing import Any, Callable, Sequence


class TargetError(ValueError):
    """A target that cannot be imported or called as gaexp calls it: one line naming what was expected."""


def load(target: str, key: str, keywords: Sequence[str] = (), positional: int | None = 0) -> Callable[..., Any]:
    """The callable `target` names, as the config key `key` (e.g. model.target) gave it; it must accept
    `positional` positional arguments, then `keywords` by keyword (positional=None: its caller checks how it
    can be called)."""
    module_name, _, attr = target.partition(":") if ":" in target else target.rpartition(".")
    if not module_name or not attr:
        raise TargetError(f"{key}={target!r}; valid: an import path module:callable, e.g. mypkg.nets:build")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise TargetError(f"{key}={target!r}: cannot import {module_name!r} ({e})") from None
    made = getattr(module, attr, None)
    if not callable(made):
        raise TargetError(f"{key}={target!r}: {module_name} has no callable {attr!r}")
    if positional is None:
        return made
    try:
        signature = inspect.signature(made)
    except ValueError:  # a builtin without a signature: the call itself will tell
        return made
    try:
        signature.bind(*([None] * positional), **{name: None for name in keywords})
    except TypeError as e:
        counted = ["a positional argument"] if positional == 1 else [f"{positional} positional arguments"] * bool(positional)
        wanted = ", ".join([*counted, *(f"{k}=" for k in keywords)])
        if not wanted:  # called with nothing: say what it still needs
            raise TargetError(f"{key}={target!r}: {attr}{signature} must be callable with no arguments ({e})") from None
        raise TargetError(f"{key}={target!r}: {attr}{signature} must take {wanted}") from None
    return made


def import_from_cwd() -> None:
    """What `python -m` gives and a console script does not: the current folder first on the import path, so
    `gaexp model=custom model.target=mynets:build` and `gaexp-check mynets:build` find a mynets.py beside the
    user (joblib's workers inherit the path)."""
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
