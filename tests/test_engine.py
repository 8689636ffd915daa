"""accumulate=auto (gaexp/engine.py): batched where it computes the loop's step and fits, the loop otherwise with
one line; the engine used recorded and in the protocol key; a cell FINISHED by either engine not run again."""

from __future__ import annotations

import logging

import pytest
import torch
from mlflow.tracking import MlflowClient
from omegaconf import OmegaConf
from torch import nn

from gaexp import analysis, cell, engine, memory, tracking
from gaexp.cell import run_cell
from gaexp.model import make_model
from gaexp.task.build import make as make_task
from gaexp import tags as runtags
from gaexp.config import AnalysisConfig
from tests.conftest import TINY
from tests.test_app import prepared

AUTO = [o for o in TINY if not o.startswith("accumulate=")]  # the tiny budget under the default engine

SCALED_FILE = """
import torch
from torch import nn


class Scale(nn.Module):  # a layer of one's own, declaring nothing: the batched engine cannot know it is per sample
    def __init__(self, channels):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(channels, 1, 1))

    def forward(self, x):
        return x * self.weight


def build(norm_layer, in_channels, num_classes):
    return nn.Sequential(nn.Conv2d(in_channels, 8, 3, stride=2), Scale(8), norm_layer(8), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, num_classes))
"""
SCALED = ["model=custom", "model.target=scaled_nets:build", "model.name=scaled"]


def fits(_engine: str) -> None:
    return None


def test_auto_takes_batched_where_every_layer_chunks_and_the_step_fits(compose):
    model = make_model(cell.typed(compose(*AUTO, "norm=bn", "regime=bs1a16")), 1, 10)
    assert engine.choose("auto", model, 1, 16, 60_000, fits) == engine.Choice("batched", "auto")
    assert engine.choose("loop", model, 1, 16, 60_000, fits) == engine.Choice("loop", "loop")
    assert engine.choose("batched", model, 1, 16, 60_000, fits) == engine.Choice("batched", "batched")


def test_auto_falls_back_to_the_loop_saying_why():
    unknown = nn.Sequential(nn.Conv2d(1, 4, 3), nn.Dropout(0.1))  # dropout draws per batch: not known per sample
    choice = engine.choose("auto", unknown, 4, 4, 60_000, fits)
    assert (choice.engine, choice.fell_back) == ("loop", True)
    assert choice.reason.startswith("layer '1' is a torch.nn.modules.dropout.Dropout, not a layer gaexp knows")
    assert engine.notice(choice, "bn-bs4a4-s1") == f"bn-bs4a4-s1: accumulate=auto trains with the loop: {choice.reason}"
    known = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4))
    too_big = engine.choose("auto", known, 4, 4, 10, fits)
    assert (too_big.engine, too_big.reason) == ("loop", "a step's 4 x 4 samples are more than the 10 training images")
    assert engine.within_split(engine.Choice("batched", "auto"), 4, 4, 10) == too_big
    assert engine.within_split(engine.Choice("batched", "batched"), 4, 4, 10).engine == "batched"  # refused elsewhere
    full = engine.choose("auto", known, 4, 4, None, lambda e: "too much" if e == "batched" else None)
    assert (full.engine, full.reason) == ("loop", "a step's 16 samples at once do not fit: too much")
    assert engine.notice(engine.Choice("loop", "loop"), "x") is None and engine.notice(full, "x") is not None


def test_a_run_beyond_memory_under_auto_is_the_loop_and_under_batched_refused(compose, monkeypatch):
    """The memory check itself (memory.check_run_memory) decides: 1 GiB a sample, 4 GiB free, micro-batch 1 of 16."""
    monkeypatch.setattr(memory, "sample_bytes", lambda model, *probe: 2**30)
    monkeypatch.setattr(memory, "available_bytes", lambda device: (4 * 2**30, "free here"))
    c, choice = cell.validate(compose(*AUTO, "norm=bn", "regime=bs1a16"))
    assert (c.accumulate, choice.engine, choice.setting) == ("loop", "loop", "auto")
    assert choice.reason.startswith("a step's 16 samples at once do not fit: regime.batch_size=1 regime.num_accum=16 "
                                    "accumulate=batched: a run needs about 16.")
    with pytest.raises(ValueError, match=r"^regime.batch_size=1 regime.num_accum=16 accumulate=batched: a run needs"):
        cell.validated(compose(*AUTO, "norm=bn", "regime=bs1a16", "accumulate=batched"))


def test_a_model_batched_refuses_trains_with_the_loop_under_auto_its_line_printed_and_the_engine_recorded(
        tmp_path, compose, monkeypatch, caplog):
    (tmp_path / "scaled_nets.py").write_text(SCALED_FILE)
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = prepared(compose(*AUTO, *SCALED, "norm=gn4", "regime=bs4a4", outputs=tmp_path / "out"))
    with caplog.at_level(logging.WARNING, logger="gaexp.app"):
        run_cell(cfg, sweep_id="s1")
    lines = [r.getMessage() for r in caplog.records if "accumulate=auto" in r.getMessage()]
    assert len(lines) == 1 and lines[0].startswith(
        "scaled-gn4-bs4a4-s1: accumulate=auto trains with the loop: layer '1' is a scaled_nets.Scale, not a layer "
        "gaexp knows to be per sample or to chunk exactly (known: ")
    client = MlflowClient(cfg.mlflow.tracking_uri)
    (run,) = client.search_runs([client.get_experiment_by_name("gaexp").experiment_id])
    assert run.info.run_name == "scaled-gn4-bs4a4-s1"
    assert (run.data.tags["accumulate"], run.data.params["accumulate"]) == ("loop", "loop")
    assert run.data.tags["accumulate_setting"] == "auto"
    assert run.data.tags["accumulate_fallback"].startswith("layer '1' is a scaled_nets.Scale")


def test_auto_runs_batched_and_a_loop_store_resumes_under_it_with_no_rerun(tmp_path, compose):
    """Old stores: a cell FINISHED by the loop (recorded before auto existed: no accumulate key in its protocol)
    is skipped under auto; a cell never run trains batched, its own protocol."""
    loop = prepared(compose(*TINY, "norm=bn", "regime=bs4a4", outputs=tmp_path))
    value = run_cell(loop, sweep_id="old")
    assert run_cell(prepared(compose(*AUTO, "norm=bn", "regime=bs4a4", outputs=tmp_path)), sweep_id="new") == value
    run_cell(prepared(compose(*AUTO, "norm=bn", "regime=bs1a16", outputs=tmp_path)), sweep_id="new")
    client = MlflowClient(loop.mlflow.tracking_uri)
    runs = {r.info.run_name: r for r in client.search_runs([client.get_experiment_by_name("gaexp").experiment_id])}
    assert sorted(runs) == ["batched-bn-bs1a16-s1", "bn-bs4a4-s1"]  # the loop's cell not run again
    assert runs["bn-bs4a4-s1"].data.tags[runtags.SWEEPS] == "old,new"
    new = runs["batched-bn-bs1a16-s1"]
    assert (new.data.tags["accumulate"], new.data.tags["accumulate_setting"]) == ("batched", "auto")
    assert "accumulate_fallback" not in new.data.tags
    loop_key = runs["bn-bs4a4-s1"].data.tags["protocol_key"]
    assert loop_key != new.data.tags["protocol_key"]
    # the report of the resumed sweep: the engines differ between cells, said under the table; never within one
    summary, _, files = analysis.report(loop.mlflow.tracking_uri, "gaexp", sweep="new",
                                        design=AnalysisConfig(window_start=0, reference="bs4a4",
                                                                       table_columns=["bs4a4", "bs1a16"]),
                                        out=tmp_path / "report", plots=False)
    assert summary.engines == ("Engines differ between cells: batched: bn/bs1a16; loop: bn/bs4a4. Their steps are "
                               "the same up to rounding: a comparison across engines holds within seed noise, not "
                               "bit for bit (docs/study.md).")
    assert summary.engines in analysis.format_table(summary)


def test_a_cell_with_runs_of_both_engines_is_refused_naming_them(tmp_path, compose):
    for engine_name in ("loop", "batched"):
        run_cell(prepared(compose(*TINY, "norm=bn", "regime=bs4a4", f"accumulate={engine_name}", outputs=tmp_path)),
                 sweep_id="s1")
    run_cell(prepared(compose(*TINY, "norm=bn", "regime=bs4a4", "seed=2", outputs=tmp_path)), sweep_id="s1")
    with pytest.raises(analysis.AnalysisError, match=r"^the cell bn/bs4a4 has runs of both engines \(batched: seed 1; "
                                                     r"loop: seed 1, 2\): they agree within seed noise"):
        analysis.report(f"sqlite:///{tmp_path}/mlflow.db", "gaexp", sweep="s1",
                        design=AnalysisConfig(window_start=0), out=tmp_path / "report", plots=False)


def test_under_auto_the_protocol_keys_of_both_engines_count_the_loops_as_recorded_before_auto():
    resolved = {"accumulate": "auto", "seed": 1, "regime": {"batch_size": 4}}
    auto, batched, loop, cached = (engine.keys(resolved, engine.Choice(e, s), tracking.protocol_key)
                                   for e, s in (("batched", "auto"), ("batched", "batched"), ("loop", "loop"),
                                                ("cached", "cached")))
    before = tracking.protocol_key({"seed": 1, "regime": {"batch_size": 4}})  # a run from before the key
    assert auto == [batched[0], loop[0], cached[0]] and loop == [before] and batched[0] != before != cached[0]
    assert engine.keys(resolved, engine.Choice("loop", "auto"), tracking.protocol_key) == [before, batched[0], cached[0]]


@pytest.mark.parametrize("value", ["Auto", "fast", ""])
def test_an_unknown_engine_is_refused_naming_the_valid_ones(compose, value):
    with pytest.raises(ValueError, match=rf"accumulate='{value}'.*valid: loop, batched, cached, auto"):
        cell.validated(compose(*AUTO, f"accumulate={value}"))



def test_a_step_beyond_a_folders_training_images_trains_with_the_loop_under_auto_and_is_refused_batched(
        tmp_path, compose, caplog):
    """A folder's size is known once read: 19 images, 5 held out, 14 to draw from; bs4a4's 16 samples a step."""
    from tests.test_imagefolder import write_folder

    folder = write_folder(tmp_path / "pets", per_class=6)
    cell_ = [*AUTO, "norm=gn4", "regime=bs4a4", "train.num_iterations=2", "data=imagefolder", f"data.path={folder}",
             "data.size=[16,16]", "data.holdout=5", "data.dataset=pets", f"data.root={tmp_path / 'store' / 'data'}"]
    cfg = prepared(compose(*cell_, outputs=tmp_path / "store"))  # auto: not refused before the run
    with caplog.at_level(logging.WARNING, logger="gaexp.app"):
        run_cell(cfg, sweep_id="s1")
    assert [r.getMessage() for r in caplog.records if "accumulate=auto" in r.getMessage()] == [
        "pets-gn4-bs4a4-s1: accumulate=auto trains with the loop: a step's 4 x 4 samples are more than the 14 "
        "training images"]
    client = MlflowClient(cfg.mlflow.tracking_uri)
    (run,) = client.search_runs([client.get_experiment_by_name("gaexp").experiment_id])
    assert run.data.tags["accumulate"] == "loop" and run.data.tags["accumulate_fallback"].endswith("14 training images")
    with pytest.raises(ValueError, match=r"regime.batch_size\*regime.num_accum=16; valid: at most 14: accumulate=batched"):
        prepared(compose(*cell_, "accumulate=batched", outputs=tmp_path / "store"))


# --- each distinct computation once: cells whose engine computes the same steps share one run ------------------

def key_of(compose, *overrides: str) -> str | None:
    """The arithmetic key of a cell (gaexp/engine.py), as the cell derives it from its resolved config."""
    cfg = compose(*AUTO, *overrides)
    c, choice = cell.validate(cfg)
    resolved = OmegaConf.to_container(cfg, resolve=True)
    return engine.arithmetic_key(resolved, choice, make_task(c.task), tracking.protocol_key)


BASE = ("norm=gn4", "regime=bs16a1")


@pytest.mark.parametrize("part", [
    "seed=2", "norm=gn16", "train.lr=0.002", "train.num_iterations=6", "train.eval_period=4", "data.holdout=600",
    "precision=bf16", "model=resnet20", "regime=bs8a1", "regime=bs4a2", "compile=eval", "device_type=cpu",
])
def test_the_arithmetic_key_changes_with_each_part_of_what_the_steps_compute(compose, part):
    """Model, norm, data, seed, precision, optimizer, steps, the optimization batch b*k and the kernels (compile)
    each change the key; `device_type=cpu` is the base's own value and leaves it."""
    base = key_of(compose, *BASE)
    changed = key_of(compose, *BASE, part)
    assert base is not None and changed is not None
    assert (changed == base) == (part == "device_type=cpu"), part


def test_the_arithmetic_key_is_the_same_for_every_split_of_one_micro_batch(compose):
    keys = {regime: key_of(compose, "norm=gn4", f"regime={regime}") for regime in ("bs16a1", "bs4a4", "bs1a16", "bs2a8")}
    assert None not in keys.values() and len(set(keys.values())) == 1, keys


@pytest.mark.parametrize("overrides, why", [
    (("norm=bn", "regime=bs4a4"), "BatchNorm couples a micro-batch's samples: chunked by b"),
    (("norm=gn4", "regime=w2b2a4"), "two replicas"),
    (("norm=gn4", "regime=bs4a4", "accumulate=loop"), "the loop, micro-batch by micro-batch"),
    (("norm=gn4", "regime=bs4a4", "accumulate=batched"), "batched asked, not auto's choice"),
    (("norm=gn4", "regime=bs4a4", "task=contrastive", "task.negatives=micro"), "each micro-batch's own negatives"),
])
def test_a_coupled_norm_replicas_another_engine_or_a_split_dependent_loss_is_never_shared(compose, overrides, why):
    assert key_of(compose, *overrides) is None, why


@pytest.mark.parametrize("overrides, free", [
    ((), True), (("task=contrastive", "task.negatives=step"), True), (("task=contrastive", "task.negatives=micro"), False),
    (("task=lm", "model=gpt", "norm=ln", "data=fortunes", "task.loss=token_mean"), False),
    (("task=lm", "model=gpt", "norm=ln", "data=fortunes", "task.loss=seq_mean"), True),
    (("task=lm", "model=gpt", "norm=ln", "data=fortunes", "task.loss=step_token_mean"), True),
    (("task=lm", "model=gpt_moe", "norm=ln", "data=fortunes", "task.loss=step_token_mean", "task.balance=global"), False),
])
def test_a_loss_is_split_free_where_its_step_is_the_same_however_split(compose, overrides, free):
    """A token mean per micro-batch, each micro-batch's own negatives and an MoE's balance depend on the split."""
    assert make_task(cell.typed(compose(*AUTO, "regime=bs4a4", *overrides)).task).split_free is free


def test_a_shared_cell_records_its_twins_run_with_same_as_and_no_time_of_its_own(tmp_path, compose):
    """bs16a1 trains; bs4a4, the same steps, records them: the same histories, results and curves, tagged with the
    run it shares and no time or process peak of its own; bs1a16 with share=false computes them again, and gets
    them bit for bit. The shared run's model is its twin's."""
    first = prepared(compose(*AUTO, "norm=gn4", "regime=bs16a1", outputs=tmp_path))
    value = run_cell(first, sweep_id="s")
    assert run_cell(prepared(compose(*AUTO, "norm=gn4", "regime=bs4a4", outputs=tmp_path)), sweep_id="s") == value
    run_cell(prepared(compose(*AUTO, "norm=gn4", "regime=bs1a16", "share=false", outputs=tmp_path)), sweep_id="s")
    client = MlflowClient(first.mlflow.tracking_uri)
    runs = {r.info.run_name.split("-")[2]: r for r in client.search_runs([client.get_experiment_by_name("gaexp").experiment_id])}
    twin, shared, computed = runs["bs16a1"], runs["bs4a4"], runs["bs1a16"]
    assert shared.data.tags[runtags.SAME_AS] == twin.info.run_id
    assert runtags.SAME_AS not in twin.data.tags and runtags.SAME_AS not in computed.data.tags
    assert len({r.data.tags[runtags.ARITHMETIC_KEY] for r in runs.values()}) == 1
    for name in ("valid_acc", "train_loss"):
        histories = [[(m.step, m.value) for m in client.get_metric_history(r.info.run_id, name)]
                     for r in (twin, shared, computed)]
        assert histories[0] == histories[1] == histories[2] and len(histories[0]) == 2, name
    assert shared.data.metrics["final_valid_acc"] == twin.data.metrics["final_valid_acc"] == value
    assert tracking.curves_of(shared) == tracking.curves_of(twin)
    assert not set(shared.data.metrics) & {"samples_per_sec", "wall_seconds", "peak_rss_mb", "batched_peak_rss_mb"}
    assert {"samples_per_sec", "wall_seconds"} <= set(twin.data.metrics) & set(computed.data.metrics)
    assert shared.data.metrics["activation_mb"] < twin.data.metrics["activation_mb"]  # its own micro-batch of 4
    reloaded = [tracking.load_model(first.mlflow.tracking_uri, r.info.run_id).state_dict() for r in (twin, shared)]
    assert all(torch.equal(reloaded[0][k], reloaded[1][k]) for k in reloaded[0])
