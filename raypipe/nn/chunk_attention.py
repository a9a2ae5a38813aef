"""A sequence chunk's attention block by block (`TrainConfig.sequence_chunks`): the chunk's
queries against the earlier chunks' keys and values and against its own, each through torch's
CPU flash-attention kernel, the results merged by their log-sum-exps. The backward runs the
kernel's backward per part with the merged output and log-sum-exp, as ring attention does, so the
gradients are those of attention over the joined keys.

Why: joining the earlier chunks' keys with the chunk's own (`torch.cat`) under a (queries, keys)
mask saves that joined copy in every chunk's graph (about L(k + 1)/2 keys per layer instead of L)
and takes torch's masked CPU attention, its slow path. Here the chunk's own block is square and
causal and the earlier ones are attended together without it, so no part needs a mask but a
padding or sliding window's slice (a block that slice hides entirely is skipped), and the graph
saves only the keys each chunk made: the earlier blocks are joined for the kernel's call only.

`supported` says where the kernel exists (the CPU, float32/64 and bfloat16, no dropout);
elsewhere layers join the keys under a mask as before (`Position.extend`).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_FLASH_BACKWARD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)
_DTYPES = (torch.float32, torch.float64, torch.bfloat16)


def supported(query: torch.Tensor, dropout: float = 0.0) -> bool:
    """Whether `attend` can run this query: on the CPU, in a dtype the kernel takes, without dropout."""
    return _FLASH is not None and query.device.type == "cpu" and query.dtype in _DTYPES and dropout == 0.0


def attend(
    query: torch.Tensor,
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    mask: torch.Tensor | None = None,
    scale: float | None = None,
    plan: list[tuple[bool, object]] | None = None,
) -> torch.Tensor:
    """Attention of a chunk's `query` (batch, heads, queries, dim) over blocks of keys and values
    (batch, kv heads, block length, dim; grouped-query heads allowed), the last block the chunk's
    own, its queries' positions. `mask`: None (every earlier key seen, the own block causal) or
    a boolean (batch or 1, 1, queries, all keys) mask, True where a query sees a key, as
    transformers makes it over the joined keys. `plan`: `block_plan(query, keys, mask)` where the caller
    made it already (the layers of a stage share a chunk's mask). Returns (batch, heads, queries,
    dim)."""
    plan = plan if plan is not None else block_plan(query, keys, mask)
    kept = [i for i, (causal, block_mask) in enumerate(plan) if block_mask is not False]
    plan = [plan[i] for i in kept]
    return _BlockAttention.apply(query, scale, plan, *[keys[i] for i in kept], *[values[i] for i in kept])


def block_plan(query: torch.Tensor, keys: list[torch.Tensor], mask: torch.Tensor | None) -> list[tuple[bool, object]]:
    """How `attend` runs each block under `mask` (its slice reduced three ways, a cost that grows
    with the chunk's keys): per block, (causal, its additive mask, None, or False where it hides
    the block entirely)."""
    if mask is None:
        return causal_plan(len(keys))
    last = len(keys) - 1
    plan: list[tuple[bool, object]] = []
    start = 0
    for i, block in enumerate(keys):
        seen = mask[..., start : start + block.shape[-2]]
        start += block.shape[-2]
        if not bool(seen.any()):
            plan.append((False, False))
        elif bool(seen.all()):
            plan.append((False, None))
        elif i == last and seen.shape[-1] == seen.shape[-2] and bool((seen == _causal(seen)).all()):
            plan.append((True, None))
        else:
            additive = torch.zeros(seen.shape, dtype=query.dtype, device=query.device)
            plan.append((False, additive.masked_fill_(~seen, float("-inf"))))
    return plan


def causal_plan(blocks: int) -> list[tuple[bool, object]]:
    """`block_plan` without a mask: every earlier block seen whole, the last (the chunk's own) causal."""
    return [(i == blocks - 1, None) for i in range(blocks)]


def _causal(seen: torch.Tensor) -> torch.Tensor:
    n = seen.shape[-1]
    return torch.ones(n, n, dtype=torch.bool, device=seen.device).tril()


class _BlockAttention(torch.autograd.Function):
    """The merged attention over blocks; saves the query, the merged output and log-sum-exp and
    the blocks' keys and values (the tensors the caller holds anyway), no joined copy. The kernel
    runs per group (`_groups`): the blocks seen without the causal triangle joined, copied only
    for the call."""

    @staticmethod
    def forward(ctx: Any, query: torch.Tensor, scale: float | None, plan: list, *blocks: torch.Tensor) -> torch.Tensor:
        n = len(plan)
        outputs, lses, masked = [], [], False
        for causal, mask, key, value, _ in _groups(plan, blocks[:n], blocks[n:]):
            out, lse = _FLASH(query, key, value, 0.0, causal, attn_mask=mask, scale=scale)
            if mask is not None:  # a query row the mask hides entirely: the kernel says 0, not -inf
                lse = lse.masked_fill(torch.isneginf(mask).all(-1).expand_as(lse), float("-inf"))
                masked = True
            outputs.append(out)
            lses.append(lse)
        ctx.scale, ctx.plan = scale, plan
        if not masked:  # every query sees itself: each part's log-sum-exp is finite
            merged, lse = _merge_finite(outputs, lses, query.dtype)
            ctx.save_for_backward(query, merged, lse, *blocks)
            return merged
        lse = torch.logsumexp(torch.stack(lses), 0)
        finite = torch.where(torch.isneginf(lse), 0.0, lse)
        wide = torch.promote_types(query.dtype, torch.float32)
        # summed group by group, the kernel's (batch, queries, heads, dim) layout is kept: the
        # caller's transpose for its output projection is then no copy (a stacked sum made one)
        merged = sum(out.to(wide) * torch.exp(part - finite).unsqueeze(-1) for out, part in zip(outputs, lses))
        merged = merged.to(query.dtype)
        ctx.save_for_backward(query, merged, torch.where(torch.isneginf(lse), float("inf"), lse), *blocks)
        return merged

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        query, merged, lse, *blocks = ctx.saved_tensors
        n = len(ctx.plan)
        grad = grad.contiguous()
        wide = torch.promote_types(query.dtype, torch.float32)
        grad_query = None
        grad_keys: list[object] = [None] * n
        grad_values: list[object] = [None] * n
        for causal, mask, key, value, members in _groups(ctx.plan, blocks[:n], blocks[n:]):
            dq, dk, dv = _FLASH_BACKWARD(
                grad, query, key, value, merged, lse, 0.0, causal, attn_mask=mask, scale=ctx.scale
            )
            grad_query = dq.to(wide) if grad_query is None else grad_query.add_(dq)  # the kernel's own: ours to add to
            lengths = [blocks[i].shape[-2] for i in members]
            for i, dk_i, dv_i in zip(members, dk.split(lengths, -2), dv.split(lengths, -2)):
                grad_keys[i], grad_values[i] = dk_i, dv_i
        if grad_query is None:  # the mask hides every block
            grad_query = torch.zeros_like(query)
        return (grad_query.to(query.dtype), None, None, *grad_keys, *grad_values)


def _merge_finite(outputs: list[torch.Tensor], lses: list[torch.Tensor], dtype: torch.dtype) -> tuple:
    """(the parts' outputs merged by their log-sum-exps, the merged log-sum-exp) where every
    query saw some key in each part (no -inf to guard): one part is the merge; two are weighed
    in place, the kernel's (batch, queries, heads, dim) layout kept (the caller's transpose for
    its output projection is then no copy)."""
    if len(outputs) == 1:
        return outputs[0], lses[0]
    lse = functools.reduce(torch.logaddexp, lses)  # `_groups` makes two parts: the own block, the earlier ones
    wide = torch.promote_types(dtype, torch.float32)
    merged = outputs[0].to(wide) * torch.exp(lses[0] - lse).unsqueeze(-1)
    for out, part in zip(outputs[1:], lses[1:]):
        merged.addcmul_(out, torch.exp(part - lse).unsqueeze(-1))
    return merged.to(dtype), lse


def _groups(plan: list, keys: tuple, values: tuple) -> list[tuple[bool, Any, torch.Tensor, torch.Tensor, list[int]]]:
    """The blocks as the kernel runs them, (causal, mask, keys, values, which blocks): a causal
    block alone (the chunk's own), every other block joined into one, their keys, values and
    masks concatenated along the keys. One call and one term of the merge instead of one per
    earlier chunk: per-call costs and the merge grew with the chunk's index."""
    groups = [(True, None, keys[i], values[i], [i]) for i, (causal, _) in enumerate(plan) if causal]
    joined = [i for i, (causal, _) in enumerate(plan) if not causal]
    if len(joined) == 1:
        (i,) = joined
        groups.append((False, plan[i][1], keys[i], values[i], joined))
    elif joined:
        masks = [plan[i][1] for i in joined]
        mask = None
        if any(m is not None for m in masks):  # a block seen whole is a block of zeros
            like = next(m for m in masks if m is not None)
            sized = lambda i: like.new_zeros(*like.shape[:-1], keys[i].shape[-2])  # noqa: E731
            mask = torch.cat([m if m is not None else sized(i) for i, m in zip(joined, masks)], dim=-1)
        key = torch.cat([keys[i] for i in joined], dim=-2)
        groups.append((False, mask, key, torch.cat([values[i] for i in joined], dim=-2), joined))
    return groups
