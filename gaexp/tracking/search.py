"""Run searches read to their last page (`search_all`), the newest run of a filter, and a sweep's runs as the store
finds them: those it ran (tag sweep_id) and those it resumed over (tag gaexp.sweeps).
"""

from __future__ import annotations

import gc
from contextlib import contextmanager
from typing import Callable, Iterator

from mlflow.entities import Run, ViewType
from mlflow.tracking import MlflowClient

from gaexp.tags import SWEEPS, SWEEP_ID, filter_equals, in_sweep


PAGE_SIZE = 1_000  # runs per search page (search_all follows the pages to the end)


def search_all(client: MlflowClient, experiment_ids: list[str], filter_string: str = "",
               order_by: list[str] | None = None, run_view_type: int = ViewType.ACTIVE_ONLY) -> list[Run]:
    """Every run the search matches: MLflow returns a page at a time (`PAGE_SIZE` runs); this follows its
    page tokens to the end, so no store is too large to be read whole. A run that moved between pages while
    they were read (a run started meanwhile shifts the order) is kept once."""
    runs: dict[str, Run] = {}
    token = None
    with bulk_read():
        while True:
            page = client.search_runs(experiment_ids, filter_string, run_view_type, PAGE_SIZE, order_by, token)
            runs.update((r.info.run_id, r) for r in page)
            token = page.token
            if not token:
                return list(runs.values())


@contextmanager
def bulk_read() -> Iterator[None]:
    """Python's cyclic garbage collector paused while a read builds many objects, none of them garbage:
    a search of thousands of runs allocates hundreds of thousands (a run's params and tags), and the
    collector's passes over them took 2 to 3 times the read itself (6,000 runs: 17-19 s, 6-7 s paused).
    Restored after, as it was."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def newest_run(client: MlflowClient, experiment_ids: list[str], filter_string: str = "",
               wanted: Callable[[Run], bool] = lambda run: True) -> Run | None:
    """The newest run (by start time) of the search that `wanted` keeps, read a page at a time until found."""
    token = None
    while True:
        size = min(10, PAGE_SIZE) if token is None else PAGE_SIZE  # the first page small: usually it is there
        page = client.search_runs(experiment_ids, filter_string, ViewType.ACTIVE_ONLY, size,
                                  ["attributes.start_time DESC"], token)
        found = next((r for r in page if wanted(r)), None)
        token = page.token
        if found is not None or not token:
            return found


def sweeps_of(run: Run) -> list[str]:
    tags = run.data.tags
    return tags[SWEEPS].split(",") if SWEEPS in tags else [in_sweep(tags)]


def runs_in_sweep(client: MlflowClient, experiment_ids: list[str], sweep_id: str, filter_string: str = "") -> list[Run]:
    """The runs a sweep ran or resumed over (`sweeps_of`), and that `filter_string` also matches: found by the
    store (tag sweep_id; tag SWEEPS for the runs it resumed over, which add_to_sweep appended it to),
    whatever else the store holds."""
    also = f" and {filter_string}" if filter_string else ""
    ran = filter_equals(SWEEP_ID, sweep_id)  # equality: an index lookup (index_tags)
    resumed = f"tags.`{SWEEPS}` LIKE '%,{sweep_id}%'"  # after a comma: only the runs it resumed over match
    found = {r.info.run_id: r for query in (ran, resumed) for r in search_all(client, experiment_ids, query + also)}
    return [r for r in found.values() if sweep_id in sweeps_of(r)]
