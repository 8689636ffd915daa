"""An Optuna search's studies in MLflow: a parent run per study with its best trial and Optuna's plots, the trials'
runs nested under it (when the sweep ends), and `gaexp-tuned`, the commands that rerun each study's best trial.

A trial's own side (reporting to its study, its objective) is gaexp/trial.py.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import optuna  # noqa: E402
from hydra_plugins.gaexp_optuna_sweeper.config import REPEATS  # noqa: E402
from hydra_plugins.gaexp_optuna_sweeper.trials import open_storage  # noqa: E402
from mlflow.entities import Metric, Param, RunTag  # noqa: E402
from mlflow.tracking import MlflowClient  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

from gaexp import arguments, tracking  # noqa: E402
from gaexp.metrics import BEST_TRIAL, BEST_VALUE, TRIAL_VALUE  # noqa: E402
from gaexp.redact import mask, reconnectable  # noqa: E402
from gaexp.tags import (BEST, OBJECTIVE, OPTUNA_STATE, OPTUNA_STATES, OPTUNA_STORAGE, OPTUNA_STUDY, OPTUNA_TRIAL,  # noqa: E402
                        PARENT_RUN, ROLE, STUDY_ROLE, TRIAL_ROLE, filter_equals)
from gaexp.config import AnalysisConfig  # noqa: E402
from gaexp.trial import describe_objective  # noqa: E402




def report_studies(client: MlflowClient, experiment_id: str, results: Path, design: AnalysisConfig,
                   storage: str | None = None, task: str = "classify") -> list[str]:
    """After a tuning sweep: one parent run per study (found again on later sweeps) carrying the best
    value and params, as metrics stepped by the trial count, the objective (tag `objective`), and
    Optuna's plots; its trials' runs become its children. `results`: the sweeper's
    optimization_results.yaml; `design`: the sweep's analysis node, whose objective the trials returned;
    `storage`: the study storage as the sweep's config gives it (the file has its password masked; without it,
    the file's, connected as `reconnectable` makes it). Returns the study names."""
    summary = OmegaConf.load(results)
    storage = storage or reconnectable(summary.storage)
    for name, outcome in summary.studies.items():
        study = optuna.load_study(study_name=name, storage=open_storage(storage))
        found = client.search_runs([experiment_id], f"{filter_equals(ROLE, STUDY_ROLE)} and {filter_equals(OPTUNA_STUDY, name)}")
        parent = found[0].info.run_id if found else client.create_run(
            experiment_id, run_name=f"study-{name}",
            tags={ROLE: STUDY_ROLE, OPTUNA_STUDY: name, OPTUNA_STORAGE: mask(storage)}).info.run_id
        trials = len(study.trials)
        client.set_tag(parent, OPTUNA_STATES, ", ".join(f"{k} {v}" for k, v in outcome.states.items()))
        client.set_tag(parent, OBJECTIVE, describe_objective(design, task))
        if outcome.best is not None:
            metrics = {BEST_VALUE.name: float(outcome.best.value), BEST_TRIAL.name: float(outcome.best.trial)}
            metrics |= {f"{BEST}{k}": float(v) for k, v in outcome.best.params.items() if isinstance(v, (int, float))}
            client.log_batch(parent, metrics=[Metric(k, v, int(time.time() * 1000), trials) for k, v in metrics.items()])
            client.log_batch(parent, tags=[RunTag(f"{BEST}{k}", str(v)) for k, v in outcome.best.params.items()])
            with tempfile.TemporaryDirectory() as tmp:
                for path in plots(study, Path(tmp)):
                    client.log_artifact(parent, str(path))
        states = {str(t.number): t.state.name for t in study.trials}
        runs = tracking.search_all(client, [experiment_id], filter_equals(OPTUNA_STUDY, name))
        parents = trial_runs(client, experiment_id, name, study, runs, parent)
        for run in runs:
            if run.data.tags.get(ROLE) in (STUDY_ROLE, TRIAL_ROLE):
                continue
            number = run.data.tags.get(OPTUNA_TRIAL)
            wanted = {PARENT_RUN: parents.get(number, parent), OPTUNA_STATE: states.get(number, "")}
            changed = [RunTag(tag, value) for tag, value in wanted.items() if run.data.tags.get(tag) != value]
            if changed:
                client.log_batch(run.info.run_id, tags=changed)
        client.set_terminated(parent, "FINISHED")
    return list(summary.studies)


def trial_runs(client: MlflowClient, experiment_id: str, name: str, study: optuna.Study, runs: list,
               parent: str) -> dict[str, str]:
    """A run per trial that has repeats (found again on later sweeps), under the study's run: its params,
    state, and value (the mean of its repeats, each a metric too); returns {trial number: its run id}, under
    which its repeats' runs go."""
    found = {r.data.tags.get(OPTUNA_TRIAL): r.info.run_id for r in runs if r.data.tags.get(ROLE) == TRIAL_ROLE}
    made = {}
    for trial in study.trials:
        repeats = trial.user_attrs.get(REPEATS)
        if not repeats:
            continue
        number = str(trial.number)
        run_id = found.get(number) or client.create_run(experiment_id, run_name=f"trial-{trial.number}", tags={
            ROLE: TRIAL_ROLE, OPTUNA_STUDY: name, OPTUNA_TRIAL: number, PARENT_RUN: parent}).info.run_id
        now = int(time.time() * 1000)
        values = {f"{TRIAL_VALUE.name}.{k}": v for k, v in repeats.items() if v is not None}
        values |= {TRIAL_VALUE.name: trial.value} if trial.value is not None else {}
        client.log_batch(run_id, metrics=[Metric(k.replace("=", "_"), float(v), now, 0) for k, v in values.items()],
                         params=[] if number in found else [Param(k, str(v)) for k, v in trial.params.items()],
                         tags=[RunTag(OPTUNA_STATE, trial.state.name)])
        client.set_terminated(run_id, "FINISHED")
        made[number] = run_id
    return made


def plots(study: optuna.Study, out: Path) -> list[Path]:
    """Optuna's own matplotlib plots: the optimization history, and each searched key's slice."""
    from optuna.visualization import matplotlib as ovm

    written = []
    with warnings.catch_warnings():  # Optuna marks its matplotlib plots experimental
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        figures = {"optimization_history.png": ovm.plot_optimization_history(study)}
        if any(t.state == optuna.trial.TrialState.COMPLETE for t in study.trials):
            figures["slice.png"] = ovm.plot_slice(study)
    for filename, axes in figures.items():
        figure = (axes.flat[0] if hasattr(axes, "flat") else axes).figure
        figure.savefig(out / filename, dpi=120, bbox_inches="tight")
        plt.close(figure)
        written.append(out / filename)
    return written


RERUN_DROPPED = ("optuna.", "seed=", "+seed=", "data.holdout=", "+data.holdout=", "hydra/sweeper=")


def rerun_overrides(trial_overrides: list[str], seeds: str, extra: list[str]) -> list[str]:
    """The command line that reruns a trial's exact protocol on the test set: the trial's own overrides
    (its dataset, model, budget, sampled values, ...) without its trial node, seed and holdout, then
    the test split, the seeds, gaexp's grid sweeper (the search's experiment file may name the Optuna one)
    and the caller's extra overrides."""
    kept = [line for line in trial_overrides if not line.startswith(RERUN_DROPPED)]
    return [*kept, "data.holdout=0", f"seed={seeds}", "hydra/sweeper=gaexp_grid", *extra]


def tuned_commands(client: MlflowClient, experiment: str, study_prefix: str, seeds: str,
                   extra: list[str]) -> list[tuple[str, dict, list[str]]]:
    """Per study of `study_prefix`: (study, best trial as found, the command that reruns it at the best
    values on the test set with `seeds`). The protocol is the best trial's: its logged Hydra overrides
    (the run's hydra/overrides.yaml artifact), so the dataset, model, budget and every other key are the
    trial's; only the evaluation split (data.holdout=0) and the seeds change."""
    found = client.get_experiment_by_name(experiment)
    if found is None:
        raise ValueError(f"no experiment {experiment!r} in {client.tracking_uri}")
    parents = tracking.search_all(client, [found.experiment_id], filter_equals(ROLE, STUDY_ROLE))
    commands = []
    for parent in sorted(parents, key=lambda r: r.data.tags[OPTUNA_STUDY]):
        name = parent.data.tags[OPTUNA_STUDY]
        if not (name == study_prefix or name.startswith(f"{study_prefix}[")) or BEST_TRIAL.name not in parent.data.metrics:
            continue
        number = int(parent.data.metrics[BEST_TRIAL.name])
        runs = [r for r in tracking.search_all(client, [found.experiment_id], f"{filter_equals(OPTUNA_STUDY, name)} and "
                                              f"{filter_equals(OPTUNA_TRIAL, number)} and attributes.status = 'FINISHED'")
                if r.data.tags.get(ROLE) != TRIAL_ROLE]
        if not runs:
            raise ValueError(f"study {name}: no FINISHED run of its best trial {number} in experiment {experiment!r}")
        with tempfile.TemporaryDirectory() as tmp:
            try:
                path = client.download_artifacts(runs[0].info.run_id, "hydra/overrides.yaml", tmp)
            except Exception as e:  # noqa: BLE001 - MLflow raises its own kinds for a missing artifact
                raise ValueError(f"study {name}: best trial {number}'s run {runs[0].info.run_id} has no logged "
                                 f"overrides (hydra/overrides.yaml): {e}") from None
            overrides = list(OmegaConf.load(path))
        outcome = {"trial": number, "value": parent.data.metrics[BEST_VALUE.name],
                   **{k.removeprefix(BEST): v for k, v in parent.data.tags.items() if k.startswith(BEST)}}
        commands.append((name, outcome, rerun_overrides(overrides, seeds, extra)))
    if not commands:
        raise ValueError(f"no finished study {study_prefix}[...] in experiment {experiment!r} (run the search first)")
    return commands


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="gaexp-tuned", description=(
        "Rerun each cell of an Optuna search at its best values, on the test set, with several seeds."))
    arguments.add_store_arguments(parser, experiment="gaexp-tune_lr")
    parser.add_argument("--study", default="tune_lr", help="the search's study_name (default: %(default)s)")
    parser.add_argument("--seeds", default="1,2,3", help="seeds of the reruns (default: %(default)s)")
    parser.add_argument("--run", action="store_true", help="run the commands (default: print them)")
    parser.add_argument("overrides", nargs="*", help="more overrides for every rerun, e.g. launch=joblib "
                                                     "mlflow.experiment_name=gaexp-tune_lr-test")
    args = parser.parse_args(argv)
    arguments.require_store(args.tracking_uri)
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")  # one config.yaml per study: no bars
    try:
        with arguments.store_errors(args.tracking_uri):
            commands = tuned_commands(MlflowClient(args.tracking_uri), args.experiment, args.study, args.seeds,
                                      args.overrides)
    except ValueError as e:
        sys.exit(mask(f"error: {e}"))
    for name, outcome, overrides in commands:
        print(f"{name}: best trial {outcome['trial']}, value {outcome['value']:.4f}, "
              + ", ".join(f"{k}={v}" for k, v in outcome.items() if k not in ("trial", "value")))
        print("  gaexp -m " + " ".join(overrides))
        if args.run:
            proc = subprocess.run([sys.executable, "-m", "gaexp", "-m", *overrides])
            if proc.returncode:
                sys.exit(f"error: the rerun of {name} exited {proc.returncode}")


if __name__ == "__main__":
    main()
