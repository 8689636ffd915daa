"""The benchmark's arithmetic and output; its timings are checked by running it, never here."""

from __future__ import annotations

import re

import pytest

from gaexp import bench


def test_grid_seconds_by_hand():
    rates = {"bs1a1": 100.0, "bs1a16": 200.0, "bs4a4": 400.0, "bs16a1": 800.0}
    per_run_train = 3600 * 1 / 100 + 3600 * 16 / 200 + 3600 * 16 / 400 + 3600 * 16 / 800
    per_run_eval = 4 * 12 * 10_000 / 1000.0
    assert bench.grid_seconds(rates, eval_rate=1000.0) == pytest.approx(15 * (per_run_train + per_run_eval))


def test_benchmark_prints_rates_ratios_and_the_grid_estimate(data_root, capsys):
    bench.main(["--samples", "16", "--repeats", "1", "--eval-images", "64", "--data-root", str(data_root)])
    out = capsys.readouterr().out
    for name in ("bs1a1", "bs1a16", "bs4a4", "bs16a1", "eval"):
        assert re.search(rf"^{name}\s+\d+\s+\d+\s+\d+\.\d\dx", out, re.M), out
    assert re.search(r"naive loop, cell after cell, \d+ thread\(s\):\s+\d+\.\d\d h", out)
    assert re.search(r"gaexp, \d+ cells at once x 1 thread\(s\):\s+\d+\.\d\d h\s+\(\d+\.\d\dx faster", out)


def test_bad_regime_is_named(capsys):
    with pytest.raises(SystemExit):
        bench.main(["--regimes", "bs1a1,big"])
    assert "bad regime 'big': expected bs<b>a<k>" in capsys.readouterr().err
