"""A small decoder-only language model (nanoGPT's shape, sized for 2 cores), torch alone: token and position
embeddings, `layers` pre-norm blocks of causal self-attention and an MLP, a final norm and a head tied to the
token embedding. Built as gaexp's model builders are (`norm_layer`, `in_channels`, `num_classes`: here the
vocabulary), for `model=gpt` with `task=lm`.

`gpt_moe` replaces each block's MLP by a mixture of experts with a router (`MoE`), for the balancing study.

Every layer computes each sequence from that sequence alone (causal attention within a sequence, per-token
norms, routing per token without capacity), so accumulate=batched computes the loop's step (gaexp/batched.py). The norm is each token's: norm=ln is
LayerNorm over a token's features (ln's GroupNorm(1, C) on a token's C features), norm=none none; a norm over the
batch is refused in one line.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn


def token_norm(norm_layer: Callable[[int], nn.Module], width: int) -> nn.Module:
    """The per-token norm that `norm_layer` stands for: LayerNorm for ln, none for none."""
    layer = norm_layer(width)
    if isinstance(layer, nn.GroupNorm) and layer.num_groups == 1:
        return nn.LayerNorm(width, elementwise_affine=layer.affine)
    if type(layer) is nn.Identity:
        return layer
    raise ValueError(f"model=gpt normalizes each token's features alone; valid: norm=ln (LayerNorm) or norm=none "
                     f"(got a {type(layer).__name__})")


class CausalSelfAttention(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        if width % heads:
            raise ValueError(f"model=gpt: width {width} is not divisible by heads {heads}")
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in self.qkv(x).split(c, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


def mlp(width: int, hidden: int) -> nn.Module:
    return nn.Sequential(nn.Linear(width, hidden), nn.GELU(), nn.Linear(hidden, width))


class MoE(nn.Module):
    """A mixture of `experts` MLPs, each of 4 * width / experts hidden units (the dense MLP's compute and parameters
    split among them, as fine-grained experts): a linear router's softmax picks each token's `top_k` experts, whose outputs are
    summed with their probabilities renormalized over the chosen. No capacity limit drops a token, so a token's
    output depends on that token alone (every expert runs densely on every token: small experts on a CPU).
    `routing` keeps the last forward's (router probabilities, chosen experts as 0/1), float32 [B, T, experts]
    each: what a balancing loss reads (gaexp/task/lm.py)."""

    def __init__(self, width: int, experts: int, top_k: int) -> None:
        super().__init__()
        if not 1 <= top_k <= experts:
            raise ValueError(f"model=gpt_moe: top_k {top_k}; valid: 1 to its {experts} experts")
        self.router = nn.Linear(width, experts, bias=False)
        self.experts = nn.ModuleList(mlp(width, max(1, 4 * width // experts)) for _ in range(experts))
        self.top_k = top_k
        self.routing: tuple[torch.Tensor, torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.router(x)
        probs = logits.to(torch.promote_types(logits.dtype, torch.float32)).softmax(-1)
        weights, chosen = probs.topk(self.top_k, dim=-1)
        gates = torch.zeros_like(probs).scatter(-1, chosen, weights / weights.sum(-1, keepdim=True))
        self.routing = (probs, torch.zeros_like(probs).scatter(-1, chosen, 1.0))
        return sum(gates[..., i:i + 1].to(x.dtype) * expert(x) for i, expert in enumerate(self.experts))


class Block(nn.Module):
    def __init__(self, width: int, heads: int, norm_layer: Callable[[int], nn.Module], experts: int = 0,
                 top_k: int = 2) -> None:
        super().__init__()
        self.norm1, self.attn = token_norm(norm_layer, width), CausalSelfAttention(width, heads)
        self.norm2 = token_norm(norm_layer, width)
        self.mlp = MoE(width, experts, top_k) if experts else mlp(width, 4 * width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    def __init__(self, vocab: int, context: int, layers: int, width: int, heads: int,
                 norm_layer: Callable[[int], nn.Module], experts: int = 0, top_k: int = 2) -> None:
        super().__init__()
        self.context = context
        self.tokens, self.positions = nn.Embedding(vocab, width), nn.Embedding(context, width)
        self.blocks = nn.Sequential(*(Block(width, heads, norm_layer, experts, top_k) for _ in range(layers)))
        self.norm = token_norm(norm_layer, width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.tokens.weight  # tied, as GPT-2's
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                nn.init.normal_(p, std=0.02 / (2 * layers) ** 0.5 if name.endswith("proj.weight") else 0.02)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits [B, T, vocab] of the next token at each position of `tokens` int64 [B, T]."""
        t = tokens.shape[1]
        if t > self.context:
            raise ValueError(f"model=gpt: sequences of {t} tokens, more than its context of {self.context}; valid: "
                             f"data.context <= {self.context}")
        x = self.tokens(tokens) + self.positions(torch.arange(t, device=tokens.device))
        return self.head(self.norm(self.blocks(x)))


def gpt(norm_layer: Callable[[int], nn.Module], in_channels: int, num_classes: int, context: int = 256,
        layers: int = 2, width: int = 64, heads: int = 4) -> GPT:
    """The model of conf/model/gpt.yaml: `num_classes` is the vocabulary (256 bytes for text data);
    `in_channels` is 1 for text and unused."""
    return GPT(num_classes, context, layers, width, heads, norm_layer)


def gpt_moe(norm_layer: Callable[[int], nn.Module], in_channels: int, num_classes: int, context: int = 256,
            layers: int = 2, width: int = 64, heads: int = 4, experts: int = 4, top_k: int = 2) -> GPT:
    """The model of conf/model/gpt_moe.yaml: `gpt` with each block's MLP a mixture of `experts` (`MoE`), `top_k`
    of them per token."""
    return GPT(num_classes, context, layers, width, heads, norm_layer, experts, top_k)
