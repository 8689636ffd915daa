"""A sweep read from the store: its plan run and its cells' runs (trained or skipped by it) as the accounting's cells,
each with the graphs it was first to compile and whether it was its worker's first.
"""

from __future__ import annotations

import time
from typing import Sequence

from mlflow.entities import Run
from mlflow.tracking import MlflowClient

from gaexp.task import CLASSIFY, headline_of
from gaexp.progress.account import Cell, Plan, plan_costs
from gaexp.progress.cost import graph_units, run_graphs, run_seconds
from gaexp.tags import (CELLS, CELLS_AT_ONCE, COSTS, EXPECTED_S, GRAPHS, HEARTBEAT, HOST, PLAN_ROLE, ROLE, SWEEP_ID,
                        filter_equals, in_sweep, is_training_run)
from gaexp.tracking import runs_in_sweep


def sweep_runs(client: MlflowClient, experiment_id: str, sweep_id: str) -> tuple[Run | None, list[Run]]:
    """The sweep's plan run (None if not recorded) and its cells' runs (trained or skipped by it)."""
    cells = [r for r in runs_in_sweep(client, [experiment_id], sweep_id) if is_training_run(r.data.tags)]
    plans = client.search_runs([experiment_id], f"{filter_equals(ROLE, PLAN_ROLE)} and {filter_equals(SWEEP_ID, sweep_id)}",
                               max_results=1)
    return (plans[0] if plans else None), cells


def plan_of(run: Run | None) -> Plan:
    if run is None:
        return Plan(None, None, None)
    tags = run.data.tags
    at_once = tags.get(CELLS_AT_ONCE, "")
    return Plan(int(tags[CELLS]), float(tags[EXPECTED_S]), int(at_once) if at_once.isdigit() else None,
                run.info.start_time / 1000, run.info.end_time / 1000 if run.info.end_time else None,
                float(tags.get(GRAPHS, 0)), plan_costs(tags.get(COSTS)))


def cell_of(client: MlflowClient, run: Run, sweep_id: str, now: float, new_graphs: float = 0.0, fresh: int = 0) -> Cell:
    info, tags, params = run.info, run.data.tags, run.data.params
    status = "SKIPPED" if in_sweep(tags) != sweep_id and info.status == "FINISHED" else info.status
    end = info.end_time / 1000 if info.end_time else now
    steps = int(params.get("train.num_iterations", 0))
    headline = headline_of(params.get("task.name", CLASSIFY)).metric.name  # valid_acc, or a language model's valid_loss
    step, acc = steps, run.data.metrics.get(f"final_{headline}")
    if status in ("RUNNING", "FAILED", "KILLED"):  # where it is, or stopped: its latest evaluation
        history = client.get_metric_history(info.run_id, headline)
        step, acc = (history[-1].step, history[-1].value) if history else (0, None)
    beat = float(tags.get(HEARTBEAT, info.start_time / 1000))
    expected = run_seconds(tags, params) if "train.num_iterations" in params else 0.0
    return Cell(info.run_name, status, expected, max(0.0, end - info.start_time / 1000), step, steps, acc,
                now - beat, new_graphs, fresh, headline)


def cells_of(client: MlflowClient, runs: Sequence[Run], sweep_id: str, now: float) -> list[Cell]:
    """The runs as cells, by start time, each credited with the graphs no run that started before it
    compiled (a skipped run's count as compiled: they were, by its sweep) and whether it was the first its
    worker process ran (tag gaexp.host)."""
    return [cell_of(client, run, sweep_id, now, graphs, fresh) for run, graphs, fresh in firsts(runs, sweep_id)]


def firsts(runs: Sequence[Run], sweep_id: str) -> list[tuple[Run, float, int]]:
    """Pure: the runs by start time, each with its new graphs and 1 if first of its worker (see cells_of)."""
    seen: set[tuple[str, ...]] = set()
    hosts: set[str] = set()
    out = []
    for run in sorted(runs, key=lambda r: r.info.start_time):
        graphs = run_graphs(run.data.tags) - seen
        seen |= graphs
        host = run.data.tags.get(HOST)  # none: a run recorded before gaexp tagged it, not counted as a first
        fresh = int(host is not None and host not in hosts)
        hosts.add(host)
        skipped = in_sweep(run.data.tags) != sweep_id
        out.append((run, 0.0 if skipped else graph_units(graphs), 0 if skipped else fresh))
    return out


def read(client: MlflowClient, experiment_id: str, sweep_id: str, now: float | None = None) -> tuple[Plan, list[Cell]]:
    now = time.time() if now is None else now
    plan_run, runs = sweep_runs(client, experiment_id, sweep_id)
    return plan_of(plan_run), cells_of(client, runs, sweep_id, now)
