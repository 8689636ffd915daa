"""Hydra's basic sweeper (the product of the swept values), with gaexp's two additions.

- Longest cells first: launchers start cells in the order given, so a long cell started last keeps one
  core busy while the others idle. Each cell's config is composed (as Hydra's own check does anyway) and
  its expected work computed (gaexp/progress/); the cells run longest first, ties in the given order.
- Progress: the plan is recorded as an MLflow run `sweep-<id>`, and while the launcher runs, the
  launching terminal shows the cells by state and an ETA, read from the tracking store (any launcher).

Hydra's plugin scan imports this module in every Hydra application: gaexp and MLflow load when a sweep runs.
"""

from __future__ import annotations

import dataclasses
import logging
import shlex
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, FrozenSet, Iterator, List, Optional, Sequence, Tuple

from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.utils import JobStatus
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf

from hydra_plugins.gaexp_grid_sweeper.config import ORDERS

if TYPE_CHECKING:  # the annotation's name only: gaexp loads when a sweep runs
    from gaexp import progress

log = logging.getLogger(__name__)


def uncompleted(error: Exception) -> str:
    """What to do when a submitit task ended without a result (UncompletedJobError: cancelled, out of time, node
    lost) under hydra-submitit-launcher's own launchers, which stop at the first one (`launch=slurm` and
    `launch=local` wait for every task instead: submitit_launcher.py). The error's first two lines name the job
    and its state."""
    what = " ".join(str(error).splitlines()[:2])
    return (f"error: {what}\nThe command stopped waiting; the other tasks it submitted go on (launch=slurm or "
            "launch=local would have waited for them). When `squeue` no longer lists them, run the same command again: FINISHED cells "
            "are skipped, and a cell whose run this task left RUNNING is marked KILLED and runs again "
            "(docs/cluster.md).")


def cost_of(cfg: DictConfig, accumulate: str) -> Tuple[float, FrozenSet[Tuple[str, ...]]]:
    """A cell's expected work and the graphs it compiles (gaexp/progress/), from its own composed config and
    the engine its checks chose (`accumulate`: loop or batched, accumulate=auto resolved)."""
    from gaexp import progress  # gaexp (torch, MLflow) loads when a sweep runs, not at Hydra's plugin scan
    from gaexp.train import planned_phases
    from gaexp.study import TEST_IMAGES

    graphs = progress.graph_keys(planned_phases(cfg.compile, cfg.norm.name), cfg.model.name, cfg.data.dataset,
                                 cfg.norm.name, cfg.regime.batch_size, accumulate)
    return progress.expected_seconds(cfg.regime.batch_size, progress.replica_work(cfg.regime.num_accum,
                                                                                  cfg.regime.replicas),
                                     cfg.train.num_iterations,
                                     cfg.train.eval_period, cfg.data.holdout or TEST_IMAGES,
                                     cfg.model.cost, accumulate,
                                     progress.precision_cost(cfg.precision.name, cfg.device_type)), graphs


def check_cell(cfg: DictConfig, overrides: Sequence[str]) -> Tuple[str, bool]:
    """Every check the cell's job would make before training (gaexp.cell.validate), here, before anything of the
    sweep is recorded; a bad value in a swept axis ends the command with one line naming the cell. Returns the
    engine the cell will train with (accumulate=auto resolved) and whether it may record the steps of another cell
    of the same one micro-batch of b*k instead of computing them (gaexp/engine.py `one_pass`, gaexp.cell.may_share)."""
    from gaexp.cell import may_share, validate  # the cell's own checks; gaexp loads when a sweep runs
    from gaexp.config import job_config
    from gaexp.engine import one_pass
    from gaexp.task.build import make as make_task

    try:
        c, choice = validate(job_config(cfg))
    except Exception as e:  # noqa: BLE001 - every kind of bad input ends the command the same way
        raise SystemExit(f"error: cell {' '.join(overrides)}: {e}") from None
    return c.accumulate, may_share(c) and one_pass(choice, make_task(c.task), c.regime.replicas)


def shared_cells(cells: Sequence[Sequence[str]], one: Sequence[bool], samples: Sequence[int]) -> List[bool]:
    """Pure: which cells, in launch order, record the steps of an earlier one instead of computing them: cells
    whose steps are their one micro-batch's (`one`) with the same overrides but their regime and the same b*k
    (`samples`) compute the same thing (gaexp/engine.py `arithmetic_key`); the first computes, the rest share."""
    first: set = set()
    shared = []
    for cell, alone, n in zip(cells, one, samples):
        key = (tuple(o for o in cell if not o.lstrip("+~").startswith("regime")), n)
        shared.append(alone and key in first)
        if alone:
            first.add(key)
    return shared


def longest_first(cells: Sequence[Sequence[str]], costs: Sequence[float]) -> List[List[str]]:
    """The cells by expected work, longest first; equal ones keep their order (sorted is stable)."""
    return [list(cells[i]) for i in sorted(range(len(cells)), key=lambda i: -costs[i])]


class GridSweeper(BasicSweeper):
    def __init__(self, max_batch_size: Optional[int], params: Optional[Dict[str, str]] = None,
                 order: str = "longest_first", progress: Optional[bool] = None, poll_s: float = 10.0) -> None:
        if order not in ORDERS:
            raise HydraException(f"hydra.sweeper.order={order!r}; valid: {', '.join(ORDERS)}")
        if max_batch_size is not None and max_batch_size < 1:
            raise HydraException(f"hydra.sweeper.max_batch_size={max_batch_size!r}; valid: null or an integer >= 1")
        if poll_s <= 0:
            raise HydraException(f"hydra.sweeper.poll_s={poll_s!r}; valid: seconds > 0")
        super().__init__(max_batch_size=max_batch_size, params=params)
        self.order, self.show, self.poll_s = order, progress, poll_s

    def cell_config(self, overrides: Sequence[str]) -> DictConfig:
        """The config a cell's job will compose."""
        return self.hydra_context.config_loader.load_sweep_config(master_config=self.config,
                                                                  sweep_overrides=list(overrides))

    def cost(self, overrides: Sequence[str]) -> float:
        cfg = self.cell_config(overrides)
        return cost_of(cfg, check_cell(cfg, overrides)[0])[0]

    def sweep(self, arguments: List[str]) -> Any:
        from gaexp import progress
        from hydra_plugins.gaexp_optuna_sweeper.tally import duration

        parser = OverridesParser.create(config_loader=self.hydra_context.config_loader)
        (cells,) = self.split_arguments(parser.parse_overrides([*self._parse_config(), *arguments]), None)
        varying = [i for i in range(len(cells[0]) if cells else 0) if len({c[i] for c in cells}) > 1]
        costs, compiles, one, samples = [], [], [], []
        for cell in cells:  # composed and checked as its job will be: bad input stops the sweep before the plan run
            cfg = self.cell_config(cell)
            engine, alone = check_cell(cfg, [cell[i] for i in varying])
            cost, compiled = cost_of(cfg, engine)
            costs.append(cost)
            compiles.append(compiled)
            one.append(alone)
            samples.append(cfg.regime.batch_size * cfg.regime.num_accum)
        for _ in range(2 if self.order == "longest_first" else 1):  # ordered, then shared cells (nearly free) last
            if self.order == "longest_first":
                order = sorted(range(len(cells)), key=lambda i: -costs[i])  # as longest_first orders them
                cells = longest_first(cells, costs)
                costs, compiles, one, samples = ([x[i] for i in order] for x in (costs, compiles, one, samples))
            shared = shared_cells(cells, one, samples)
            costs = [progress.CELL_S if s else cost for s, cost in zip(shared, costs)]
            compiles = [frozenset() if s else graphs for s, graphs in zip(shared, compiles)]
        graphs: set = set()
        new = []  # each cell's graphs that no cell launched before it compiles
        for compiled in compiles:
            new.append(progress.graph_units(compiled - graphs))
            graphs |= compiled
        size = self.max_batch_size or len(cells)
        self.overrides = [cells[i:i + size] for i in range(0, len(cells), size)]
        sweep_dir = Path(self.config.hydra.sweep.dir)
        at_once = self.config.get("cells_at_once")
        units = progress.graph_units(graphs)
        plan = progress.Plan(len(cells), sum(costs) + units * progress.GRAPH_S,
                             at_once if at_once and at_once > 0 else None, graphs=units, costs=tuple(zip(costs, new)))
        log.info("%d cells, %s (first: %s); expected work %s on one core of the reference machine", len(cells),
                 self.order.replace("_", " "), " ".join(cells[0][i] for i in varying) if cells else "-",
                 duration(plan.expected_s))
        if sum(shared):
            log.info("%s", progress.shared_line(sum(shared), len(cells)))
        with self.resumable(sweep_dir.name, len(cells)):
            sweep_dir.mkdir(parents=True, exist_ok=True)
            OmegaConf.save(self.config, sweep_dir / "multirun.yaml")
            return self.launch_all(plan, sweep_dir)

    def launch_all(self, plan: progress.Plan, sweep_dir: Path) -> Any:
        """Every batch of cells through the launcher, the plan tracked meanwhile."""
        with self.tracked(plan, sweep_dir):
            returns, job_idx = [], 0
            while not self.is_done():
                batch = self.get_job_batch()
                try:
                    results = self.launcher.launch(batch, initial_job_idx=job_idx)
                except Exception as e:  # noqa: BLE001 - only submitit's "task ended without a result" is explained
                    if type(e).__name__ != "UncompletedJobError":
                        raise
                    raise SystemExit(uncompleted(e)) from None
                for r in results:
                    if r.status == JobStatus.FAILED and self.storage_fault(r._return_value):
                        raise r._return_value  # said in one line by `resumable`, without Hydra's line before it
                    _ = r.return_value  # as the basic sweeper: a job's exception surfaces here
                job_idx += len(batch)
                returns.append(results)
            return returns

    @contextmanager
    def resumable(self, sweep_id: str, total: int) -> Iterator[None]:
        """Ctrl-C (SIGINT), or SIGTERM or SIGHUP (gaexp.liveness.Ended): once the plan run and the cells' runs are
        KILLED (tracking.tracked_run), one line instead of the launcher's traceback, and exit status 130 (143,
        129). A storage fault (gaexp/faults.py: a full disk, wherever it surfaced), once no cell runs: one line
        with the cells finished and what to do, status 1."""
        from gaexp import liveness

        try:
            yield
        except BaseException as e:  # noqa: BLE001 - after SIGTERM, a worker's pool broken by the end is that end
            fault = None if isinstance(e, (SystemExit, KeyboardInterrupt)) else self.storage_fault(e)
            if fault is not None:
                print(self.resume_line(f"error: {fault.cause}", sweep_id, total, f"{fault.todo}, then rerun"),
                      file=sys.stderr, flush=True)
                raise SystemExit(1) from None
            if isinstance(e, SystemExit) or not (isinstance(e, KeyboardInterrupt) or liveness.ended()):
                raise
            print(self.resume_line("interrupted", sweep_id, total), file=sys.stderr, flush=True)
            raise SystemExit(liveness.exit_status(e)) from None

    def storage_fault(self, e: BaseException) -> Any:
        """The storage fault in `e`, if any (gaexp/faults.py), SQLite's naming this command's store."""
        from gaexp import faults

        return faults.storage_fault(e, self.config.mlflow.tracking_uri, self.config.paths.outputs)

    def resume_line(self, head: str, sweep_id: str, total: int, todo: str = "rerun") -> str:
        """`head`, how many of the sweep's cells finished (in the store: the ones it trained and the ones it
        skipped as FINISHED earlier), and the command that resumes it."""
        from mlflow.tracking import MlflowClient

        from gaexp import progress, tracking
        from gaexp.redact import mask

        try:
            client = MlflowClient(self.config.mlflow.tracking_uri)
            _, cells = progress.read(client, tracking.experiment_id(client, self.config.mlflow.experiment_name),
                                     sweep_id)
            done = f": {sum(c.status in ('FINISHED', 'SKIPPED') for c in cells)} of {total} cells finished"
        except (Exception, KeyboardInterrupt):  # noqa: BLE001 - a store busy, a second Ctrl-C: the line without it
            done = ""
        return mask(f"{head}{done}; {todo} the same command to resume, finished cells are skipped: "
                    f"gaexp {shlex.join(sys.argv[1:])}")

    @contextmanager
    def tracked(self, plan: progress.Plan, sweep_dir: Path) -> Iterator[None]:
        """The plan as a run `sweep-<id>` (FINISHED when every launch returned), live progress meanwhile."""
        from mlflow.tracking import MlflowClient

        from gaexp import progress, tracking
        from gaexp.tags import plan_tags

        cfg = self.config
        client = MlflowClient(cfg.mlflow.tracking_uri)
        experiment_id = tracking.experiment_id(client, cfg.mlflow.experiment_name)
        tags = plan_tags(sweep_id=sweep_dir.name, cells=plan.cells, expected_s=plan.expected_s,
                         cells_at_once=plan.cells_at_once or None, graphs=plan.graphs,
                         costs=progress.costs_tag(plan.costs), order=self.order)
        with tracking.tracked_run(client, experiment_id, f"sweep-{sweep_dir.name}", tags) as run_id:
            if self.show is False:
                yield
                return
            plan = dataclasses.replace(plan, started=client.get_run(run_id).info.start_time / 1000)
            with progress.Live(cfg.mlflow.tracking_uri, experiment_id, sweep_dir.name, plan, sweep_dir, run_id, self.poll_s,
                               bar=self.show):
                yield
