"""The benchmark's arithmetic and output; its timings are checked by running it, never here."""

from __future__ import annotations

import re

import pytest
import torch

from gaexp.tools import bench
from gaexp.model import ResNet20, SimpleModel
from gaexp.train import step_function


def test_a_norms_grid_seconds_by_hand():
    rates = {"bs1a1": (100.0, 1.0), "bs1a16": (200.0, 2.0), "bs4a4": (400.0, 0.0), "bs16a1": (800.0, 0.0),
             "eval": (1000.0, 0.5)}
    train = 3600 * 1 / 100 + 3600 * 16 / 200 + 3600 * 16 / 400 + 3600 * 16 / 800
    evals = 4 * 12 * 10_000 / 1000.0
    overhead = 1.0 + 2.0 + 4 * 0.5
    assert bench.norm_grid_seconds(rates, jobs=2) == pytest.approx(3 * (train + evals + overhead) / 2)


def test_benchmark_prints_every_norms_table_its_cost_against_none_and_the_grid(data_root, capsys, monkeypatch):
    engines = []
    monkeypatch.setattr(bench, "step_function", lambda engine, *a: engines.append(engine) or step_function(engine, *a))
    bench.main(["--norms", "bn,gn4,none", "--compile", "off", "--samples", "16", "--repeats", "1",
                "--eval-images", "64", "--jobs", "2", "--data-root", str(data_root)])
    out = capsys.readouterr().out
    assert out.startswith("inputs: model simple; norms bn,gn4,none; regimes bs1a1,bs1a16,bs4a4,bs16a1; device cpu, 1 thread(s); "
                          "16 training samples and 64 test images per measurement, 1 repeats")
    for norm in ("bn", "gn4", "none"):
        table = out.split(f"\n{norm}: compile=off compiles nothing\n")[1]
        for name in ("bs1a1", "bs1a16", "bs4a4", "bs16a1", "eval"):  # off: gaexp's side is the eager loop
            found = re.search(rf"^{name}\s+\d+\s+(\d+)\s+1\.00x\s+0\.0\s+(\d+)\s+(\d+\.\d\d)x +(\w*) ", table, re.M)
            assert found, table
            loop, batched, gain, auto = found.groups()
            assert auto == ("" if name == "eval" else "batched")  # accumulate=auto: every study norm chunks exactly
            assert float(gain) == pytest.approx(int(batched) / int(loop), rel=0.02)  # rates printed rounded: ±0.5
            if name == "eval":  # evaluation does not depend on the engine
                assert batched == loop and gain == "1.00"
    assert re.search(r"^none\s+1\.00x\s+1\.00x\s+1\.00x\s+1\.00x\s+1\.00x$", out, re.M)
    assert re.search(r"^gn4(\s+\d+\.\d\dx){5}$", out, re.M)
    rows = {m[1]: [float(v) for v in m.groups()[1:]]
            for m in re.finditer(r"^(bn|gn4|none|total)\s+(\d+\.\d\d)\s+(\d+\.\d\d)\s+(\d+\.\d\d)\s+(\d+\.\d\d)",
                                 out.split("Estimated grid")[1], re.M)}
    assert engines.count("batched") == engines.count("loop") == 3 * 4 * 2  # per norm and regime: a warm-up, a repeat
    for side in range(4):  # eager, gaexp, batched, auto
        assert rows["total"][side] == pytest.approx(sum(rows[n][side] for n in ("bn", "gn4", "none")), abs=0.02)
    assert all(rows[n][3] == rows[n][2] for n in rows)  # auto's grid is the batched one


@pytest.mark.slow
def test_benchmark_times_the_compiled_side_beside_the_eager_one(data_root, capsys):
    bench.main(["--norms", "in", "--regimes", "bs4a4", "--samples", "32", "--repeats", "1", "--eval-images", "272",
                "--data-root", str(data_root)])
    out = capsys.readouterr().out
    assert "\nin: compile=auto compiles train and eval\n" in out
    for name in ("bs4a4", "eval"):
        eager, fast, ratio = re.search(rf"^{name}\s+(\d+)\s+(\d+)\s+(\d+\.\d\d)x", out, re.M).groups()
        assert float(ratio) == pytest.approx(int(fast) / int(eager), abs=0.01)
    assert "Estimated grid" not in out  # it needs the four regimes


def test_the_benchmark_builds_the_chosen_model_as_a_cell_does():
    assert bench.models() == ["resnet20", "simple"]  # custom needs a target given on the command line
    model = bench.build("resnet20", "gn4", 3, 100)
    assert type(model) is ResNet20 and sum(isinstance(m, torch.nn.GroupNorm) for m in model.modules()) == 19
    assert model(torch.rand(2, 3, 32, 32)).shape == (2, 100)  # the dataset's channels and classes
    assert type(bench.build("simple", "bn", 1, 10)) is SimpleModel


@pytest.mark.parametrize("argv,message", [
    (["--regimes", "bs1a1,big"], "--regimes: bad regime 'big'; valid: bs<b>a<k>, e.g. bs1a1, bs1a16"),
    (["--norms", "bn,gn"], "--norms: 'gn'; valid: bn, in, gn4, gn16, none, ln, in_affine"),
    (["--compile", "fast"], "argument --compile: invalid choice: 'fast' (choose from"),
    (["--model", "custom"], "argument --model: invalid choice: 'custom' (choose from 'resnet20', 'simple')"),
])
def test_bad_input_is_named_with_the_valid_choices(argv, message, capsys):
    with pytest.raises(SystemExit):
        bench.main(argv)
    assert message in capsys.readouterr().err
