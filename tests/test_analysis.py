from __future__ import annotations

import dataclasses
import subprocess
import sys

import warnings

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import pytest
from mlflow.tracking import MlflowClient
from scipy import stats

from gaexp import analysis, tracking
from gaexp import tags as runtags
from gaexp.analysis import AnalysisError, collect, load_study, plot_curves, summarize
from gaexp.config import AnalysisConfig
from tests.conftest import add_run

STUDY = AnalysisConfig()  # the study's design: conf/experiment/spec.yaml states the same

STEPS = (300, 600, 900)
# (norm, regime, seed) -> valid_acc at STEPS; chosen so every mean can be checked by hand
HISTORIES = {
    ("bn", "bs16a1", 1): (0.90, 0.92, 0.94), ("bn", "bs16a1", 2): (0.80, 0.82, 0.84),
    ("bn", "bs1a16", 1): (0.50, 0.60, 0.70), ("bn", "bs1a16", 2): (0.40, 0.45, 0.50),
    ("bn", "bs4a4", 1): (0.88, 0.90, 0.92), ("bn", "bs4a4", 2): (0.80, 0.84, 0.88),
    ("bn", "bs1a1", 1): (0.30, 0.40, 0.50), ("bn", "bs1a1", 2): (0.20, 0.30, 0.40),
    ("gn4", "bs16a1", 1): (0.90, 0.91, 0.92), ("gn4", "bs16a1", 2): (0.86, 0.87, 0.88),
    ("gn4", "bs1a16", 1): (0.90, 0.91, 0.92), ("gn4", "bs1a16", 2): (0.86, 0.87, 0.88),
}


@pytest.fixture
def store(tmp_path):
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    experiment_id = tracking.prepare_store(uri, "gaexp", str(tmp_path / "artifacts"))
    client = MlflowClient(uri)
    for (norm, regime, seed), accs in HISTORIES.items():
        add_run(client, experiment_id, norm, regime, seed, accs)
    return client, experiment_id, uri


def test_collect_is_tidy(store):
    client, _, _ = store
    collected = collect(client, "gaexp", "latest")
    data = collected.data
    assert list(data.columns) == analysis.TIDY and len(data) == 3 * len(HISTORIES)
    row = data[(data.norm == "bn") & (data.regime == "bs1a16") & (data.seed == 2) & (data.step == 600)].iloc[0]
    assert (row.valid_acc, row.train_loss, row.batch_size, row.num_accum) == (0.45, pytest.approx(0.55), 1, 16)
    assert collected.sweep == "sweep-a" and collected.excluded.empty


def test_table_equals_hand_computed_means(store):
    client, _, _ = store
    summary = summarize(collect(client, "gaexp").data, STUDY)
    table = summary.table
    assert list(table.columns) == ["bs16a1", "bs1a16", "bs4a4"] and list(table.index) == ["bn", "gn4"]
    assert table.loc["bn", "bs16a1"] == pytest.approx((0.90 + 0.92 + 0.94 + 0.80 + 0.82 + 0.84) / 6, abs=1e-12)
    assert table.loc["bn", "bs1a16"] == pytest.approx((0.50 + 0.60 + 0.70 + 0.40 + 0.45 + 0.50) / 6, abs=1e-12)
    assert table.loc["bn", "bs4a4"] == pytest.approx((0.88 + 0.90 + 0.92 + 0.80 + 0.84 + 0.88) / 6, abs=1e-12)
    assert table.loc["gn4", "bs1a16"] == pytest.approx(0.89, abs=1e-12)
    assert np.isnan(table.loc["gn4", "bs4a4"])

    cell = summary.cells.loc[("bn", "bs1a16")]
    assert cell["mean"] == pytest.approx((0.6 + 0.45) / 2) and cell["std"] == pytest.approx(np.std([0.6, 0.45], ddof=1))
    assert cell.seeds == 2 and cell.final_acc == pytest.approx((0.70 + 0.50) / 2)


def test_window_start_keeps_only_later_evaluations(store):
    client, _, _ = store
    summary = summarize(collect(client, "gaexp").data, AnalysisConfig(window_start=600))
    assert summary.table.loc["bn", "bs16a1"] == pytest.approx((0.94 + 0.84) / 2, abs=1e-12)
    assert summary.table.loc["bn", "bs1a16"] == pytest.approx((0.70 + 0.50) / 2, abs=1e-12)
    short = summarize(collect(client, "gaexp").data, AnalysisConfig(window_start=900))  # a budget below the window
    assert short.table.loc["bn", "bs16a1"] == pytest.approx((0.90 + 0.92 + 0.94 + 0.80 + 0.82 + 0.84) / 6, abs=1e-12)
    assert short.window_note.startswith("every evaluation (none after step 900, the window's start: the last is at "
                                        "step 900;")
    assert analysis.format_table(short).startswith("mnist: mean valid accuracy (%) over every evaluation (none after "
                                                   "step 900")
    assert not summarize(collect(client, "gaexp").data, AnalysisConfig(window_start=600)).window_note


def test_a_subset_grid_reports_only_what_it_ran(tmp_path):
    """A sweep of bn, gn4 x bs1a16, bs16a1: no bs4a4 column of dashes, no cells missing that it never asked for."""
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    experiment_id = tracking.prepare_store(uri, "gaexp", str(tmp_path / "artifacts"))
    client = MlflowClient(uri)
    for (norm, regime, seed), accs in HISTORIES.items():
        if regime in ("bs1a16", "bs16a1"):
            add_run(client, experiment_id, norm, regime, seed, accs)
    summary = summarize(collect(client, "gaexp").data, STUDY)
    assert list(summary.table.columns) == ["bs16a1", "bs1a16"] and summary.missing == []
    text = analysis.format_table(summary)
    assert "bs4a4" not in text and "Missing cells" not in text
    add_run(client, experiment_id, "gn4", "bs4a4", 1, (0.9, 0.9, 0.9))  # now asked for: bn/bs4a4 is missing
    summary = summarize(collect(client, "gaexp").data, STUDY)
    assert list(summary.table.columns) == ["bs16a1", "bs1a16", "bs4a4"]
    assert summary.missing == ["bn/bs4a4: no run", "gn4/bs4a4: 1 of 2 seeds"]


def test_paired_differences_with_t_intervals(store):
    client, _, _ = store
    paired = summarize(collect(client, "gaexp").data, STUDY).paired.set_index(["norm", "regime"])
    diffs = np.array([0.6 - 0.92, 0.45 - 0.82])  # per seed: windowed means of bs1a16 minus bs16a1
    half = 12.706204736174707 * diffs.std(ddof=1) / np.sqrt(2)  # t(0.975, df=1)
    bn = paired.loc[("bn", "bs1a16")]
    assert bn["diff"] == pytest.approx(diffs.mean()) and bn.pairs == 2
    assert (bn.ci_low, bn.ci_high) == (pytest.approx(diffs.mean() - half), pytest.approx(diffs.mean() + half))
    assert (bn.sd_a, bn.sd_b) == (pytest.approx(np.std([0.6, 0.45], ddof=1)), pytest.approx(np.std([0.92, 0.82], ddof=1)))
    assert bn.verdict == "worse" and bn.ci_high < 0  # 2 pairs, -0.32 and -0.37: clear of 0 even at t(1)
    gn = paired.loc[("gn4", "bs1a16")]  # the same accuracies, seed for seed: a difference of exactly 0
    assert gn["diff"] == pytest.approx(0.0, abs=1e-12) and gn.verdict == "equivalent"
    assert ("gn4", "bs4a4") not in paired.index


def seeds(mean: float, sd: float, n: int) -> np.ndarray:
    """n values whose mean and standard deviation (ddof=1) are exactly these."""
    z = np.linspace(-1, 1, n) + 0.1 * np.sin(np.arange(n))
    z = (z - z.mean()) / z.std(ddof=1)
    return mean + sd * z


def paired(diffs_points: np.ndarray, margin: float = 0.5, base: float = 0.9) -> dict:
    """paired_verdict of two cells (fractions) whose same-seed differences are these, in points."""
    b = pd.Series(base + 0.01 * np.cos(np.arange(len(diffs_points))), index=range(1, len(diffs_points) + 1))
    return analysis.paired_verdict(b + np.asarray(diffs_points) / 100, b, margin / 100)


def tost_p(d: np.ndarray, margin: float) -> float:
    """The paired TOST p-value by its definition: the larger of the two one-sided t-tests' p-values."""
    n, se = len(d), d.std(ddof=1) / np.sqrt(len(d))
    return max(stats.t.sf((d.mean() + margin) / se, n - 1), stats.t.cdf((d.mean() - margin) / se, n - 1))


@pytest.mark.parametrize("diffs, verdict", [
    ([0.05, -0.03, 0.02, 0.0, 0.04, -0.02], "equivalent"),  # clearly inside ±0.5
    ([-8.0, -9.5, -10.2], "worse"),                          # clearly below 0
    ([2.9, 3.2, 2.8], "better"),
    ([0.1, -0.6, 0.4], "inconclusive"),                      # 0 inside a wide interval: never "equivalent"
    ([-12.1, -28.0, 3.8], "inconclusive"),                   # the tuned BatchNorm row the old table called a match
    ([0.45, 0.55, 0.50, 0.48, 0.52], "better"),             # tight, on the margin: not equivalent, clear of 0
])
def test_verdicts_of_paired_samples_with_known_answers(diffs, verdict):
    d = np.array(diffs) / 100
    out = paired(diffs)
    assert out["verdict"] == verdict and out["pairs"] == len(diffs)
    assert out["diff"] == pytest.approx(d.mean(), abs=1e-12)
    half = stats.t.ppf(0.975, len(d) - 1) * d.std(ddof=1) / np.sqrt(len(d))
    assert (out["ci_low"], out["ci_high"]) == (pytest.approx(d.mean() - half, abs=1e-12),
                                               pytest.approx(d.mean() + half, abs=1e-12))
    assert out["p_equivalent"] == pytest.approx(tost_p(d, 0.005), rel=1e-9)
    assert (out["seeds_needed"] is None) == (verdict != "inconclusive")


def test_equivalent_needs_the_tost_not_just_zero_inside_the_interval():
    """The same samples at two margins: inside ±0.5 (equivalent), not shown inside ±0.02 (inconclusive)."""
    diffs = [0.05, -0.03, 0.02, 0.0, 0.04, -0.02]
    assert paired(diffs, margin=0.5)["verdict"] == "equivalent"
    narrow = paired(diffs, margin=0.02)
    assert narrow["verdict"] == "inconclusive" and narrow["ci_low"] < 0 < narrow["ci_high"]


@pytest.mark.parametrize("mean, sd", [(0.1, 0.4), (-0.2, 0.3), (-1.0, 1.5), (0.3, 0.2)])
def test_the_suggested_seed_count_is_the_first_that_settles_it(mean, sd):
    """With the observed mean and spread held, the suggested n gives a verdict and n - 1 does not."""
    first = paired(seeds(mean, sd, 3))
    assert first["verdict"] == "inconclusive"
    n = first["seeds_needed"]
    assert n is not None and n > 3
    assert paired(seeds(mean, sd, n))["verdict"] != "inconclusive"
    assert paired(seeds(mean, sd, n - 1))["verdict"] == "inconclusive" or n - 1 == 3


def test_a_spread_no_seed_count_settles_says_so():
    near = paired([0.49, -0.45, 0.6])  # a mean of 0.21 with a spread of 0.58: settled within MAX_SEEDS
    assert (near["verdict"], near["seeds_needed"]) == ("inconclusive", 13)
    far = paired(seeds(0.49, 3.0, 3))  # a mean next to the margin, a huge spread
    assert far["seeds_needed"] is None
    assert analysis.verdict_text(far["verdict"], far["seeds_needed"]) == "inconclusive (over 100 seeds)"
    assert analysis.verdict_text("inconclusive", 7) == "inconclusive (7 seeds)"


def test_one_seed_has_no_verdict_and_identical_cells_are_equivalent():
    one = paired([0.3])
    assert one["verdict"] == "n/a (1 seed)" and np.isnan(one["ci_low"]) and one["pairs"] == 1
    with warnings.catch_warnings():  # a zero spread is answered directly, not by tests dividing by it
        warnings.simplefilter("error")
        same = paired([0.0, 0.0, 0.0])
        shifted = paired([0.7, 0.7, 0.7])  # every seed exactly 0.7 better: outside ±0.5 with no doubt
    assert (same["verdict"], same["ci_low"], same["ci_high"]) == ("equivalent", 0.0, 0.0)
    assert shifted["verdict"] == "better" and shifted["ci_low"] == pytest.approx(0.007)


def test_the_margin_is_validated_and_printed_in_every_table_header(store):
    for bad in (0, -0.5, 100, 250.0, float("nan")):
        with pytest.raises(ValueError, match=rf"analysis.margin={bad!r}; valid: a number in \(0, 100\)"):
            AnalysisConfig(margin=bad)
    client, _, _ = store
    text = analysis.format_table(summarize(collect(client, "gaexp").data, AnalysisConfig(margin=0.25)))
    paired_part, ranking_part = text.split("Ranking on bs1a16")
    assert "verdict at a margin of ±0.25 points" in paired_part and "| verdict (±0.25) |" in paired_part
    assert "margin of ±0.25 points" in ranking_part and "| verdict (±0.25) |" in ranking_part and "yes" not in text
    assert "| gn4 | bs1a16 | +0.00 | [+0.00, +0.00] | 2.83 / 2.83 | 2 | equivalent |" in text


def test_ranking_on_bs1a16_against_both_baselines(store, tmp_path):
    client, experiment_id, _ = store
    for norm, seed, accs in [("in", 1, (0.95, 0.96, 0.97)), ("in", 2, (0.93, 0.94, 0.95)),
                             ("bn_microeval", 1, (0.93, 0.94, 0.95)), ("bn_microeval", 2, (0.90, 0.91, 0.92))]:
        add_run(client, experiment_id, norm, "bs1a16", seed, accs)
    summary = summarize(collect(client, "gaexp").data, STUDY)
    ranking = summary.ranking.set_index("norm")
    assert list(ranking.index) == ["in", "bn_microeval", "gn4", "bn"]  # by mean: 0.95, 0.925, 0.89, 0.525
    assert list(ranking["rank"]) == [1, 2, 3, 4] and ranking.loc["bn_microeval", "mean"] == pytest.approx(0.925)
    fix = ranking.loc["bn_microeval"]
    to_bn, to_in = np.array([0.94 - 0.92, 0.91 - 0.82]), np.array([0.94 - 0.96, 0.91 - 0.94])  # same-seed pairs
    for diffs, name in [(to_bn, "bn/bs16a1"), (to_in, "in/bs1a16")]:
        half = 12.706204736174707 * diffs.std(ddof=1) / np.sqrt(2)
        assert fix[f"vs {name}"] == pytest.approx(diffs.mean())
        assert (fix[f"vs {name} low"], fix[f"vs {name} high"]) == (pytest.approx(diffs.mean() - half),
                                                                  pytest.approx(diffs.mean() + half))
    assert ranking.loc["in", "vs in/bs1a16"] == 0.0
    assert fix.sd == pytest.approx(np.std([0.94, 0.91], ddof=1))
    assert ranking.loc["in", "vs in/bs1a16 verdict"] == "baseline"
    text = analysis.format_table(summary)
    assert ("| 2 | bn_microeval | 92.50 | 2.12 | 2 | +5.50 [-38.97, +49.97] | inconclusive (6 seeds) | "
            "-2.50 [-8.85, +3.85] | inconclusive (3 seeds) |") in text
    assert "| 1 | in | 95.00 | 1.41 | 2 | +8.00 [-42.82, +58.82] | inconclusive (5 seeds) | 0 (baseline) |  |" in text


def test_missing_and_failed_runs_are_reported_not_averaged(store, tmp_path):
    client, experiment_id, _ = store
    add_run(client, experiment_id, "gn4", "bs4a4", 1, (0.1, 0.1, 0.1), status="FAILED")
    add_run(client, experiment_id, "gn4", "bs1a1", 1, (0.5, 0.6, 0.7))
    collected = collect(client, "gaexp")
    assert collected.excluded.run_name.tolist() == ["gn4-bs4a4-s1"] and collected.excluded.status.tolist() == ["FAILED"]
    summary = summarize(collected.data, STUDY)
    assert np.isnan(summary.table.loc["gn4", "bs4a4"])
    assert summary.missing == ["gn4/bs1a1: 1 of 2 seeds", "gn4/bs4a4: no run"]
    analysis.export(collected, summary, tmp_path / "report")
    text = (tmp_path / "report" / "table.md").read_text()
    assert "Missing cells: gn4/bs1a1: 1 of 2 seeds; gn4/bs4a4: no run" in text
    assert "Excluded runs (not FINISHED): gn4-bs4a4-s1 (FAILED)" in text


def test_data_parallel_cells_against_their_accumulation_twins(tmp_path):
    """Each DP column paired with its twin (b, w*k) of the same seeds, with its normalization and optimization
    batches; a DP cell whose twin did not run has no row."""
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    experiment_id = tracking.prepare_store(uri, "gaexp", str(tmp_path / "artifacts"))
    client = MlflowClient(uri)
    for seed, (dp, twin, sync, big) in enumerate([(0.950, 0.951, 0.970, 0.972), (0.960, 0.958, 0.975, 0.974),
                                                  (0.955, 0.956, 0.972, 0.973)], start=1):
        for norm, regime, acc in [("bn", "w4b1a4", dp), ("bn", "bs1a16", twin), ("bn_sync", "w4b1a4", sync),
                                  ("bn", "bs16a1", big), ("bn_sync", "bs16a1", big), ("bn", "w2b8a1", dp)]:
            add_run(client, experiment_id, norm, regime, seed, (acc,) * 3)
    design = AnalysisConfig(table_columns=["bs16a1", "bs1a16", "w4b1a4", "w2b8a1"], margin=0.5)
    summary = summarize(collect(client, "gaexp").data, design)
    twins = summary.twins.set_index(["norm", "regime"])
    assert list(twins.index) == [("bn", "w4b1a4")]  # bn/w2b8a1's twin bs8a2 and bn_sync's bs1a16 did not run
    row = twins.loc["bn", "w4b1a4"]
    assert (row.twin, row.norm_batch, row.opt_batch, row.pairs) == ("bs1a16", 1, 16, 3)
    assert row["diff"] == pytest.approx(0.0) and row.verdict == "equivalent"
    text = analysis.format_table(summary)
    assert "| bn | w4b1a4 | bs1a16 | 1 | 16 | +0.00 |" in text
    assert analysis.twin_of("w4b1a4") == "bs1a16" and analysis.twin_of("w2b4a2") == "bs4a4"
    assert analysis.twin_of("bs4a4") is None and analysis.twin_of("mine") is None
    synchronized = analysis.twins(pd.Series({("bn_sync", "w4b1a4", 1): 0.9, ("bn_sync", "bs1a16", 1): 0.9}),
                                  ["bn_sync"], ["w4b1a4"], 0.005)
    assert synchronized.norm_batch.tolist() == [4]  # statistics over the 4 replicas' micro-batches of 1


def test_studies_are_config_files():
    assert load_study("spec") == STUDY
    assert load_study("tune_lr").per_cell == ["lr"] and load_study("spec_resnet20").window_start == 200
    fixes = load_study("bn_fixes")
    assert fixes.norm_order[:4] == ["bn", "in", "ln", "in_affine"] and fixes.baselines == STUDY.baselines
    assert load_study("precision").baselines == ["bn/bs16a1", "gn4/bs1a16"]  # the study's best norm there ran gn4
    assert load_study("dp").table_columns == ["bs16a1", "bs1a16", "bs4a4", "bs8a2", "w2b8a1", "w4b4a1", "w2b4a2", "w4b1a4"]
    with pytest.raises(AnalysisError, match=r"--study 'nope': no file .*nope.yaml; valid: \['bn_fixes', 'contrastive', 'dp', 'lm', 'moe', 'precision', 'spec', 'spec_cifar10', 'spec_resnet20', 'tune_lr'\]"):
        load_study("nope")


def test_a_study_design_changes_the_report(store):
    client, _, _ = store
    design = AnalysisConfig(table_columns=["bs16a1", "bs4a4"], ranked_regime="bs4a4", baselines=["bn/bs16a1"])
    summary = summarize(collect(client, "gaexp").data, design)
    assert list(summary.table.columns) == ["bs16a1", "bs4a4"] and list(summary.paired.regime) == ["bs4a4"]
    assert list(summary.ranking.norm) == ["bn"] and "vs bn/bs16a1" in summary.ranking.columns
    assert "vs in/bs1a16" not in summary.ranking.columns


def test_a_tuned_table_lets_lr_differ_between_cells_only(tmp_path):
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    experiment_id = tracking.prepare_store(uri, "gaexp", str(tmp_path / "artifacts"))
    client = MlflowClient(uri)
    for regime, lr in (("bs16a1", 0.003), ("bs1a16", 0.0005)):
        for seed in (1, 2):
            add_run(client, experiment_id, "gn4", regime, seed, (0.9, 0.9, 0.9), lr=lr)
    tuned = AnalysisConfig(per_cell=["lr"], table_columns=["bs16a1", "bs1a16"])
    with pytest.raises(AnalysisError, match=r"2 different protocols .*lr=0.003"):
        summarize(collect(client, "gaexp").data, STUDY)  # the study's design pools one lr only
    summary = summarize(collect(client, "gaexp").data, tuned)
    assert summary.cells.loc[("gn4", "bs1a16"), "lr"] == 0.0005 and summary.cells.loc[("gn4", "bs16a1"), "lr"] == 0.003
    assert "| gn4 | bs1a16 | 0.0005 | 90.00 |" in analysis.format_table(summary)
    add_run(client, experiment_id, "gn4", "bs1a16", 3, (0.9, 0.9, 0.9), lr=0.01)
    with pytest.raises(AnalysisError, match=r"lr differs within the cell gn4/bs1a16"):
        summarize(collect(client, "gaexp").data, tuned)


def test_different_protocols_are_refused(store):
    client, experiment_id, _ = store
    add_run(client, experiment_id, "gn4", "bs4a4", 1, (0.9, 0.9), num_iterations=1200, eval_period=600)
    with pytest.raises(AnalysisError, match="2 different protocols .*num_iterations=1200.*--sweep"):
        summarize(collect(client, "gaexp").data, STUDY)


def test_datasets_never_pool_and_one_is_selected(store, tmp_path, capsys):
    client, experiment_id, uri = store
    for (norm, regime, seed), accs in HISTORIES.items():  # the same cells on Fashion-MNIST, 0.1 lower
        add_run(client, experiment_id, norm, regime, seed, [a - 0.1 for a in accs], dataset="fashion_mnist")
    add_run(client, experiment_id, "in", "bs1a16", 1, (0.5,), dataset="fashion_mnist", status="FAILED")
    with pytest.raises(AnalysisError, match=r"runs of 2 datasets \(fashion_mnist, mnist\) never pool; "
                                            r"choose one with --dataset"):
        summarize(collect(client, "gaexp").data, STUDY)

    mnist = summarize(collect(client, "gaexp", dataset="mnist").data, STUDY)  # runs recorded before: mnist
    fashion_collected = collect(client, "gaexp", dataset="fashion_mnist")
    fashion = summarize(fashion_collected.data, STUDY)
    assert fashion_collected.excluded.run_name.tolist() == ["fashion_mnist-in-bs1a16-s1"]
    assert (mnist.dataset, fashion.dataset) == ("mnist", "fashion_mnist")
    assert mnist.table.loc["bn", "bs1a16"] == pytest.approx((0.50 + 0.60 + 0.70 + 0.40 + 0.45 + 0.50) / 6, abs=1e-12)
    assert np.allclose(fashion.table.values, mnist.table.values - 0.1, equal_nan=True)
    with pytest.raises(AnalysisError, match=r"--dataset 'cifar10': no such runs in sweep 'sweep-a'; "
                                            r"there: \['fashion_mnist', 'mnist'\]"):
        collect(client, "gaexp", dataset="cifar10")

    made = analysis.report_each_part(uri, "gaexp", "sweep-a", STUDY, tmp_path / "r")  # the end of a sweep
    assert [(name, written[0]) for _, name, _, written in made] == [
        ("fashion_mnist", tmp_path / "r" / "fashion_mnist" / "table.md"), ("mnist", tmp_path / "r" / "mnist" / "table.md")]
    assert (tmp_path / "r" / "fashion_mnist" / "table.md").read_text().startswith("fashion_mnist: mean valid accuracy")
    assert "fashion_mnist-in-bs1a16-s1 (FAILED)" in (tmp_path / "r" / "fashion_mnist" / "table.md").read_text()
    assert "FAILED" not in (tmp_path / "r" / "mnist" / "table.md").read_text()
    assert {"curves.png", "curves.pdf", "train_loss.png"} <= {p.name for p in (tmp_path / "r" / "mnist").iterdir()}
    tables = analysis.report_each_part(uri, "gaexp", "sweep-a", dataclasses.replace(STUDY, plots=False), tmp_path / "t")
    assert [written[0] for _, _, _, written in tables] == [tmp_path / "t" / "fashion_mnist" / "table.md",
                                                          tmp_path / "t" / "mnist" / "table.md"]
    assert not list((tmp_path / "t").rglob("*.p[nd][gf]"))  # analysis.plots=false: the tables, no figure

    analysis.main(["--tracking-uri", uri, "--dataset", "fashion_mnist", "--out", str(tmp_path / "cli")])
    assert capsys.readouterr().out.startswith("sweep: sweep-a  dataset: fashion_mnist  runs: 12 finished, 1 excluded")
    with pytest.raises(SystemExit, match=r"error: runs of 2 datasets .*--dataset"):
        analysis.main(["--tracking-uri", uri, "--out", str(tmp_path / "cli")])


def test_models_never_pool_one_report_each_and_one_is_selected(store, tmp_path, capsys):
    client, experiment_id, uri = store
    for (norm, regime, seed), accs in HISTORIES.items():  # the same cells on resnet20, 0.05 higher
        add_run(client, experiment_id, norm, regime, seed, [a + 0.05 for a in accs], model="resnet20")
    with pytest.raises(AnalysisError, match=r"^runs of 2 models \(resnet20, simple\) never pool; choose one with --model$"):
        summarize(collect(client, "gaexp").data, STUDY)
    simple = summarize(collect(client, "gaexp", model="simple").data, STUDY)  # runs recorded before: simple
    resnet = summarize(collect(client, "gaexp", model="resnet20").data, STUDY)
    assert np.allclose(resnet.table.values, simple.table.values + 0.05, equal_nan=True)
    assert (simple.label, resnet.label) == ("mnist", "mnist, resnet20")
    with pytest.raises(AnalysisError, match=r"--model 'vgg': no such runs in sweep 'sweep-a'; there: \['resnet20', 'simple'\]"):
        collect(client, "gaexp", model="vgg")

    made = analysis.report_each_part(uri, "gaexp", "sweep-a", STUDY, tmp_path / "r")
    assert [(part, name, written[0]) for part, name, _, written in made] == [
        ({"dataset": "mnist", "model": "resnet20", "precision": "fp32"}, "resnet20", tmp_path / "r" / "resnet20" / "table.md"),
        ({"dataset": "mnist", "model": "simple", "precision": "fp32"}, "simple", tmp_path / "r" / "simple" / "table.md")]
    assert (tmp_path / "r" / "resnet20" / "table.md").read_text().startswith("mnist, resnet20: mean valid accuracy")
    assert (tmp_path / "r" / "simple" / "table.md").read_text().startswith("mnist: mean valid accuracy")

    analysis.main(["--tracking-uri", uri, "--model", "resnet20", "--out", str(tmp_path / "cli")])
    assert capsys.readouterr().out.startswith("sweep: sweep-a  dataset: mnist  model: resnet20  runs: 12 finished")
    with pytest.raises(SystemExit, match=r"error: runs of 2 models .*--model"):
        analysis.main(["--tracking-uri", uri, "--out", str(tmp_path / "cli")])


def test_sweep_selection(store):
    client, experiment_id, _ = store
    add_run(client, experiment_id, "gn4", "bs4a4", 1, (0.9, 0.9, 0.9), sweep="sweep-b")
    assert collect(client, "gaexp", "latest").data.sweep_id.unique().tolist() == ["sweep-b"]
    assert collect(client, "gaexp", "sweep-a").data.run_id.nunique() == len(HISTORIES)
    assert collect(client, "gaexp", "all").data.run_id.nunique() == len(HISTORIES) + 1
    assert collect(client, "gaexp", "sweep-a,sweep-b").data.run_id.nunique() == len(HISTORIES) + 1
    with pytest.raises(AnalysisError, match=r"no sweep 'nope' .*\['sweep-a', 'sweep-b'\]"):
        collect(client, "gaexp", "nope")
    with pytest.raises(AnalysisError, match=r"no experiment 'other' .*\['gaexp', 'Default'\]"):
        collect(client, "other")


def test_figures_have_a_panel_per_norm_and_a_line_per_regime(store):
    client, _, _ = store
    data = collect(client, "gaexp").data
    fig = plot_curves(data)
    axes = [ax for ax in fig.axes if ax.get_title()]
    assert [ax.get_title() for ax in axes] == ["bn", "gn4"]
    assert [line.get_label() for line in axes[0].lines] == ["bs1a1", "bs1a16", "bs4a4", "bs16a1"]
    assert [line.get_label() for line in axes[1].lines] == ["bs1a16", "bs16a1"]
    mean_line = axes[0].lines[1]  # bn/bs1a16: mean over the two seeds at each step
    assert list(mean_line.get_xdata()) == list(STEPS)
    assert np.allclose(mean_line.get_ydata(), [45, 52.5, 60])  # %, as the tables
    assert axes[0].get_ylim() == axes[1].get_ylim() and axes[0].get_ylabel() == "validation accuracy (%)"
    plt.close(fig)
    fig = plot_curves(data.assign(step=data.step // STEPS[0]))  # a short run: evaluations at steps 1, 2, 3
    fig.canvas.draw()
    assert all(float(t).is_integer() for t in fig.axes[0].get_xticks())
    plt.close(fig)
    fig = plot_curves(data, "train_loss")
    assert fig.axes[0].get_yscale() == "log"
    plt.close(fig)


def test_export_writes_every_file(store, tmp_path):
    client, _, uri = store
    summary, collected, written = analysis.report(uri, "gaexp", out=tmp_path / "r")
    assert sorted(p.name for p in written) == sorted(
        ["table.md", "table.csv", "cells.csv", "paired.csv", "runs.csv", "ranking.csv",
         "curves.png", "curves.pdf", "train_loss.png", "train_loss.pdf"])
    assert all(p.stat().st_size > 0 for p in written)
    table = pd.read_csv(tmp_path / "r" / "table.csv", index_col="norm")
    assert table.loc["bn", "bs16a1"] == pytest.approx(summary.table.loc["bn", "bs16a1"])
    assert (tmp_path / "r" / "curves.png").read_bytes()[:4] == b"\x89PNG"


def test_cli_errors_are_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        analysis.main(["--tracking-uri", f"sqlite:///{tmp_path}/none.db"])
    assert info.value.code == f"error: no MLflow store at sqlite:///{tmp_path}/none.db"
    assert not (tmp_path / "none.db").exists()


def test_the_cli_takes_a_margin_and_refuses_a_bad_one(store, tmp_path, capsys):
    _, _, uri = store
    analysis.main(["--tracking-uri", uri, "--margin", "0.25", "--out", str(tmp_path / "r")])
    assert "| verdict (±0.25) |" in capsys.readouterr().out
    with pytest.raises(SystemExit) as info:
        analysis.main(["--tracking-uri", uri, "--margin", "0", "--out", str(tmp_path / "bad")])
    assert info.value.code == "error: analysis.margin=0.0; valid: a number in (0, 100)"
    assert not (tmp_path / "bad").exists()


def test_memory_table_per_regime(tmp_path):
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    experiment_id = tracking.prepare_store(uri, "gaexp", str(tmp_path / "artifacts"))
    client = MlflowClient(uri)
    for regime, act, speed in (("bs16a1", 8.0, 800.0), ("bs1a16", 0.5, 300.0), ("bs4a4", 2.0, 500.0)):
        for seed, rss in ((1, 900.0), (2, 1000.0)):
            add_run(client, experiment_id, "gn4", regime, seed, (0.9, 0.9, 0.9),
                    summary={"activation_mb": act, "samples_per_sec": speed * seed, "wall_seconds": 10.0 * seed,
                             "peak_rss_mb": rss})
    collected = collect(client, "gaexp")
    memory = analysis.memory_table(collected.runs, STUDY)
    assert list(memory.index) == ["bs1a16", "bs4a4", "bs16a1"]
    assert memory.loc["bs1a16", "activation_vs_bs16a1"] == 0.5 / 8.0
    assert memory.loc["bs4a4", ["micro_batch", "effective_batch", "runs"]].tolist() == [4, 16, 2]
    assert memory.loc["bs1a16", "samples_per_sec"] == 450.0 and memory.loc["bs16a1", "peak_rss_mb"] == 1000.0
    assert "cuda_max_mem_mb" not in memory.columns  # never logged on the CPU
    analysis.export(collected, summarize(collected.data, STUDY), tmp_path / "r")
    assert "| bs1a16 | 1 | 16 | 2 | 0.062 | 0.50 | 450 | 15 | 1000 |" in (tmp_path / "r" / "table.md").read_text()


def test_a_batched_grids_memory_table_keeps_the_loops_activations_and_adds_its_own(tmp_path):
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    experiment_id = tracking.prepare_store(uri, "gaexp", str(tmp_path / "artifacts"))
    client = MlflowClient(uri)
    for regime, act in (("bs16a1", 8.0), ("bs1a16", 0.5)):
        for seed, rss in ((1, 1200.0), (2, 1300.0)):
            add_run(client, experiment_id, "gn4", regime, seed, (0.9, 0.9, 0.9),
                    summary={"activation_mb": act, "batched_activation_mb": 8.0, "samples_per_sec": 900.0,
                             "wall_seconds": 10.0, "batched_peak_rss_mb": rss})
    collected = collect(client, "gaexp")
    memory = analysis.memory_table(collected.runs, STUDY)
    assert memory.loc["bs1a16", ["activation_mb", "activation_vs_bs16a1", "batched_activation_mb"]].tolist() == \
        [0.5, 0.5 / 8.0, 8.0]
    assert memory.loc["bs1a16", "batched_peak_rss_mb"] == 1300.0 and "peak_rss_mb" not in memory.columns
    assert "| bs1a16 | 1 | 16 | 2 | 0.062 | 0.50 | 900 | 10 | 8.00 | 1300 |" in analysis.format_memory(memory)


def test_trial_runs_in_the_same_store_and_sweep_never_enter_the_grid_report(store):
    """An Optuna search logs its trials as training runs (tags norm, regime, seed) into the same experiment,
    here even under the grid's sweep id: the grid's table and runs stay the grid's."""
    client, experiment_id, _ = store
    before = summarize(collect(client, "gaexp").data, STUDY).table
    trials = [add_run(client, experiment_id, "bn", "bs1a16", seed, (0.99, 0.99, 0.99)) for seed in (1, 2)]
    for number, run_id in enumerate(trials):
        client.set_tag(run_id, "optuna.study", "bn-bs1a16")
        client.set_tag(run_id, "optuna.trial", str(number))
    collected = collect(client, "gaexp")
    assert not set(trials) & set(collected.data.run_id) and collected.excluded.empty
    pd.testing.assert_frame_equal(summarize(collected.data, STUDY).table, before)
    assert collected.data.run_id.nunique() == len(HISTORIES)


def test_rows_follow_the_order_the_norms_are_declared_in_then_ones_own_sorted():
    """A study that sets no norm_order (the default) orders its rows as gaexp/norms.py declares the norms."""
    default = analysis.norm_order(AnalysisConfig())
    assert analysis.in_order(["zz", "gn4", "mean_bn", "in", "brn", "bn"], default) == ["bn", "in", "gn4", "brn", "mean_bn", "zz"]
    assert analysis.norm_order(AnalysisConfig(norm_order=["in", "bn"])) == ["in", "bn"]


def test_the_latest_sweep_passes_a_newer_single_run_by(store):
    """In a folder of mixed work: a single run (`gaexp` without -m) after a grid; the report's latest is the grid,
    and the single run's own sweep where no multirun ran."""
    client, experiment_id, _ = store
    single = add_run(client, experiment_id, "gn4", "bs4a4", 1, (0.9, 0.9, 0.9), sweep="run-c")
    client.set_tag(single, runtags.SINGLE_RUN, "true")
    assert collect(client, "gaexp", "latest").data.sweep_id.unique().tolist() == ["sweep-a"]
    only = client.create_experiment("singles")
    client.set_tag(add_run(client, only, "gn4", "bs4a4", 1, (0.9,), sweep="run-d"), runtags.SINGLE_RUN, "true")
    assert analysis.latest_sweep(client, [only]) == "run-d"


def test_a_report_with_another_window_than_the_runs_command_says_both(store, tmp_path, capsys):
    """gaexp-tuned's reruns carry their search's analysis.window_start, and their sweep's report uses it; the
    study's report (another window) says so, and how to get the other table."""
    client, experiment_id, uri = store
    for run in client.search_runs([experiment_id]):
        client.log_param(run.info.run_id, "analysis.window_start", "600")
    analysis.main(["--tracking-uri", uri, "--out", str(tmp_path / "r"), "--no-plots"])
    out = capsys.readouterr().out
    assert out.startswith("note: this report averages evaluations at step > 250 (the study's analysis.window_start); "
                          "the runs' own command had 600, which their sweep's report used: --window-start 600 gives "
                          "that table\nsweep: ")
    analysis.main(["--tracking-uri", uri, "--out", str(tmp_path / "r"), "--no-plots", "--window-start", "600"])
    assert "note:" not in capsys.readouterr().out


def test_precisions_never_pool_each_has_its_table_then_all_are_set_beside_fp32(store, tmp_path, capsys):
    client, experiment_id, uri = store  # HISTORIES: runs recorded before precision was a choice, i.e. fp32
    shift = {("bn", "bs16a1"): -0.01, ("bn", "bs1a16"): -0.20, ("gn4", "bs16a1"): 0.0, ("gn4", "bs1a16"): 0.0}
    for (norm, regime, seed), accs in HISTORIES.items():  # bf16: bn/bs1a16 20 points lower in both seeds
        if (norm, regime) in shift:
            add_run(client, experiment_id, norm, regime, seed, [a + shift[norm, regime] for a in accs],
                    precision="bf16")
    with pytest.raises(AnalysisError, match=r"^runs of 2 precisions \(bf16, fp32\) never pool; choose one with "
                                            r"--precision$"):
        summarize(collect(client, "gaexp").data, STUDY)
    fp32 = summarize(collect(client, "gaexp", precision="fp32").data, STUDY)
    bf16 = summarize(collect(client, "gaexp", precision="bf16").data, STUDY)
    assert bf16.table.loc["bn", "bs1a16"] == pytest.approx(fp32.table.loc["bn", "bs1a16"] - 0.20)
    assert list(bf16.paired.regime) == ["bs1a16", "bs1a16"]  # against its own true batch, at its own precision

    compared = analysis.compare_precisions(collect(client, "gaexp").data, STUDY)
    rows = compared.table.set_index(["norm", "regime", "precision"])
    assert rows.loc[("bn", "bs1a16", "bf16"), "diff"] == pytest.approx(-0.20)
    assert rows.loc[("bn", "bs1a16", "bf16"), "verdict"] == "worse"  # the same -20 points in both seeds
    assert rows.loc[("gn4", "bs1a16", "bf16"), "verdict"] == "equivalent"
    assert pd.isna(rows.loc[("bn", "bs4a4", "fp32"), "diff"])  # fp32 is the reference: no difference of its own
    assert ("bn", "bs4a4", "bf16") not in rows.index  # bf16 never ran it

    analysis.main(["--tracking-uri", uri, "--out", str(tmp_path / "cli"), "--no-plots"])
    out = capsys.readouterr().out
    assert "\nmnist, bf16: mean valid accuracy" in out and "\nmnist: mean valid accuracy" in out
    assert "| bn | bs1a16 | fp32 | 52.50 | 10.61 | 2 | reference |  |\n| bn | bs1a16 | bf16 | 32.50 | 10.61 | 2 | -20.00 [-20.00, -20.00] | worse |" in out
    assert (tmp_path / "cli" / "precisions.md").is_file() and (tmp_path / "cli" / "bf16" / "table.md").is_file()

    made = analysis.report_each_part(uri, "gaexp", "sweep-a", STUDY, tmp_path / "r")
    assert [(part, name) for part, name, _, _ in made] == [
        ({"dataset": "mnist", "model": "simple", "precision": "bf16"}, "bf16"),
        ({"dataset": "mnist", "model": "simple", "precision": "fp32"}, "fp32"),
        ({"dataset": "mnist", "model": "simple"}, "precisions")]
    assert (tmp_path / "r" / "precisions.md").read_text().startswith("mnist: precisions side by side")


def test_a_precision_at_another_budget_is_shown_not_compared(store):
    client, experiment_id, uri = store
    for seed in (1, 2):
        add_run(client, experiment_id, "gn4", "bs16a1", seed, (0.5,), num_iterations=300, precision="fp16")
    compared = analysis.compare_precisions(collect(client, "gaexp").data, STUDY)
    assert compared.note == "fp16 not compared with fp32: num_iterations 300 against 900"
    assert compared.table[compared.table.precision == "fp16"]["diff"].isna().all()


def test_a_loss_headline_ranks_lowest_first_and_calls_a_higher_loss_worse():
    """A language model's headline is a loss (metrics.TOKEN_LOSS): lower is better, so the same paired difference
    that is `better` for an accuracy is `worse` for it, and the ranking puts the lowest mean first."""
    from gaexp.metrics import TOKEN_LOSS
    higher = pd.Series([2.50, 2.61, 2.55], index=[1, 2, 3])
    lower = higher - pd.Series([0.30, 0.31, 0.29], index=[1, 2, 3])
    assert analysis.paired_verdict(higher, lower, 0.02)["verdict"] == "better"
    assert analysis.paired_verdict(higher, lower, 0.02, higher_is_better=False)["verdict"] == "worse"
    per_run = pd.concat({("token_mean", "bs1a16"): higher, ("step_token_mean", "bs1a16"): lower},
                        names=["norm", "regime", "seed"])
    design = AnalysisConfig(ranked_regime="bs1a16", baselines=["step_token_mean/bs1a16"], rows="task.loss", margin=0.02)
    ranking = analysis.rank(per_run, design, TOKEN_LOSS)
    assert list(ranking.norm) == ["step_token_mean", "token_mean"]
    assert ranking.loc[1, "vs step_token_mean/bs1a16 verdict"] == "worse"
    text = analysis.format_ranking(ranking, design, TOKEN_LOSS)
    assert "| rank | loss | bs1a16 nats | std | seeds |" in text and "| 2 | token_mean | 2.553 | " in text


def test_the_report_imports_scipy_only_where_it_computes_an_interval():
    """scipy.stats takes about 0.8 s to import: a sweep's own process, and a report of one seed (a first try, the
    tests' sweeps), compute no interval and import none of it; a comparison of two seeds does."""
    probe = ("import sys, pandas as pd; from gaexp.analysis import paired_verdict; "
             "one = paired_verdict(pd.Series([97.0]), pd.Series([96.0]), 0.5); print(one['verdict'], 'scipy.stats' in sys.modules); "
             "two = paired_verdict(pd.Series([97.0, 96.5]), pd.Series([96.0, 96.1]), 0.5); "
             "print(round(two['ci_low'], 2), 'scipy.stats' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert done.stdout.splitlines() == ["n/a (1 seed) False", f"{round(stats.ttest_rel([97.0, 96.5], [96.0, 96.1]).confidence_interval(0.95)[0], 2)} True"], done.stderr[-2000:]
