"""`python -m gaexp.tools.hf_zoo`: gaexp-check on every transformers architecture with a text or image head, against
the truth.

A benchmark, not a test (the whole zoo, 420 rows in transformers 5.25, takes about an hour on 2 cores, most of it
importing transformers once a row; tests/test_hf_zoo.py runs a few rows). Each row is a model type of the installed
transformers and a task whose head it has (its auto mappings: causal-lm, masked-lm, sequence-classification,
image-classification), built by the task's Auto class from a small config: the config class's defaults with every size
it names shrunk (`small_config`: 2 layers, a hidden size of 64, 4 heads of 16, 2 key-value heads, a vocabulary of 128, a
32x32 image, the same in its sub-configs; OVERRIDES for what the rules cannot know), so that the whole zoo fits on a
CPU; one that cannot be built, or whose forward fails, is a row "not built" with transformers' reason. It is checked by
`check_accumulation` itself on the task's inputs (gaexp.check.hf.task_inputs: padding that varies between
micro-batches), with a loss normalised by the step's own count (the loss never couples, so the verdict is the model's).
The truth is worked out without the check (`truth`), on a float64 copy with its random layers off (float32, said in the
row, for a model that casts to float32 itself): a model couples the samples of a batch exactly when its logits for a
micro-batch differ from the same rows' logits in the whole batch, or a batch-statistics layer (BatchNorm) is in training
mode, or its buffers end one forward of the batch differently from one forward per micro-batch. Each row runs in a
process of its own, so one that hangs or runs out of memory is a row of the table, not the end of the run.

    python -m gaexp.tools.hf_zoo                                 # every row, seed 0: the table on stdout
    python -m gaexp.tools.hf_zoo --models llama,bert --tasks causal-lm,masked-lm --output zoo.md
"""

from __future__ import annotations

import argparse
import copy
import difflib
import json
import math
import os
import re
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

TASKS = ("causal-lm", "masked-lm", "sequence-classification", "image-classification")
MAPPINGS = {  # task: the auto mapping (model type: class name) that lists the architectures with its head
    "causal-lm": "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
    "masked-lm": "MODEL_FOR_MASKED_LM_MAPPING_NAMES",
    "sequence-classification": "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES",
    "image-classification": "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES",
}
N, MICRO, SEQ_LEN = 8, 2, 16  # the step: 8 samples, as 4 micro-batches of 2; tokens a row
TRUTH_RTOL = {"float64": 1e-9, "float32": 1e-5}  # a micro-batch's logits further than this from the whole batch's
# rows couple: float64, or float32 for a model with a float32 cast of its own that refuses float64
IMAGE_SIZES = (32, 64, 96, 128, 224)  # the ladder of square images, smallest first, for a model that refuses 32
TIMEOUT = 300.0
FAILING = ("crash", "false alarm", "miss")  # outcomes that make the command exit 1, and a timeout in the check

# The sizes a config names, shrunk: each attribute present as an int (in the config or a sub-config) larger than the
# value it is listed under is given that value.
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, VOCAB, POSITIONS = 64, 4, 2, 16, 64, 128, 64
LAYERS = (2, 4, 8)  # layers, fewest first: a hybrid whose first 2 layers hold no attention layer gets more
SIZES = [
    (HIDDEN, ("hidden_size", "d_model", "n_embd", "n_embed", "dim", "embed_dim", "embedding_size",
              "word_embed_proj_dim", "emb_dim", "embedding_dim", "hidden_size_global", "true_hidden_size",
              "input_embedding_size", "output_embedding_size", "attention_hidden_size", "lru_width", "d_latents",
              "out_hidden_size", "intra_bottleneck_size", "pooler_hidden_size")),
    (HEADS, ("num_attention_heads", "n_head", "num_heads", "n_heads", "encoder_attention_heads",
             "decoder_attention_heads", "attention_heads", "num_encoder_attention_heads", "num_decoder_attention_heads",
             "linear_num_key_heads", "linear_num_value_heads", "num_self_attention_heads",
             "num_cross_attention_heads")),
    (KV_HEADS, ("num_key_value_heads", "n_kv_heads", "num_kv_heads", "multi_query_group_num", "num_query_groups")),
    (2, ("num_experts_per_tok", "num_experts_per_token", "moe_topk", "moe_k")),
    (1, ("n_group", "topk_group", "num_expert_group", "first_k_dense_replace", "n_shared_experts")),
    (0, ("num_kv_shared_layers",)),
    (HEAD_DIM, ("head_dim", "d_kv", "d_head", "attention_head_size", "kv_channels", "dim_head", "attention_head_dim",
                "v_head_dim", "qk_head_dim", "linear_key_head_dim", "linear_value_head_dim", "q_lora_rank",
                "kv_lora_rank", "swa_head_dim", "mamba_headdim", "mamba_d_head", "hidden_size_per_layer_input")),
    (8, ("qk_rope_head_dim", "qk_nope_head_dim", "rotary_dim", "mamba_n_heads", "index_topk", "sliding_window")),
    (FFN, ("intermediate_size", "ffn_dim", "n_inner", "d_ff", "ffn_hidden_size", "encoder_ffn_dim", "decoder_ffn_dim",
           "d_inner", "dim_ff", "dff", "intermediate_size_mlp", "feed_forward_size", "mlp_dim")),
    (32, ("moe_intermediate_size", "shared_expert_intermediate_size", "moe_shared_expert_intermediate_size",
          "expert_ffn_hidden_size", "shared_intermediate_size", "first_dense_intermediate_size",
          "dense_intermediate_size", "shared_experts_intermediate_size", "mlp_only_intermediate_size")),
    (4, ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts", "num_groups")),
    (POSITIONS, ("max_position_embeddings", "n_positions", "n_ctx", "max_seq_len", "max_sequence_length")),
]
SIZE_OF = {name: value for value, names in SIZES for name in names}
LAYER_NAMES = ("num_hidden_layers", "n_layer", "num_layers", "n_layers", "num_decoder_layers", "num_encoder_layers",
               "decoder_layers", "encoder_layers", "depth")
STAGE_LISTS = ("depths", "hidden_sizes", "num_heads", "num_attention_heads", "embed_dim", "embed_dims")
TOKEN_IDS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "sep_token_id": 3, "cls_token_id": 4,
             "mask_token_id": 5, "unk_token_id": 6, "decoder_start_token_id": 0}  # a special id outside the small
# vocabulary becomes this; any other (an image token) one from the top of the vocabulary down
KEEP = "default"  # in OVERRIDES: the config class's default, not shrunk
OVERRIDES: dict[str, dict[str, Any]] = {  # what the rules above cannot know, by model type (of the config or of one of
    # its sub-configs), or MODEL_TYPE:TASK for the top config of that task's row
    "bamba": {"attn_layer_indices": [1]},  # its default has no attention layer, which its forward refuses
    "deepseek_v2": {"num_experts_per_tok": 2},  # its default, None, is no number of experts
    "dots1": {"n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1},
    "dots3_note_text": {"adapter_in_dim": HIDDEN},
    "esmc": {"num_key_value_heads": HEADS},  # no grouped-query attention
    "granitemoehybrid": {"layer_types": ["mamba", "attention"]},
    "hgnet_v2": {"hidden_sizes": KEEP},  # the classifier reads the widths of its stage_*_channels lists
    "layoutlmv3": {"coordinate_size": 12, "shape_size": 8},  # 4 coordinates and 2 sizes make the hidden size
    "levit": {"patch_size": KEEP},  # its stem's four stride-2 convolutions are its patches
    "lfm2_moe": {"layer_types": ["conv", "full_attention"], "num_dense_layers": 1},
    "lilt": {"hidden_size": 48},  # its 6 box embeddings of hidden_size // 6 make the hidden size
    "mamba2": {"num_heads": 8},  # hidden_size * expand must equal num_heads * head_dim
    "qwen4_exp_text": {"indexer_n_heads": 2, "indexer_kv_heads": 1, "indexer_head_dim": 16, "indexer_budget": 8,
                       "indexer_compress_ratio": 4},
    "reformer": {"axial_pos_embds_dim": [32, 32], "axial_pos_shape": [4, 4], "lsh_attn_chunk_length": 4,
                 "local_attn_chunk_length": 4, "max_position_embeddings": 16},
    "reformer:causal-lm": {"is_decoder": True},
    "perceiver:masked-lm": {"max_position_embeddings": SEQ_LEN},  # its decoder's queries are its logits' positions
    "textnet": {"hidden_sizes": KEEP, "depths": KEEP},  # its kernel lists have an entry a block
}
DROPOUT_WORDS = ("dropout", "drop_path", "droppath", "layerdrop", "drop_rate", "drop_prob", "jitter",
                 "stochastic_depth")
RANDOM_MODULES = ("Dropout", "DropPath", "StochasticDepth")


def task_architectures(tasks: Sequence[str] = TASKS) -> dict[str, list[str]]:
    """Each task's model types, as the installed transformers maps them to its Auto class."""
    from transformers.models.auto import modeling_auto

    return {task: sorted(getattr(modeling_auto, MAPPINGS[task])) for task in tasks}


def _configs(config: Any) -> list[Any]:
    """The config and every sub-config under it (text_config, vision_config, ...), outermost first."""
    from transformers import PretrainedConfig

    found, stack = [], [config]
    while stack:
        c = stack.pop(0)
        if any(c is f for f in found):
            continue
        found.append(c)
        stack += [v for v in vars(c).values() if isinstance(v, PretrainedConfig)]
    return found


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _small_kwargs(c: Any, image_size: int, layers: int) -> dict[str, Any]:
    """The arguments that make one config small (its class's constructor derives the rest from them): each size of
    SIZES, lists of one entry a layer cut to `layers`, a network of stages with one block a stage and widths 16 to
    16 * 2**(stages - 1), the image and its patches, the vocabulary and the special ids within it; each sub-config
    made small the same way."""
    from transformers import PretrainedConfig

    attrs = vars(c)
    kw: dict[str, Any] = {}
    old_layers = next((attrs[k] for k in LAYER_NAMES if _is_int(attrs.get(k))), None)
    per_layer = [name for name, value in attrs.items() if isinstance(value, (list, tuple)) and name not in STAGE_LISTS
                 and old_layers and old_layers > layers and len(value) == old_layers]
    keep = _kept_layers([attrs[name] for name in per_layer], old_layers or 0, layers)
    for name, value in attrs.items():
        if isinstance(value, PretrainedConfig):
            small = _small_kwargs(value, image_size, layers)
            if small:
                kw[name] = type(value)(**small)
        elif name in LAYER_NAMES and _is_int(value) and value > layers:
            kw[name] = len(keep)
        elif name in SIZE_OF and _is_int(value) and value > SIZE_OF[name]:
            kw[name] = SIZE_OF[name]
        elif "vocab_size" in name and _is_int(value) and value > VOCAB:
            kw[name] = VOCAB
        elif name == "vocab_size" and value is None:
            kw[name] = VOCAB
        elif name in per_layer:
            kw[name] = [value[i] for i in keep]
    heads = kw.get("num_attention_heads", attrs.get("num_attention_heads"))
    if "head_dim" in attrs and attrs["head_dim"] is None and _is_int(heads):
        kw["head_dim"] = kw.get("hidden_size", attrs.get("hidden_size", HIDDEN)) // heads
    if "num_key_value_heads" in attrs and attrs["num_key_value_heads"] is None and _is_int(heads):
        kw["num_key_value_heads"] = KV_HEADS  # None: as many as heads (Nemotron); grouped-query attention here
    if _is_int(attrs.get("qk_rope_head_dim")) and attrs.get("head_dim") == attrs["qk_rope_head_dim"]:
        kw["head_dim"] = kw["qk_rope_head_dim"]  # multi-head latent attention (DeepSeek): rotary on the rope part
    if "kv_lora_rank" in attrs and _is_int(heads) and _is_int(attrs.get("num_key_value_heads")):
        kw["num_key_value_heads"] = heads  # ... and as many key-value heads as heads
    if "vocab_size" in attrs and attrs["vocab_size"] is None:  # a vocabulary the config leaves open (ESM): its ids
        kw.update({name: small for name, small in TOKEN_IDS.items() if name in attrs and attrs[name] is None})
    stages = next((len(attrs[k]) for k in ("depths", "hidden_sizes") if isinstance(attrs.get(k), (list, tuple))), 0)
    if stages:
        if isinstance(attrs.get("depths"), (list, tuple)):
            kw["depths"] = [1] * len(attrs["depths"])
        for name in ("hidden_sizes", "embed_dim", "embed_dims"):
            if isinstance(attrs.get(name), (list, tuple)):
                kw[name] = [16 * 2 ** i for i in range(len(attrs[name]))]
        for name in ("num_heads", "num_attention_heads"):
            if isinstance(attrs.get(name), (list, tuple)):
                kw[name] = [2 ** i for i in range(len(attrs[name]))]
        if _is_int(attrs.get("embed_dim")):
            kw["embed_dim"] = 16
        if _is_int(attrs.get("num_heads")) or _is_int(attrs.get("num_attention_heads")):  # one count for stages of
            kw.pop("num_heads", None), kw.pop("num_attention_heads", None)  # their own widths: as it was
    if isinstance(attrs.get("intermediate_size"), (list, tuple)):
        kw["intermediate_size"] = [FFN] * len(kw.get("intermediate_size", attrs["intermediate_size"]))
    if _is_int(attrs.get("image_size")):
        kw["image_size"] = image_size
    elif isinstance(attrs.get("image_size"), (list, tuple)) and len(attrs["image_size"]) == 2:
        kw["image_size"] = [image_size, image_size]
    if _is_int(attrs.get("patch_size")) and attrs["patch_size"] > 4:
        kw["patch_size"] = 4 if stages else 8
    vocab = kw.get("vocab_size", attrs.get("vocab_size"))
    if _is_int(vocab):
        spare = vocab - 1
        for name, value in attrs.items():
            if not (name.endswith("_token_id") or name.endswith("_token_index")):
                continue
            if _is_int(value) and value >= vocab:
                kw[name] = TOKEN_IDS.get(name, spare)
                spare -= name not in TOKEN_IDS
            elif isinstance(value, list) and any(_is_int(v) and v >= vocab for v in value):
                kw[name] = [TOKEN_IDS.get(name, 2)]
    for name, value in OVERRIDES.get(getattr(c, "model_type", ""), {}).items():
        if value == KEEP:
            kw.pop(name, None)
        else:
            kw[name] = value
    return kw


def _kept_layers(lists: list[Sequence[Any]], old: int, layers: int) -> list[int]:
    """The layers a small config keeps of `old`: the first of each kind that a per-layer list of names or flags
    holds (a hybrid's first attention layer among linear ones, its first sparse MLP; 8 at most), then the first
    others, `layers` at least."""
    keep: set[int] = set()
    for values in lists:
        if all(isinstance(v, (str, bool)) for v in values):
            keep |= {list(values).index(kind) for kind in set(values)}
    keep = set(sorted(keep)[:LAYERS[-1]])
    i = 0
    while len(keep) < min(layers, old):
        keep.add(i)
        i += 1
    return sorted(keep)


def small_config(model_type: str, task: str, image_size: int = 32, layers: int = LAYERS[0]) -> Any:
    """The model type's config class built small: its defaults with every size it names shrunk, here and in its
    sub-configs (`_small_kwargs`), and OVERRIDES'."""
    from transformers import CONFIG_MAPPING

    cls = CONFIG_MAPPING[model_type]
    kw = {**_small_kwargs(cls(), image_size, layers), **OVERRIDES.get(f"{model_type}:{task}", {})}
    config = cls(**kw)
    if not getattr(config, "architectures", None):  # the Auto class picks among several classes by it
        from transformers.models.auto import modeling_auto

        arch = getattr(modeling_auto, MAPPINGS[task]).get(model_type)
        config.architectures = [arch if isinstance(arch, str) else arch[0]]
    for c in _configs(config) if task == "sequence-classification" else []:
        if "pad_token_id" in vars(c) and c.pad_token_id is None:
            c.pad_token_id = 0  # a decoder's classifier finds each row's last token by the pad token (as hf.load)
    if task == "sequence-classification" and getattr(config, "pad_token_id", None) is None:
        config.pad_token_id = 0
    if getattr(config, "is_encoder_decoder", False) and getattr(config, "decoder_start_token_id", None) is None:
        config.decoder_start_token_id = getattr(config, "pad_token_id", None) or 0  # T5's: the decoder starts at pad
    return config


def build(model_type: str, task: str, image_size: int = 32, layers: int = LAYERS[0]) -> Any:
    """The task's head on the small config, weights drawn from seed 0 (a model of several languages, Xmod, set to its
    first)."""
    import torch
    import transformers

    from gaexp.check.hf import TASKS as HF_TASKS

    config = small_config(model_type, task, image_size, layers)
    torch.manual_seed(0)
    model = getattr(transformers, HF_TASKS[task][0]).from_config(config)
    languages = getattr(config, "languages", None)
    if hasattr(model, "set_default_language") and languages:
        model.set_default_language(list(languages)[0])
    return model


def logits_of(outputs: Any) -> Any:
    """The outputs' logits (a ModelOutput or a dict), or the outputs themselves when a tensor, else the first tensor
    (PP-LCNet's classifier returns its logits as last_hidden_state)."""
    import torch

    if isinstance(outputs, torch.Tensor):
        return outputs
    if isinstance(outputs, Mapping) and outputs.get("logits") is not None:
        return outputs["logits"]
    values = list(outputs.values()) if isinstance(outputs, Mapping) else outputs
    if isinstance(values, (tuple, list)) and values and isinstance(values[0], torch.Tensor):
        return values[0]
    raise TypeError(f"the model returned {type(outputs).__name__} with no logits")


def step_loss(task: str) -> Callable[..., Any]:
    """The loss of one micro-batch normalised by the whole step's count (the check gives it the step's targets and
    does not scale it), so that it never couples: cross-entropy summed over the valid labels (shifted by one for a
    causal LM) over the step's count of valid labels; for a classifier, summed over the rows over the step's rows."""
    import torch.nn.functional as F

    if task in ("causal-lm", "masked-lm"):
        shift = task == "causal-lm"

        def per_step(outputs: Any, labels: Any, step_targets: Any) -> Any:
            logits = logits_of(outputs)
            if shift:
                logits, labels, step_targets = logits[:, :-1], labels[:, 1:], step_targets[:, 1:]
            total = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1),
                                    ignore_index=-100, reduction="sum")
            return total / step_targets.ne(-100).sum().clamp(min=1)
    else:
        def per_step(outputs: Any, labels: Any, step_targets: Any) -> Any:
            return F.cross_entropy(logits_of(outputs).float(), labels, reduction="sum") / step_targets.shape[0]
    return per_step


def _rows(inputs: Mapping[str, Any], start: int, stop: int, n: int) -> dict[str, Any]:
    import torch

    return {k: v[start:stop] if isinstance(v, torch.Tensor) and v.dim() and v.shape[0] == n else v
            for k, v in inputs.items()}


def _rel(a: Any, b: Any) -> float:
    if a.shape != b.shape:  # a micro-batch's output shaped by the batch (padding trimmed to the longest row)
        return math.inf
    diff, ref = float((a - b).norm()), float(b.norm())
    return diff / ref if ref else (0.0 if diff == 0 else math.inf)


def deterministic_copy(model: Any, dtype: str = "float64") -> Any:
    """A float64 (or `dtype`) copy in training mode with its random layers off: modules named *Dropout*, *DropPath*,
    *StochasticDepth* in eval mode with their p 0, every float dropout/drop-path/jitter rate of its config(s) and
    modules 0; its mixture of experts, if any, computed expert by expert (eager: grouped_mm takes no float64)."""
    import torch

    twin = copy.deepcopy(model).to(getattr(torch, dtype)).train()
    if hasattr(twin, "set_experts_implementation"):
        try:
            twin.set_experts_implementation("eager")  # grouped_mm, the default, takes no float64
        except Exception:  # noqa: BLE001 - a model that has no experts
            pass
    from_hf = hasattr(twin, "config")
    configs = _configs(twin.config) if from_hf else []
    for m in twin.modules():
        if any(w in type(m).__name__ for w in RANDOM_MODULES):
            m.eval()
            if isinstance(getattr(m, "p", None), float):
                m.p = 0.0  # an attention reads its dropout's p when the attention itself is in training mode
        for name, value in list(vars(m).items()):
            if isinstance(value, float) and any(w in name.lower() for w in DROPOUT_WORDS):
                setattr(m, name, 0.0)
        c = getattr(m, "config", None)
        if c is not None and from_hf and all(c is not k for k in configs):
            configs += _configs(c)
    for c in configs:
        for name, value in list(vars(c).items()):
            if isinstance(value, float) and any(w in name for w in DROPOUT_WORDS):
                setattr(c, name, 0.0)
    return twin


def truth(model: Any, inputs: Mapping[str, Any], micro_batch: int, dtype: str = "float64") -> dict[str, Any]:
    """Whether the model couples the samples of a batch, worked out without the check, on a float64 (or `dtype`) copy
    with its random layers off (`deterministic_copy`): "unsafe" when a batch-statistics layer (BatchNorm) is in training
    mode, or a micro-batch's logits differ from the same rows' in the whole batch by more than TRUTH_RTOL, or the
    buffers end one forward of the whole batch differently from one forward per micro-batch; "unknown" when two
    forwards of the whole batch differ (still random). Also the largest relative difference, the BatchNorm layers and
    the buffers that end differently."""
    import torch
    from torch import nn

    twin, rtol = deterministic_copy(model, dtype), TRUTH_RTOL[dtype]
    x = {k: v.to(getattr(torch, dtype)) if isinstance(v, torch.Tensor) and v.is_floating_point() else v
         for k, v in inputs.items()}
    n = next(v.shape[0] for v in x.values() if isinstance(v, torch.Tensor))
    norms = [name for name, m in twin.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.training]
    start = {k: v.detach().clone() for k, v in twin.named_buffers()}

    def reset() -> None:
        for k, v in twin.named_buffers():
            v.copy_(start[k])

    with torch.no_grad():
        parts = [logits_of(twin(**_rows(x, a, a + micro_batch, n))) for a in range(0, n, micro_batch)]
        after_parts = {k: v.detach().clone() for k, v in twin.named_buffers()}
        reset()
        whole = logits_of(twin(**x))
        after_whole = {k: v.detach().clone() for k, v in twin.named_buffers()}
        reset()
        again = logits_of(twin(**x))
        reset()
    result: dict[str, Any] = {"batchnorm": norms, "rel": 0.0, "buffers": []}
    if _rel(again, whole) > 0:
        return {**result, "truth": "unknown",
                "why": f"two forwards of the batch differ (rel. {_rel(again, whole):.2g})"}
    result["rel"] = max(_rel(p, whole[a:a + micro_batch]) for p, a in zip(parts, range(0, n, micro_batch)))
    result["buffers"] = [k for k, v in after_whole.items()
                         if v.shape != after_parts[k].shape or
                         (_rel(after_parts[k].double(), v.double()) > rtol if v.is_floating_point()
                          else not torch.equal(after_parts[k], v))]
    why = [f"{len(norms)} BatchNorm in training mode"] if norms else []
    if result["rel"] > rtol:
        why.append(f"outputs depend on the batch (rel. {result['rel']:.2g})")
    if result["buffers"]:
        why.append(f"{len(result['buffers'])} buffers end differently ({result['buffers'][0]})")
    if dtype != "float64":
        why.append(f"in {dtype}")
    return {**result, "truth": "unsafe" if len(why) > (dtype != "float64") else "safe", "why": "; ".join(why)}


def _line(e: BaseException) -> str:
    """The exception in one line: its first, and the next when the first only introduces it (pydantic-like
    validation errors say the cause on their second line)."""
    lines = [line.strip() for line in str(e).strip().splitlines() if line.strip()]
    text = " ".join(lines[:2]) if len(lines) > 1 and lines[0].endswith(":") else (lines[0] if lines else "")
    return f"{type(e).__name__}: {text}"[:240]


def _phase(name: str) -> None:
    print(f"phase: {name}", file=sys.stderr, flush=True)


def _inputs(model: Any, task: str, seed: int) -> tuple[dict[str, Any], Any]:
    """The task's inputs (gaexp.check.hf.task_inputs) without labels, so the model computes no loss of its own;
    for a model whose config keeps its vocabulary in text_config (a multimodal causal LM), drawn from that."""
    from types import SimpleNamespace

    from gaexp.check.errors import CheckError
    from gaexp.check.hf import task_inputs

    try:
        inputs, labels = task_inputs(model, task, N, MICRO, SEQ_LEN, "varied", seed)
    except CheckError:
        text = getattr(getattr(model, "config", None), "text_config", None)
        if text is None or not hasattr(text, "vocab_size"):
            raise
        inputs, labels = task_inputs(SimpleNamespace(config=text), task, N, MICRO, SEQ_LEN, "varied", seed)
    inputs.pop("labels", None)
    config = getattr(model, "config", None)
    eos = getattr(config, "eos_token_id", None)
    if task == "sequence-classification" and getattr(config, "is_encoder_decoder", False) and _is_int(eos):
        # BART's and T5's classifiers read the last <eos> of each row, and need one in every row: each row's last real
        # token made <eos>, and <eos> nowhere else
        ids, mask = inputs["input_ids"], inputs["attention_mask"]
        ids = ids.masked_fill(ids == eos, (eos + 1) % config.vocab_size)
        last = mask.sum(1) - 1
        ids[range(ids.shape[0]), last] = eos
        inputs["input_ids"] = ids
    return inputs, labels


def _forward_passes(model: Any, task: str) -> str:
    """'' when a micro-batch passes the forward in training and in evaluation mode, else the refusal (the model's
    buffers given back, in training mode)."""
    import torch

    state = {k: v.detach().clone() for k, v in model.named_buffers()}
    inputs, _ = _inputs(model, task, 0)
    try:
        with torch.no_grad():
            for mode in (True, False):
                model.train(mode)
                model(**_rows(inputs, 0, MICRO, N))
        return ""
    except Exception as e:  # noqa: BLE001 - the forward refused this config: the caller tries the next
        return _line(e)
    finally:
        with torch.no_grad():
            for k, v in model.named_buffers():
                v.copy_(state[k])
        model.train()


def build_checked(model_type: str, task: str) -> tuple[Any, str, str]:
    """The model, built and passing a forward of a micro-batch, with the fewest layers of LAYERS that does (a hybrid's
    first layers may hold no attention layer, which transformers refuses) and, for an image model, the smallest size
    of IMAGE_SIZES; (None, "", the reason) when none is built, or its inputs are refused, or its forward fails."""
    from gaexp.check.errors import CheckError

    sizes = IMAGE_SIZES if task == "image-classification" else IMAGE_SIZES[:1]
    first = ""
    for layers in LAYERS:
        for size in sizes:
            try:
                model = build(model_type, task, size, layers)
            except Exception as e:  # noqa: BLE001 - transformers' refusal of the small config: a row "not built"
                reason = f"build fails: {_line(e)}"
            else:
                try:
                    reason = _forward_passes(model, task)
                except CheckError as e:
                    return None, "", f"no inputs: gaexp.check.hf.task_inputs refuses: {_line(e)}"
                if not reason:
                    return model, f"{size}x{size}" if task == "image-classification" else "", ""
                reason = f"forward fails: {reason}"
            first = first or reason
    return None, "", first


def check_one(name: str, seeds: Sequence[int] = (0,)) -> dict[str, Any]:
    """One row, MODEL_TYPE:TASK: the model built from its small config, its truth and gaexp-check's answer at each
    seed (in this process)."""
    import torch

    from gaexp.check import check_accumulation
    from gaexp.check.errors import CheckError, NonFiniteError

    model_type, _, task = name.partition(":")
    row: dict[str, Any] = {"model": model_type, "task": task, "class": "", "params": 0, "seeds": []}
    _phase("build")
    model, size, reason = build_checked(model_type, task)
    if model is None:
        row["error"] = reason
        return row
    row.update({"class": type(model).__name__, "params": sum(p.numel() for p in model.parameters()), "size": size})
    for seed in seeds:
        entry: dict[str, Any] = {"seed": seed}
        row["seeds"].append(entry)
        inputs, labels = _inputs(model, task, seed)
        _phase("truth")
        try:
            entry.update(truth(model, inputs, MICRO))
        except Exception as e:  # noqa: BLE001 - a float64 copy that fails: in float32, else no truth (said)
            try:
                entry.update(truth(model, inputs, MICRO, "float32"))
            except Exception as e32:  # noqa: BLE001 - the check still runs
                entry.update({"truth": "unknown", "why": f"the float64 copy fails: {_line(e)}; in float32: "
                              f"{_line(e32)}", "rel": None})
        _phase("check")
        torch.manual_seed(seed)
        tic = time.perf_counter()
        try:
            report = check_accumulation(model, inputs, labels, step_loss(task), micro_batch=MICRO,
                                        num_accum=N // MICRO, seed=seed)
        except (CheckError, NonFiniteError) as e:
            entry.update({"verdict": "refused", "error": _line(e)})
        except Exception as e:  # noqa: BLE001 - a crash of the check: the row says where
            entry.update({"verdict": "crash", "error": _line(e),
                          "traceback": traceback.format_exc().strip().splitlines()[-8:]})
        else:
            entry.update({"verdict": "safe" if report.safe else "unsafe",
                          "named": [[c.module, c.type, c.rel] for c in report.modules],
                          "buffers_named": [b.name for b in report.buffers], "untested": len(report.untested),
                          "untested_why": len(report.untested_why), "random": len(report.stochastic),
                          "gradient_rel": report.gradient_rel, "loss_couples": report.loss_couples,
                          "unexplained": report.unexplained})
        entry["seconds"] = time.perf_counter() - tic
    return row


@dataclass
class Judged:
    """A row and its outcome, with the notes that say why when it is not right."""
    row: dict[str, Any]
    outcome: str  # right, false alarm, miss, crash, refused, truth unknown, not built, timeout
    notes: list[str] = field(default_factory=list)


def _named(s: dict[str, Any]) -> str:
    named = s.get("named", [])
    parts = [f"{m or '(model)'} {t} {rel:.2g}" for m, t, rel in named[:3]] + \
        ([f"and {len(named) - 3} more"] if len(named) > 3 else [])
    what = f"named {len(named)}: {', '.join(parts)}" if named else "named none"
    if s.get("buffers_named"):
        what += f"; buffers {len(s['buffers_named'])}: {s['buffers_named'][0]}"
    if s.get("loss_couples"):
        what += "; the loss couples"
    return f"{what}; gradient rel. {s.get('gradient_rel', math.nan):.2g}"


def judge(row: dict[str, Any]) -> Judged:
    """The check's answer against the truth, at every seed (the worst decides the row: crash, miss, false alarm,
    refused, truth unknown, right). A row whose process died in the check (killed for memory) is a crash; one that
    ended before the check is not built."""
    if "error" in row:
        outcome = "timeout" if row.get("timeout") else "crash" if row.get("died") == "check" else "not built"
        return Judged(row, outcome, [row["error"]])
    outcomes = []
    for s in row["seeds"]:
        prefix = f"seed {s['seed']}: " if len(row["seeds"]) > 1 else ""
        if s["verdict"] == "crash":
            outcomes.append(("crash", prefix + s["error"]))
        elif s["verdict"] == "refused":
            outcomes.append(("refused", prefix + s["error"]))
        elif s["truth"] == "unknown":
            outcomes.append(("truth unknown", prefix + f"{s['why']}; the check said {s['verdict']}"))
        elif s["verdict"] != s["truth"]:
            outcomes.append(("false alarm" if s["truth"] == "safe" else "miss",
                             prefix + _named(s) + (f"; truth: {s['why']}" if s.get("why") else "")))
        else:
            outcomes.append(("right", ""))
    rank = ("crash", "miss", "false alarm", "refused", "truth unknown", "right")
    worst = min(outcomes, key=lambda o: rank.index(o[0]), default=("right", ""))
    return Judged(row, worst[0], [note for outcome, note in outcomes if outcome == worst[0] and note])


def failing(j: Judged) -> bool:
    """A crash, a false alarm, a miss, or the check itself past the time limit (a hang)."""
    return j.outcome in FAILING or (j.outcome == "timeout" and j.row.get("timeout") == "check")


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def table(judged: list[Judged]) -> str:
    """The markdown table: a row per architecture and task, then the counts."""
    lines = ["| architecture | task | class | params | truth | verdict | named modules | untested | check s "
             "| outcome |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for j in judged:
        r, seeds = j.row, j.row.get("seeds", [])
        truths = ", ".join(dict.fromkeys(s["truth"] + (f" ({_short(s['why'])})" if s.get("why") else "")
                                         for s in seeds)) or "-"
        verdicts = ", ".join(dict.fromkeys(s["verdict"] for s in seeds)) or "-"
        named = max((len(s.get("named", [])) for s in seeds), default=0)
        untested = max((s.get("untested", 0) for s in seeds), default=0)
        seconds = max((s["seconds"] for s in seeds), default=None)
        outcome = j.outcome + (f" ({'; '.join(j.notes)})" if j.notes else "")
        params = f"{r['params'] / 1e3:.0f}k" if r.get("params") else "-"
        cells = [r["model"], r["task"], r.get("class") or "-", params, truths, verdicts,
                 str(named) if seeds else "-", str(untested) if seeds else "-",
                 f"{seconds:.1f}" if seconds is not None else "-", outcome]
        lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    lines += ["", summary(judged)]
    return "\n".join(lines)


def _short(why: str) -> str:
    """The truth's reasons without their figures, for the table (the JSON rows keep them)."""
    return re.sub(r" \([^()]*\)", "", why)


def summary(judged: list[Judged]) -> str:
    """N rows: a right, b false alarm, ... (in a fixed order: the check's outcomes and not built always, the others
    where they occurred)."""
    order = ("right", "false alarm", "miss", "crash", "refused", "truth unknown", "timeout", "not built")
    counts = {k: sum(j.outcome == k for j in judged) for k in order}
    return f"{len(judged)} rows: " + ", ".join(f"{n} {k}" for k, n in counts.items()
                                               if n or k in order[:5] or k == "not built")


def run_row(name: str, seeds: Sequence[int], timeout: float) -> dict[str, Any]:
    """check_one in a process of its own (a hang, out of memory or a dead process is a row, not the end of the zoo)."""
    model_type, _, task = name.partition(":")
    argv = [sys.executable, "-m", "gaexp.tools.hf_zoo", "--one", name, "--seeds", ",".join(map(str, seeds))]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error", "TOKENIZERS_PARALLELISM": "false"}
    row: dict[str, Any] = {"model": model_type, "task": task, "class": "", "params": 0, "seeds": []}
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired as e:
        phase = _last_phase(e.stderr)
        return {**row, "timeout": phase, "error": f"took over {timeout:.0f} s (in: {phase})"}
    last = [line for line in done.stdout.strip().splitlines() if line.startswith("{")][-1:]
    if done.returncode != 0 or not last:
        why = (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1]
        phase = _last_phase(done.stderr)
        return {**row, "died": phase, "error": f"exit {done.returncode} (in: {phase}): {why}"[:240]}
    return json.loads(last[0])


def _last_phase(stderr: str | bytes | None) -> str:
    """The phase a row's process was in when it ended: build, truth or check (each said on stderr as it starts)."""
    err = stderr.decode(errors="replace") if isinstance(stderr, bytes) else (stderr or "")
    phases = [line.split(": ", 1)[1] for line in err.splitlines() if line.startswith("phase: ")]
    return phases[-1] if phases else "start"


def _list(text: str) -> list[str]:
    return [t for t in (part.strip() for part in text.split(",")) if t]


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m gaexp.tools.hf_zoo", description=__doc__.split("\n\n")[0])
    p.add_argument("--tasks", type=_list, default=list(TASKS), help=f"comma-separated (default: {','.join(TASKS)})")
    p.add_argument("--models", type=_list, default=None, help="comma-separated transformers model types, e.g. "
                   "llama,bert (default: every one with a head of the tasks)")
    p.add_argument("--seeds", type=lambda t: [int(s) for s in _list(t)], default=[0], help="comma-separated "
                   "(default: 0)")
    p.add_argument("--timeout", type=float, default=TIMEOUT, help="seconds per row (default: %(default)s)")
    p.add_argument("--output", default=None, help="also write the table here (and the raw rows as OUTPUT.jsonl)")
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)  # the child process: one row, JSON out
    args = p.parse_args(argv)
    if args.one:
        print(json.dumps(check_one(args.one, args.seeds)))
        return
    prog = "python -m gaexp.tools.hf_zoo"
    bad = [t for t in args.tasks if t not in TASKS]
    if bad or not args.tasks:
        print(f"{prog}: --tasks {','.join(bad)}: valid: {','.join(TASKS)}", file=sys.stderr)
        sys.exit(2)
    import transformers

    archs = task_architectures(args.tasks)
    known = sorted({m for types in archs.values() for m in types})
    unknown = [m for m in args.models or [] if m not in known]
    if unknown or args.models == []:
        close = [c for m in unknown for c in difflib.get_close_matches(m, known, 1)]
        print(f"{prog}: --models {','.join(unknown)}: not a model type with a {'/'.join(args.tasks)} head in "
              f"transformers {transformers.__version__}" + (f" (did you mean {','.join(close)}?)" if close else "") +
              f"; {len(known)} valid: {', '.join(known[:8])}, ...", file=sys.stderr)
        sys.exit(2)
    rows = [f"{m}:{t}" for m in (args.models or known) for t in args.tasks if m in archs[t]]
    judged = []
    raw = open(f"{args.output}.jsonl", "w") if args.output else None
    started = time.perf_counter()
    for i, name in enumerate(rows, 1):
        tic = time.perf_counter()
        row = run_row(name, args.seeds, args.timeout)
        j = judge(row)
        judged.append(j)
        note = f": {j.notes[0][:160]}" if j.notes and j.outcome != "right" else ""
        print(f"[{i}/{len(rows)}] {row['model']} {row['task']}: {j.outcome} ({time.perf_counter() - tic:.0f} s){note}",
              file=sys.stderr, flush=True)
        if raw:
            raw.write(json.dumps(row) + "\n")
            raw.flush()
    text = table(judged) + f" (wall {time.perf_counter() - started:.0f} s)"
    print(text)
    if raw:
        raw.close()
        with open(args.output, "w") as f:
            f.write(text + "\n")
    sys.exit(1 if any(failing(j) for j in judged) else 0)


if __name__ == "__main__":
    main()
