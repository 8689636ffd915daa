"""The Hydra application: one grid cell per job (gaexp/cell.py), tracked as one MLflow run; the command line
refused in one line before Hydra's own message. The callbacks around a sweep are gaexp/callbacks.py; what a
launcher runs at once its launch config says (conf/launch/), so the app names no launcher.
"""

from __future__ import annotations

import logging
import os
import shlex
import sys
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Iterator, Sequence

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from gaexp import faults, liveness, redact, targets
from gaexp.config import (CONFIG_DIR, FAILED_MARKER, compose_config, composition_problem, hydra_overrides, sweep_cases,
                          unknown_choice)
from gaexp.machine import launched_problem, torchrun_rank

log = logging.getLogger(__name__)
_storage_fault: faults.StorageFault | None = None  # the one a cell of this process met: no cell here records after


@contextmanager
def quiet_console(quiet: bool, level: int = logging.WARNING) -> Iterator[None]:
    """While a cell runs in a sweep: only warnings and errors on the console handlers Hydra gave the job (its
    log file keeps everything). Restored after, for launchers that run cells in the launching process."""
    handlers = [h for h in logging.getLogger().handlers if type(h) is logging.StreamHandler] if quiet else []
    levels = [h.level for h in handlers]  # type(...) is: a FileHandler subclasses StreamHandler
    for handler in handlers:
        handler.setLevel(level)
    try:
        yield
    finally:
        for handler, before in zip(handlers, levels):
            handler.setLevel(before)


@hydra.main(version_base="1.3", config_path=CONFIG_DIR, config_name="config")
def main(cfg: DictConfig) -> float:
    from gaexp.cell import run_cell  # torch and MLflow: loaded when a cell runs, not to print a config or refuse input
    from gaexp.hooks import Stopped

    redact.mask_logs()  # the job's console and log file
    faults.quiet_storage_noise()  # a full disk: one line, not a traceback per log record
    hc = HydraConfig.get()
    output_dir = Path(hc.runtime.output_dir)
    watch = liveness.sweep_watch()  # in a launcher's worker: the sweep's process, to stop with it
    with watch.running_cell() if watch is not None else nullcontext():
        try:
            if hc.mode != RunMode.MULTIRUN:
                try:
                    return run_cell(cfg, sweep_id=Path(hc.run.dir).name, hydra_dir=output_dir / hc.output_subdir)
                except Exception as e:
                    if fault := faults.storage_fault(e, cfg.mlflow.tracking_uri, cfg.paths.outputs):
                        raise SystemExit(redact.mask(f"error: {fault}")) from None
                    raise
            return sweep_cell(cfg, hc, output_dir)
        except Stopped as e:  # a trial its pruner stopped: not a failure, the sweeper records it PRUNED
            import optuna

            raise optuna.TrialPruned(str(e)) from None


def sweep_cell(cfg: DictConfig, hc: DictConfig, output_dir: Path) -> float:
    """A cell in a multirun: the launching terminal shows the sweep's progress, the cell's lines go to its
    gaexp.log; a cell that fails leaves FAILED_MARKER and nan, and the others run. A storage fault (a full disk:
    gaexp/faults.py) is raised instead, as one line, for the sweep to stop starting cells; a later cell in this
    process meets it at once."""
    global _storage_fault
    from gaexp.cell import run_cell
    from gaexp.hooks import Stopped

    if _storage_fault is not None:
        raise _storage_fault
    try:
        with quiet_console(not hc.verbose):
            return run_cell(cfg, sweep_id=Path(hc.sweep.dir).name, hydra_dir=output_dir / hc.output_subdir,
                            in_sweep=True)
    except Stopped:
        raise
    except Exception as e:  # noqa: BLE001 - one failed cell must not stop the others; FailuresCallback reports it
        if fault := faults.storage_fault(e, cfg.mlflow.tracking_uri, cfg.paths.outputs):
            _storage_fault = fault
            raise fault from None
        log.exception("cell %s failed", hc.job.override_dirname)  # masked, its traceback too (redact.mask_logs)
        (output_dir / FAILED_MARKER).write_text(redact.masked_exception(e))
        return float("nan")


def cli(argv: Sequence[str] | None = None) -> None:
    """The `gaexp` command (`python -m gaexp` too): the current folder first on the import path as `python -m`
    has it, so a model.target, norm.target or data.target beside the user imports; an unknown group choice,
    an unknown key or a value of the wrong type refused in one line before Hydra's own longer message (the
    first cell composed once more); then `main`. Everything it prints is masked (gaexp/redact.py)."""
    redact.mask_terminal()  # whatever prints: Hydra's own errors, a lexer's echo of an override
    targets.import_from_cwd()
    args = sys.argv[1:] if argv is None else list(argv)
    overrides = hydra_overrides(args)
    searched = any(o.lstrip("+").startswith("hydra.searchpath") for o in overrides)  # files this cannot see
    problem = None if searched else (unknown_choice(overrides) or hydra_sweep_problem(overrides)
                                     or composition_problem(overrides))
    if problem is None and torchrun_rank() is not None:
        problem = torchrun_problem(args, overrides)
    if problem:
        raise SystemExit(redact.mask(f"error: {problem}"))
    try:
        with liveness.ending_as_ctrl_c():  # SIGTERM, SIGHUP: as Ctrl-C, with their own exit status
            main()
    except BaseException as e:  # Ctrl-C outside a grid sweep's launches (which say how many cells finished)
        if isinstance(e, SystemExit) or not (isinstance(e, KeyboardInterrupt) or liveness.ended()):
            raise
        print("interrupted", file=sys.stderr)  # the runs it started are KILLED (tracking.tracked_run)
        raise SystemExit(liveness.exit_status(e)) from None  # 130, as a shell reports a command Ctrl-C stopped


def torchrun_problem(args: Sequence[str], overrides: Sequence[str]) -> str | None:
    """Under torchrun, each process one replica of one cell: a sweep (every process would run all of it) or a
    cell of another replica count than torchrun's processes refused in one line, by every process that gets there
    before torchrun stops the others (it does when the first exits)."""
    if {"-m", "--multirun"} & set(args):
        return ("gaexp -m under torchrun: each of its processes would run the whole sweep; valid: one cell per "
                "torchrun command (torchrun --nproc-per-node 2 -m gaexp regime=w2b8a1), or a sweep whose DP cells "
                "start their own replicas (gaexp -m regime=w2b8a1,bs8a2 launch=joblib|slurm)")
    replicas = compose_config(sweep_cases(overrides)[0]).regime.replicas
    return launched_problem("torchrun", int(os.environ.get("WORLD_SIZE", "1")), replicas)


def hydra_sweep_problem(overrides: Sequence[str]) -> str | None:
    """Hydra sweeps none of its own keys (`hydra.sweeper.grid.norm=bn,gn4` unquoted) and its refusal said no
    more. A sweeper's own list of values (gaexp_optuna's `grid`) is one string, quoted for Hydra and again for
    the shell: the line gives that override as it composes (a `+` where the key is new to its dict)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        parsed = OverridesParser.create().parse_overrides(list(overrides))
    except Exception:  # noqa: BLE001 - composition_problem says what does not parse
        return None
    for i, (text, o) in enumerate(zip(overrides, parsed)):
        if not (o.is_sweep_override() and o.key_or_group.startswith("hydra.")):
            continue
        key, _, value = text.partition("=")
        rest = [*overrides[:i], *overrides[i + 1:]]
        quoted = f"{key}='{value}'"
        try:
            problem = composition_problem([*rest, quoted])
            if problem and "add it with +" in problem:  # a key new to its dict
                quoted = f"+{quoted}"
                problem = composition_problem([*rest, quoted])
        except Exception:  # noqa: BLE001 - what composing the override as given says, below
            return None
        if problem and "no key" in problem:  # hydra.sweeper.grid of a sweeper that has none
            return problem
        if problem:  # hydra.launcher.n_jobs=1,2: no string
            return f"{text}: Hydra sweeps none of its own settings; run one command per value"
        shell = f'"{quoted}"' if not set(quoted) & set('"$`\\!') else shlex.quote(quoted)
        return (f"{text}: Hydra sweeps none of its own settings; the sweeper takes this list as one string, "
                f"quoted: {shell} (docs/tuning.md)")
    return None


if __name__ == "__main__":
    main()
