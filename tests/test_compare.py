"""The store comparison on hand-made stores: equal results pass, any changed number is named."""

from __future__ import annotations

import pytest
from mlflow.tracking import MlflowClient

from gaexp import compare, tracking
from gaexp.hooks import EvalPoint


def make_store(path, acc_at_4=0.5, tags=None, params=None, wall=1.0):
    uri = f"sqlite:///{path}/mlflow.db"
    client = MlflowClient(uri)
    experiment_id = tracking.prepare_store(uri, "gaexp", str(path / "artifacts"))
    for name in ("gn4-bs4a4-s1", "bn-bs4a4-s1"):
        base = {"norm": name.split("-")[0], "sweep_id": str(path), "protocol_key": "k-" + name}
        with tracking.tracked_run(client, experiment_id, name, {**base, **(tags or {})}) as run_id:
            tracking.log_params(client, run_id, {"train": {"lr": 0.001}, **(params or {})})
            history = [EvalPoint(2, 0.9, {"valid_acc": 0.25}, 10.0), EvalPoint(4, 0.8, {"valid_acc": acc_at_4}, 10.0)]
            for point in history:
                tracking.log_eval_point(client, run_id, point)
            tracking.log_summary(client, run_id, history, wall_seconds=wall)
    return uri


def test_the_same_results_in_another_sweep_and_time_are_equal(tmp_path, capsys):
    a = make_store(tmp_path / "a")
    b = make_store(tmp_path / "b", wall=2.0, params={"cells_at_once": 2})  # other sweep id, time, a new key
    found, params = compare.differences(MlflowClient(a), MlflowClient(b))
    assert found == [] and params == ["bn-bs4a4-s1: param cells_at_once: None -> '2'",
                                      "gn4-bs4a4-s1: param cells_at_once: None -> '2'"]
    with pytest.raises(SystemExit) as info:
        compare.main([a, b])
    assert info.value.code == 0 and "2 runs compared: 0 result differences, 2 param differences" in capsys.readouterr().out


def test_a_tag_added_since_matches_runs_without_it_at_the_value_they_implicitly_had(tmp_path):
    a = make_store(tmp_path / "a")  # recorded before the model and dataset tags
    b = make_store(tmp_path / "b", tags={"model": "simple", "dataset": "mnist", "accumulate": "loop"})
    assert compare.differences(MlflowClient(a), MlflowClient(b))[0] == []
    c = make_store(tmp_path / "c", tags={"model": "resnet20", "accumulate": "batched"})
    assert {"gn4-bs4a4-s1: tag model: None != 'resnet20'", "gn4-bs4a4-s1: tag accumulate: None != 'batched'"} <= \
        set(compare.differences(MlflowClient(a), MlflowClient(c))[0])


def test_a_changed_history_or_tag_is_named(tmp_path, capsys):
    a = make_store(tmp_path / "a")
    b = make_store(tmp_path / "b", acc_at_4=0.5000001, tags={"threads": "1"})
    found, _ = compare.differences(MlflowClient(a), MlflowClient(b))
    assert "gn4-bs4a4-s1: valid_acc history [(2, 0.25), (4, 0.5)] != [(2, 0.25), (4, 0.5000001)]" in found
    assert "gn4-bs4a4-s1: metric final_valid_acc: 0.5 != 0.5000001" in found
    assert "bn-bs4a4-s1: tag threads: None != '1'" in found
    with pytest.raises(SystemExit) as info:
        compare.main([a, b])
    assert info.value.code == 1
