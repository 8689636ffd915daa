"""An Optuna sweep's progress: this command's trials by state, the best value so far, an ETA.

Read from the study storage, so the launching terminal (`Live`, which the sweeper runs around its studies)
and any other shell (gaexp-status, through `sweep_tally`) see the same thing. The sweeper records its plan
in each of its studies' user attributes (`PLAN` + the sweep's id: the studies, the trials it runs of each,
n_jobs, when it started and ended) and marks each trial it asks with the sweep's id (`SWEEP`), so a study that other
commands add trials to at the same time is counted for this command alone.

Public, read by gaexp-status too, and light: Hydra's plugin scan imports it, so Optuna and tqdm load only when
a function here runs.
"""

import dataclasses
import logging
import math
import sys
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Sequence, TextIO

if TYPE_CHECKING:
    import optuna

    from optuna.trial import FrozenTrial
    from tqdm import tqdm

log = logging.getLogger(__name__)
PLAN = "gaexp.sweep_plan."  # + the sweep's id: a study's user attribute, that command's plan
SWEEP = "gaexp.sweep"  # a trial's user attribute: the id of the sweep that asked it
STATES = ("complete", "pruned", "failed", "running", "waiting")


@dataclass(frozen=True)
class StudyTally:
    """One study's trials of one sweep."""

    name: str
    planned: int  # the trials the sweep runs of it (fewer when a grid sampler runs out of points)
    counts: Dict[str, int]  # complete, pruned, failed, running, waiting
    best: Optional[tuple]  # (trial number, value) of this sweep's best complete trial; None before one
    durations: List[float]  # seconds from asked to told, of the ended trials


@dataclass(frozen=True)
class Tally:
    studies: List[StudyTally]
    counts: Dict[str, int]
    planned: int
    elapsed_s: float
    eta_s: Optional[float]  # None before a trial ended


def study_tally(name: str, mine: "Sequence[FrozenTrial]", planned: int, direction: str) -> StudyTally:
    """Pure: one study's tally from the trials a sweep asked of it (`sweep_trials`)."""
    from optuna.trial import TrialState

    counts = dict.fromkeys(STATES, 0)
    for t in mine:
        counts[{TrialState.COMPLETE: "complete", TrialState.PRUNED: "pruned", TrialState.FAIL: "failed"}.get(
            t.state, "running")] += 1
    counts["waiting"] = max(0, planned - len(mine))
    complete = [t for t in mine if t.state == TrialState.COMPLETE and t.value is not None]
    pick = max if direction == "maximize" else min
    best = pick(((t.number, t.value) for t in complete), key=lambda nv: nv[1]) if complete else None
    durations = [(t.datetime_complete - t.datetime_start).total_seconds() for t in mine
                 if t.state.is_finished() and t.datetime_start and t.datetime_complete]
    return StudyTally(name, planned, counts, best, durations)


def tally(studies: Sequence[StudyTally], n_jobs: int, started: float, now: float,
          running_since: Optional[float] = None) -> Tally:
    """Pure: the sweep's counts and its ETA. A batch of n_jobs trials is told when all of it returned, so a
    trial lasts about a batch: the ETA is the running batch's rest (the mean ended trial's length less what
    the batch has run, `running_since` its start) and one mean length for each batch still to come."""
    counts = {k: sum(s.counts[k] for s in studies) for k in STATES}
    durations = [d for s in studies for d in s.durations]
    eta = None
    if durations:
        mean = sum(durations) / len(durations)
        batches = sum(math.ceil(s.counts["waiting"] / max(1, n_jobs)) for s in studies)
        running_left = max(0.0, mean - (now - running_since)) if counts["running"] and running_since else 0.0
        eta = running_left + batches * mean
    return Tally(list(studies), counts, sum(s.planned for s in studies), max(0.0, now - started), eta)


def duration(seconds: Optional[float]) -> str:
    if seconds is None:
        return "?"
    seconds = int(round(seconds))
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m" if seconds >= 3600 else f"{seconds // 60}m{seconds % 60:02d}s"


def best_text(s: StudyTally) -> str:
    return "best -" if s.best is None else f"best {s.best[1]:.4f} (trial {s.best[0]})"


def summary_line(t: Tally) -> str:
    """'6/20 trials: 3 complete, 1 pruned, 0 failed, 2 running, 14 waiting; best 0.9812 (trial 2); elapsed
    4m10s, ETA 9m30s' (several studies: the best of each, by name)."""
    c = t.counts
    ended = c["complete"] + c["pruned"] + c["failed"]
    line = f"{ended}/{t.planned} trials: " + ", ".join(f"{c[k]} {k}" for k in STATES)
    if len(t.studies) == 1:
        line += f"; {best_text(t.studies[0])}"
    else:
        line += "; " + ", ".join(f"{s.name} {best_text(s)}" for s in t.studies if s.counts["waiting"] < s.planned)
    return line + f"; elapsed {duration(t.elapsed_s)}, ETA {duration(t.eta_s)}"


def ended_line(study: str, trial: "FrozenTrial") -> str:
    """'trial 3 PRUNED at step 600 (1m12s)', 'trial 4 COMPLETE, value 0.9812 (2m01s)', with the study's
    name when the sweep has several."""
    from optuna.trial import TrialState

    what = {TrialState.COMPLETE: f"COMPLETE, value {trial.value:.4f}" if trial.value is not None else "COMPLETE",
            TrialState.PRUNED: f"PRUNED at step {trial.last_step}" if trial.last_step is not None else "PRUNED",
            TrialState.FAIL: "FAILED"}.get(trial.state, trial.state.name)
    took = ((trial.datetime_complete - trial.datetime_start).total_seconds()
            if trial.datetime_start and trial.datetime_complete else None)
    return f"{study + ' ' if study else ''}trial {trial.number} {what} ({duration(took)})"


def sweep_trials(storage: "optuna.storages.BaseStorage", plan: Dict[str, Any],
                 sweep_id: str) -> "Dict[str, List[FrozenTrial]]":
    """Each of the plan's studies' trials asked by `sweep_id`."""
    import optuna

    return {name: [t for t in optuna.load_study(study_name=name, storage=storage).get_trials(deepcopy=False)
                   if t.user_attrs.get(SWEEP) == sweep_id] for name in plan["studies"]}


def plan_tally(plan: Dict[str, Any], trials: "Dict[str, List[FrozenTrial]]", now: float) -> Tally:
    """Pure: `tally` of the plan's studies from their trials (`sweep_trials`), at its end if it ended."""
    from optuna.trial import TrialState

    now = min(now, plan.get("ended") or now)
    studies = [study_tally(name, trials[name], planned, plan["direction"])
               for name, planned in zip(plan["studies"], plan["trials"])]
    running = [t.datetime_start.timestamp() for ts in trials.values() for t in ts
               if t.state == TrialState.RUNNING and t.datetime_start]
    t = tally(studies, plan["n_jobs"], plan["started"], now, min(running) if running else None)
    return dataclasses.replace(t, eta_s=0.0) if plan.get("ended") else t


def sweep_tally(storage: "optuna.storages.BaseStorage", study_name: str, sweep_id: str,
                now: Optional[float] = None) -> Optional[Tally]:
    """The tally of `sweep_id` from the plan it recorded in `study_name` (None: it recorded none there)."""
    import optuna

    plan = optuna.load_study(study_name=study_name, storage=storage).user_attrs.get(PLAN + sweep_id)
    if plan is None:
        return None
    return plan_tally(plan, sweep_trials(storage, plan, sweep_id), time.time() if now is None else now)


class Live:
    """Polls the storage every `every` s while the sweeper runs its studies: a tqdm bar over the trials on a
    terminal (Optuna's own `show_progress_bar` is one per study and shows no pruning), else a line per ended
    trial with the totals. A failed read (the storage busy) waits for the next poll; the sweep goes on."""

    def __init__(self, storage: "optuna.storages.BaseStorage", plan: Dict[str, Any], sweep_id: str, every: float = 10.0,
                 bar: Optional[bool] = None, out: Optional[TextIO] = None, clock: Callable[[], float] = time.time) -> None:
        self.storage, self.plan, self.sweep_id, self.every, self.clock = storage, plan, sweep_id, every, clock
        self.out = out or sys.stdout  # printed: the jobs of an in-process launcher reconfigure logging
        self.bar = sys.stderr.isatty() if bar is None else bar
        self.seen: set = set()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.loop, name="gaexp-optuna-progress", daemon=True)
        self.tqdm: "Optional[tqdm]" = None

    def __enter__(self) -> "Live":
        if self.bar:
            from tqdm import tqdm

            self.tqdm = tqdm(total=sum(self.plan["trials"]), dynamic_ncols=True,
                             bar_format="{percentage:3.0f}% |{bar:16}| {desc}")
        self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop.set()
        self.thread.join()
        self.poll()
        if self.tqdm is not None:
            self.tqdm.close()

    def loop(self) -> None:
        while not self.stop.wait(self.every):
            self.poll()

    def poll(self) -> Optional[Tally]:
        try:
            trials = sweep_trials(self.storage, self.plan, self.sweep_id)
        except Exception as e:  # noqa: BLE001 - a busy storage: the progress waits, the sweep goes on
            log.debug("progress: storage not read (%s)", e)
            return None
        t = plan_tally(self.plan, trials, self.clock())
        ended = [(name, trial) for name, ts in trials.items() for trial in ts if trial.state.is_finished()]
        if self.tqdm is not None:
            self.tqdm.n = min(t.planned - t.counts["waiting"] - t.counts["running"], self.tqdm.total)
            self.tqdm.set_description_str(summary_line(t))
            self.tqdm.refresh()
        for name, trial in sorted(ended, key=lambda nt: (nt[1].datetime_complete, nt[1].number)):
            if (name, trial.number) in self.seen:
                continue
            self.seen.add((name, trial.number))
            if self.tqdm is None:
                named = name if len(self.plan["studies"]) > 1 else ""
                print(f"{ended_line(named, trial)} | {summary_line(t)}", file=self.out, flush=True)
        return t
