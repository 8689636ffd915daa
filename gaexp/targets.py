"""Import paths in the config (`model.target`, `norm.target`) resolved to callables, refused in one line.

A target is `module:callable` (or `module.callable`); the callable must accept the keyword arguments gaexp
calls it with. Nothing is imported until a config names it. Whatever the user's module raises while it is
imported (a SyntaxError too) is bad input, said in one line naming the file and line (`raised`).
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
import sysconfig
import traceback
from functools import lru_cache
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
    except Exception as e:  # noqa: BLE001 - whatever the user's module raises on import, a SyntaxError too
        if isinstance(e, ImportError) and located(e, module_name.partition(".")[0]) is None:  # not there at all
            raise TargetError(f"{key}={target!r}: cannot import {module_name!r} ({e})") from None
        raise TargetError(f"{key}={target!r}: cannot import {module_name!r}: {raised(e, target)}") from None
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


def accepts(made: Callable[..., Any], keywords: Sequence[str] = (), positional: int = 0) -> bool:
    """Whether `made` can be called with `positional` positional arguments and then `keywords` by keyword (True
    for a builtin without a signature: the call itself will tell)."""
    try:
        signature = inspect.signature(made)
    except (ValueError, TypeError):
        return True
    try:
        signature.bind(*([None] * positional), **{name: None for name in keywords})
    except TypeError:
        return False
    return True


def signature_of(made: Callable[..., Any]) -> str:
    """`build(norm_layer, in_channels, num_classes)`, as a message names a callable."""
    name = getattr(made, "__name__", type(made).__name__)
    try:
        return f"{name}{inspect.signature(made)}"
    except (ValueError, TypeError):
        return name


@lru_cache(maxsize=1)
def _library_dirs() -> tuple[str, ...]:
    """Where code that is not the user's lives: Python's own library, the installed packages, gaexp."""
    paths = sysconfig.get_paths()
    dirs = {paths[name] for name in ("stdlib", "platstdlib", "purelib", "platlib") if name in paths}
    dirs.add(os.path.dirname(os.path.abspath(__file__)))
    return tuple(os.path.realpath(d) + os.sep for d in dirs)


def _shown(filename: str) -> str:
    """A file as the user knows it: relative to the current folder when inside it."""
    path = os.path.abspath(filename)
    relative = os.path.relpath(path, os.getcwd())
    return path if relative.startswith(os.pardir) else relative


def located(e: BaseException, package: str = "") -> str | None:
    """Where in the user's code `e` arose, as `mynets.py, line 3`: a SyntaxError's own file and line, else the
    innermost frame of its traceback in a file outside Python's library, the installed packages and gaexp, or in
    `package` (the target's top package, wherever it is installed). None when there is none: the module named
    was not found, or the error is a library's own."""
    if isinstance(e, SyntaxError) and e.filename and not e.filename.startswith("<"):
        return f"{_shown(e.filename)}, line {e.lineno}"
    frames = [(frame.f_code.co_filename, line) for frame, line in traceback.walk_tb(e.__traceback__)
              if not frame.f_code.co_filename.startswith("<") and (
                  not os.path.realpath(frame.f_code.co_filename).startswith(_library_dirs())
                  or package and str(frame.f_globals.get("__name__", "")).partition(".")[0] == package)]
    return f"{_shown(frames[-1][0])}, line {frames[-1][1]}" if frames else None


def raised(e: BaseException, target: str = "") -> str:
    """An exception of the user's code in one line: `SyntaxError at mynets.py, line 3: '(' was never closed`
    (`located`, `target` the import path that named the code; without a place, its type and message)."""
    message = e.msg if isinstance(e, SyntaxError) and e.msg else str(e)
    message = message.strip().splitlines()[0] if message.strip() else ""
    where = located(e, target.partition(":")[0].partition(".")[0])
    return f"{type(e).__name__}{f' at {where}' if where else ''}{f': {message}' if message else ''}"


def import_from_cwd() -> None:
    """What `python -m` gives and a console script does not: the current folder first on the import path, so
    `gaexp model=custom model.target=mynets:build` and `gaexp-check mynets:build` find a mynets.py beside the
    user (joblib's workers inherit the path)."""
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
