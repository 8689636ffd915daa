"""The study's grid is read from its study file: what the tools cost and generate is what `make sweep` runs."""

from gaexp.tools import bench, storegen
from gaexp.config import compose_config
from gaexp.study import study


def test_the_study_is_its_files_grid_at_the_full_protocol():
    spec = study()
    cfg = compose_config(["+experiment=spec"], hydra=True)
    params = cfg.hydra.sweeper.params
    assert (",".join(spec.norms), ",".join(spec.regimes), ",".join(map(str, spec.seeds))) == (
        params.norm, params.regime, params.seed)
    assert (spec.steps, spec.eval_period, spec.evaluations) == (cfg.train.num_iterations, cfg.train.eval_period, 12)
    assert spec.shapes == {"bs1a1": (1, 1), "bs1a16": (1, 16), "bs4a4": (4, 4), "bs16a1": (16, 1)}
    assert spec.cells == 60 == len(storegen.cells())
    assert bench.STUDY == spec


def test_a_study_file_with_its_own_budget_and_grid_is_read_as_written(tmp_path):
    (tmp_path / "experiment").mkdir()
    (tmp_path / "experiment" / "mine.yaml").write_text(
        "# @package _global_\nhydra:\n  sweeper:\n    params:\n      norm: gn4,bn_sync\n      regime: w2b4a2,bs3a5\n"
        "      seed: 1,2,3,4\ntrain:\n  num_iterations: 600\n  eval_period: 100\n")
    mine = study("mine", str(tmp_path))
    assert (mine.norms, mine.regimes, mine.seeds) == (("gn4", "bn_sync"), ("w2b4a2", "bs3a5"), (1, 2, 3, 4))
    assert (mine.steps, mine.evaluations, mine.cells) == (600, 6, 16)
    assert mine.shapes == {"w2b4a2": (4, 2), "bs3a5": (3, 5)}
