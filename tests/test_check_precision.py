"""gaexp-check --precision: the check stays in float32; the step under the precision is measured against float64,
and summing the micro-batch gradients in bf16 is told apart (exit status 4) from summing them in float32."""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from gaexp.check import CheckError, NonFiniteError, check_accumulation, measurably_worse, precision_drift
from gaexp.check.cli import BAD_INPUT, IMPRECISE, SAFE, UNSAFE, run, status
from gaexp.model import SimpleModel
from gaexp.norms import norm_layer

LINEAR = "from torch import nn\n\n\ndef build():\n    return nn.Sequential(nn.Flatten(), nn.Linear(784, 10))\n"


@pytest.fixture
def linear(tmp_path, monkeypatch) -> list[str]:
    """A linear classifier of MNIST-shaped inputs, as gaexp-check's TARGET and its input shape: its own rounding
    is small, so what summing adds shows."""
    (tmp_path / "precision_linear.py").write_text(LINEAR)
    monkeypatch.syspath_prepend(str(tmp_path))
    return ["precision_linear:build", "--input-shape", "1,28,28"]


def checked(argv: list[str]) -> tuple[int, dict]:
    status_, text = run([*argv, "--json"])
    return status_, json.loads(text, parse_constant=lambda c: pytest.fail(f"{c} in JSON"))


def test_float32_is_as_it_was_with_no_precision_section():
    """No flag and --precision fp32 print the same text, line for line as before precision was a choice (the
    numbers aside), with no precision section, and JSON with no precision key."""
    _, plain = run(["model=simple", "norm=gn4"])
    _, fp32 = run(["model=simple", "norm=gn4", "--precision", "fp32"])

    def shape(text: str) -> list[str]:
        return [re.sub(r"\d[\d.e+-]*", "N", line) for line in text.splitlines()]

    assert shape(plain) == shape(fp32) == [
        "gaexp-check model=simple norm=gnN: random inputs of shape N,N,N, cpu, seed N",
        "SAFE: micro-batch N x N accumulation steps against one batch of N, from the same weights and samples (N s)",
        "mode: training, every module",
        "loss: cross_entropy, each micro-batch's scaled by N/N",
        "threshold: relative difference N (the square root of floatN's machine epsilon)",
        "gradient: relative difference N over all parameters",
        "modules coupling the samples of a batch: none",
        "buffers ending the step differently: none",
        "loss: per-sample (relative difference of its gradient N)"], plain
    status_, report = checked(["model=simple", "norm=gn4", "--precision", "fp32"])
    assert status_ == SAFE and report["verdict"] == "safe" and "precision" not in report


def test_groupnorm_under_bf16_is_safe_with_both_errors_against_float64():
    status_, report = checked(["model=simple", "norm=gn4", "--precision", "bf16"])
    assert status_ == SAFE and report["verdict"] == "safe" and report["gradient_rel"] < 1e-5  # the check: float32
    drift = report["precision"]
    assert drift["precision"] == "bf16" and drift["summed_in"] == "float32" and not drift["worse"]
    assert 1e-3 < drift["accumulated_rel"] < 0.2 and 1e-3 < drift["big_rel"] < 0.2  # bf16's rounding, not float32's
    assert drift["ratio"] == pytest.approx(drift["accumulated_rel"] / drift["big_rel"]) and drift["ratio"] < 1.5
    _, text = run(["model=simple", "norm=gn4", "--precision", "bf16"])
    lines = text.splitlines()
    assert lines[1].startswith("SAFE: ") and lines[-5] == (
        "precision bf16: the forward under torch.autocast(bfloat16); float32 weights; micro-batch gradients summed "
        "in float32")
    assert lines[-3].startswith("  accumulated, 4 micro-batches of 2 summed in float32")
    assert lines[-2].startswith("  one batch of 8") and "IMPRECISE" not in text


def test_batchnorm_under_bf16_is_still_unsafe_its_coupling_measured_in_float32():
    """The structural verdict and its numbers are float32's, whatever the precision: rounding never passes for a
    coupling, and a coupling is never hidden by rounding."""
    plain_status, plain = checked(["model=simple", "norm=bn"])
    status_, report = checked(["model=simple", "norm=bn", "--precision", "bf16"])
    assert plain_status == status_ == UNSAFE and report["verdict"] == "unsafe"
    assert [c["module"] for c in report["modules"]] == ["features.1", "features.5", "features.9", "features.13"]
    assert [c["rel"] for c in report["modules"]] == [c["rel"] for c in plain["modules"]]
    assert report["gradient_rel"] == plain["gradient_rel"] and report["buffers"] == plain["buffers"]
    assert 1e-3 < report["precision"]["accumulated_rel"] < 0.5  # each against its own float64 step


def test_summing_256_micro_batches_in_bf16_is_imprecise_and_a_float32_buffer_is_not(linear):
    """bf16 weights, 256 micro-batches of 2: summed in .grad (bf16) the accumulated gradient is about 8x as far from
    float64 as one batch of 512 (exit status 4, the remedy named); summed in a float32 buffer, about 1.1x."""
    status_, report = checked([*linear, "--micro-batch", "2", "--accum", "256", "--precision", "bf16w"])
    drift = report["precision"]
    assert status_ == IMPRECISE and report["verdict"] == "imprecise" and report["safe"] is True
    assert drift["summed_in"] == "bfloat16" and drift["worse"] and drift["ratio"] > 4
    assert drift["accumulated_rel"] - drift["big_rel"] > 2 * drift["floor"] and drift["floor"] == 2 ** -8
    assert "precision=bf16w-acc32 in gaexp (gaexp-check --accumulate-in fp32)" in drift["remedy"]
    status_, text = run([*linear, "--micro-batch", "2", "--accum", "256", "--precision", "bf16w"])
    assert status_ == IMPRECISE and text.splitlines()[1].startswith("SAFE in float32, IMPRECISE in bf16w: "), text
    assert re.search(r"^IMPRECISE: 256 micro-batch gradients summed in bfloat16 are [\d.]+x as far from float64 as "
                     r"one batch of 512 \(0.0\d+ against 0.00\d+\)$", text, re.M), text
    status_, report = checked([*linear, "--micro-batch", "2", "--accum", "256", "--precision", "bf16w",
                               "--accumulate-in", "fp32"])
    drift = report["precision"]
    assert status_ == SAFE and report["verdict"] == "safe" and drift["precision"] == "bf16w-acc32"
    assert drift["summed_in"] == "float32" and not drift["worse"] and drift["ratio"] < 1.5 and drift["remedy"] == ""


@pytest.mark.parametrize("accumulated, big, worse", [
    (0.0101, 0.00246, True),  # bf16 weights, 64 micro-batches summed in bf16, on a linear model: 4.1x
    (0.0322, 0.0213, False),  # the study's CNN, 256 summed in bf16: 1.5x, bf16's own rounding dominating
    (0.0090, 0.0044, True),  # just over 2x, by more than the floor
    (0.0060, 0.0029, False),  # over 2x, by less than one bf16 rounding (2^-8 = 0.0039)
])
def test_measurably_worse_is_twice_the_big_batchs_error_and_more_than_one_rounding(accumulated, big, worse):
    assert measurably_worse(accumulated, big, 2 ** -8) is worse


def test_unsafe_wins_over_imprecise():
    def report(safe: bool, worse: bool | None) -> SimpleNamespace:
        return SimpleNamespace(safe=safe, precision=None if worse is None else SimpleNamespace(worse=worse))

    assert [status(report(*case)) for case in [(True, None), (True, False), (True, True), (False, True),
                                               (False, None)]] == [SAFE, SAFE, IMPRECISE, UNSAFE, UNSAFE]


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_a_float32_buffer_is_refused_where_the_gradients_are_float32(precision, capsys):
    status_, line = run(["model=simple", "norm=gn4", "--precision", precision, "--accumulate-in", "fp32"])
    assert status_ == BAD_INPUT and line == (
        f"gaexp-check: error: --accumulate-in fp32 with --precision {precision}; valid: --accumulate-in fp32 with "
        f"--precision bf16w, param with any ({precision}'s gradients are float32, summed in float32 already)")
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("argv, message", [
    (["--precision", "bf16w-acc32"], "argument --precision: 'bf16w-acc32'; valid: fp32, bf16, fp16, bf16w "
                                     "(bf16w-acc32 is --precision bf16w --accumulate-in fp32)"),
    (["--precision", "bf8"], "argument --precision: 'bf8'; valid: fp32, bf16, fp16, bf16w"),
    (["precision=bf16", "--precision", "bf16w"], "precision=bf16 among the overrides and --precision bf16w; valid: "
                                                 "one of them"),
])
def test_bad_precision_input_is_one_line_naming_the_choices(argv, message):
    status_, line = run(["model=simple", "norm=gn4", *argv])
    assert status_ == BAD_INPUT and message in line and "\n" not in line, line


def test_a_gaexp_models_precision_among_the_overrides_is_the_one_measured():
    status_, report = checked(["model=simple", "norm=gn4", "precision=bf16w-acc32"])
    assert status_ == SAFE and report["precision"]["precision"] == "bf16w-acc32"
    assert report["precision"]["summed_in"] == "float32"


def test_fp16_runs_with_a_scaler_on_the_models_own_device(linear):
    """On a CPU, GradScaler() alone (CUDA's) turns itself off: the scale would be None."""
    status_, report = checked([*linear, "--micro-batch", "2", "--accum", "2", "--precision", "fp16"])
    drift = report["precision"]
    assert status_ == SAFE and drift["scale"] == 2.0 ** 16 and drift["skipped"] == 0
    assert 1e-5 < drift["accumulated_rel"] < 1e-2 and 1e-5 < drift["big_rel"] < 1e-2  # float16's rounding


class Loud(nn.Module):
    """Logits times 1000: at the scaler's first scale, 2^16, the scaled gradients overflow float16."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(12, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * 1000.0


def test_fp16_backs_off_its_scale_as_training_does_and_measures_at_the_scale_found():
    torch.manual_seed(0)
    drift = precision_drift(Loud(), torch.rand(4, 12), torch.randint(0, 3, (4,)), micro_batch=2, num_accum=2,
                            precision="fp16")
    assert drift.skipped >= 1 and drift.scale == 2.0 ** 16 / 2 ** drift.skipped
    assert drift.accumulated_rel < 1e-2 and drift.big_rel < 1e-2


def test_the_python_api_adds_the_figures_and_leaves_the_model_as_it_was(train_split):
    inputs, labels = train_split.inputs(slice(0, 8)).contiguous(), train_split.labels[:8]
    torch.manual_seed(0)
    model = SimpleModel(norm_layer("gn4"))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    report = check_accumulation(model, inputs, labels, micro_batch=2, num_accum=4, precision="bf16w")
    assert report.safe and report.precision is not None and report.precision.precision == "bf16w"
    assert 1e-3 < report.precision.accumulated_rel < 0.2 and "precision bf16w: bfloat16 weights" in str(report)
    assert all(v.dtype == state[k].dtype and torch.equal(v, state[k]) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())


def test_a_precision_the_check_cannot_use_is_its_bad_input():
    model = SimpleModel(norm_layer("gn4"))
    inputs, labels = torch.randn(8, 1, 28, 28), torch.randint(0, 10, (8,))
    with pytest.raises(CheckError, match=re.escape("precision='bf8'; valid: bf16, bf16w, bf16w-acc32, fp16, fp32")):
        check_accumulation(model, inputs, labels, micro_batch=2, num_accum=4, precision="bf8")


def test_a_step_not_finite_under_the_precision_is_never_measured():
    """Without a scaler there is nothing to back off: logits of 1e60 overflow bfloat16 weights."""
    class Huge(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(x) * 1e30 * 1e30  # 1e60: beyond bfloat16 (3.4e38), not float64

    torch.manual_seed(0)
    with pytest.raises(NonFiniteError, match="under precision=bf16w after the step of"):
        precision_drift(Huge(), torch.rand(4, 4), torch.randint(0, 3, (4,)), micro_batch=2, num_accum=2,
                        precision="bf16w")


class Scale(nn.Module):
    """x * w with w = 1 + 2^-12, which bfloat16 rounds to 1: in bf16 weights, (x * w)^2 / 2 and its gradient are
    exact for x = 1."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.tensor([1 + 2 ** -12]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.w


def test_the_float64_step_holds_the_weights_the_precision_holds():
    """bf16 weights are the run's weights: the reference is the step from them, in float64, so a step that bf16
    computes exactly has no error (from the float32 weights it would be 2^-12 off)."""
    drift = precision_drift(Scale(), torch.ones(4, 1), torch.zeros(4), lambda out, t: (out ** 2).mean() / 2,
                            micro_batch=2, num_accum=2, precision="bf16w")
    assert drift.accumulated_rel == drift.big_rel == 0.0


class NoAutocast(nn.Module):
    """A layer whose forward fails under autocast, as oneDNN's LSTM does on some CPUs under bf16."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_autocast_enabled("cpu"):
            raise RuntimeError("could not create a primitive descriptor")
        return self.proj(x)


def test_a_model_that_fails_under_the_precision_is_one_line_naming_the_phase_and_exit_2():
    code, text = run(["test_check_precision:NoAutocast", "--input-shape", "4", "--precision", "bf16"])
    assert code == 2 and "\n" not in text, text
    assert text.startswith("gaexp-check: error: the check failed in the step under precision bf16: RuntimeError in "
                           "NoAutocast.forward (test_check_precision.py, line ")
    assert text.endswith(": could not create a primitive descriptor")
