"""Benchmark: how close a finished sweep's ETA was to the truth, from its runs in the store.

`python -m gaexp.tools.eta_replay --tracking-uri sqlite:///ABS/mlflow.db [--sweep ID]` rebuilds, at the moment
each cell of the sweep ended, what the store held then (the cells started by that moment, running or
ended, from their runs' start and end times) and gives it to the ETA's own accounting
(`progress.snapshot`); the truth is the time from that moment to the end of the sweep's plan run (every
launch returned). The plan's work is costed from the runs' configs as the sweeper costs it now, so an older
sweep shows what today's model would have said. A table row per ended cell, then the largest error from the first ended cell on, and from
the first cell on whose truth is over `--floor-s`, counted within 25% and within 25% or one poll (10 s, what
the terminal's ETA can be behind).
The figures, at 20, 300 and 3,600 steps: docs/results.md, "The ETA".
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from typing import Sequence

from mlflow.entities import Run
from mlflow.tracking import MlflowClient

from gaexp import arguments, progress
from hydra_plugins.gaexp_optuna_sweeper.tally import duration
from gaexp.redact import mask
from gaexp.tags import in_sweep


@dataclass(frozen=True)
class Moment:
    cell: str  # the cell that ended
    at_s: float  # from the sweep's start
    eta_s: float
    truth_s: float

    @property
    def error(self) -> float:
        return (self.eta_s - self.truth_s) / self.truth_s if self.truth_s > 0 else 0.0


def cells_at(runs: Sequence[Run], t_ms: int, sweep_id: str) -> list[progress.Cell]:
    """Pure: the sweep's cells as the store held them at `t_ms` (a run started by then; ended by then or running)."""
    cells = []
    for run, graphs, fresh in progress.firsts([r for r in runs if r.info.start_time <= t_ms], sweep_id):
        tags, params = run.data.tags, run.data.params
        ended = run.info.end_time is not None and run.info.end_time <= t_ms
        status = ("SKIPPED" if in_sweep(tags) != sweep_id else run.info.status) if ended else "RUNNING"
        end = run.info.end_time if ended else t_ms
        cells.append(progress.Cell(run.info.run_name, status, progress.run_seconds(tags, params),
                                   (end - run.info.start_time) / 1000, new_graphs=graphs, fresh=fresh))
    return cells


def replay(plan_run: Run, runs: Sequence[Run]) -> list[Moment]:
    """The ETA the accounting gives at each cell's end, beside the truth."""
    recorded = progress.plan_of(plan_run)  # its cells and cells at once; the work as the sweeper costs it now
    sweep_id = in_sweep(plan_run.data.tags)
    costs = [(progress.run_seconds(run.data.tags, run.data.params), graphs)  # by start: the launch order
             for run, graphs, _ in progress.firsts(runs, sweep_id)]
    graphs = progress.graph_units(frozenset().union(*(progress.run_graphs(r.data.tags) for r in runs)))
    work = sum(e for e, _ in costs) + graphs * progress.GRAPH_S
    plan = progress.Plan(recorded.cells, work, recorded.cells_at_once, recorded.started, None, graphs, tuple(costs))
    end = plan_run.info.end_time
    moments, most_running = [], 0
    for run in sorted((r for r in runs if r.info.end_time), key=lambda r: r.info.end_time):
        t = run.info.end_time
        cells = cells_at(runs, t, sweep_id)
        most_running = max(most_running, sum(c.status == "RUNNING" for c in cells) + 1)  # it ran until now
        snap = progress.snapshot(plan, cells, now=t / 1000, observed_at_once=most_running)
        moments.append(Moment(run.info.run_name, (t - plan_run.info.start_time) / 1000, snap.eta_s or 0.0,
                              (end - t) / 1000))
    return moments


def table(moments: Sequence[Moment], floor_s: float, poll_s: float = 10.0) -> str:
    lines = ["| cell ended | at | ETA | truth | error |", "|---|---|---|---|---|"]
    for m in moments:
        lines.append(f"| {m.cell} | {duration(m.at_s)} | {duration(m.eta_s)} | "
                     f"{duration(m.truth_s)} | {100 * m.error:+.0f}% |")
    counted = [m for m in moments if m.truth_s > floor_s]
    worst = max(counted, key=lambda m: abs(m.error)) if counted else None
    if worst is not None:
        close = sum(abs(m.error) <= 0.25 or abs(m.eta_s - m.truth_s) <= poll_s for m in counted)
        lines.append(f"\nlargest error with more than {floor_s:.0f} s left: {100 * worst.error:+.0f}% "
                     f"(at {duration(worst.at_s)}, after {worst.cell}); "
                     f"{sum(abs(m.error) <= 0.25 for m in counted)}/{len(counted)} within 25%, "
                     f"{close}/{len(counted)} within 25% or {poll_s:.0f} s (a poll)")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m gaexp.tools.eta_replay", description=__doc__.splitlines()[0])
    arguments.add_store_arguments(parser, required=True, sweep_help="sweep id (none: the newest sweep with a plan run)")
    parser.add_argument("--floor-s", type=float, default=5.0,
                        help="leave out moments with fewer seconds left from the summary (default: %(default)s)")
    args = parser.parse_args(argv)
    arguments.require_store(args.tracking_uri)
    with arguments.store_errors(args.tracking_uri):
        client = MlflowClient(args.tracking_uri)
        experiment = client.get_experiment_by_name(args.experiment)
        if experiment is None:
            sys.exit(mask(f"error: no experiment {args.experiment!r} in {args.tracking_uri}"))
        ids = [args.sweep] if args.sweep else progress.sweeps_to_show(client, experiment.experiment_id, "all")[:1]
        for sweep_id in ids:
            plan_run, runs = progress.sweep_runs(client, experiment.experiment_id, sweep_id)
            if plan_run is None or plan_run.info.end_time is None:
                sys.exit(f"error: sweep {sweep_id!r} has no ended plan run; valid: a sweep of the gaexp sweeper that ended")
            print(f"sweep {sweep_id}: {len(runs)} cells, {duration((plan_run.info.end_time - plan_run.info.start_time) / 1000)}")
            print(table(replay(plan_run, runs), args.floor_s))


if __name__ == "__main__":
    main()
