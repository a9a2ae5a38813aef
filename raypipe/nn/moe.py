"""Mixture of Experts: a top-k router, experts as MLPs, a load-balancing loss, capacity, and
expert parallelism (each rank of an expert-parallel group holds a share of the experts and
tokens travel to their experts and back by `all_to_all`).

    moe = MoE(dim=128, num_experts=8, top_k=2, make_expert=lambda: ExpertMLP(128, 512))
    y, aux = moe(x)          # x (..., dim) -> y (..., dim) and the layer's auxiliary loss

Routing is decided where the tokens are, per forward call: softmax gates over all experts,
the top k kept (renormalised to sum to one when k > 1, as Mixtral and GShard do). With a
`capacity_factor`, expert e takes at most ceil(factor * tokens * k / experts) of the call's
assignments, first choices before second ones and in token order within each (GShard's
priority); the rest are dropped and counted (the token keeps its residual). Without one the
layer is dropless. Because routing and capacity are per call, a microbatch routed on one rank
is routed exactly as the one-process model routes it, whatever ep is: that is what makes
expert parallelism exact.

The auxiliary loss is Switch/GShard's `E * sum_e f_e * P_e` (f_e the share of assignments
to expert e, P_e its mean gate probability) times `aux_loss_coef`, plus ST-MoE's router
z-loss `mean(logsumexp(logits)^2)` times `z_loss_coef` when that is set.

Under expert parallelism (`keep_experts`) the layer holds experts [r * E/ep, (r+1) * E/ep)
under their global names (`experts.<e>`), so state dicts and checkpoints do not depend on
ep. Each forward exchanges per-expert counts, then the tokens, then the outputs, with
`all_to_all_single` in the ep group (its backward is the reverse exchange). Per process,
`take_step_report` collects what the step routed: assignments per expert and drops per layer,
and the all-to-all's bytes and intervals for the timeline.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from raypipe.core.errors import ConfigError


@dataclass
class ExpertParallelGroup:
    """This process's place among the ranks sharing a MoE layer's experts; `group` is set when
    the stage actor joins the trainer's world."""

    rank: int = 0
    size: int = 1
    group: object = None

    def process_group(self) -> object:
        if self.size > 1 and self.group is None:
            raise RuntimeError(
                f"expert-parallel rank {self.rank} of {self.size} routed tokens before joining its "
                f"group; MoE layers with ep > 1 run inside a Trainer's stage actors."
            )
        return self.group


class ExpertMLP(nn.Module):
    """One expert: dim -> hidden -> dim with GELU (the dense GPT's MLP)."""

    def __init__(self, dim: int, hidden: int, bias: bool = True) -> None:
        super().__init__()
        self.c_fc = nn.Linear(dim, hidden, bias=bias)
        self.c_proj = nn.Linear(hidden, dim, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x)))


class _Recorder:
    """What this process's MoE layers did since the last step report: all-to-all bytes sent and
    the (start, end) wall-clock intervals spent in all-to-all."""

    def __init__(self) -> None:
        self.bytes, self.intervals = 0, []

    def take_intervals(self) -> list[tuple[float, float]]:
        intervals, self.intervals = self.intervals, []
        return intervals


RECORDER = _Recorder()


def reset_recorder() -> None:
    RECORDER.bytes, RECORDER.intervals = 0, []


class _AllToAll(torch.autograd.Function):
    """Rows of `x` to the ranks of `group` (`send[r]` rows to rank r, `recv[r]` rows from it);
    backward sends the gradients back the same way reversed."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, send: list[int], recv: list[int], group: object) -> torch.Tensor:
        ctx.send, ctx.recv, ctx.group = send, recv, group
        return _exchange(x, send, recv, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _exchange(grad, ctx.recv, ctx.send, ctx.group), None, None, None


def _exchange(x: torch.Tensor, send: list[int], recv: list[int], group: Any) -> torch.Tensor:
    started = time.time()
    out = x.new_empty((sum(recv), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), recv, send, group=group)
    RECORDER.bytes += (
        (sum(send) - send[dist.get_group_rank(group, dist.get_rank())]) * x[0:1].numel() * x.element_size()
    )
    RECORDER.intervals.append((started, time.time()))
    return out


class MoE(nn.Module):
    """A mixture-of-experts feed-forward layer: `forward(x) -> (y, aux_loss)`.

    Args:
        dim: the width of x; num_experts, top_k (1 or 2): the experts and how many each token uses.
        make_expert: builds one expert (called num_experts times, in order, so the weights are a
            function of the seed alone); default `ExpertMLP(dim, 4 * dim)`.
        capacity_factor: None for dropless, else each expert's share of the call's assignments.
        aux_loss_coef, z_loss_coef: the load-balancing loss's and the router z-loss's weights.
        renormalize: scale the chosen gates to sum to one (None: when top_k > 1; Mixtral always does).

    Attributes:
        router_logits: the last forward's router logits (tokens, experts), for a loss computed
            across layers (transformers' Mixtral balances all layers' routing at once).
    """

    def __init__(
        self,
        dim: int,
        num_experts: int,
        top_k: int = 2,
        make_expert: Callable[[], nn.Module] | None = None,
        capacity_factor: float | None = None,
        aux_loss_coef: float = 0.01,
        z_loss_coef: float = 0.0,
        renormalize: bool | None = None,
    ) -> None:
        super().__init__()
        check_moe(num_experts, top_k, capacity_factor, aux_loss_coef, z_loss_coef)
        self.num_experts, self.top_k, self.capacity_factor = num_experts, top_k, capacity_factor
        self.renormalize = top_k > 1 if renormalize is None else renormalize
        self.router_logits: torch.Tensor | None = None
        self.aux_loss_coef, self.z_loss_coef = aux_loss_coef, z_loss_coef
        self.router = nn.Linear(dim, num_experts, bias=False)
        make_expert = make_expert or (lambda: ExpertMLP(dim, 4 * dim))
        self.experts = nn.ModuleDict({str(e): make_expert() for e in range(num_experts)})
        self.ep = ExpertParallelGroup()
        self.first = 0  # the global index of the first expert held here
        self.reset_stats()

    # ----- expert parallelism -----------------------------------------------------

    def keep_experts(self, ep: ExpertParallelGroup) -> list[str]:
        """Keeps this ep rank's share of the experts; returns the state-dict keys (relative to this
        layer) of the experts it dropped.

        Raises:
            ConfigError: num_experts does not divide by ep.
        """
        if self.num_experts % ep.size:
            raise ConfigError(
                f"a MoE layer has {self.num_experts} experts, which do not divide across "
                f"TrainConfig.ep={ep.size} ranks: use an ep that divides {self.num_experts}."
            )
        per_rank = self.num_experts // ep.size
        self.ep, self.first = ep, ep.rank * per_rank
        held = range(self.first, self.first + per_rank)
        dropped = [
            f"experts.{e}.{k}"
            for e in range(self.num_experts)
            if e not in held
            for k in self.experts[str(e)].state_dict()
        ]
        self.experts = nn.ModuleDict({str(e): self.experts[str(e)] for e in held})
        return dropped

    def held_experts(self) -> list[int]:
        return [int(e) for e in self.experts]

    # ----- routing ------------------------------------------------------------------

    def capacity(self, tokens: int) -> int | None:
        if self.capacity_factor is None:
            return None
        return math.ceil(self.capacity_factor * tokens * self.top_k / self.num_experts)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        n, experts = x.shape[0], self.num_experts
        self.router_logits = self.router(x)
        logits = self.router_logits.float()
        probs = logits.softmax(dim=-1)
        gates, chosen = probs.topk(self.top_k, dim=-1)  # (n, k)
        if self.renormalize:
            gates = gates / gates.sum(dim=-1, keepdim=True)
        # assignments in priority order: every token's first choice, then every second choice
        expert = chosen.t().reshape(-1)
        token = torch.arange(n, device=x.device).repeat(self.top_k)
        gate = gates.t().reshape(-1)
        onehot = F.one_hot(expert, experts)
        routed = onehot.sum(dim=0)
        aux = self.aux_loss_coef * experts * (routed.float() / (n * self.top_k) * probs.mean(dim=0)).sum()
        if self.z_loss_coef:
            aux = aux + self.z_loss_coef * torch.logsumexp(logits, dim=-1).pow(2).mean()
        capacity = self.capacity(n)
        if capacity is not None:
            position = (onehot.cumsum(dim=0) * onehot).sum(dim=-1) - 1
            keep = position < capacity
            expert, token, gate = expert[keep], token[keep], gate[keep]
        order = torch.argsort(expert, stable=True)
        expert, token, gate = expert[order], token[order], gate[order]
        counts = torch.bincount(expert, minlength=experts)
        self._count(routed, n * self.top_k - len(expert))
        out = self._run_experts(x[token], counts)
        y = out.new_zeros((n, out.shape[-1])).index_add_(0, token, out * gate.unsqueeze(-1).to(out.dtype))
        return y.reshape(shape), aux

    def _run_experts(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Each row through its expert; `rows` sorted by expert, `counts[e]` of them for expert e."""
        if self.ep.size == 1:
            pieces = rows.split(counts.tolist())
            return torch.cat([self.experts[str(e)](piece) for e, piece in enumerate(pieces)])
        group, ranks, local = self.ep.process_group(), self.ep.size, self.num_experts // self.ep.size
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts, group=group)
        send = counts.view(ranks, local).sum(dim=1).tolist()
        by_source = received.view(ranks, local)  # rows from each rank for each expert held here
        inbound = _AllToAll.apply(rows, send, by_source.sum(dim=1).tolist(), group)
        pieces = inbound.split(by_source.reshape(-1).tolist())  # source-major, then expert
        outputs: list[torch.Tensor | None] = [None] * len(pieces)
        for j in range(local):
            mine = [pieces[s * local + j] for s in range(ranks)]
            result = self.experts[str(self.first + j)](torch.cat(mine)).split([len(p) for p in mine])
            for s in range(ranks):
                outputs[s * local + j] = result[s]
        return _AllToAll.apply(torch.cat(outputs), by_source.sum(dim=1).tolist(), send, group)

    # ----- what it routed -------------------------------------------------------------

    def reset_stats(self) -> None:
        self.routed = torch.zeros(self.num_experts, dtype=torch.long, device="cpu")  # host counts, never meta
        self.dropped = 0

    def _count(self, routed: torch.Tensor, dropped: int) -> None:
        # not when activation checkpointing recomputes the forward inside backward: counted once
        if self.training and torch._C._current_graph_task_id() == -1:
            self.routed += routed.detach().cpu()
            self.dropped += int(dropped)


def check_moe(
    num_experts: object,
    top_k: object,
    capacity_factor: object,
    aux_loss_coef: object,
    z_loss_coef: object,
    prefix: str = "",
) -> None:
    """Raises ConfigError naming the first invalid MoE setting and its fix."""
    if not isinstance(num_experts, int) or isinstance(num_experts, bool) or num_experts < 1:
        raise ConfigError(f"{prefix}num_experts={num_experts!r} is invalid: give a whole number of experts >= 1.")
    if top_k not in (1, 2) or isinstance(top_k, bool) or top_k > num_experts:
        raise ConfigError(f"{prefix}top_k={top_k!r} is invalid: give 1 or 2 (at most num_experts={num_experts}).")
    if capacity_factor is not None and (not isinstance(capacity_factor, (int, float)) or capacity_factor <= 0):
        raise ConfigError(
            f"{prefix}capacity_factor={capacity_factor!r} is invalid: give a number > 0 "
            f"(1.25 is usual), or null for dropless routing."
        )
    for name, value in (("aux_loss_coef", aux_loss_coef), ("z_loss_coef", z_loss_coef)):
        if not isinstance(value, (int, float)) or value < 0:
            raise ConfigError(f"{prefix}{name}={value!r} is invalid: give a number >= 0 (0 switches it off).")


def moe_layers(module: nn.Module) -> list[tuple[str, MoE]]:
    return [(name, m) for name, m in module.named_modules() if isinstance(m, MoE)]


def shard_experts(layer: nn.Module, ep: ExpertParallelGroup) -> list[str]:
    """Keeps this ep rank's experts in every MoE of `layer`; returns the dropped keys (relative to `layer`)."""
    dropped = []
    for name, moe in moe_layers(layer):
        dropped += [f"{name}.{k}" if name else k for k in moe.keep_experts(ep)]
    return dropped


def expert_parameters(module: nn.Module) -> set[int]:
    """The ids of the parameters of every expert in `module` (what only ep ranks holding it share)."""
    return {id(p) for _, moe in moe_layers(module) for p in moe.experts.parameters()}


def keyed_moe_layers(layers: Iterable[tuple[int, nn.Module]]) -> dict[str, MoE]:
    """Every MoE among `layers` ((global index, layer) pairs) under "<index>.<module name>"."""
    return {
        f"{index}.{name}" if name else str(index): moe for index, layer in layers for name, moe in moe_layers(layer)
    }


def take_step_report(moes: dict[str, MoE]) -> dict[str, Any]:
    """Per MoE layer (`keyed_moe_layers`), the assignments each expert received and the drops since
    the last report (then reset), and the all-to-all bytes sent: what a step report carries."""
    experts = {}
    for key, moe in moes.items():
        experts[key] = {"routed": moe.routed.tolist(), "dropped": moe.dropped}
        moe.reset_stats()
    report = {"experts": experts, "all_to_all_bytes": RECORDER.bytes} if experts else {}
    RECORDER.bytes = 0
    return report


def check_expert_parallel(specs: Any, ep: int) -> None:
    """Builds every layer on the meta device to refuse an ep no MoE layer can use, before any actor starts.

    Raises:
        ConfigError: ep > 1 and no layer has a MoE, or a MoE's experts do not divide by ep.
    """
    if ep == 1:
        return
    found = False
    for index, spec in enumerate(specs):
        try:
            with torch.device("meta"):
                module = spec.build()
        except Exception:  # a constructor that needs real tensors: the actor will report it
            continue
        for _, moe in moe_layers(module):
            found = True
            if moe.num_experts % ep:
                raise ConfigError(
                    f"TrainConfig.ep={ep}: layer {index} has a MoE of {moe.num_experts} experts, "
                    f"which do not divide across {ep} ranks; use an ep that divides {moe.num_experts}."
                )
    if not found:
        raise ConfigError(
            f"TrainConfig.ep={ep}, but no layer holds a MoE (raypipe.nn.MoE) whose experts could be "
            f"split: set ep=1, or use a model with MoE layers (e.g. GPTConfig(num_experts=8, moe_every=1))."
        )
