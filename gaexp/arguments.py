"""What every console script asks the same way: the store (`--tracking-uri`, by default the one a sweep in this
folder writes), the experiment and the sweep; and the one line for a store that is not there or is damaged."""

from __future__ import annotations

import argparse
import contextlib
import sqlite3
import sys
from pathlib import Path
from typing import Iterator
from urllib.parse import quote

STORE_FORMS = "sqlite:///ABSOLUTE/PATH.db or http(s)://HOST:PORT"
# An SQLite store up to this size is checked whole before it is read: PRAGMA quick_check reads every page, at
# about 200 MB/s (2026-12-03, 2-core machine: a 2,400-run store of 66 MB in 0.37 s, a 100,000-run one of 2.7 GB
# in 13 s). A larger one has its header and schema read only; damage deeper in it shows when MLflow reads the
# page, and `store_errors` turns it into the same one line.
FULL_CHECK_BYTES = 64 * 2**20


def positive_ints(text: str, valid: str) -> tuple[int, ...]:
    """Comma-separated positive integers, for argparse: refused in one line saying what is valid."""
    try:
        values = tuple(int(s) for s in text.split(","))
    except ValueError:
        values = ()
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}; valid: {valid}")
    return values


def default_store() -> str:
    """The store a sweep started in this folder writes (paths.outputs=outputs), as an absolute SQLite URI."""
    return "sqlite:///" + str(Path("outputs/mlflow.db").resolve())


def add_store_arguments(parser: argparse.ArgumentParser, experiment: str = "gaexp", sweep: str | None = None,
                        sweep_help: str = "", flag: str = "--tracking-uri", required: bool = False) -> None:
    """`flag` (the store; default: `default_store()` unless required), `--experiment` and, with `sweep_help`,
    `--sweep` (default `sweep`)."""
    if required:
        parser.add_argument(flag, required=True, type=unmasked, help=f"MLflow store: {STORE_FORMS}")
    else:
        parser.add_argument(flag, default=default_store(), type=unmasked,
                            help=f"MLflow store: {STORE_FORMS} (default: %(default)s)")
    parser.add_argument("--experiment", default=experiment, help="experiment name (default: %(default)s)")
    if sweep_help:
        parser.add_argument("--sweep", default=sweep, help=f"{sweep_help} (default: %(default)s)")


def unmasked(uri: str) -> str:
    """A store as gaexp prints it in a hint (`http://user:***@host`) made to connect: its masked password left
    out, which the MLflow client then takes from MLFLOW_TRACKING_PASSWORD."""
    from gaexp.redact import reconnectable

    return reconnectable(uri)


def store_file(uri: str) -> Path | None:
    """The database file of an SQLite store (None: a store of another kind)."""
    return Path(uri.removeprefix("sqlite:///")) if uri.startswith("sqlite:///") else None


def require_store(uri: str) -> None:
    """Exit with one line for a store given as a path, not a URI (MLflow would read it as its retired file
    store, in a traceback), an SQLite store with no file (MLflow would make an empty one there) or one SQLite
    cannot read (`store_damage`)."""
    if "://" not in uri:
        hint = f" (this file's: sqlite:///{Path(uri).resolve()})" if Path(uri).is_file() else ""
        sys.exit(f"error: {uri!r} is not a store's URI; valid: {STORE_FORMS}{hint}")
    path = store_file(uri)
    if path is None:
        return
    if not path.is_file():
        sys.exit(f"error: no MLflow store at {uri}")
    cause = store_damage(path)
    if cause is not None:
        sys.exit(unreadable(path, cause))


def unreadable(path: Path, cause: str) -> str:
    return f"error: the MLflow store {path} cannot be read: {cause}"


def store_damage(path: Path, full_check_bytes: int | None = None) -> str | None:
    """SQLite's own words for what is wrong with the database file, or None. Opened read-only (nothing is
    written), its schema read, which a zeroed header ('file is not a database') or a truncated file
    ('database disk image is malformed') fails, and MLflow's `runs` table looked for (an emptied file has
    none, and MLflow would write a new store into it); then, up to `full_check_bytes` (default
    FULL_CHECK_BYTES), every page read (PRAGMA quick_check). A file SQLite cannot tell about now (locked by a
    writer, say) is left to MLflow."""
    limit = FULL_CHECK_BYTES if full_check_bytes is None else full_check_bytes
    try:
        with contextlib.closing(sqlite3.connect(f"file:{quote(str(path.resolve()))}?mode=ro", uri=True,
                                                timeout=5)) as db:
            tables = {name for (name,) in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
            if "runs" not in tables:
                return "no MLflow tables in it (an emptied file, or another program's database)"
            if path.stat().st_size > limit:
                return None
            problems = [line for row in db.execute("PRAGMA quick_check(1)") for line in row[0].splitlines()
                        if not line.startswith("*** ")]
    except sqlite3.OperationalError:  # busy, locked, cannot open: no damage SQLite can name; MLflow says what it finds
        return None
    except sqlite3.DatabaseError as e:
        return str(e)
    if problems == ["ok"]:
        return None
    return "database disk image is malformed (PRAGMA quick_check: " + "; ".join(problems) + ")"


def sqlite_error(error: BaseException | None) -> sqlite3.Error | None:
    """The SQLite error that `error` is or was raised from (MLflow and SQLAlchemy raise theirs from it)."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, sqlite3.Error):
            return error
        seen.add(id(error))
        error = error.__cause__
    return None


@contextlib.contextmanager
def store_errors(uri: str) -> Iterator[None]:
    """Exit with one line naming the store's file and SQLite's cause when the block fails on an SQLite error:
    damage that `require_store` did not read (a page of a large store), a store locked too long."""
    try:
        yield
    except Exception as e:
        found, path = sqlite_error(e), store_file(uri)
        if found is None or path is None:
            raise
        sys.exit(unreadable(path, str(found)))
