"""Storage faults in one line: what a full, over-quota, read-only or failing disk, or an SQLite store locked beyond
its retries, raises wherever it surfaces (the MLflow store, its artifacts, Hydra's folders, the report), found in
an exception's chain and said as one line naming the path, the cause and what to do (`storage_fault`).

A cell that meets one raises it as `StorageFault` instead of failing alone (gaexp.app.sweep_cell), since no other
cell could record either: the sweep starts no new cell, and says how many finished and that the same command
resumes once there is room (hydra_plugins/gaexp_grid_sweeper/). Nothing already recorded is touched: SQLite
refuses the write whole, and a run that cannot be ended FAILED stays RUNNING until the next command marks it
KILLED (its process is gone). No MLflow or torch here.
"""

from __future__ import annotations

import errno
import logging
from urllib.parse import unquote, urlparse

RESUME = "then rerun the same command: finished cells are skipped"
CAUSES = {  # errno: (what, what to do)
    errno.ENOSPC: ("no space left on device", "free space there, or set paths.outputs (and mlflow.tracking_uri) to "
                                              "a larger disk"),
    errno.EDQUOT: ("disk quota exceeded", "free space within your quota there, or set paths.outputs (and "
                                          "mlflow.tracking_uri) to another disk"),
    errno.EROFS: ("read-only file system", "set paths.outputs (and mlflow.tracking_uri) to a writable folder"),
    errno.EIO: ("input/output error", "the disk failed a read or write: check it (dmesg, smartctl)"),
}
LOCKED = ("the SQLite store is locked beyond its retries", "another process holds it (a second sweep on another "
          "host, an open sqlite3 shell, a store on NFS): stop it, or use an MLflow server (docs/cluster.md)")
SQLITE = {  # SQLite's messages, as sqlite3.OperationalError says them, with the errno they mean
    "database or disk is full": errno.ENOSPC,
    "disk i/o error": errno.EIO,
    "attempt to write a readonly database": errno.EROFS,
}


class StorageFault(OSError):
    """A storage fault said in one line, `cause: todo; then rerun ...` (picklable: it crosses from a launcher's
    worker to the sweep, which puts its count of finished cells between the cause and what to do)."""

    def __init__(self, cause: str, todo: str) -> None:
        super().__init__(f"{cause}: {todo}; {RESUME}")
        self.cause, self.todo = cause, todo

    def __reduce__(self) -> tuple:
        return StorageFault, (self.cause, self.todo)

    def __str__(self) -> str:
        return f"{self.cause}: {self.todo}; {RESUME}"


def chain(e: BaseException) -> list[BaseException]:
    """`e` and the exceptions it was raised from or while handling, once each."""
    seen: list[BaseException] = []
    todo: list[BaseException | None] = [e]
    while todo:
        x = todo.pop(0)
        if x is None or any(x is s for s in seen):
            continue
        seen.append(x)
        todo += [x.__cause__, x.__context__]
    return seen


def store_path(tracking_uri: str | None) -> str | None:
    """The file of an SQLite tracking URI (sqlite:////abs/mlflow.db), else None."""
    if not tracking_uri or not tracking_uri.startswith("sqlite:"):
        return None
    path = unquote(urlparse(tracking_uri).path)
    return path[1:] if path.startswith("//") else path


def storage_fault(e: BaseException, tracking_uri: str | None = None,
                  outputs: str | None = None) -> StorageFault | None:
    """The storage fault in `e`'s chain as one line, `no space left on device at PATH: free space there ...;
    then rerun ...`, or None where there is none. SQLite's own errors name the store of `tracking_uri`; an
    OSError without a file name (a write to a file opened earlier) the folder `outputs`."""
    for x in chain(e):
        if isinstance(x, StorageFault):
            return x
        if isinstance(x, OSError) and x.errno in CAUSES:
            what, todo = CAUSES[x.errno]
            where = f" at {x.filename2 or x.filename}" if x.filename2 or x.filename else \
                f" under {outputs}" if outputs else ""
            return StorageFault(f"{what}{where}", todo)
    for x in chain(e):
        message = str(x).lower()
        code = next((c for text, c in SQLITE.items() if text in message), None)
        what, todo = (CAUSES[code] if code else LOCKED if "database is locked" in message else (None, None))
        if what:
            where = store_path(tracking_uri)
            return StorageFault(f"{what} at {where or 'the tracking store'}", todo)
    return None


def quiet_storage_noise() -> None:
    """What a full disk makes libraries print besides the one line: a traceback per log record a log file can no
    longer take (logging's `--- Logging error ---`), and MLflow's ERROR with the SQL of each refused write, before
    it raises the same error."""
    logging.raiseExceptions = False
    logging.getLogger("mlflow.store.db.utils").setLevel(logging.CRITICAL)
