"""How a key is declared once: its default, help and valid range (`key`, `node`, the `Rule`s), a value refused in one
line naming the valid ones (`require`), and the range checks a schema node runs when it is made (`Checked`).
"""

import dataclasses
import math
from dataclasses import field
from typing import Any, Callable, ClassVar, Iterator, Optional, Tuple

from omegaconf import MISSING


Rule = Tuple[Callable[[Any], bool], str]  # a range check: the test, and what is valid in words


def at_least(low: int) -> Rule:
    return (lambda v: v >= low), f"an integer >= {low}"


def number(low: float, high: Optional[float] = None, open_low: bool = False) -> Rule:
    """A finite number >= low (> low when open_low), and <= high if given."""
    def ok(v: float) -> bool:
        return math.isfinite(v) and (v > low if open_low else v >= low) and (high is None or v <= high)
    if high is not None:
        return ok, f"a number in {'(' if open_low else '['}{low:g}, {high:g}]"
    return ok, f"a finite number {'>' if open_low else '>='} {low}"


def one_of(*values: str) -> Rule:
    return (lambda v: v in values), ", ".join(values)


NOT_ADDED = object()  # `was` of the keys every recorded run already had


def key(default: Any, help: str, runtime: bool = False, valid: Optional[Rule] = None, was: Any = NOT_ADDED) -> Any:
    """A schema field: its default (a list is copied per instance), its one-line help, protocol or
    runtime, and its valid range (checked by `Checked.__post_init__`). A protocol key added after runs
    were recorded says what those runs had (`was`): while it has that value it stays out of the protocol
    key, so they still match."""
    metadata = {"help": help, "runtime": runtime, "valid": valid, "was": was}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=metadata)
    return field(default=default, metadata=metadata)


def node(schema: type, help: str, runtime: bool = False) -> Any:
    """A nested config node typed by `schema`."""
    return field(default_factory=schema, metadata={"help": help, "runtime": runtime})


def require(name: str, value: Any, ok: bool, valid: str) -> None:
    """The one form of every range error: the key, the value (a long one cut, with its length), what is valid."""
    if not ok:
        shown = repr(value)
        if len(shown) > 120:
            shown = f"{shown[:60]}... ({len(value) if isinstance(value, str) else len(shown):,} characters)"
        raise ValueError(f"{name}={shown}; valid: {valid}")


INT64 = (-2**63, 2**63 - 1)  # the integers torch, numpy and SQLite take: any integer key is one of them


def _ints(value: Any) -> Iterator[int]:
    """The integers of a value: itself, or the items of a list."""
    if type(value) is int:
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _ints(item)


class Checked:
    """A schema node whose fields' `valid` rules run when it becomes an object (`typed`); an integer of any of
    its fields, in a list too, must be an int64 (YAML and the command line give Python's unbounded ones)."""

    PREFIX: ClassVar[str] = ""  # the node's place in the config, for error messages

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if any(not INT64[0] <= i <= INT64[1] for i in _ints(value)):
                words = f.metadata["valid"][1] if f.metadata.get("valid") else "an integer"
                require(self.PREFIX + f.name, value, False, f"{words}, within int64 [-2**63, 2**63 - 1]")
            if f.metadata.get("valid") and value is not MISSING and value != MISSING:  # a group fills it in
                test, words = f.metadata["valid"]
                require(self.PREFIX + f.name, value, test(value), words)
