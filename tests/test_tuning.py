"""gaexp/tuning.py: an Optuna search's studies in MLflow and `gaexp-tuned`, rerunning each study's best trial as
a run of the grid on its own dataset."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.test_sweeper_studies import HOLDOUT, study_args, study_of


@pytest.mark.slow
def test_gaexp_tuned_reruns_the_best_trials_protocol_on_its_dataset(tmp_path, gaexp_command, training_runs,
                                                                    fashion_root):
    """A Fashion-MNIST search was rerun on MNIST: gaexp-tuned rebuilt the command from norm, regime, train
    and device only. Now the reruns are the best trial's own overrides, with the test set and the seeds."""
    proc = gaexp_command(tmp_path, *study_args(tmp_path), "data=fashion_mnist", f"data.root={fashion_root}",
                         "hydra.sweeper.n_trials=2", "hydra.sweeper.n_jobs=1", f"data.holdout={HOLDOUT}",
                         "train.lr=tag(log, interval(1e-4, 1e-2))", "hydra.sweeper.sampler.seed=3",
                         "train.eval_period=20")  # one evaluation a cell: the reruns' are of the 10,000 test images
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    best = study_of(tmp_path, "t").best_trial
    tuned = subprocess.run([sys.executable, "-m", "gaexp.tuning", "--run", "--tracking-uri",
                            f"sqlite:///{tmp_path}/mlflow.db", "--experiment", "gaexp", "--study", "t", "--seeds", "1,2"],
                           cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert tuned.returncode == 0, tuned.stdout[-3000:] + tuned.stderr[-3000:]
    _, runs = training_runs(f"sqlite:///{tmp_path}/mlflow.db")
    for seed in (1, 2):
        rerun = runs.get(f"fashion_mnist-gn4-bs16a1-s{seed}")  # no trial number: a run of the grid, on its dataset
        assert rerun is not None, (sorted(runs), tuned.stdout[-3000:], tuned.stderr[-2000:])
        assert rerun.info.status == "FINISHED" and "optuna.study" not in rerun.data.tags
        assert (rerun.data.tags["dataset"], rerun.data.params["data.holdout"], rerun.data.params["train.num_iterations"]) \
            == ("fashion_mnist", "0", "20")
        assert float(rerun.data.params["train.lr"]) == best.params["train.lr"]
