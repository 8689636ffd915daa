"""A new SQLite MLflow store made from a template, for the whole suite: MLflow makes a new store by running its
schema's migrations (alembic: about 2 s of CPU each time), and the suite makes hundreds of stores, in its own
processes and in the commands it starts. `make(path)` runs MLflow's own `_initialize_tables` once, into a
template file; `install(path)` then has MLflow initialize each new SQLite store by copying that template into it
(sqlite3's backup API), in this process, and, through `sitecustomize` (GAEXP_TEST_STORE_TEMPLATE, set by
conftest), in every Python process the tests start, once MLflow loads. The schema is MLflow's, made by the same
migrations; MLflow itself then adds the Default experiment as in any new store. Other databases migrate as usual.
"""

from __future__ import annotations

import importlib.abc
import sqlite3
import sys
from typing import Any, Callable

UTILS = "mlflow.store.db.utils"  # where MLflow's tracking store calls _initialize_tables(engine)


def make(path: str) -> None:
    """The template: an empty SQLite store, migrated to MLflow's current schema by MLflow itself."""
    import sqlalchemy
    from mlflow.store.db import utils

    engine = sqlalchemy.create_engine(f"sqlite:///{path}")
    try:
        utils._initialize_tables(engine)
    finally:
        engine.dispose()


def seeded(original: Callable[[Any], None], template: str) -> Callable[[Any], None]:
    """`_initialize_tables` that copies the template into a new, empty SQLite file store, else does as
    `original`."""
    def initialize(engine: Any) -> None:
        database = engine.url.database if engine.url.get_backend_name() == "sqlite" else None
        if not database or database == ":memory:":
            return original(engine)
        target = engine.raw_connection()
        try:
            if target.driver_connection.execute("SELECT count(*) FROM sqlite_master").fetchone()[0]:
                return original(engine)  # some tables there (a damaged store, an old schema): MLflow's own way
            source = sqlite3.connect(template)
            try:
                source.backup(target.driver_connection)
            finally:
                source.close()
            target.commit()
        finally:
            target.close()
    initialize.seeded = True  # type: ignore[attr-defined]
    return initialize


def patch(module: Any, template: str) -> None:
    if not getattr(module._initialize_tables, "seeded", False):
        module._initialize_tables = seeded(module._initialize_tables, template)


class _OnImport(importlib.abc.MetaPathFinder):
    """Patches MLflow's db utilities as soon as they are imported (a process that never imports MLflow pays
    nothing)."""

    def __init__(self, template: str) -> None:
        self.template = template

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != UTILS:
            return None
        sys.meta_path.remove(self)
        import importlib.util

        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        exec_module, template = spec.loader.exec_module, self.template

        def exec_and_patch(module: Any) -> None:
            exec_module(module)
            patch(module, template)
        spec.loader.exec_module = exec_and_patch  # type: ignore[method-assign]
        return spec


def install(template: str) -> None:
    """New SQLite stores from `template` in this process, now if MLflow's db utilities are loaded, else on load."""
    if UTILS in sys.modules:
        patch(sys.modules[UTILS], template)
    else:
        sys.meta_path.insert(0, _OnImport(template))
