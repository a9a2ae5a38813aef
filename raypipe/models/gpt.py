"""A GPT (nanoGPT-style) written as a list of layers a pipeline can split.

Layer 0 embeds tokens and positions, layers 1..n_layer are pre-norm transformer
blocks, and the last layer is the final norm plus an output head that is not tied
to the embedding (tying would put one weight on two stages). Read top to bottom.

The layers are plain PyTorch. Each declares a `tp_plan` for tensor parallelism
(Megatron style): the token embedding splits its vocabulary, attention splits its
heads (q, k and v alike) and the MLP its hidden features, and the head splits the
vocabulary of its logits, gathering them for the loss.

With `num_experts` set, every `moe_every`-th block's MLP is a mixture of experts
(`raypipe.nn.MoE`, top-k routing, experts split across ep ranks under expert
parallelism). The layers then hand on `(hidden, aux)`: the sum of the MoE layers'
auxiliary losses so far travels with the activations to the head, whose output
`(logits, aux)` the loss adds up, so the total loss and every gradient are the
one-process model's however the blocks are split (in eval mode the head returns the
logits alone, and the loss is the cross-entropy).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from raypipe.config.checks import check_whole_number
from raypipe.core.errors import ConfigError
from raypipe.core.layers import LayerSpec
from raypipe.nn import ColumnParallel, RowParallel, VocabParallel, chunk_attention, sequence_chunks
from raypipe.nn.moe import ExpertMLP, MoE, check_moe


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
    num_experts: int = 0  # 0: dense; else experts per MoE layer
    moe_every: int = 1  # with num_experts: block i is a MoE block when (i + 1) % moe_every == 0
    top_k: int = 2
    capacity_factor: float | None = None  # None: dropless
    aux_loss_coef: float = 0.01
    z_loss_coef: float = 0.0

    @property
    def moe(self) -> bool:
        return self.num_experts > 0

    def is_moe_block(self, i: int) -> bool:
        return self.moe and (i + 1) % self.moe_every == 0

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
        check_whole_number("model.num_experts", self.num_experts, 0)
        if self.moe:
            check_whole_number("model.moe_every", self.moe_every, 1)
            check_moe(
                self.num_experts, self.top_k, self.capacity_factor, self.aux_loss_coef, self.z_loss_coef, "model."
            )

    @property
    def parameters(self) -> int:
        c, v, t, n = self.n_embd, self.vocab_size, self.block_size, self.n_layer
        norm = c + (c if self.bias else 0)  # LayerNorm weight (+ bias)
        mlp = 8 * c * c + (5 * c if self.bias else 0)
        per_block = 4 * c * c + (4 * c if self.bias else 0) + mlp + 2 * norm  # attn, mlp, two norms
        moe_blocks = sum(self.is_moe_block(i) for i in range(n))
        extra = moe_blocks * ((self.num_experts - 1) * mlp + c * self.num_experts)  # experts beyond one, router
        return v * c + t * c + n * per_block + extra + norm + c * v  # embeddings, blocks, ln_f, head


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

    runs_sequence_chunks = True  # a chunk's tokens are embedded at their positions (`raypipe.nn.sequence_chunks`)

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.block_size, self.moe = cfg.block_size, cfg.moe
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        _init(self, cfg.n_layer)

    def tp_plan(self, tp_size: int) -> dict:
        return {"wte": VocabParallel()}

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        chunk = sequence_chunks.current()  # a sequence chunk's positions start where it starts
        start = chunk.offset if chunk is not None else 0
        t = start + idx.shape[1]
        if t > self.block_size:
            raise ValueError(f"sequence length {t} exceeds model.block_size={self.block_size}")
        pos = torch.arange(start, t, device=idx.device)
        h = self.drop(self.wte(idx) + self.wpe(pos))
        return (h, h.new_zeros((), dtype=torch.float32)) if self.moe else h


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
        dropout = self.dropout if self.training else 0.0
        chunk = sequence_chunks.current()
        if chunk is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout)
        elif chunk_attention.supported(q, dropout):  # a sequence chunk: it sees the chunks before it too
            y = chunk_attention.attend(q, *chunk.blocks(self, k, v))
        else:
            k, v = chunk.extend(self, k, v)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=chunk.causal_mask(q.device), dropout_p=dropout)
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

    runs_sequence_chunks = True  # its attention keeps earlier chunks' keys and values (`raypipe.nn.sequence_chunks`)
    cost_key: tuple = ()  # blocks of one class and shapes cost the same: the profiler times one (`actors.profiler`)

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

    def forward(self, x: torch.Tensor | tuple) -> torch.Tensor | tuple:
        if isinstance(x, tuple):  # a MoE model's (hidden, aux loss so far)
            return self.forward(x[0]), x[1]
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class MoEBlock(Block):
    """A block whose MLP is a mixture of experts: (hidden, aux) -> (hidden, aux + this layer's)."""

    runs_sequence_chunks = False  # its balancing loss is over the whole sequence's routing, not a sum over chunks

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__(cfg)
        self.mlp = MoE(
            cfg.n_embd,
            cfg.num_experts,
            cfg.top_k,
            lambda: ExpertMLP(cfg.n_embd, 4 * cfg.n_embd, cfg.bias),
            cfg.capacity_factor,
            cfg.aux_loss_coef,
            cfg.z_loss_coef,
        )
        _init(self, cfg.n_layer)
        self.num_experts = cfg.num_experts

    def tp_plan(self, tp_size: int) -> dict:
        plan = {k: v for k, v in super().tp_plan(tp_size).items() if not k.startswith("mlp.")}
        for e in range(self.num_experts):  # each expert's MLP split like the dense one
            plan[f"mlp.experts.{e}.c_fc"] = ColumnParallel()
            plan[f"mlp.experts.{e}.c_proj"] = RowParallel()
        return plan

    def forward(self, x: tuple) -> tuple:
        h, aux = x
        h = h + self.attn(self.ln_1(h))
        y, layer_aux = self.mlp(self.ln_2(h))
        return h + y, aux + layer_aux


class Head(nn.Module):
    """Final layer norm and the output projection to vocabulary logits (B, T, V)."""

    runs_sequence_chunks = True  # token by token

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        _init(self, cfg.n_layer)
        self.moe = cfg.moe

    def tp_plan(self, tp_size: int) -> dict:
        return {"lm_head": ColumnParallel(gather_output=True)}  # the loss sees whole logits

    def forward(self, x: torch.Tensor | tuple) -> torch.Tensor | tuple:
        if isinstance(x, tuple):  # a MoE model's (hidden, aux): the loss adds aux in training
            logits = self.forward(x[0])
            return (logits, x[1]) if self.training else logits
        return self.lm_head(self.ln_f(x))


def layers(cfg: GPTConfig) -> list[LayerSpec]:
    """The GPT as pipeline layers: embedding, n_layer blocks (MoE ones where `cfg` says), head."""
    blocks = [LayerSpec(MoEBlock if cfg.is_moe_block(i) else Block, cfg) for i in range(cfg.n_layer)]
    return [LayerSpec(Embedding, cfg)] + blocks + [LayerSpec(Head, cfg)]


def loss_fn(output: torch.Tensor | tuple, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over every position of the microbatch (plus a MoE model's
    auxiliary loss, which its head hands on beside the logits in training)."""
    logits, aux = output if isinstance(output, tuple) else (output, None)
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))
    return loss if aux is None else loss + aux
