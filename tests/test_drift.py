"""python -m gaexp.tools.drift: the accumulated gradient's error against float64 per precision and k, gaexp-check's own
measurement, with each precision's training speed and memory measured in a fresh process."""

from __future__ import annotations

import datetime
import os
import re
import shlex

import pytest
import torch
from torch import nn

from gaexp import check
from gaexp.tools import drift
from gaexp.data.batches import Split, micro_batch_indices
from gaexp.memory import reset_peak_rss
from gaexp.precision import precision_config


def cells(text: str) -> dict[str, list[str]]:
    """The table's rows by gaexp's precision name: their cells after the first."""
    rows = [line.strip("|").split(" | ") for line in text.splitlines() if line.startswith("| ") and "`" in line]
    return {re.search(r"`(.+)`", row[0]).group(1): [c.strip() for c in row[1:]] for row in rows}


def number(cell: str) -> float:
    return float(cell.split()[0].strip("*"))


@pytest.fixture(scope="module")
def measured() -> tuple[list[drift.Row], str]:
    """The table at a tiny size: k = 1 and 4 on the study's CNN, three precisions, one timed step of 2; its rows and
    its text."""
    args = drift.parser().parse_args(["--ks", "1,4", "--precisions", "fp32,bf16w,bf16w-acc32", "--steps", "1",
                                      "--time-k", "2"])
    rows = drift.measure(args, torch.device("cpu"))
    return rows, drift.render(args, torch.device("cpu"), rows)


@pytest.fixture(scope="module")
def table(measured) -> str:
    return measured[1]


def test_the_table_says_its_inputs_and_the_command_that_makes_it_again(table):
    head, command = table.splitlines()[:2]
    assert head.startswith("gaexp.tools.drift: model=simple norm=gn4, micro-batch b=1, k=1,4; random MNIST-shaped images")
    assert "; cpu (" in head and f"; torch {torch.__version__}; {datetime.date.today().isoformat()}" in head
    words = shlex.split(command.removeprefix("command: "))
    assert words[:3] == ["python", "-m", "gaexp.tools.drift"]
    again = drift.parser().parse_args(words[3:])
    assert (again.model, again.norm, again.batch_size, again.ks, again.precisions, again.steps, again.time_k) == (
        "simple", "gn4", 1, (1, 4), ("fp32", "bf16w", "bf16w-acc32"), 1, 2)
    assert "| precision | k=1 | k=4 | samples/s (k=2) | peak memory |" in table


def test_float32_is_float32s_rounding_and_bf16_summed_in_bf16_drifts_further(table):
    rows = cells(table)
    assert list(rows) == ["fp32", "bf16w", "bf16w-acc32"]
    assert all(1e-9 < number(c) < 1e-5 for c in rows["fp32"][:2])  # float32 against float64: about 1e-7
    assert 1e-3 < number(rows["bf16w"][0]) < 0.2
    assert re.fullmatch(r"[\d.e-]+ \([\d.e-]+\)", rows["bf16w"][1])  # the big batch's error beside it


def test_one_micro_batch_is_the_same_either_sum_and_four_summed_in_bf16_drift_further(measured):
    """Beyond the table's two digits: k=1 sums nothing, so bf16 weights give one gradient whichever the sum; at k=4,
    three roundings of the sum in bf16 against one of a float32 buffer."""
    by_name = {row.precision.name: row.drifts for row in measured[0]}
    param, buffer = by_name["bf16w"], by_name["bf16w-acc32"]
    assert param[0].accumulated_rel == buffer[0].accumulated_rel == param[0].big_rel
    assert param[1].accumulated_rel > buffer[1].accumulated_rel and param[1].big_rel == buffer[1].big_rel
    assert (param[1].summed_in, buffer[1].summed_in) == ("bfloat16", "float32")


def test_each_precision_trains_in_a_fresh_process_and_says_its_peak(table):
    """The process's peak, and what the steps added to it where the peak can be reset (Linux's clear_refs)."""
    resets = reset_peak_rss()
    for name, row in cells(table).items():
        rate, memory = row[2:]
        assert float(rate) > 0, name
        found = re.fullmatch(r"(\d+) MiB \(\+(\d+)\)" if resets else r"(\d+) MiB()", memory)
        assert found, (name, memory)
        peak, added = found.groups()
        assert int(peak) > 100 and 0 <= int(added or 0) < int(peak), name  # torch alone is more than 100 MiB


def test_training_is_measured_in_a_process_of_its_own():
    assert drift.in_fresh_process(os.getpid) != os.getpid()


def test_the_cells_are_gaexp_checks_measurement():
    """One function, two callers: the drift of a step is what gaexp-check --precision reports for it."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(784, 10))
    generator = torch.Generator().manual_seed(0)
    split = Split(torch.randint(0, 256, (64, 1, 28, 28), dtype=torch.uint8, generator=generator),
                  torch.randint(0, 10, (64,), generator=generator))
    found = drift.errors(model, split, 2, [16], precision_config("bf16w"), 0, torch.device("cpu"))[0]
    index = next(micro_batch_indices(64, 32, 0))
    report = check.check_accumulation(model, split.inputs(index), split.labels[index], micro_batch=2, num_accum=16,
                                      precision="bf16w")
    assert found == report.precision and found.accumulated_rel > found.big_rel > 0


def test_a_bold_cell_is_where_gaexp_check_calls_accumulation_worse():
    worse = check.PrecisionDrift("bf16w", "", "bfloat16", 0.015, 0.0019, 8.1, 2 ** -8, True, "remedy")
    fine = check.PrecisionDrift("bf16w-acc32", "", "float32", 0.0021, 0.0019, 1.1, 2 ** -8, False, "")
    assert [drift.cell(worse, 256), drift.cell(fine, 256), drift.cell(fine, 1)] == [
        "**0.015** (0.0019)", "0.0021 (0.0019)", "0.0021"]


@pytest.mark.parametrize("argv, message", [
    (["--ks", "1,0"], "argument --ks: '1,0'; valid: accumulation steps as positive integers"),
    (["--precisions", "fp32,bf8"],
     "argument --precisions: precision='bf8'; valid: bf16, bf16w, bf16w-acc32, fp16, fp32"),
    (["--model", "vgg"], "argument --model: invalid choice: 'vgg' (choose from"),
    (["--steps", "-1"], "--steps -1 --time-k 16; valid: --batch-size >= 1, --steps >= 0, --time-k >= 1"),
])
def test_bad_arguments_are_one_line_naming_the_choices(argv, message, capsys):
    with pytest.raises(SystemExit) as done:
        drift.main(argv)
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert done.value.code == 2 and message in err, err


def test_missing_mnist_is_one_line_naming_the_command_that_fetches_it(tmp_path, capsys):
    with pytest.raises(SystemExit) as done:
        drift.main(["--data", "mnist", "--data-root", str(tmp_path), "--ks", "1", "--steps", "0"])
    assert done.value.code == 2 and capsys.readouterr().err == (
        f"python -m gaexp.tools.drift: error: data=mnist: not found under {tmp_path}; fetch it with `python -m gaexp.data "
        f"--dataset mnist --root {tmp_path}`\n")


def test_help_names_every_option(capsys):
    with pytest.raises(SystemExit) as done:
        drift.main(["--help"])
    out = capsys.readouterr().out
    assert done.value.code == 0
    for option in ("--model", "--norm", "--batch-size", "--ks", "--precisions", "--data", "--device", "--steps",
                   "--time-k"):
        assert option in out
