"""Transformers models for the check, offline: a model loaded from a local folder or a config file by transformers'
Auto classes (`load`), the inputs of its task as a trainer feeds them (`task_inputs`: tokens from the config's
vocabulary, padding that varies between micro-batches, labels as the task takes them; images; image-text pairs),
and the step's count of items as transformers' Trainer counts `num_items_in_batch` (`trainer_count`).

transformers is optional (`pip install gaexp[hf]`): it is imported by these functions, never by gaexp's import.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from gaexp.check.errors import CheckError
from gaexp.check.loss import IGNORE_INDEX, count_items

PREFIX = "hf:"  # gaexp-check hf:PATH: a transformers checkpoint folder or a config file
TASKS = {  # --task: the Auto class that builds its head, and the architecture name's ending that implies it
    "causal-lm": ("AutoModelForCausalLM", "ForCausalLM"),
    "masked-lm": ("AutoModelForMaskedLM", "ForMaskedLM"),
    "sequence-classification": ("AutoModelForSequenceClassification", "ForSequenceClassification"),
    "image-classification": ("AutoModelForImageClassification", "ForImageClassification"),
    "contrastive": ("AutoModel", "Model"),  # an image-text model (CLIP, SigLIP) with return_loss=True
}
PADDING = ("varied", "none")  # --pad: rows of lengths that differ between micro-batches, or every row full
MASKED = 0.15  # masked-lm: the share of each row's tokens masked and predicted (BERT's)
WEIGHTS = ("model.safetensors", "pytorch_model.bin", "model.safetensors.index.json", "pytorch_model.bin.index.json")


def transformers_module() -> Any:
    try:
        import transformers
    except ImportError:
        raise CheckError("transformers is not installed: pip install 'gaexp[hf]' (or transformers>=5) to check a "
                         "transformers model") from None
    return transformers


def task_of(config: Any, task: str | None) -> str:
    """--task, or the one the config's architectures name (LlamaForCausalLM: causal-lm)."""
    if task is not None:
        if task not in TASKS:
            raise CheckError(f"--task {task!r}; valid: {', '.join(TASKS)}")
        return task
    from transformers.models.auto import modeling_auto as auto

    heads = {"causal-lm": auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, "masked-lm": auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES,
             "sequence-classification": auto.MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES,
             "image-classification": auto.MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES}
    for arch in getattr(config, "architectures", None) or []:
        for name, (_, ending) in TASKS.items():  # GPT2LMHeadModel is causal-lm by its Auto class's mapping
            if name != "contrastive" and (arch.endswith(ending) or arch in heads[name].values()):
                return name
    if getattr(config, "text_config", None) is not None and getattr(config, "vision_config", None) is not None:
        return "contrastive"
    raise CheckError(f"the config names no task ({getattr(config, 'architectures', None) or 'no architectures'}); "
                     f"give --task, one of {', '.join(TASKS)}")


def load(path: str, task: str | None) -> tuple[nn.Module, str]:
    """The model at PATH (a folder with config.json, and its weights if it has any; or a config .json file) with
    the head of its task, built offline (HF_HUB_OFFLINE: nothing is downloaded); and the task."""
    transformers = transformers_module()
    where = Path(path).expanduser()
    if not where.exists():
        raise CheckError(f"TARGET={PREFIX}{path}: no such folder or file; give a checkpoint folder with a config.json, "
                         "or a config file (nothing is downloaded)")
    if where.is_dir() and not (where / "config.json").is_file():
        raise CheckError(f"TARGET={PREFIX}{path}: the folder has no config.json")
    was = os.environ.get("HF_HUB_OFFLINE")
    os.environ["HF_HUB_OFFLINE"] = "1"
    try:
        try:
            config = transformers.AutoConfig.from_pretrained(str(where))
        except Exception as e:  # noqa: BLE001 - transformers' refusal, said in one line
            raise CheckError(f"TARGET={PREFIX}{path}: transformers cannot read its config: {type(e).__name__}: {e}"
                             .splitlines()[0]) from None
        task = task_of(config, task)
        auto = getattr(transformers, TASKS[task][0])
        if task == "sequence-classification" and getattr(config, "pad_token_id", None) is None:
            config.pad_token_id = 0  # a decoder's classifier finds each row's last token by the pad token
        weights = where.is_dir() and any((where / w).is_file() for w in WEIGHTS)
        bars = transformers.utils.logging.is_progress_bar_enabled()
        transformers.utils.logging.disable_progress_bar()  # loading the weights: no bar in the report
        try:
            model = (auto.from_pretrained(str(where), config=config, local_files_only=True) if weights
                     else auto.from_config(config))
        except Exception as e:  # noqa: BLE001 - as above
            raise CheckError(f"TARGET={PREFIX}{path}: {TASKS[task][0]} cannot build it for --task {task}: "
                             f"{type(e).__name__}: {e}".splitlines()[0]) from None
        finally:
            if bars:
                transformers.utils.logging.enable_progress_bar()
        model.train()  # from_pretrained gives it in eval mode; a trainer trains it in training mode
    finally:
        if was is None:
            os.environ.pop("HF_HUB_OFFLINE", None)
        else:
            os.environ["HF_HUB_OFFLINE"] = was
    return model, task


def _config(model: nn.Module, part: str | None = None) -> Any:
    config = getattr(model, "config", None)
    if config is None:
        raise CheckError(f"{type(model).__name__} has no .config: --task is for transformers models (or a builder "
                         "returning one)")
    return getattr(config, part, None) or config if part else config


def lengths(n: int, seq_len: int, pad: str, micro_batch: int, generator: torch.Generator) -> torch.Tensor:
    """Each row's count of real tokens: all seq_len, or (varied) drawn from seq_len/4 to seq_len, with the first two
    micro-batches' totals made to differ (so that a mean over a micro-batch's count shows)."""
    if pad == "none":
        return torch.full((n,), seq_len)
    low = max(2, seq_len // 4)
    drawn = torch.randint(low, seq_len + 1, (n,), generator=generator)
    if n >= 2 * micro_batch and drawn[:micro_batch].sum() == drawn[micro_batch:2 * micro_batch].sum():
        drawn[0] = low if drawn[0] != low else seq_len
    return drawn


def _tokens(config: Any, n: int, seq_len: int, pad: str, micro_batch: int, generator: torch.Generator
            ) -> tuple[torch.Tensor, torch.Tensor]:
    vocab = getattr(config, "vocab_size", None)
    if not isinstance(vocab, int) or vocab < 2:
        raise CheckError(f"the model's config has vocab_size={vocab!r}; the text tasks draw tokens from it")
    limit = getattr(config, "max_position_embeddings", None)
    if isinstance(limit, int) and 0 < limit < seq_len:  # XLNet says -1: no limit
        raise CheckError(f"--seq-len {seq_len}: the model takes at most {limit} positions (max_position_embeddings)")
    pad_id = getattr(config, "pad_token_id", None)
    pad_id = pad_id if isinstance(pad_id, int) and 0 <= pad_id < vocab else 0
    ids = torch.randint(0, vocab, (n, seq_len), generator=generator)
    mask = (torch.arange(seq_len)[None] < lengths(n, seq_len, pad, micro_batch, generator)[:, None]).long()
    return ids.masked_fill(mask == 0, pad_id), mask


def _image_size(config: Any) -> tuple[int, int, int]:
    size = getattr(config, "image_size", None) or 32
    if isinstance(size, dict):
        size = (size.get("height", 32), size.get("width", 32))
    h, w = (size, size) if isinstance(size, int) else tuple(size)[:2]
    return getattr(config, "num_channels", 3) or 3, int(h), int(w)


def task_inputs(model: nn.Module, task: str, n: int, micro_batch: int, seq_len: int, pad: str, seed: int
                ) -> tuple[dict[str, Any], torch.Tensor | None]:
    """b*k samples of the task as a trainer's collator gives them (a dict of the model's keyword arguments, labels
    among them) and the labels (None for a contrastive pair, whose loss needs none)."""
    if seq_len < 2:
        raise CheckError(f"--seq-len {seq_len}; valid: an integer >= 2")
    if pad not in PADDING:
        raise CheckError(f"--pad {pad!r}; valid: {', '.join(PADDING)}")
    g = torch.Generator().manual_seed(seed)
    if task in ("causal-lm", "masked-lm", "sequence-classification"):
        config = _config(model)
        ids, mask = _tokens(config, n, seq_len, pad, micro_batch, g)
        if task == "causal-lm":
            labels = ids.masked_fill(mask == 0, IGNORE_INDEX)
        elif task == "masked-lm":
            chosen = (torch.rand(ids.shape, generator=g) < MASKED) & (mask == 1)
            chosen[:, 0] = True  # at least one item a row
            labels = ids.masked_fill(~chosen, IGNORE_INDEX)
            token = getattr(config, "mask_token_id", None)
            if isinstance(token, int) and 0 <= token < config.vocab_size:
                ids = ids.masked_fill(chosen, token)
        else:
            labels = torch.randint(0, max(1, getattr(config, "num_labels", 2)), (n,), generator=g)
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}, labels
    if task == "image-classification":
        config = _config(model)
        pixels = torch.rand((n, *_image_size(config)), generator=g)
        labels = torch.randint(0, max(1, getattr(config, "num_labels", 2)), (n,), generator=g)
        return {"pixel_values": pixels, "labels": labels}, labels
    if task == "contrastive":
        ids, mask = _tokens(_config(model, "text_config"), n, seq_len, pad, micro_batch, g)
        pixels = torch.rand((n, *_image_size(_config(model, "vision_config"))), generator=g)
        return {"input_ids": ids, "attention_mask": mask, "pixel_values": pixels, "return_loss": True}, None
    raise CheckError(f"--task {task!r}; valid: {', '.join(TASKS)}")


def trainer_count(model: nn.Module) -> Callable[[Any], int]:
    """The step's count of items as transformers' Trainer counts `num_items_in_batch`: labels that are not -100,
    from the second position on for a decoder whose loss shifts the labels (ForCausalLMLoss)."""
    try:
        from transformers.loss.loss_utils import LOSS_MAPPING, ForCausalLMLoss
    except ImportError:
        return count_items
    config = getattr(model, "config", None)
    shifts = LOSS_MAPPING.get(getattr(model, "loss_type", None)) is ForCausalLMLoss and \
        not getattr(config, "is_encoder_decoder", False)
    if not shifts:
        return count_items

    def count(step_targets: Any) -> int:
        labels = step_targets["labels"] if isinstance(step_targets, dict) else step_targets
        return int(labels[..., 1:].ne(IGNORE_INDEX).sum())
    return count
