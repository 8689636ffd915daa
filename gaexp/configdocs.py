"""docs/configuration.md's tables of config keys and norm options, generated from the schema (gaexp/config/schema.py) by
`make docs`."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from omegaconf import MISSING

from gaexp.config import NORM_SCHEMAS, Config, schema_leaves


def _yaml_value(value: Any) -> str:
    if isinstance(value, list):
        return "[" + ", ".join(map(_yaml_value, value)) + "]"
    if value is None or isinstance(value, bool):
        return {None: "null", True: "true", False: "false"}[value]
    return str(value)


def markdown_table() -> str:
    """docs/configuration.md's tables of keys and of norm options, generated from the schema (`make docs`)."""
    def row(name: str, f: Any, kind: str) -> str:
        default = f.default_factory() if f.default is dataclasses.MISSING else f.default
        shown = "from the group" if default == MISSING else _yaml_value(default)
        valid = f.metadata["valid"][1] if f.metadata.get("valid") else ""
        return f"| `{name}` | `{shown}` | {kind} | {valid} | {f.metadata['help']} |"

    rows = ["| key | default | kind | valid | meaning |", "|---|---|---|---|---|"]
    rows += [row(name, f, "runtime" if is_runtime else "protocol") for name, f, is_runtime in schema_leaves(Config)]
    rows += ["", "Options of the norms that have some (protocol keys; `${...}` values follow the regime):", "",
             "| key | default | norm | valid | meaning |", "|---|---|---|---|---|"]
    for kind, schema in NORM_SCHEMAS.items():
        rows += [row(f"norm.{name}", f, f"`{kind}`") for name, f, _ in schema_leaves(schema) if name != "name"]
    return "\n".join(rows)


DOCS_MARKERS = ("<!-- config-keys:begin -->\n", "\n<!-- config-keys:end -->")


DOCS_PAGE = "docs/configuration.md"  # the page whose DOCS_MARKERS hold the tables (`make docs`)


def write_docs_table(path: str = DOCS_PAGE) -> None:
    """Replace the table between DOCS_MARKERS in `path` (by default DOCS_PAGE) by `markdown_table()`."""
    text = Path(path).read_text()
    begin, end = text.index(DOCS_MARKERS[0]) + len(DOCS_MARKERS[0]), text.index(DOCS_MARKERS[1])
    Path(path).write_text(text[:begin] + markdown_table() + text[end:])
