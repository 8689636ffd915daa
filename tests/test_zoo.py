"""gaexp/tools/zoo.py: the zoo's truth, its judging, and one model through the real command (the whole zoo is a
benchmark: python -m gaexp.tools.zoo)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torchvision.models

from conftest import REPO
from gaexp.tools.zoo import SIZES, check_one, judge, smallest_input, table, truth


def test_the_truth_is_the_batchnorms_in_training_mode():
    model = torchvision.models.mobilenet_v3_small()
    assert len(truth(model)) == 34 and truth(model)[0] == "features.0.1"
    model.features[0][1].eval()
    assert len(truth(model)) == 33 and truth(torchvision.models.squeezenet1_1()) == []


def test_the_smallest_input_is_the_first_size_accepted_in_both_modes():
    assert smallest_input(torchvision.models.squeezenet1_1(), SIZES)[0] == 32
    model = torchvision.models.inception_v3(init_weights=False)  # its auxiliary head needs 299 in training mode
    assert smallest_input(model, (32, 64, 299)) == (299, "")
    size, reason = smallest_input(torchvision.models.vit_b_32(), (32, 64))
    assert size is None and "Wrong image height" in reason


def row(truth_: list[str], *seeds: tuple[str, list[str]]) -> dict:
    return {"model": "m", "params": 1e6, "truth": truth_, "size": 32,
            "seeds": [{"seed": i, "status": {"safe": 0, "unsafe": 1}.get(v, 2), "verdict": v, "named": named,
                       "random": [], "untested": [], "seconds": 0.5} for i, (v, named) in enumerate(seeds)]}


@pytest.mark.parametrize("seeds,truth_,outcome", [
    ([("safe", []), ("safe", [])], [], "right"),
    ([("unsafe", ["bn"]), ("unsafe", ["bn"])], ["bn"], "right"),
    ([("safe", []), ("unsafe", ["drop"])], [], "false alarm"),
    ([("safe", []), ("safe", [])], ["bn"], "miss"),
    ([("unsafe", ["bn", "drop"])], ["bn"], "wrong modules"),
    ([("error", [])], [], "error"),
])
def test_each_seed_is_judged_against_the_truth(seeds, truth_, outcome):
    judged = judge(row(truth_, *seeds))
    assert judged.outcome == outcome
    assert f"1 models: 1 {outcome}" in table([judged])


def test_a_stock_model_through_the_real_command_at_three_seeds():
    result = check_one("mobilenet_v3_small", (0, 1, 2), SIZES)
    assert result["size"] == 32 and [s["verdict"] for s in result["seeds"]] == ["unsafe"] * 3
    assert judge(result).outcome == "right" and all(s["status"] == 1 for s in result["seeds"])
    assert {t for s in result["seeds"] for t, _ in s["random"]} == {"Dropout"}


@pytest.mark.slow
def test_the_benchmark_command_writes_its_table(tmp_path):
    out = tmp_path / "zoo.md"
    done = subprocess.run([sys.executable, "-m", "gaexp.tools.zoo", "--models", "squeezenet1_1", "--seeds", "0", "1",
                           "--output", str(out)], capture_output=True, text=True, timeout=600, cwd=REPO)
    assert done.returncode == 0, done.stderr
    assert "| squeezenet1_1 | 3x32x32 | 1.2M | 0 | safe | yes | 1 Dropout | 0 |" in out.read_text()
    assert out.read_text().rstrip().endswith("1 models: 1 right") and (tmp_path / "zoo.md.jsonl").exists()
    bad = subprocess.run([sys.executable, "-m", "gaexp.tools.zoo", "--models", "resnet9"], capture_output=True, text=True,
                         timeout=120, cwd=REPO)
    assert bad.returncode == 2 and "--models resnet9: not torchvision classification models; valid: alexnet" in bad.stderr
