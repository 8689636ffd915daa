"""Where a grid sweep's wall time went, from what the MLflow store recorded: `python -m gaexp.breakdown`.

The sweep's plan run (tag gaexp.role = sweep) bounds it: from its start to its end, each of its workers (a
process that ran cells, tag gaexp.host = host:pid) had that much time, and the table shares those
worker-seconds out. Per cell run, from its tags, its summary metrics and its valid_acc history's timestamps:

    cell_start ─ setup ─ run start ─ logging ─ train start ─ training and evaluations ─ last evaluation ─ logging ─ run end
                                               (last valid_acc timestamp − wall_seconds)

training is what samples_per_sec measured (evaluations excluded), evaluation the rest of wall_seconds, less the
first evaluation's excess over the others (`first_eval_excess`: a compiled cell's graph is built there). Per
worker process, its start (gaexp.process_start, clock ticks since boot: known where the run ran on this host
in this boot) to its first cell's start is its start-up and imports; after its last run ends, the tail. What is
left is the time between cells: the launcher, a cell's process waiting for its next one.

Pure functions (`run_parts`, `shares`, `compile_temperature`, `table`) apart from reading the store
(`read_sweep`), so the arithmetic is tested on numbers given by hand.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from mlflow.entities import Run
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from gaexp import arguments, metrics
from gaexp.redact import mask
from gaexp.tags import (BATCH_SIZE, CELL_START, COMPILED, DATASET, HOST, MODEL, NORM, NUM_ACCUM, PLAN_ROLE, PROCESS_START,
                        REPLICAS, ROLE, SWEEP_ID, filter_equals, in_sweep, is_training_run)
from gaexp.tracking import newest_run, runs_in_sweep, search_all

# The table's rows: (key, label). `shares` gives each its worker-seconds.
PARTS = (("process", "process start and imports"),
         ("setup", "setup: checks, data, model"),
         ("before", "logging before training"),
         ("training", "training"),
         ("evaluation", "evaluation"),
         ("compilation", "compilation (first evaluation's excess)"),
         ("after", "logging after training (summary, model)"),
         ("unfinished", "runs that did not finish (failed, killed, running)"),
         ("between", "between cells (launcher, idle)"),
         ("tail", "tail (a worker with nothing left)"))
LABELS = dict(PARTS)
RUN_PARTS = ("setup", "before", "training", "evaluation", "compilation", "after", "unfinished")


class BreakdownError(Exception):
    """What the user asked for is not in the store: one line says what is."""


@dataclass(frozen=True)
class RunTimes:
    """One cell's run of the sweep, in epoch seconds."""

    worker: str  # host:pid of the process that ran it
    start: float
    end: float
    cell_start: float | None = None  # None: a run recorded before gaexp tagged it
    process_start: float | None = None  # its worker process's start; None: not known (another host, boot, tag)
    wall_seconds: float | None = None  # first step to last evaluation; None: the run did not finish
    training: float | None = None  # seconds of training steps (`training_seconds`)
    evaluations: tuple[tuple[int, float], ...] = ()  # (step, epoch seconds) of each evaluation, by step
    graph: tuple[str, ...] | None = None  # what it compiled: (model, dataset, norm, compiled); None: compile off
    name: str = ""


@dataclass(frozen=True)
class Breakdown:
    wall: float  # seconds from the plan's start to its end
    workers: int  # worker processes at once
    cells: int
    seconds: dict[str, float | None]  # each of PARTS' keys: worker-seconds; None: not known
    unknown: dict[str, str]  # a part's key: why it is not known, or known only in part

    @property
    def total(self) -> float:
        return self.wall * self.workers

    def percent(self, part: str) -> float | None:
        value = self.seconds[part]
        return None if value is None or self.total <= 0 else 100 * value / self.total


def training_seconds(num_iterations: int, batch_size: int, num_accum: int, samples_per_sec: float) -> float:
    """The seconds of training steps: samples_per_sec counts the training samples over training alone."""
    return num_iterations * batch_size * num_accum / samples_per_sec


def first_eval_excess(train_start: float, evaluations: Sequence[tuple[int, float]], training: float) -> float:
    """The first evaluation's seconds beyond a usual one's (compilation, where a graph is compiled, and any
    first-call warm-up), at least 0. The gaps between train start and the evaluations' timestamps each hold
    the steps since the previous evaluation and one evaluation: less those steps at the run's mean seconds a
    step, each gap leaves its evaluation's seconds (and the previous one's logging); the first's minus the
    median of the others. Equal gaps of eval_period steps make it the first gap minus the others' median.
    0 with fewer than two evaluations (nothing to compare with)."""
    if len(evaluations) < 2:
        return 0.0
    per_step = training / evaluations[-1][0]
    times = [(0, train_start), *evaluations]
    spent = [(t - t0) - (s - s0) * per_step for (s0, t0), (s, t) in zip(times, times[1:])]
    return max(0.0, spent[0] - statistics.median(spent[1:]))


def run_parts(run: RunTimes) -> dict[str, float | None]:
    """The run's seconds by part (RUN_PARTS); together they make its cell_start to its end (its start to its
    end where cell_start is None: setup None). A run that did not finish is all `unfinished`."""
    parts: dict[str, float | None] = dict.fromkeys(RUN_PARTS, 0.0)
    parts["setup"] = None if run.cell_start is None else run.start - run.cell_start
    if run.wall_seconds is None or run.training is None or not run.evaluations:
        parts["unfinished"] = run.end - run.start
        return parts
    last = run.evaluations[-1][1]
    train_start = last - run.wall_seconds
    evaluating = run.wall_seconds - run.training
    compilation = min(first_eval_excess(train_start, run.evaluations, run.training), max(0.0, evaluating))
    parts.update(before=train_start - run.start, training=run.training, evaluation=evaluating - compilation,
                 compilation=compilation, after=run.end - last)
    return parts


def processes(runs: Sequence[RunTimes]) -> dict[str, list[RunTimes]]:
    """The runs of each worker process, by start."""
    by: dict[str, list[RunTimes]] = {}
    for run in sorted(runs, key=lambda r: r.start):
        by.setdefault(run.worker, []).append(run)
    return by


def first_moment(runs: Sequence[RunTimes]) -> float:
    """When a worker's first cell began (its run's start where its cell_start is not recorded)."""
    return runs[0].cell_start if runs[0].cell_start is not None else runs[0].start


def workers_at_once(runs: Sequence[RunTimes], plan_start: float) -> int:
    """The most worker processes alive at once, each from its start (or its first cell's, not before the
    plan's start) to its last run's end: a launcher that replaced a worker had one at a time in its place."""
    events = []
    for own in processes(runs).values():
        first = first_moment(own)
        begin = max(plan_start, first if own[0].process_start is None else min(own[0].process_start, first))
        events += [(begin, 1), (max(r.end for r in own), -1)]
    alive = most = 0
    for _, change in sorted(events):  # at equal times an end (-1) comes first: one process replacing another
        alive += change
        most = max(most, alive)
    return max(most, 1)


def shares(runs: Sequence[RunTimes], plan_start: float, plan_end: float, launcher: str | None = None) -> Breakdown:
    """Pure: the sweep's worker-seconds, (plan_end - plan_start) x `workers_at_once`, by part. `launcher`: the
    host:pid of the process that launched the cells (the plan run's), which runs them itself under the basic
    launcher: its start is no worker's. The time outside the runs is each worker's start (to its first cell's
    start), the tail (plan_end less each of the last `workers` processes' last run end) and, left, the time
    between cells. A part no run recorded is None, and its seconds fall between cells."""
    wall = plan_end - plan_start
    by = processes(runs)
    workers = workers_at_once(runs, plan_start)
    seconds: dict[str, float | None] = dict.fromkeys(LABELS, 0.0)
    unknown: dict[str, str] = {}
    per_run = [run_parts(r) for r in runs]
    for part in RUN_PARTS:
        known = [p[part] for p in per_run if p[part] is not None]
        seconds[part] = sum(known) if known else None
    if missing := sum(p["setup"] is None for p in per_run):
        unknown["setup"] = (f"{missing} of {len(runs)} runs recorded no {CELL_START} (made before gaexp did): "
                            "their setup is counted between cells")
    starts = []
    for worker, own in by.items():
        if worker == launcher:
            starts.append(0.0)  # the launching process itself: its start was before the sweep's
        elif own[0].cell_start is not None and own[0].process_start is not None:
            starts.append(max(0.0, own[0].cell_start - max(own[0].process_start, plan_start)))
    seconds["process"] = sum(starts) if starts else None
    if len(starts) < len(by):
        unknown["process"] = (f"{len(by) - len(starts)} of {len(by)} workers' start not known (the process's start "
                              f"from another host or boot, or its first cell's {CELL_START} not recorded): "
                              "counted between cells")
    unknown = {part: unknown[part] for part in LABELS if part in unknown}  # in the table's order
    last_ends = sorted((max(r.end for r in own) for own in by.values()), reverse=True)[:workers]
    seconds["tail"] = sum(plan_end - end for end in last_ends)
    between = wall * workers - sum(v for k, v in seconds.items() if k != "between" and v is not None)
    seconds["between"] = 0.0 if abs(between) < 1e-6 else between  # float rounding of a sum that is 0
    if not any(p["unfinished"] for p in per_run):
        seconds.pop("unfinished")
    return Breakdown(wall, workers, len(runs), seconds, unknown)


def compile_temperature(runs: Sequence[RunTimes]) -> tuple[list[float], list[float]]:
    """Pure: the compilation excess (`run_parts`) of each compiled graph's first cell (cold: its graph built
    for the first time in the sweep; Inductor's disk cache may hold it from an earlier one) and of the later
    cells with the same graph (warm), finished runs by start."""
    cold: list[float] = []
    warm: list[float] = []
    seen: set[tuple[str, ...]] = set()
    for run in sorted(runs, key=lambda r: r.start):
        if run.graph is None or run.wall_seconds is None:
            continue
        excess = run_parts(run)["compilation"]
        (warm if run.graph in seen else cold).append(excess)
        seen.add(run.graph)
    return cold, warm


def duration(seconds: float) -> str:
    seconds = round(seconds)
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m" if seconds >= 3600 else f"{seconds // 60}m{seconds % 60:02d}s"


def table(sweep_id: str, b: Breakdown, runs: Sequence[RunTimes], notes: Sequence[str] = ()) -> str:
    """The report: the sweep, its wall time, cells and workers, the Markdown table, cold against warm
    compilation and the notes."""
    lines = [f"sweep {sweep_id}: wall {duration(b.wall)} ({b.wall:.1f} s), {b.cells} cells, {b.workers} workers "
             f"({b.total:.1f} worker-seconds)", "",
             "| part | worker-seconds | share |", "|---|---:|---:|"]
    for part, label in PARTS:
        if part not in b.seconds:
            continue
        value, share = b.seconds[part], b.percent(part)
        flag = " *" if part in b.unknown else ""
        lines.append(f"| {label}{flag} | {'n/a' if value is None else f'{value:.1f}'} | "
                     f"{'n/a' if share is None else f'{share:.1f}%'} |")
    lines.append(f"| total | {b.total:.1f} | 100.0% |")
    cold, warm = compile_temperature(runs)
    if cold:
        mean_warm = f"{statistics.mean(warm):.1f} s mean over {len(warm)} later cells" if warm else "no later cells"
        lines += ["", f"compilation, cold against warm: {statistics.mean(cold):.1f} s mean over the first cell of "
                      f"each of {len(cold)} graphs (norm, compiled), {mean_warm} with the same graph"]
    else:
        lines += ["", "compilation, cold against warm: no cell compiled (compile=off)"]
    lines += [f"* {LABELS[part]}: {why}" for part, why in b.unknown.items()]
    lines += list(notes)
    return "\n".join(lines)


# --- reading the store ------------------------------------------------------------------------------------

def boot_time(stat: Path = Path("/proc/stat")) -> float | None:
    """This boot's start in epoch seconds (btime), or None without /proc."""
    try:
        return next(float(line.split()[1]) for line in stat.read_text().splitlines() if line.startswith("btime "))
    except (OSError, StopIteration, IndexError, ValueError):
        return None


def process_epoch(ticks: str | None, host: str, run_start: float, this_host: str, btime: float | None,
                  clk_tck: int) -> float | None:
    """Pure: a process's start in epoch seconds from its start in clock ticks since boot (PROCESS_START),
    where its run ran on this host in this boot; None otherwise."""
    if ticks is None or not ticks.isdigit() or host != this_host or btime is None or run_start < btime:
        return None
    return btime + int(ticks) / clk_tck


def plan_run(client: MlflowClient, experiment_id: str, experiment_name: str, sweep: str) -> Run:
    """The plan run of `sweep` ('latest': the newest), or BreakdownError naming the sweeps there."""
    plans = filter_equals(ROLE, PLAN_ROLE)
    if sweep == "latest":
        found = newest_run(client, [experiment_id], plans)
    elif "'" not in sweep:
        found = next(iter(client.search_runs([experiment_id], f"{plans} and {filter_equals(SWEEP_ID, sweep)}",
                                             max_results=1)), None)
    else:
        found = None
    if found is not None:
        return found
    there = sorted({in_sweep(p.data.tags) for p in search_all(client, [experiment_id], plans)} - {""})
    if not there:
        raise BreakdownError(f"experiment {experiment_name!r} has no grid sweep (no plan run, tag {ROLE} = "
                             f"{PLAN_ROLE}): an Optuna search or single runs record none")
    raise BreakdownError(f"no grid sweep {sweep!r} in experiment {experiment_name!r}; there: {', '.join(there)}")


def run_times(client: MlflowClient, run: Run, now: float, this_host: str, btime: float | None,
              clk_tck: int) -> RunTimes:
    """The run's times: those of a FINISHED run in full, of another (FAILED, KILLED, still RUNNING: to `now`)
    its start and end."""
    info, tags, params, values = run.info, run.data.tags, run.data.params, run.data.metrics
    start, end = info.start_time / 1000, (info.end_time / 1000 if info.end_time else now)
    worker = tags.get(HOST, "?:?")
    host = worker.rpartition(":")[0]
    cell_start = float(tags[CELL_START]) if CELL_START in tags else None
    times = RunTimes(worker, start, end, cell_start, process_epoch(tags.get(PROCESS_START), host, start, this_host,
                                                                   btime, clk_tck), name=info.run_name)
    needed = (metrics.WALL_SECONDS.name, metrics.SAMPLES_PER_SEC.name)
    if info.status != "FINISHED" or not all(k in values for k in needed) or "train.num_iterations" not in params:
        return times
    history = sorted((m.step, m.timestamp / 1000) for m in client.get_metric_history(info.run_id, metrics.VALID_ACC.name))
    training = training_seconds(int(params["train.num_iterations"]), int(tags[BATCH_SIZE]),  # over all replicas
                                int(tags[NUM_ACCUM]) * int(tags.get(REPLICAS, 1)), values[metrics.SAMPLES_PER_SEC.name])
    compiled = tags.get(COMPILED, "off")
    graph = None if compiled == "off" else (tags.get(MODEL, ""), tags.get(DATASET, ""), tags[NORM], compiled)
    return RunTimes(worker, start, end, cell_start, times.process_start, values[metrics.WALL_SECONDS.name], training,
                    tuple(history), graph, info.run_name)


def read_sweep(client: MlflowClient, experiment_name: str, sweep: str, now: float | None = None,
               this_host: str | None = None, btime: float | None = None,
               clk_tck: int | None = None) -> tuple[str, float, float, str | None, list[RunTimes], list[str]]:
    """The sweep's id, its plan's start and end (epoch seconds; a plan still running: `now`), the launching
    process (host:pid), the runs it trained (not those it skipped as FINISHED by an earlier sweep) and notes."""
    now = time.time() if now is None else now
    this_host = socket.gethostname() if this_host is None else this_host
    btime = boot_time() if btime is None else btime
    clk_tck = os.sysconf("SC_CLK_TCK") if clk_tck is None else clk_tck
    experiment = client.get_experiment_by_name(experiment_name)
    if experiment is None:
        names = [e.name for e in client.search_experiments()]
        raise BreakdownError(f"no experiment {experiment_name!r} in {mask(client.tracking_uri)}; there: {names}")
    plan = plan_run(client, experiment.experiment_id, experiment_name, sweep)
    sweep_id = plan.data.tags[SWEEP_ID]
    notes = []
    end = plan.info.end_time / 1000 if plan.info.end_time else now
    if not plan.info.end_time:
        notes.append(f"note: the sweep is still running ({plan.info.status}): its time up to now")
    found = [r for r in runs_in_sweep(client, [experiment.experiment_id], sweep_id) if is_training_run(r.data.tags)]
    trained = [r for r in found if in_sweep(r.data.tags) == sweep_id]
    if len(found) > len(trained):
        notes.append(f"note: {len(found) - len(trained)} cells were skipped, FINISHED by an earlier sweep: not counted")
    runs = [run_times(client, r, now, this_host, btime, clk_tck) for r in trained]
    return sweep_id, plan.info.start_time / 1000, end, plan.data.tags.get(HOST), runs, notes


def report(client: MlflowClient, experiment_name: str, sweep: str) -> str:
    sweep_id, start, end, launcher, runs, notes = read_sweep(client, experiment_name, sweep)
    if not runs:
        raise BreakdownError(f"sweep {sweep_id} trained no cell (each was skipped, or none started): nothing to share out")
    return table(sweep_id, shares(runs, start, end, launcher), runs, notes)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m gaexp.breakdown", description=(
        "Where a grid sweep's wall time went, read from the tracking store: the worker-seconds of process "
        "start, setup, logging, training, evaluation, compilation, the time between cells and the tail."))
    arguments.add_store_arguments(parser, sweep="latest", sweep_help="'latest' (the newest grid sweep) or a sweep id")
    args = parser.parse_args(argv)
    arguments.require_store(args.tracking_uri)
    try:
        with arguments.store_errors(args.tracking_uri):
            text = report(MlflowClient(args.tracking_uri), args.experiment, args.sweep)
    except (BreakdownError, MlflowException) as e:
        sys.exit(f"error: {e}")
    print(text, flush=True)


if __name__ == "__main__":
    main()
