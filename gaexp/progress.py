"""A sweep's progress, read from the tracking store: cells by state, the work left, an ETA.

Every launcher's cells write their runs to the same store, so the launching terminal (`Live`, which the
gaexp sweeper runs around its launches) and any other shell (`gaexp-status`) see the same thing. The sweeper
records its plan as a run `sweep-<id>` (tags `gaexp.cells`, `gaexp.expected_s`, `gaexp.cells_at_once`).

Cells differ by 5x in work, so progress counts work, not cells: each cell's expected seconds on one core
(`expected_seconds`, a model of the grid measured in docs/results.md: training, evaluation and a cell's
fixed cost), plus a compilation for each graph the sweep compiles first (`graph_keys`: Inductor's
disk cache makes later cells' graphs cheap). The cells that finished correct both, each at its own scale
(`fit_rates`), so a sweep of 20-step cells, which is mostly compilation, gets the right ETA as a 3,600-step
one does.
"""

from __future__ import annotations

import argparse
import heapq
import logging
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Mapping, Sequence, TextIO

import numpy as np
from mlflow.entities import Run
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient
from tqdm import tqdm

from gaexp import cli, metrics
from gaexp.config import FP32
from gaexp.redact import mask, reconnectable
from gaexp.study import TEST_IMAGES
from gaexp.tags import (ACCUMULATE, BATCH_SIZE, CELLS, CELLS_AT_ONCE, COMPILED, COSTS, DATASET, DEVICE, EXPECTED_S, GRAPHS,
                        HEARTBEAT, HOST, MODEL, NORM, NUM_ACCUM, OPTUNA_STUDY, PLAN_ROLE, PRECISION, REPLICAS, ROLE, SWEEP_ID,
                        filter_equals, filter_present, in_sweep, is_training_run)
from gaexp.tracking import newest_run, recorded_process, runs_in_sweep, search_all
from hydra_plugins.gaexp_optuna_sweeper import tally as trials
from hydra_plugins.gaexp_optuna_sweeper.tally import duration
from hydra_plugins.gaexp_optuna_sweeper.trials import open_storage

# One core of the 2-core machine, compile=auto (the 60-cell grid and the ETA's figures, docs/results.md):
# a micro-batch of b trains forward and backward in MICRO_S * b**BATCH_EXPONENT s, Adam's step takes STEP_S,
# evaluation EVAL_IMAGE_S per image; a cell's run costs CELL_S more (its records, its model saved) and
# GAP_S passes between one cell's end and the next one's start on the same worker (its config, data and
# model made). An evaluation graph compiled with no cache costs GRAPH_S, a training graph (forward and
# backward) TRAIN_GRAPH graphs' worth. The cells that finished rescale these. accumulate=batched trains a step's
# b*k samples in one pass (MICRO_S * (b*k)**BATCH_EXPONENT) and draws its k micro-batches at DRAW_S each (the
# batched grid: 1375 samples/s at bs1a16 against 1583 at bs16a1, docs/results.md).
MICRO_S, BATCH_EXPONENT, STEP_S, EVAL_IMAGE_S, DRAW_S = 2.6e-3, 0.7, 1.8e-3, 2.5e-4, 1.0e-4
CELL_S, GAP_S, GRAPH_S, TRAIN_GRAPH = 1.0, 1.0, 9.0, 1.5
# A precision's training and evaluation against float32's with the same engine, on a CPU with bf16 instructions
# (docs/results.md, "The precision study", 2026-12-04): bf16 at float32's speed within the noise, bf16w-acc32 0.9x its
# cost (the study's cells beside bf16's), bf16w's loop 1.2x (its loop cells beside bf16's batched ones, in this
# model's units), fp16 (emulated on that CPU) 10x (200-step cells beside float32's: 9.9x, 11.7x). A precision not
# named here, and any on a GPU, costs as float32; on a CPU that emulates bf16 (several times slower), the cells
# that finish correct the speed (fit_rates).
PRECISION_COST = {"bf16": 1.0, "bf16w": 1.2, "bf16w-acc32": 0.9, "fp16": 10.0}
log = logging.getLogger(__name__)
MAX_COSTS = 8000  # characters: MLflow's limit on a tag's value
DONE = ("FINISHED", "FAILED", "KILLED")


def expected_seconds(batch_size: int, num_accum: int, num_iterations: int, eval_period: int,
                     valid_images: int = TEST_IMAGES, model_cost: float = 1.0, accumulate: str = "loop",
                     precision_cost: float = 1.0) -> float:
    """A cell's expected seconds on one core of the reference machine, compilation of new graphs left out;
    `model_cost` (model.cost) scales the simple CNN's times to another model's, `precision_cost`
    (`precision_cost()`) float32's to the cell's precision; `accumulate`: the engine, loop (k passes of b samples
    a step) or batched (one pass of b*k)."""
    evaluations = num_iterations // eval_period + (num_iterations % eval_period > 0)
    if accumulate == "batched":
        step = MICRO_S * (batch_size * num_accum) ** BATCH_EXPONENT + num_accum * DRAW_S + STEP_S
    else:
        step = num_accum * MICRO_S * batch_size ** BATCH_EXPONENT + STEP_S
    return CELL_S + model_cost * precision_cost * (num_iterations * step + evaluations * valid_images * EVAL_IMAGE_S)


def precision_cost(precision: str, device_type: str) -> float:
    """`PRECISION_COST` of the precision named as runs record it (the `precision` tag, precision.name), on the
    device type the cell trains on."""
    return PRECISION_COST.get(precision, 1.0) if device_type == "cpu" else 1.0


def replica_work(num_accum: int, replicas: int) -> int:
    """The micro-batches of b a step computes over all its replicas: w replicas of k cost the cores what
    accumulation's w*k does (and count as w cores when cells share a machine)."""
    return num_accum * replicas


def graph_keys(phases: Iterable[str], model: str, dataset: str, norm: str, batch_size: int,
               accumulate: str) -> frozenset[tuple[str, ...]]:
    """The graphs a cell compiles (`phases`: "train", "eval"): evaluation's depend on the model, data
    and norm, training's on the batch size and the engine too. Cells that share one share Inductor's cache."""
    keys = {("eval", model, dataset, norm)} if "eval" in phases else set()
    if "train" in phases:
        keys.add(("train", model, dataset, norm, str(batch_size), accumulate))
    return frozenset(keys)


def graph_units(keys: Iterable[tuple[str, ...]]) -> float:
    """Compilations in evaluation graphs' worth."""
    return sum(TRAIN_GRAPH if key[0] == "train" else 1.0 for key in keys)


def cell_seconds(tags: Mapping[str, str], params: Mapping[str, str]) -> float:
    """`expected_seconds` of a cell's run, from its tags and logged config (w replicas: their core-seconds, as
    `replica_work` counts them)."""
    return expected_seconds(int(tags[BATCH_SIZE]), replica_work(int(tags[NUM_ACCUM]), int(tags.get(REPLICAS, 1))),
                            int(params["train.num_iterations"]),
                            int(params["train.eval_period"]), int(params.get("data.holdout", 0)) or TEST_IMAGES,
                            float(params.get("model.cost", 1.0)), tags.get(ACCUMULATE, "loop"),
                            precision_cost(tags.get(PRECISION, FP32), tags.get(DEVICE, "cpu")))


def run_graphs(tags: Mapping[str, str]) -> frozenset[tuple[str, ...]]:
    """`graph_keys` of a cell's run, from its tags (`compiled`: what it compiled)."""
    phases = [] if tags.get(COMPILED, "off") == "off" else tags[COMPILED].split(",")
    return graph_keys(phases, tags.get(MODEL, ""), tags.get(DATASET, ""), tags.get(NORM, ""),
                      int(tags.get(BATCH_SIZE, 0)), tags.get(ACCUMULATE, "loop"))


@dataclass(frozen=True)
class Cell:
    """One run of a sweep as the store shows it."""

    name: str
    status: str  # RUNNING, FINISHED, FAILED, KILLED, or SKIPPED (FINISHED by an earlier sweep)
    expected_s: float
    elapsed_s: float  # so far (running), or start to end
    step: int = 0  # the last evaluated optimizer step
    steps: int = 0
    valid_acc: float | None = None
    heartbeat_age_s: float | None = None
    new_graphs: float = 0.0  # graph_units of the graphs it was the sweep's first to compile (by start time)
    fresh: int = 0  # 1: the first cell of the sweep its worker process ran

    @property
    def work_s(self) -> float:
        return self.expected_s + self.new_graphs * GRAPH_S


@dataclass(frozen=True)
class Plan:
    cells: int | None  # None: not recorded (a sweep run by another sweeper, or a single run)
    expected_s: float | None  # the cells' expected_seconds and GRAPH_S for each graph
    cells_at_once: int | None
    started: float | None = None  # epoch seconds
    ended: float | None = None  # the plan run's end: every launch returned (or the launching process stopped)
    graphs: float = 0.0  # graph_units of the distinct graphs its cells compile
    costs: tuple[tuple[float, float], ...] | None = None  # each cell's (expected_seconds, new graph units), launch order


@dataclass(frozen=True)
class Snapshot:
    counts: dict[str, int]  # finished, failed, killed, skipped, running, starting, waiting
    total: int | None
    done_s: float  # expected seconds of work done (finished, failed, skipped, and running cells' part)
    total_s: float | None
    elapsed_s: float | None
    eta_s: float | None
    speed: float  # expected seconds of training and evaluation per real second of one cell (1: as the model says)
    graph_s: float = GRAPH_S  # the seconds a new graph takes here, as fitted
    left_s: float | None = None  # expected seconds of work left (running cells' rest, waiting cells); None: unknown
    stopped: bool = False  # the launching process is gone: nothing more runs, no ETA

    @property
    def share(self) -> float | None:
        """The work done as a fraction of the work done and left: a skipped cell's work is done work, and the
        work a resume no longer does (the graphs its skipped cells compiled before) is not left, so a sweep
        whose every cell ended reads 1. None: the work is not known (no plan)."""
        if self.left_s is None or self.done_s + self.left_s <= 0:
            return None
        return self.done_s / (self.done_s + self.left_s)


# How far the model may be off before cells tell (a fraction of a cell's seconds; seconds for a graph and
# for a worker's first cell), and how closely a cell's seconds are known (a fraction, and a floor).
SPEED_PRIOR, NOISE, NOISE_FLOOR_S = 0.5, 0.05, 1.0
FRESH_S = 10.0  # a worker process's first cell: torch.compile's own start-up, a cold cache's shared code


@dataclass(frozen=True)
class Rates:
    """Real seconds per expected second, per new graph, and for a worker process's first cell."""

    per: float = 1.0
    graph_s: float = GRAPH_S
    fresh_s: float = FRESH_S

    def seconds(self, cell: "Cell") -> float:
        return self.per * cell.expected_s + self.graph_s * cell.new_graphs + self.fresh_s * cell.fresh


def fit_rates(observed: Sequence[tuple[float, float, int, float]]) -> Rates:
    """Pure: `Rates` from cells that ended, each as (expected_s, new graph units, 1 if its worker's first cell,
    real seconds): the least-squares fit of real = per * expected + graph_s * graphs + fresh_s * first, with
    the model's values as priors. A short cell's extra seconds go mostly to compilation, a long cell's to the
    machine's speed; cells with and without new graphs, first in a worker or not, tell the three apart. A
    cost the cells say is below zero is taken as zero and the others fitted without it."""
    prior = np.array([1.0, GRAPH_S, FRESH_S])
    scale = np.array([SPEED_PRIOR, GRAPH_S, FRESH_S])
    x = np.array([o[:3] for o in observed], dtype=float).reshape(-1, 3)
    y = np.array([o[3] for o in observed], dtype=float)
    w = 1 / np.maximum(NOISE * y, NOISE_FLOOR_S) ** 2
    free = [0, 1, 2]
    while True:
        a = (x[:, free].T * w) @ x[:, free] + np.diag(1 / scale[free] ** 2)
        theta = np.linalg.solve(a, (x[:, free].T * w) @ y + prior[free] / scale[free] ** 2)
        negative = [f for f, t in zip(free, theta) if f and t < 0]
        if not negative:
            break
        free.remove(negative[0])
    fitted = dict(zip(free, theta))
    return Rates(max(fitted[0], 1e-3), fitted.get(1, 0.0), fitted.get(2, 0.0))


def finish(running_left: Sequence[float], waiting: Sequence[float], at_once: int) -> float:
    """Pure: when the last cell ends, `at_once` workers each taking the next waiting cell (its seconds, in
    launch order) as it frees: the last cells, which run with workers idle, are not spread over all of them."""
    free = sorted([*running_left, *[0.0] * max(0, at_once - len(running_left))])
    for seconds in waiting:
        heapq.heappush(free, heapq.heappop(free) + seconds)
    return max(free, default=0.0)


def snapshot(plan: Plan, cells: Sequence[Cell], failed_unrecorded: int = 0, now: float | None = None,
             observed_at_once: int = 0, stopped: bool = False) -> Snapshot:
    """Accounting of a sweep: pure, from its plan and its cells' runs. `failed_unrecorded`: cells that failed
    before creating a run (their FAILED.txt is in the sweep folder). A running cell already past what the
    fit gives it counts as ending now, so a slow machine's ETA grows before its first cell ends. While the
    launcher runs, a worker with no RUNNING cell is starting the next one (its run not yet made: config, data,
    model), counted as starting, not waiting. `stopped`: the launching process is gone, so no ETA and nothing
    starting."""
    now = time.time() if now is None else now
    counts = {k: 0 for k in ("finished", "failed", "killed", "skipped", "running", "starting", "waiting")}
    for cell in cells:
        counts[cell.status.lower()] += 1
    counts["failed"] += failed_unrecorded
    finished = [(c.expected_s, c.new_graphs, c.fresh, c.elapsed_s) for c in cells
                if c.status == "FINISHED" and c.elapsed_s > 0]
    running = [c for c in cells if c.status == "RUNNING"]
    rates = fit_rates(finished)
    overdue = [c for c in running if c.elapsed_s > rates.seconds(c)]
    if overdue:
        rates = fit_rates(finished + [(c.expected_s, c.new_graphs, c.fresh, c.elapsed_s) for c in overdue])
    running_left = [max(0.0, rates.seconds(c) - c.elapsed_s) for c in running]
    mean_s = (plan.expected_s / plan.cells) if plan.cells and plan.expected_s else 0.0
    done_s = sum(c.work_s for c in cells if c.status != "RUNNING") + failed_unrecorded * mean_s
    done_s += sum(c.work_s * (1 - left / max(rates.seconds(c), 1e-9)) for c, left in zip(running, running_left))
    left_s = sum(c.work_s * left / max(rates.seconds(c), 1e-9) for c, left in zip(running, running_left))
    total, total_s, eta = plan.cells, plan.expected_s, None
    if total is not None:
        counts["waiting"] = max(0, total - len(cells) - failed_unrecorded)
    if total_s is not None:
        at_once = max(plan.cells_at_once or 0, observed_at_once, len(running), 1)
        later = cells[at_once:]  # (by start) after the first workers' first cells: does each get a new worker?
        each = rates.fresh_s * (sum(c.fresh for c in later) / len(later) if later else 0.0) + GAP_S
        if plan.costs is not None and len(plan.costs) == plan.cells:  # the waiting cells, in launch order
            left_costs = plan.costs[plan.cells - counts["waiting"]:]
            waiting = [rates.per * e + rates.graph_s * g + each for e, g in left_costs]
            left_s += sum(e + g * GRAPH_S for e, g in left_costs)
        else:  # the plan's work less what was seen, shared out evenly
            graphs_left = max(0, plan.graphs - sum(c.new_graphs for c in cells))
            waiting_s = max(0.0, total_s - plan.graphs * GRAPH_S - sum(c.expected_s for c in cells)
                            - failed_unrecorded * mean_s)
            real = rates.per * waiting_s + rates.graph_s * graphs_left + each * counts["waiting"]
            left_s += waiting_s + graphs_left * GRAPH_S if counts["waiting"] else 0.0
            waiting = [real / counts["waiting"]] * counts["waiting"] if counts["waiting"] else []
        eta = None if stopped else finish(running_left, waiting, at_once)
    if not stopped and plan.ended is None and plan.cells_at_once:  # the launcher's free workers: starting a cell
        counts["starting"] = min(counts["waiting"], max(0, plan.cells_at_once - len(running)))
        counts["waiting"] -= counts["starting"]
    elapsed = None if plan.started is None else max(0.0, (plan.ended or now) - plan.started)
    return Snapshot(counts, total, done_s, total_s, elapsed, eta, 1 / rates.per, rates.graph_s,
                    None if total_s is None else left_s, stopped)


def summary_line(s: Snapshot, work: bool = True) -> str:
    """'23/60 cells: 20 finished, 1 failed, 2 skipped, 2 running, 35 waiting; 41% of the work; elapsed 24m10s, ETA 35m';
    'running' gives way to 'starting' while workers start their cells and none runs yet; a stopped sweep ends
    with 'stopped' where the ETA would be."""
    c = s.counts
    done = c["finished"] + c["failed"] + c["killed"] + c["skipped"]
    parts = [f"{c[k]} {k}" for k in ("finished", "failed", "killed", "skipped", "running", "starting", "waiting")
             if c[k] or k == "finished" or (k == "running" and not c["starting"])]
    line = f"{done}/{s.total if s.total is not None else '?'} cells: {', '.join(parts)}"
    if s.share is not None and work:
        line += f"; {100 * s.share:.0f}% of the work"
    return line + f"; elapsed {duration(s.elapsed_s)}, " + ("stopped" if s.stopped else f"ETA {duration(s.eta_s)}")


# --- reading the store ----------------------------------------------------------------------------------

def sweep_runs(client: MlflowClient, experiment_id: str, sweep_id: str) -> tuple[Run | None, list[Run]]:
    """The sweep's plan run (None if not recorded) and its cells' runs (trained or skipped by it)."""
    cells = [r for r in runs_in_sweep(client, [experiment_id], sweep_id) if is_training_run(r.data.tags)]
    plans = client.search_runs([experiment_id], f"{filter_equals(ROLE, PLAN_ROLE)} and {filter_equals(SWEEP_ID, sweep_id)}",
                               max_results=1)
    return (plans[0] if plans else None), cells


def costs_tag(costs: Sequence[tuple[float, float]]) -> str | None:
    """`COSTS`'s value, or None when it would not fit in a tag (the ETA then shares the work out evenly)."""
    text = " ".join(f"{e:.1f}:{g:g}" for e, g in costs)
    return text if len(text) <= MAX_COSTS else None


def plan_costs(text: str | None) -> tuple[tuple[float, float], ...] | None:
    if not text:
        return None
    return tuple((float(e), float(g)) for e, g in (word.split(":") for word in text.split()))


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
    step, acc = steps, run.data.metrics.get(metrics.FINAL_VALID_ACC.name)
    if status in ("RUNNING", "FAILED", "KILLED"):  # where it is, or stopped: its latest evaluation
        history = client.get_metric_history(info.run_id, metrics.VALID_ACC.name)
        step, acc = (history[-1].step, history[-1].value) if history else (0, None)
    beat = float(tags.get(HEARTBEAT, info.start_time / 1000))
    expected = cell_seconds(tags, params) if "train.num_iterations" in params else 0.0
    return Cell(info.run_name, status, expected, max(0.0, end - info.start_time / 1000), step, steps, acc,
                now - beat, new_graphs, fresh)


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


def running_lines(cells: Sequence[Cell], stale_after_s: float = 3600) -> list[str]:
    lines = []
    for c in sorted((c for c in cells if c.status == "RUNNING"), key=lambda c: c.name):
        acc = "-" if c.valid_acc is None else f"{c.valid_acc:.4f}"
        quiet = (f"  (no heartbeat for {duration(c.heartbeat_age_s)}: its process may be gone)"
                 if c.heartbeat_age_s is not None and c.heartbeat_age_s > stale_after_s else "")
        lines.append(f"  {c.name:<20} step {c.step:>5}/{c.steps}  valid_acc {acc}  running {duration(c.elapsed_s)}{quiet}")
    return lines


# --- live, in the launching process -----------------------------------------------------------------------

class Live:
    """Polls the store every `every` s while the launcher runs the cells: a tqdm bar over the work on a
    terminal, else a log line per ended cell with the totals. Never stops the sweep: a failed read
    (the store busy) is retried at the next poll."""

    def __init__(self, tracking_uri: str, experiment_id: str, sweep_id: str, plan: Plan, sweep_dir: Path,
                 plan_run_id: str | None = None, every: float = 10.0, bar: bool | None = None, out: TextIO | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.uri, self.experiment_id, self.sweep_id = tracking_uri, experiment_id, sweep_id
        self.client: MlflowClient | None = None  # made at the first poll, where a store that fails is waited out
        self.plan, self.sweep_dir, self.plan_run_id, self.every = plan, sweep_dir, plan_run_id, every
        self.clock = clock  # the time now, in seconds since the epoch (a test's own clock)
        self.out = out or sys.stdout  # printed, not logged: an in-process launcher's cells reconfigure logging
        self.bar = sys.stderr.isatty() if bar is None else bar
        self.seen: set[str] = set()
        self.most_running, self.last_beat = 0, 0.0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.loop, name="gaexp-progress", daemon=True)
        self.tqdm: tqdm | None = None

    def __enter__(self) -> "Live":
        if self.bar:
            self.tqdm = tqdm(total=round(self.plan.expected_s or 0), dynamic_ncols=True,
                             bar_format="{percentage:3.0f}% |{bar:16}| {desc}")
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()
        self.poll()  # the final state
        if self.tqdm is not None:
            self.tqdm.close()

    def loop(self) -> None:
        while not self.stop.wait(self.every):
            self.poll()

    def poll(self) -> Snapshot | None:
        now = self.clock()
        try:
            self.client = self.client or MlflowClient(self.uri)
            plan, cells = read(self.client, self.experiment_id, self.sweep_id, now)
            if self.plan_run_id and now - self.last_beat > 60:  # the plan run's process is alive
                self.client.set_tag(self.plan_run_id, HEARTBEAT, f"{now:.0f}")
                self.last_beat = now
        except Exception as e:  # noqa: BLE001 - a busy store, a server restarting: the progress waits, the sweep goes on
            log.debug("progress: store not read (%s)", e)
            return None
        recorded_failures = sum(c.status == "FAILED" for c in cells)
        markers = len(list(self.sweep_dir.glob("*/FAILED.txt")))
        running = sum(c.status == "RUNNING" for c in cells)
        self.most_running = max(self.most_running, running)
        snap = snapshot(self.plan, cells, max(0, markers - recorded_failures), now, self.most_running)
        if self.tqdm is not None:
            if snap.left_s is not None:  # the work done and left (a resume's skipped cells: done)
                self.tqdm.total = max(1, round(snap.done_s + snap.left_s))
            self.tqdm.n = min(round(snap.done_s), self.tqdm.total)
            self.tqdm.set_description_str(summary_line(snap, work=False))  # the bar shows the work
        for cell in sorted((c for c in cells if c.status != "RUNNING" and c.name not in self.seen),
                           key=lambda c: c.name):
            self.seen.add(cell.name)
            if self.tqdm is None:
                acc = "" if cell.valid_acc is None else f", valid_acc {cell.valid_acc:.4f}"
                print(f"{cell.name} {cell.status} ({duration(cell.elapsed_s)}{acc}) | {summary_line(snap)}",
                      file=self.out, flush=True)
        return snap


# --- gaexp-status -----------------------------------------------------------------------------------------

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
        tally = trials.sweep_tally(open_storage(reconnectable(storage)), run.data.tags[OPTUNA_STUDY], sweep_id, now)
    except Exception as e:  # noqa: BLE001 - a storage gone or unreachable: the runs still tell what they can
        return [f"  (its Optuna storage {storage} was not read: {type(e).__name__}: {mask(str(e))})"]
    if tally is None:
        return ["  (a sweep made before gaexp recorded its plan in the study: its runs so far)"]
    lines = ["  " + trials.summary_line(tally)]
    if len(tally.studies) > 1:
        lines += [f"    {s.name}: " + ", ".join(f"{s.counts[k]} {k}" for k in trials.STATES) + f"; {trials.best_text(s)}"
                  for s in tally.studies]
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
    lines = [f"sweep {sweep_id}{state}", *(search or ["  " + summary_line(snap)]), *([RESUME] if stopped else []),
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
    cli.add_store_arguments(parser, sweep="active", sweep_help="'active' (sweeps still running, else the newest), "
                                                               "'latest' (the newest sweep, grid or search), 'all', "
                                                               "or sweep ids, comma-separated")
    parser.add_argument("--watch", type=float, default=0, metavar="S", help="print again every S seconds until "
                        "no shown sweep is running (0: once; default: %(default)s)")
    parser.add_argument("--stale-after-s", type=float, default=3600,
                        help="flag RUNNING cells without a heartbeat this long (default: %(default)s)")
    args = parser.parse_args(argv)
    cli.require_store(args.tracking_uri)
    if not args.tracking_uri.startswith(("sqlite:///", "http://", "https://")):
        sys.exit(f"error: --tracking-uri {args.tracking_uri!r}; valid: {cli.STORE_FORMS}")
    if args.watch < 0:
        sys.exit(f"error: --watch {args.watch}; valid: 0 (once) or a number of seconds > 0")
    try:
        with cli.store_errors(args.tracking_uri):
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
