"""What every console script asks the same way: the store (`--tracking-uri`, by default the one a sweep in this
folder writes), the experiment and the sweep; and the one line for a store that is not there."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

STORE_FORMS = "sqlite:///ABSOLUTE/PATH.db or http(s)://HOST:PORT"


def default_store() -> str:
    """The store a sweep started in this folder writes (paths.outputs=outputs), as an absolute SQLite URI."""
    return "sqlite:///" + str(Path("outputs/mlflow.db").resolve())


def add_store_arguments(parser: argparse.ArgumentParser, experiment: str = "gaexp", sweep: str | None = None,
                        sweep_help: str = "", flag: str = "--tracking-uri", required: bool = False) -> None:
    """`flag` (the store; default: `default_store()` unless required), `--experiment` and, with `sweep_help`,
    `--sweep` (default `sweep`)."""
    if required:
        parser.add_argument(flag, required=True, help=f"MLflow store: {STORE_FORMS}")
    else:
        parser.add_argument(flag, default=default_store(), help=f"MLflow store: {STORE_FORMS} (default: %(default)s)")
    parser.add_argument("--experiment", default=experiment, help="experiment name (default: %(default)s)")
    if sweep_help:
        parser.add_argument("--sweep", default=sweep, help=f"{sweep_help} (default: %(default)s)")


def require_store(uri: str) -> None:
    """Exit with one line for an SQLite store with no file (MLflow would make an empty one there)."""
    if uri.startswith("sqlite:///") and not Path(uri.removeprefix("sqlite:///")).is_file():
        sys.exit(f"error: no MLflow store at {uri}")
