"""gaexp/tools/hf_zoo.py: the small configs, the loss that never couples, the truth worked out without the check, the
judging, and rows through the real check (the whole zoo is a benchmark: python -m gaexp.tools.hf_zoo)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402
from torch import nn  # noqa: E402

from conftest import REPO  # noqa: E402
from gaexp.tools.hf_zoo import (  # noqa: E402
    _kept_layers, build, check_one, judge, run_row, small_config, step_loss, summary, table, truth,
)


def params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def test_the_small_config_shrinks_every_size_and_keeps_the_special_ids_in_the_vocabulary():
    config = small_config("llama", "causal-lm")
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads,
            config.head_dim, config.intermediate_size, config.vocab_size) == (64, 2, 4, 2, 16, 64, 128)
    assert config.bos_token_id < 128 and config.eos_token_id < 128
    assert params(build("llama", "causal-lm")) < 100_000  # the default is 6.7 billion
    bert = build("bert", "masked-lm")
    assert type(bert).__name__ == "BertForMaskedLM" and params(bert) < 100_000
    assert bert.config.pad_token_id < 128 and bert.config.num_hidden_layers == 2
    vit = build("vit", "image-classification")
    assert (vit.config.image_size, vit.config.patch_size) == (32, 8) and params(vit) < 100_000
    resnet = small_config("resnet", "image-classification")  # a network of stages: one block a stage, narrow
    assert resnet.depths == [1, 1, 1, 1] and resnet.hidden_sizes == [16, 32, 64, 128]


def test_a_hybrid_keeps_its_first_layer_of_each_kind():
    kinds = ["linear_attention"] * 3 + ["full_attention"]
    assert _kept_layers([kinds * 8], 32, 2) == [0, 3]
    assert _kept_layers([["full_attention"] * 32], 32, 2) == [0, 1]
    qwen3_next = small_config("qwen3_next", "causal-lm")  # every 4th layer is full attention in its default
    assert "full_attention" in qwen3_next.layer_types and qwen3_next.num_hidden_layers == len(qwen3_next.layer_types)


def test_the_loss_of_the_micro_batches_sums_to_the_whole_batchs():
    torch.manual_seed(0)
    logits = torch.randn(8, 6, 5)
    labels = torch.randint(0, 5, (8, 6))
    labels[::3, 2:] = -100  # valid counts that differ between micro-batches
    for task in ("causal-lm", "masked-lm"):
        loss = step_loss(task)
        whole = loss({"logits": logits}, labels, labels)
        parts = sum(loss({"logits": logits[a:a + 2]}, labels[a:a + 2], labels) for a in range(0, 8, 2))
        assert torch.allclose(whole, parts, rtol=1e-6)
    flat = torch.randint(0, 5, (8,))
    loss = step_loss("sequence-classification")
    assert torch.allclose(loss({"logits": logits[:, 0]}, flat, flat),
                          sum(loss({"logits": logits[a:a + 2, 0]}, flat[a:a + 2], flat) for a in range(0, 8, 2)))


class Centered(nn.Module):
    """Per-sample layers, then the batch's mean subtracted: couples without a BatchNorm."""

    def __init__(self, centered: bool) -> None:
        super().__init__()
        self.linear, self.drop, self.centered = nn.Linear(4, 3), nn.Dropout(0.5), centered

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.drop(self.linear(x))
        return y - y.mean(0, keepdim=True) if self.centered else y


class Normed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear, self.norm = nn.Linear(4, 3), nn.BatchNorm1d(3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.linear(x))


class Counting(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 3)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.linear(x)


class Noisy(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + torch.rand(())


def test_the_truth_without_the_check():
    x = {"x": torch.randn(8, 4)}
    assert truth(Centered(False), x, 2)["truth"] == "safe"  # its Dropout off in the truth's copy
    centered = truth(Centered(True), x, 2)
    assert centered["truth"] == "unsafe" and centered["rel"] > 0.1 and "outputs depend on the batch" in centered["why"]
    norm = truth(Normed(), x, 2)
    assert norm["truth"] == "unsafe" and norm["batchnorm"] == ["norm"] and norm["buffers"] == [
        "norm.running_mean", "norm.running_var", "norm.num_batches_tracked"]
    assert norm["why"].startswith("1 BatchNorm in training mode; outputs depend on the batch")
    counting = truth(Counting(), x, 2)  # 4 forwards against 1: no BatchNorm, and still not the same step
    assert counting["truth"] == "unsafe" and counting["buffers"] == ["calls"] and counting["rel"] == 0
    assert truth(Noisy(4, 3), x, 2)["truth"] == "unknown"


def row(truth_: str, verdict: str, **extra) -> dict:
    seed = {"seed": 0, "truth": truth_, "why": "1 BatchNorm in training mode" if truth_ == "unsafe" else "",
            "verdict": verdict, "named": [["bn", "BatchNorm2d", 1.3]] if verdict == "unsafe" else [], "untested": 2,
            "gradient_rel": 0.25, "seconds": 0.5, **extra}
    return {"model": "m", "task": "causal-lm", "class": "M", "params": 1000, "seeds": [seed]}


@pytest.mark.parametrize("data,outcome,note", [
    (row("safe", "safe"), "right", None),
    (row("unsafe", "unsafe"), "right", None),
    (row("safe", "unsafe"), "false alarm", "named 1: bn BatchNorm2d 1.3; gradient rel. 0.25"),
    (row("unsafe", "safe"), "miss", "named none; gradient rel. 0.25; truth: 1 BatchNorm in training mode"),
    (row("safe", "crash", error="IndexError: tuple index"), "crash", "IndexError: tuple index"),
    (row("safe", "refused", error="CheckError: x"), "refused", "CheckError: x"),
    (row("unknown", "safe"), "truth unknown", "the check said safe"),
    ({"model": "m", "task": "causal-lm", "error": "not built: ImportError: timm"}, "not built", "timm"),
    ({"model": "m", "task": "causal-lm", "error": "took over 300 s (in: check)", "timeout": "check"}, "timeout", "300"),
    ({"model": "m", "task": "causal-lm", "error": "exit -9 (in: check): Killed", "died": "check"}, "crash", "exit -9"),
])
def test_each_row_is_judged_against_the_truth(data, outcome, note):
    judged = judge(data)
    assert judged.outcome == outcome
    assert (note is None and judged.notes == []) or note in judged.notes[0]
    text = table([judged])
    assert f"| {outcome}" in text and text.splitlines()[-1].startswith("1 rows: ")
    assert f"1 {outcome}" in summary([judged])


def test_rows_through_the_real_check():
    llama = check_one("llama:causal-lm", (0,))
    [seed] = llama["seeds"]
    assert llama["class"] == "LlamaForCausalLM" and seed["truth"] == "safe" and seed["verdict"] == "safe"
    assert seed["rel"] < 1e-12 and seed["gradient_rel"] < 1e-5 and judge(llama).outcome == "right"
    resnet = check_one("resnet:image-classification", (0,))
    [seed] = resnet["seeds"]
    assert seed["truth"] == "unsafe" and seed["verdict"] == "unsafe" and len(seed["batchnorm"]) == 17
    assert {t for _, t, _ in seed["named"]} == {"BatchNorm2d"} and judge(resnet).outcome == "right"
    assert "| unsafe (17 BatchNorm in training mode; outputs depend on the batch; 51 buffers end differently) |" in \
        table([judge(resnet)])
    mixtral = build("mixtral", "causal-lm")  # its experts' grouped_mm takes no float64: computed expert by expert
    x = {"input_ids": torch.randint(0, 128, (8, 16))}
    assert truth(mixtral, x, 2)["truth"] == "safe" and truth(mixtral, x, 2)["rel"] < 1e-12
    if importlib.util.find_spec("timm") is None:  # a model that cannot be built is a row, not a crash
        timm = judge(check_one("timm_wrapper:image-classification"))
        assert timm.outcome == "not built" and "requires the timm library" in timm.notes[0]


def test_the_command_runs_a_row_in_a_process_and_refuses_an_unknown_model():
    done = run_row("bert:masked-lm", (0,), 120)
    assert done["class"] == "BertForMaskedLM" and judge(done).outcome == "right"
    bad = subprocess.run([sys.executable, "-m", "gaexp.tools.hf_zoo", "--models", "lama"], capture_output=True,
                         text=True, timeout=120, cwd=REPO)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1
    assert "--models lama: not a model type" in bad.stderr and "(did you mean llama?)" in bad.stderr
