"""Reads at a team's scale: a generated store (gaexp.tools.storegen) read across many pages, whole.

MLflow returns a search a page at a time; with the page size made small here, a store of 180 runs
crosses 26 pages, and the report, gaexp-status, the resume check and compare must still see
every run (a single-page read would see 7)."""

import pytest
from mlflow.tracking import MlflowClient

from gaexp import analysis, compare, progress, tracking
from gaexp.tools import storegen
from gaexp import tags as runtags

SWEEPS = 3


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    uri = f"sqlite:///{tmp_path_factory.mktemp('generated') / 'mlflow.db'}"
    assert storegen.generate(uri, SWEEPS * 60 - 10) == SWEEPS  # whole sweeps of 60
    assert storegen.generate(uri, 120) == SWEEPS  # an existing store is extended, never shrunk
    return uri


@pytest.fixture
def small_pages(monkeypatch):
    monkeypatch.setattr(tracking.search, "PAGE_SIZE", 7)


def test_the_generated_store_has_gaexps_schema_in_sweeps_of_60(store):
    client = MlflowClient(store)
    runs = analysis.training_runs(client, "gaexp")
    assert len(runs) == 60  # by name: each sweep has the same 60 cells
    run = runs["bn-bs4a4-s1"]
    assert {"train.lr", "regime.batch_size", "norm.name", "data.dataset"} <= set(run.data.params)
    assert run.data.tags["protocol_key"] and run.data.tags[runtags.SWEEPS] == run.data.tags["sweep_id"]
    assert [m.step for m in client.get_metric_history(run.info.run_id, "valid_acc")] == list(range(250, 3001, 250))


def test_the_report_reads_every_run_across_the_pages(store, small_pages):
    client = MlflowClient(store)
    every = analysis.collect(client, "gaexp", "all")
    assert every.data.run_id.nunique() == SWEEPS * 60 and len(every.data) == SWEEPS * 60 * storegen.EVALS
    one = analysis.collect(client, "gaexp", storegen.sweep_id(2))
    assert one.data.run_id.nunique() == 60 and set(one.data.sweep_id) == {storegen.sweep_id(2)}
    assert analysis.collect(client, "gaexp").sweep == storegen.sweep_id(SWEEPS - 1)  # latest
    two = analysis.collect(client, "gaexp", f"{storegen.sweep_id(0)},{storegen.sweep_id(SWEEPS - 1)}")
    assert two.data.run_id.nunique() == 120
    assert len(compare.training_runs(client, "gaexp")) == 60 and len(tracking.search_all(client, ["1"])) == SWEEPS * 61


def test_status_lists_every_sweep_and_counts_every_cell_across_the_pages(store, small_pages, capsys):
    progress.main(["--tracking-uri", store, "--sweep", "all"])
    out = capsys.readouterr().out
    assert [line.split()[1] for line in out.splitlines() if line.startswith("sweep ")] == \
        [storegen.sweep_id(k) for k in reversed(range(SWEEPS))]
    assert out.count("60/60 cells: 60 finished") == SWEEPS


def test_the_resume_check_finds_every_finished_cell_and_the_resume_sees_them_all(store, small_pages):
    client = MlflowClient(store)
    ids = [client.get_experiment_by_name("gaexp").experiment_id]
    cells = tracking.runs_in_sweep(client, ids, storegen.sweep_id(1))
    training = [r for r in cells if "norm" in r.data.tags]
    assert len(training) == 60
    for run in training:
        found = tracking.find_finished(client, ids[0], run.data.tags["protocol_key"])
        assert found is not None and found.info.run_id == run.info.run_id
        tracking.add_to_sweep(client, found, "resume-1")  # what a resumed sweep does for each skipped cell
    resumed = tracking.runs_in_sweep(client, ids, "resume-1")
    assert sorted(r.info.run_id for r in resumed) == sorted(r.info.run_id for r in training)
    assert analysis.collect(client, "gaexp", "resume-1").data.run_id.nunique() == 60


def test_curves_read_from_the_tags_equal_the_histories(store, monkeypatch):
    """A run's curves tags hold the floats its histories hold: the report is the same read either way."""
    client = MlflowClient(store)
    tagged = analysis.collect(client, "gaexp", storegen.sweep_id(1))
    monkeypatch.setattr(analysis.collection, "curves_of", lambda run: None)  # as for runs logged before the tags
    read = analysis.collect(client, "gaexp", storegen.sweep_id(1))
    assert tagged.data.equals(read.data) and len(read.data) == 60 * storegen.EVALS
