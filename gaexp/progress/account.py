"""The accounting and the ETA, pure: the sweep's plan, its cells by state, the rates fitted to the finished cells
(`fit_rates`), the work left and when it ends (`snapshot`, `finish`), the one summary line.
"""

from __future__ import annotations

import heapq
import time
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from gaexp.metrics import VALID_ACC
from gaexp.progress.cost import GAP_S, GRAPH_S
from hydra_plugins.gaexp_optuna_sweeper.tally import duration


MAX_COSTS = 8000  # characters: MLflow's limit on a tag's value


DONE = ("FINISHED", "FAILED", "KILLED")


@dataclass(frozen=True)
class Cell:
    """One run of a sweep as the store shows it."""

    name: str
    status: str  # RUNNING, FINISHED, FAILED, KILLED, or SKIPPED (FINISHED by an earlier sweep)
    expected_s: float
    elapsed_s: float  # so far (running), or start to end
    step: int = 0  # the last evaluated optimizer step
    steps: int = 0
    value: float | None = None  # its headline's latest value (valid_acc; a language model's valid_loss)
    heartbeat_age_s: float | None = None
    new_graphs: float = 0.0  # graph_units of the graphs it was the sweep's first to compile (by start time)
    fresh: int = 0  # 1: the first cell of the sweep its worker process ran
    headline: str = VALID_ACC.name  # its name

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


def shared_line(shared: int, total: int) -> str:
    """How many of a sweep's cells record another cell's steps instead of computing them, and why (one line: the
    sweeper's plan, gaexp-status, the report)."""
    return (f"{shared} of {total} cells record the steps of another cell (tag gaexp.same_as) instead of computing them "
            "again: under accumulate=auto no layer couples their samples, so micro-batch b of k accumulation steps is "
            "one pass over the same b*k samples (share=false computes each cell)")


def costs_tag(costs: Sequence[tuple[float, float]]) -> str | None:
    """`COSTS`'s value, or None when it would not fit in a tag (the ETA then shares the work out evenly)."""
    text = " ".join(f"{e:.1f}:{g:g}" for e, g in costs)
    return text if len(text) <= MAX_COSTS else None


def plan_costs(text: str | None) -> tuple[tuple[float, float], ...] | None:
    if not text:
        return None
    return tuple((float(e), float(g)) for e, g in (word.split(":") for word in text.split()))
