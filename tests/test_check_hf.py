"""gaexp-check on transformers models, built from small configs offline: a decoder with its default cache, the model's
own loss with padding, the Trainer's num_items_in_batch fix, an MoE with its auxiliary loss, a contrastive
image-text model, an encoder, a vision transformer, a BatchNorm vision model; from the command line (hf:PATH) and in
transformers' and Lightning's Trainers."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

transformers = pytest.importorskip("transformers")
lightning = pytest.importorskip("lightning")

from conftest import REPO  # noqa: E402

from gaexp.check import check_accumulation  # noqa: E402
from gaexp.check.cli import BAD_INPUT, SAFE, UNSAFE, run  # noqa: E402
from gaexp.check.first_step import AccumulationError, join  # noqa: E402
from gaexp.check.hf import task_inputs, trainer_count  # noqa: E402

SMALL = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)


def llama(**extra) -> nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, num_key_value_heads=2, max_position_embeddings=64, **SMALL,
                                      **extra)
    return transformers.LlamaForCausalLM(config)


def padded(model: nn.Module, task: str = "causal-lm", pad: str = "varied") -> tuple[dict, torch.Tensor]:
    return task_inputs(model, task, 8, 2, 12, pad, 0)


def test_a_decoder_with_its_default_cache_is_checked_and_its_token_mean_named_with_the_remedy():
    model = llama()
    assert model.config.use_cache  # the default: each attention layer is handed a DynamicCache
    inputs, labels = padded(model)
    report = check_accumulation(model, inputs, None, "model", micro_batch=2, num_accum=4)
    assert not report.safe and report.loss_coupling == "count" and report.modules == [], str(report)
    given = report.terms[0]
    assert given.kind == "count" and given.via == ["logits"] and given.rel > 0.01
    assert given.counts == [int(labels[i:i + 2].ne(-100).sum()) for i in (0, 2, 4, 6)]
    assert report.untested == ["model.rotary_emb"] and report.untested_why == {}
    assert "the model's own loss (outputs.loss) is a mean over each micro-batch's own count" in report.causes[0]
    assert "num_items_in_batch" in report.remedies[0] and "Trainer" in report.remedies[0]


def test_a_loss_of_ones_own_reading_outputs_loss_is_measured_through_the_model_never_unexplained():
    """`loss = outputs.loss`, as the Trainer takes it: a scalar output has no batch axis to split, so the loss is
    measured term by term through the model (it was "the gradients differ while no module ... and not the loss do")."""
    model = llama()
    inputs, labels = padded(model)
    report = check_accumulation(model, inputs, labels, lambda outputs, targets: outputs.loss, micro_batch=2,
                                num_accum=4)
    assert not report.safe and not report.unexplained and report.loss_couples, str(report)
    assert [(t.name, t.kind) for t in report.terms] == [("the loss as given", "count")]


def test_the_trainers_num_items_in_batch_fix_is_safe_as_the_gradient_says():
    """With the step's count given to the forward and no 1/k, the gradient is the big batch's to rounding: the
    verdict never contradicts it (it was 'loss: couples', a false alarm, when the scalar loss was split)."""
    model = llama()
    inputs, labels = padded(model)
    report = check_accumulation(model, inputs, labels, "model", micro_batch=2, num_accum=4,
                                num_items_in_batch=trainer_count(model))
    assert report.safe and not report.loss_couples and report.gradient_rel < 1e-5, str(report)
    assert report.terms[0].kind == "" and "given the step's count of items (num_items_in_batch)" in report.loss


def test_a_compute_loss_func_with_num_items_in_batch_is_called_as_the_trainer_calls_it():
    model = llama()
    inputs, labels = padded(model)
    del inputs["labels"]
    seen = []

    def compute_loss_func(outputs, labels, num_items_in_batch=None):
        seen.append(num_items_in_batch)
        logits = outputs["logits"][:, :-1]
        summed = F.cross_entropy(logits.transpose(1, 2), labels[:, 1:], ignore_index=-100, reduction="sum")
        return summed / num_items_in_batch

    report = check_accumulation(model, inputs, labels, compute_loss_func, micro_batch=2, num_accum=4,
                                num_items_in_batch=trainer_count(model))
    assert report.safe, str(report)
    assert set(seen) == {int(labels[:, 1:].ne(-100).sum())}


def test_packed_rows_make_the_token_mean_exact():
    model = llama()
    inputs, _ = padded(model, pad="none")
    report = check_accumulation(model, inputs, None, "model", micro_batch=2, num_accum=4)
    assert report.safe and report.terms[0].kind == "", str(report)


def test_an_moe_names_its_auxiliary_loss_over_the_batch_and_the_global_balancing_remedy():
    torch.manual_seed(0)
    config = transformers.MixtralConfig(vocab_size=64, num_key_value_heads=2, max_position_embeddings=64,
                                        num_local_experts=4, num_experts_per_tok=2, output_router_logits=True, **SMALL)
    model = transformers.MixtralForCausalLM(config)
    inputs, labels = padded(model, pad="none")
    report = check_accumulation(model, inputs, labels, "model", micro_batch=2, num_accum=4,
                                num_items_in_batch=trainer_count(model))
    assert not report.safe and [t.name for t in report.terms] == ["the loss as given", "aux_loss"], str(report)
    assert [t.kind for t in report.terms] == ["batch", "batch"] and report.terms[0].via == ["logits"]
    assert "differs by its term aux_loss" in report.causes[0]
    assert "counts in full once per micro-batch, k times" in report.causes[1]
    assert any("global-batch balancing" in r and "output_router_logits" in r for r in report.remedies)


def test_a_contrastive_image_text_model_names_its_in_batch_negatives_and_gradient_caching():
    torch.manual_seed(0)
    text = transformers.CLIPTextConfig(vocab_size=64, max_position_embeddings=16, projection_dim=16, **SMALL)
    vision = transformers.CLIPVisionConfig(image_size=16, patch_size=8, projection_dim=16, **SMALL)
    model = transformers.CLIPModel(transformers.CLIPConfig(text_config=text.to_dict(), vision_config=vision.to_dict(),
                                                           projection_dim=16))
    inputs, _ = task_inputs(model, "contrastive", 8, 2, 8, "varied", 0)
    report = check_accumulation(model, inputs, None, "model", micro_batch=2, num_accum=4)
    assert not report.safe and report.loss_coupling == "samples" and report.modules == [], str(report)
    assert {"text_embeds", "image_embeds"} <= set(report.terms[0].via)
    assert "in-batch negatives" in report.causes[0] and "GradCache" in report.remedies[0]


def write_config(folder: Path, config) -> Path:
    config.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def configs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("configs")
    return {
        "bert": write_config(root / "bert", transformers.BertConfig(vocab_size=64, max_position_embeddings=32,
                                                                    architectures=["BertForMaskedLM"], **SMALL)),
        "vit": write_config(root / "vit", transformers.ViTConfig(image_size=16, patch_size=8, num_labels=3,
                                                                 architectures=["ViTForImageClassification"], **SMALL)),
        "resnet": write_config(root / "resnet", transformers.ResNetConfig(
            embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], num_labels=3,
            architectures=["ResNetForImageClassification"])),
        "llama": write_config(root / "llama", transformers.LlamaConfig(
            vocab_size=64, num_key_value_heads=2, max_position_embeddings=64, architectures=["LlamaForCausalLM"],
            **SMALL)),
    }


@pytest.mark.parametrize("name,argv,status,lines", [
    ("bert", [], UNSAFE, ["gaexp-check hf:{path}: masked-lm: 8 random rows of 16 tokens, padded after a quarter to "
                          "all of them (--pad varied), cpu, seed 0", "normalised per micro-batch"]),
    # transformers 5's BertForMaskedLM takes **kwargs and ignores num_items_in_batch: with the Trainer's fix, each
    # micro-batch's token mean counts in full
    ("bert", ["--num-items-in-batch"], UNSAFE, ["given the step's count of items (num_items_in_batch) in the model's "
                                                "forward", "the model's forward takes num_items_in_batch and ignores it",
                                                "compute_loss_func(outputs, labels, num_items_in_batch) that sums"]),
    ("vit", [], SAFE, ["image-classification: 8 random images", "modules coupling the samples of a batch: none"]),
    ("resnet", [], UNSAFE, ["8 BatchNorm2d modules couple", "nn.GroupNorm(8, C) for C = 8",
                            "the loss as given                        differs with the modules"]),
    ("llama", ["--task", "causal-lm", "--pad", "none"], SAFE, ["all real (--pad none)"]),
])
def test_the_command_checks_a_transformers_folder_offline(configs, name, argv, status, lines):
    path = configs[name]
    code, text = run([f"hf:{path}", *argv])
    assert code == status, text
    for line in lines:
        assert line.format(path=path) in text
    assert "in-batch negatives" not in text  # the modules' coupling is never laid at the loss's door


def test_the_command_loads_a_config_file_and_weights_when_the_folder_has_them(configs, tmp_path):
    code, text = run([f"hf:{configs['llama'] / 'config.json'}", "--num-items-in-batch"])
    assert code == SAFE, text
    model = llama()
    torch.nn.init.zeros_(model.lm_head.weight)  # weights that give every token the same logits
    model.save_pretrained(tmp_path / "saved")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "saved")
    assert torch.equal(loaded.lm_head.weight, model.lm_head.weight)
    code, text = run([f"hf:{tmp_path / 'saved'}", "--json"])
    assert code == UNSAFE and '"loss_coupling": "count"' in text
    assert '"eval_modules": []' in text  # in training mode, as a trainer trains it (from_pretrained gives eval)


def test_the_command_checks_ones_own_compute_loss_func_as_the_trainer_calls_it(configs, tmp_path, monkeypatch):
    (tmp_path / "mylosses.py").write_text(
        "import torch.nn.functional as F\n\n\n"
        "def compute_loss(outputs, labels, num_items_in_batch):\n"
        "    logits = outputs['logits'][:, :-1]\n"
        "    summed = F.cross_entropy(logits.transpose(1, 2), labels[:, 1:], ignore_index=-100, reduction='sum')\n"
        "    assert num_items_in_batch == labels.new_ones(1).sum() * 0 + NUM, num_items_in_batch\n"
        "    return summed / num_items_in_batch\n\n\n"
        "def token_mean(outputs, labels):\n"
        "    assert 'loss' not in outputs  # the Trainer pops the labels for a compute_loss_func\n"
        "    return F.cross_entropy(outputs['logits'][:, :-1].transpose(1, 2), labels[:, 1:], ignore_index=-100)\n")
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(configs["llama"]))
    _, labels = task_inputs(model, "causal-lm", 8, 2, 16, "varied", 0)
    text = (tmp_path / "mylosses.py").read_text().replace("NUM", str(int(labels[:, 1:].ne(-100).sum())))
    (tmp_path / "mylosses.py").write_text(text)  # the Trainer's count: labels from the second token on
    monkeypatch.syspath_prepend(str(tmp_path))
    code, text = run([f"hf:{configs['llama']}", "--loss", "mylosses:compute_loss"])
    assert code == SAFE and "compute_loss, given the step's count of items (num_items_in_batch) in the loss" in text
    code, text = run([f"hf:{configs['llama']}", "--loss", "mylosses:token_mean"])
    assert code == UNSAFE and "loss: normalised per micro-batch" in text, text


@pytest.mark.parametrize("argv,message", [
    (["hf:/no/such/folder"], "TARGET=hf:/no/such/folder: no such folder or file; give a checkpoint folder with a "
                             "config.json, or a config file (nothing is downloaded)"),
    (["model=simple", "norm=gn4", "--task", "causal-lm"], "--task causal-lm is for a transformers model"),
    (["hf:{llama}", "--input-shape", "3,32,32"], "--input-shape with --task causal-lm: the task's inputs come from the "
                                                 "model's config"),
    (["hf:{llama}", "--seq-len", "65"], "--seq-len 65: the model takes at most 64 positions"),
    (["hf:{vit}", "--task", "causal-lm"], "AutoModelForCausalLM cannot build it for --task causal-lm"),
    (["torchvision.models:resnet18", "--task", "causal-lm"], "ResNet has no .config: --task is for transformers "
                                                             "models"),
])
def test_bad_input_for_a_transformers_model_is_one_line_and_exit_2(configs, argv, message):
    code, text = run([a.format(llama=configs["llama"], vit=configs["vit"]) for a in argv])
    assert code == BAD_INPUT and message in text and "\n" not in text, text


def test_batches_of_different_lengths_are_padded_and_joined():
    a = {"input_ids": torch.ones(2, 3, dtype=torch.long), "attention_mask": torch.ones(2, 3, dtype=torch.long),
         "labels": torch.ones(2, 3, dtype=torch.long)}
    b = {key: torch.ones(2, 5, dtype=torch.long) for key in a}
    joined = join([a, b], pad_id=7)
    assert joined["input_ids"].shape == (4, 5) and joined["input_ids"][0].tolist() == [1, 1, 1, 7, 7]
    assert joined["labels"][1].tolist() == [1, 1, 1, -100, -100] and joined["attention_mask"][0, 3] == 0
    assert join([a, b], pad_id=7, left=True)["input_ids"][0].tolist() == [7, 7, 1, 1, 1]


# --- in the trainers --------------------------------------------------------------------------------------------

def collate(rows: list[dict]) -> dict[str, torch.Tensor]:
    """A collator that pads each batch to its own longest row, as transformers' collators do."""
    longest = max(len(r["input_ids"]) for r in rows)
    ids = torch.zeros(len(rows), longest, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, :len(r["input_ids"])], mask[i, :len(r["input_ids"])] = torch.tensor(r["input_ids"]), 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def documents(count: int = 32) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    return [{"input_ids": torch.randint(1, 64, (int(torch.randint(3, 17, (1,), generator=g)),), generator=g).tolist()}
            for _ in range(count)]


def hf_train(tmp_path: Path, callbacks: list, fixed: bool, report_to: list[str]) -> tuple[list[float], object]:
    model = llama()
    if not fixed:  # the Trainer then divides each micro-batch's token mean by k: the 2024 bug
        model.accepts_loss_kwargs = False
    args = transformers.TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=2,
                                          gradient_accumulation_steps=4, max_steps=2, report_to=report_to,
                                          logging_steps=1, use_cpu=True, seed=0, disable_tqdm=True, save_strategy="no")
    trainer = transformers.Trainer(model=model, args=args, train_dataset=documents(), data_collator=collate,
                                   callbacks=callbacks)
    trainer.train()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h], trainer


def figureless(line: str) -> str:
    """A verdict line without its measured differences (rounding may differ in the last digits across CPUs)."""
    return re.sub(r"(relative difference (up to )?)[0-9.e+-]+", r"\1N", line)


class FirstStep(transformers.TrainerCallback):
    """After the check, the valid labels of each batch the model trains on: the first step's, to compare."""

    def __init__(self) -> None:
        self.counts: list[int] = []

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        model.register_forward_pre_hook(lambda m, a, kw: self.counts.append(int(kw["labels"].ne(-100).sum())),
                                        with_kwargs=True)


def quoted(prefix: str) -> list[str]:
    """The callbacks' verdict lines docs/check.md quotes, without their measured differences."""
    return [figureless(line) for line in (REPO / "docs" / "check.md").read_text().splitlines()
            if line.startswith(prefix)]


@pytest.mark.slow
def test_the_transformers_callback_checks_the_first_step_logs_it_and_leaves_training_as_it_was(tmp_path, monkeypatch,
                                                                                               caplog):
    from gaexp.check.hf_callback import AccumulationCheck

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    lines = []
    for fixed in (False, True):
        check, seen = AccumulationCheck(), FirstStep()
        with caplog.at_level(logging.INFO, logger="gaexp.check"):
            losses, trainer = hf_train(tmp_path / f"run{fixed}", [check, seen], fixed, ["mlflow"])
        if not fixed:  # the micro-batches checked are those the first step trained on
            assert check.report.terms[0].counts == seen.counts[:4]
        assert losses == hf_train(tmp_path / f"bare{fixed}", [], fixed, [])[0]  # the check changes no step
        assert check.report.safe is fixed and check.line in caplog.text
        assert (tmp_path / f"run{fixed}" / "gaexp-check.txt").read_text().startswith(check.line)
        assert any(h.get("gaexp_check/safe") == float(fixed) for h in trainer.state.log_history)
        lines.append(check.line)
    assert [figureless(line) for line in lines] == quoted("gaexp-check in transformers' Trainer")
    import mlflow

    runs = mlflow.search_runs(search_all_experiments=True)
    assert sorted(runs["tags.gaexp.check.verdict"]) == ["safe", "unsafe"]
    assert sorted(runs["metrics.gaexp_check/safe"]) == [0.0, 1.0]


class Classifier(lightning.LightningModule):
    def __init__(self, norm: type[nn.Module]) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), norm(16), nn.ReLU(), nn.Linear(16, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def lightning_fit(tmp_path: Path, norm: type[nn.Module], callbacks: list) -> dict:
    from lightning.pytorch.loggers import MLFlowLogger

    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(64, 8), torch.randint(0, 3, (64,)))
    logger = MLFlowLogger(tracking_uri=f"sqlite:///{tmp_path}/mlflow.db")
    trainer = lightning.Trainer(max_steps=2, accumulate_grad_batches=4, callbacks=callbacks, logger=logger,
                                enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                                default_root_dir=tmp_path, log_every_n_steps=1)
    module = Classifier(norm)
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=2, shuffle=True))
    return {"weights": [p.detach().clone() for p in module.parameters()], "logger": logger}


@pytest.mark.slow
def test_the_lightning_callback_checks_the_first_step_logs_it_and_raises_when_asked(tmp_path):
    from gaexp.check.lightning_callback import AccumulationCheck

    lines = []
    for norm in (nn.BatchNorm1d, nn.LayerNorm):
        check = AccumulationCheck()
        fitted = lightning_fit(tmp_path / norm.__name__, norm, [check])
        bare = lightning_fit(tmp_path / f"bare{norm.__name__}", norm, [])
        assert all(torch.equal(a, b) for a, b in zip(fitted["weights"], bare["weights"]))  # training as it was
        logger = fitted["logger"]
        run = logger.experiment.get_run(logger.run_id)
        assert run.data.metrics["gaexp_check/safe"] == float(check.report.safe)
        assert run.data.tags["gaexp.check.verdict"] == ("safe" if check.report.safe else "unsafe")
        assert "train_loss" in run.data.metrics  # the module's own logging goes on
        lines.append(check.line)
    assert [figureless(line) for line in lines] == quoted("gaexp-check in Lightning")
    with pytest.raises(AccumulationError, match="UNSAFE to accumulate the first step"):
        lightning_fit(tmp_path / "raise", nn.BatchNorm1d, [AccumulationCheck(raise_on_unsafe=True)])
