"""A GPT (nanoGPT-style) written as a list of layers a pipeline can split.

Layer 0 embeds tokens and positions, layers 1..n_layer are pre-norm transformer
blocks, and the last layer is the final norm plus an output head that is not tied
to the embedding (tying would put one weight on two stages). Read top to bottom.

The layers are plain PyTorch. Each declares a `tp_plan` for tensor parallelism
(Megatron style): the token embedding splits its vocabulary, attention splits its
heads (q, k and v alike) and the MLP its hidden features, and the head splits the
vocabulary of its logits, gathering them for the loss.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from raypipe.checks import check_whole_number
from raypipe.errors import ConfigError
from raypipe.layers import LayerSpec
from raypipe.nn import ColumnParallel, RowParallel, VocabParallel


@dataclass(frozen=True)
class GPTConfig:
    """Sizes of the GPT. `vocab_size=256` fits the byte-level tokenizer."""

    vocab_size: int = 256
    block_size: int = 128
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0
    bias: bool = True

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            check_whole_number(f"model.{name}", getattr(self, name), 1)
        if self.n_embd % self.n_head:
            raise ConfigError(
                f"model.n_embd={self.n_embd} is invalid: it must divide by model.n_head={self.n_head} "
                f"(e.g. n_embd={self.n_head * max(1, round(self.n_embd / self.n_head))})."
            )
        if not isinstance(self.dropout, (int, float)) or not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"model.dropout={self.dropout!r} is invalid: give a number in [0, 1).")

    @property
    def parameters(self) -> int:
        c, v, t, n = self.n_embd, self.vocab_size, self.block_size, self.n_layer
        norm = c + (c if self.bias else 0)  # LayerNorm weight (+ bias)
        per_block = 12 * c * c + (9 * c if self.bias else 0) + 2 * norm  # attn, mlp, two norms
        return v * c + t * c + n * per_block + norm + c * v  # embeddings, blocks, ln_f, head


def _init(module: nn.Module, n_layer: int) -> None:
    """GPT-2 initialisation: N(0, 0.02), residual projections scaled by 1/sqrt(2 n_layer)."""
    for name, p in module.named_parameters():
        if name.endswith("c_proj.weight"):
            nn.init.normal_(p, std=0.02 / math.sqrt(2 * n_layer))
        elif p.dim() >= 2 or "wte" in name or "wpe" in name:
            nn.init.normal_(p, std=0.02)
        elif name.endswith("bias"):
            nn.init.zeros_(p)


class Embedding(nn.Module):
    """Token ids (B, T) -> hidden states (B, T, C): token plus learned position embedding."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.block_size = cfg.block_size
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        _init(self, cfg.n_layer)

    def tp_plan(self, tp_size: int) -> dict:
        return {"wte": VocabParallel()}

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        if t > self.block_size:
            raise ValueError(f"sequence length {t} exceeds model.block_size={self.block_size}")
        pos = torch.arange(t, device=idx.device)
        return self.drop(self.wte(idx) + self.wpe(pos))


class CausalSelfAttention(nn.Module):
    """Multi-head causal attention; under tensor parallelism each rank runs a share of the heads."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.head_dim, self.dropout = cfg.n_embd // cfg.n_head, cfg.dropout
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.resid_drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.c_attn(x).chunk(3, dim=2)  # this rank's heads (all heads when tp=1)
        q, k, v = (z.view(b, t, -1, self.head_dim).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        return self.resid_drop(self.c_proj(y.transpose(1, 2).contiguous().view(b, t, -1)))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.c_proj(F.gelu(self.c_fc(x))))


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg)
        self.n_head = cfg.n_head
        _init(self, cfg.n_layer)

    def tp_plan(self, tp_size: int) -> dict:
        if self.n_head % tp_size:
            raise ConfigError(
                f"model.n_head={self.n_head} does not divide by TrainConfig.tp={tp_size}: tensor "
                f"parallelism gives each rank whole heads; use a tp that divides {self.n_head}."
            )
        return {
            "attn.c_attn": ColumnParallel(chunks=3),  # q, k and v: each rank keeps the same heads of all three
            "attn.c_proj": RowParallel(),
            "mlp.c_fc": ColumnParallel(),
            "mlp.c_proj": RowParallel(),
        }

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class Head(nn.Module):
    """Final layer norm and the output projection to vocabulary logits (B, T, V)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        _init(self, cfg.n_layer)

    def tp_plan(self, tp_size: int) -> dict:
        return {"lm_head": ColumnParallel(gather_output=True)}  # the loss sees whole logits

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln_f(x))


def layers(cfg: GPTConfig) -> list[LayerSpec]:
    """The GPT as pipeline layers: embedding, n_layer blocks, head."""
    return [LayerSpec(Embedding, cfg)] + [LayerSpec(Block, cfg) for _ in range(cfg.n_layer)] + [
        LayerSpec(Head, cfg)
    ]


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over every position of the microbatch."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))
