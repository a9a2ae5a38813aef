"""transformers' Mixtral-shaped sparse MoE block as a `raypipe.nn.MoE`, so its experts split
across expert-parallel ranks, and transformers' load-balancing loss carried through the pipeline.

transformers 5 keeps a Mixtral layer's experts fused in two 3-D tensors (`MixtralExperts.
gate_up_proj`, `down_proj`) that its forward loops over; its checkpoints store them per expert
(`block_sparse_moe.experts.<e>.w1|w2|w3`). raypipe's block holds the experts per expert under
exactly those names, so each actor reads the experts it holds straight from the safetensors
files, and an exported model loads back into transformers (which fuses them on load). The
routing is transformers': softmax over every expert in float32, top k, renormalised, dropless.

transformers' auxiliary loss balances every layer's routing at once: with T_e the assignments
to expert e and P_e its summed router probability over all layers' rows (R of them), the loss
is `E * sum_e (T_e / R) * (P_e / R)`, times `router_aux_loss_coef`. Those sums add up layer by
layer, so each decoder layer adds its own to `router_stats` in the boundary dict and the loss
computes the ratio at the end: exactly transformers' value for each forward call (one
microbatch), whatever the split.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from raypipe.core.errors import ConfigError
from raypipe.nn.moe import MoE

if TYPE_CHECKING:
    from transformers import PretrainedConfig


def is_moe(config: PretrainedConfig) -> bool:
    """Whether the model is a Mixtral, whose experts raypipe holds one by one (expert parallelism)."""
    return getattr(config, "model_type", None) == "mixtral"


class SwiGLUExpert(nn.Module):
    """One Mixtral expert under its checkpoint names: w2(act(w1 x) * w3 x)."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        from transformers.activations import ACT2FN

        hidden, inner = config.hidden_size, config.intermediate_size
        self.w1 = nn.Linear(hidden, inner, bias=False)
        self.w2 = nn.Linear(inner, hidden, bias=False)
        self.w3 = nn.Linear(hidden, inner, bias=False)
        self.act = ACT2FN[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(self.act(self.w1(x)) * self.w3(x))


class SparseMoeBlock(MoE):
    """Replaces a Mixtral decoder layer's `mlp`: hidden states in, hidden states out (its router
    logits kept in `router_logits` for the decoder layer's routing statistics)."""

    def __init__(self, config: PretrainedConfig) -> None:
        if getattr(config, "router_jitter_noise", 0.0):
            raise ConfigError(
                f"router_jitter_noise={config.router_jitter_noise} multiplies the router's input by "
                f"noise drawn in each process, which no split can reproduce: set it to 0."
            )
        super().__init__(
            config.hidden_size,
            config.num_local_experts,
            config.num_experts_per_tok,
            make_expert=lambda: SwiGLUExpert(config),
            aux_loss_coef=0.0,
            renormalize=True,
        )

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return super().forward(hidden)[0]


def routing_stats(
    logits: torch.Tensor, config: PretrainedConfig, attention_mask: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(assignments per expert, summed router probability per expert, rows) of one layer's router
    `logits` (rows x experts), padding rows left out as transformers' `load_balancing_loss_func`
    leaves them."""
    probs = logits.softmax(dim=-1)
    top_k = config.num_experts_per_tok
    chosen = probs.topk(top_k, dim=-1).indices
    if attention_mask is None:
        weight = probs.new_ones(probs.shape[0], dtype=torch.float32)
    else:
        weight = attention_mask.reshape(-1).to(torch.float32)
    counts = torch.zeros(probs.shape[-1], dtype=torch.float32, device=probs.device)
    counts = counts.scatter_add(0, chosen.reshape(-1), weight.repeat_interleave(top_k))
    return counts, (probs.float() * weight.unsqueeze(-1)).sum(dim=0), weight.sum()


class RouterTap:
    """The router logits a decoder layer's forward makes, caught where transformers records them
    (`_can_record_outputs["router_logits"]`: a module class, and which of its outputs)."""

    def __init__(self, block: nn.Module, config: PretrainedConfig) -> None:
        self.logits: torch.Tensor | None = None
        from raypipe.models.hf.skeleton import causal_lm_class

        recorder = (getattr(causal_lm_class(config), "_can_record_outputs", None) or {}).get("router_logits")
        target = getattr(recorder, "target_class", None)
        index = getattr(recorder, "index", 0) or 0
        if target is None:
            return
        for module in block.modules():
            if isinstance(module, target):
                module.register_forward_hook(lambda _m, _i, out: setattr(self, "logits", out[index]))

    def take(self) -> torch.Tensor | None:
        logits, self.logits = self.logits, None
        return logits


def router_stats(block: nn.Module, config: PretrainedConfig) -> RouterTap:
    return RouterTap(block, config)


def add_stats(so_far: Any, layer: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    return layer if so_far is None else tuple(a + b for a, b in zip(so_far, layer))


def balancing_loss(stats: tuple[torch.Tensor, torch.Tensor, torch.Tensor], num_experts: int) -> torch.Tensor:
    """transformers' `load_balancing_loss_func` from the summed statistics."""
    counts, probs, rows = stats
    return num_experts * torch.sum((counts / rows) * (probs / rows))
