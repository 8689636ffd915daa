"""`gaexp-status`: the sweeps to show (active, latest, all, or ids), each one's cells and ETA, an Optuna search's
trials through the plugin's `tally`, and whether a sweep stopped with its process.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Sequence

from mlflow.entities import Run
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from gaexp import arguments
from gaexp.progress.account import Cell, Plan, shared_line, snapshot, summary_line
from gaexp.progress.live import running_lines
from gaexp.progress.sweep import cells_of, plan_of, sweep_runs
from gaexp.redact import mask, reconnectable
from gaexp.tags import (NORM, OPTUNA_STUDY, PLAN_ROLE, ROLE, SAME_AS, SWEEP_ID, filter_equals, filter_present, in_sweep,
                        is_training_run)
from gaexp.tracking import newest_run, recorded_process, search_all
from hydra_plugins.gaexp_optuna_sweeper import tally
from hydra_plugins.gaexp_optuna_sweeper.trials import open_storage


def sweeps_to_show(client: MlflowClient, experiment_id: str, wanted: str) -> list[str]:
    """`wanted`: 'active' (sweeps whose plan run is RUNNING or, for a search, a trial's run; else the newest
    sweep), 'latest' (the newest sweep), 'all', or ids, comma-separated."""
    if wanted not in SWEEP_CHOICES:
        return wanted.split(",")
    plan_filter = filter_equals(ROLE, PLAN_ROLE)
    if wanted == "all":
        plans = search_all(client, [experiment_id], plan_filter, ["attributes.start_time DESC"])
        runs = search_all(client, [experiment_id], filter_present(NORM), ["attributes.start_time DESC"])
        ids = dict.fromkeys([p.data.tags[SWEEP_ID] for p in plans] + [in_sweep(r.data.tags) for r in runs])
        return [i for i in ids if i]
    if wanted == "active":
        active = [p.data.tags[SWEEP_ID] for p in search_all(client, [experiment_id], plan_filter + " and "
                                                                 "attributes.status = 'RUNNING'")]
        searching = search_all(client, [experiment_id], f"attributes.status = 'RUNNING' and {filter_present(OPTUNA_STUDY)}")
        active += [r.data.tags[SWEEP_ID] for r in searching]  # an Optuna sweep records no plan run: its trials running
        if active:
            return list(dict.fromkeys(active))
    newest = newest_sweep(client, experiment_id)
    return [newest] if newest is not None else []


SWEEP_CHOICES = ("active", "latest", "all")


def newest_sweep(client: MlflowClient, experiment_id: str) -> str | None:
    """The sweep that started last, of any kind: that of the newer of the newest plan run (a grid sweep, or
    one that only resumed over finished cells) and the newest cell run (a grid's cell, a search's trial,
    which records no plan run, or a run of no sweep). None: neither."""
    found = [run for run in (newest_run(client, [experiment_id], filter_equals(ROLE, PLAN_ROLE)),
                             newest_run(client, [experiment_id], "", lambda run: is_training_run(run.data.tags)))
             if run is not None]
    return in_sweep(max(found, key=lambda run: run.info.start_time).data.tags) if found else None


def search_lines(runs: Sequence[Run], sweep_id: str, now: float) -> list[str] | None:
    """An Optuna sweep's trials, read from the study storage its runs name (param optuna.storage): counts
    by state, the best value so far, the ETA, as the sweeping terminal shows them. None: no Optuna sweep."""
    trial_runs = [r for r in runs if r.data.tags.get(OPTUNA_STUDY) and r.data.params.get("optuna.storage")]
    if not trial_runs:
        return None
    run = trial_runs[0]
    storage = run.data.params["optuna.storage"]  # as recorded: a password masked, for the driver to find
    try:
        counted = tally.sweep_tally(open_storage(reconnectable(storage)), run.data.tags[OPTUNA_STUDY], sweep_id, now)
    except Exception as e:  # noqa: BLE001 - a storage gone or unreachable: the runs still tell what they can
        return [f"  (its Optuna storage {storage} was not read: {type(e).__name__}: {mask(str(e))})"]
    if counted is None:
        return ["  (a sweep made before gaexp recorded its plan in the study: its runs so far)"]
    lines = ["  " + tally.summary_line(counted)]
    if len(counted.studies) > 1:
        lines += [f"    {s.name}: " + ", ".join(f"{s.counts[k]} {k}" for k in tally.STATES) + f"; {tally.best_text(s)}"
                  for s in counted.studies]
    return lines


RESUME = ("  stopped: the process that launched it is gone; run the same command again to resume it "
          "(its FINISHED cells are skipped, docs/reliability.md#resume)")


def sweep_stopped(plan_status: str, plan_heartbeat_age_s: float, cells: Sequence[Cell], stale_after_s: float) -> bool:
    """Pure: a grid sweep whose launching process is gone, from its plan run's status (KILLED on Ctrl-C or by the
    stale-run marking, FAILED) or, still RUNNING, its heartbeat (beaten every minute while it shows progress)
    older than `stale_after_s` with no cell running with a younger one. Nothing more of it runs: no ETA."""
    if plan_status in ("KILLED", "FAILED"):
        return True
    alive = [c for c in cells if c.status == "RUNNING" and (c.heartbeat_age_s or 0.0) <= stale_after_s]
    return plan_status == "RUNNING" and plan_heartbeat_age_s > stale_after_s and not alive


def status_text(client: MlflowClient, experiment_id: str, sweep_id: str, stale_after_s: float = 3600,
                now: float | None = None) -> tuple[str, bool]:
    """The sweep's status block, and whether it is still going (its plan run RUNNING; a search: a trial's run)."""
    now = time.time() if now is None else now
    plan_run, runs = sweep_runs(client, experiment_id, sweep_id)
    if plan_run is None and not runs:
        raise ValueError(f"no sweep {sweep_id!r} in this experiment; valid: "
                         f"{', '.join(SWEEP_CHOICES)}, or sweep ids, comma-separated")
    plan, cells = plan_of(plan_run), cells_of(client, runs, sweep_id, now)
    if plan.started is None and cells:  # no plan recorded: the sweep started with its first cell
        plan = Plan(None, None, None, min(now - c.elapsed_s for c in cells))
    stopped = plan_run is not None and sweep_stopped(plan_run.info.status, now - recorded_process(plan_run)[2], cells,
                                                     stale_after_s)
    snap = snapshot(plan, cells, now=now, stopped=stopped)
    search = None if plan_run is not None else search_lines(runs, sweep_id, now)
    state = (f" ({plan_run.info.status})" if plan_run is not None else " (Optuna search)" if search is not None
             else " (no plan recorded: cells so far)")
    shared = sum(SAME_AS in run.data.tags for run in runs)
    lines = [f"sweep {sweep_id}{state}", *(search or ["  " + summary_line(snap)]),
             *(["  " + shared_line(shared, len(cells))] if shared else []), *([RESUME] if stopped else []),
             *running_lines(cells, stale_after_s)]
    ended = ("FAILED",) if search is not None else ("FAILED", "KILLED")  # a search's KILLED: pruned, counted above
    for c in sorted((c for c in cells if c.status in ended), key=lambda c: c.name):
        lines.append(f"  {c.name:<20} {c.status} after step {c.step}/{c.steps}")
    if search is not None:
        return "\n".join(lines), any(c.status == "RUNNING" for c in cells)
    return "\n".join(lines), plan_run is not None and plan_run.info.status == "RUNNING" and not stopped


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="gaexp-status", description=(
        "Where gaexp sweeps stand, read from the tracking store: cells by state, the running ones, the ETA."))
    arguments.add_store_arguments(parser, sweep="active", sweep_help="'active' (sweeps still running, else the newest), "
                                                               "'latest' (the newest sweep, grid or search), 'all', "
                                                               "or sweep ids, comma-separated")
    parser.add_argument("--watch", type=float, default=0, metavar="S", help="print again every S seconds until "
                        "no shown sweep is running (0: once; default: %(default)s)")
    parser.add_argument("--stale-after-s", type=float, default=3600,
                        help="flag RUNNING cells without a heartbeat this long (default: %(default)s)")
    args = parser.parse_args(argv)
    arguments.require_store(args.tracking_uri)
    if not args.tracking_uri.startswith(("sqlite:///", "http://", "https://")):
        sys.exit(f"error: --tracking-uri {args.tracking_uri!r}; valid: {arguments.STORE_FORMS}")
    if args.watch < 0:
        sys.exit(f"error: --watch {args.watch}; valid: 0 (once) or a number of seconds > 0")
    try:
        with arguments.store_errors(args.tracking_uri):
            show(MlflowClient(args.tracking_uri), args.experiment, args.sweep, args.watch, args.stale_after_s)
    except (MlflowException, ValueError) as e:
        sys.exit(f"error: {e}")


def show(client: MlflowClient, experiment_name: str, sweep: str, watch: float, stale_after_s: float) -> None:
    """gaexp-status's blocks, printed once, or every `watch` s until no shown sweep is running."""
    experiment = client.get_experiment_by_name(experiment_name)
    if experiment is None:
        names = [e.name for e in client.search_experiments()]
        sys.exit(f"error: no experiment {experiment_name!r} in {mask(client.tracking_uri)}; there: {names}")
    while True:
        shown = sweeps_to_show(client, experiment.experiment_id, sweep)
        if not shown:
            sys.exit(f"error: experiment {experiment_name!r} has no gaexp sweep yet")
        blocks = [status_text(client, experiment.experiment_id, s, stale_after_s) for s in shown]
        print("\n\n".join(text for text, _ in blocks), flush=True)
        if not watch or not any(running for _, running in blocks):
            return
        time.sleep(watch)
        print()


if __name__ == "__main__":
    main()
