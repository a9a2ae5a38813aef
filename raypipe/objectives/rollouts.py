"""A GRPO generation batch as the rows a step trains on: TRL's advantages of each group of G
completions, and each prompt followed by each of its completions."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from raypipe.core.errors import BatchError
from raypipe.objectives.pairs import completion_rows

COLUMNS = ("prompt_ids", "completion_ids", "rewards")
SCALINGS = ("group", "batch", "none")


def group_advantages(
    rewards: torch.Tensor, generations: int, scale: str = "group"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each completion's advantage, its reward less its group's mean, divided by the group's
    standard deviation ("group"), the batch's ("batch") or not ("none"), + 1e-4 as TRL; and whether
    its group's rewards all equal (`frac_reward_zero_std`). Groups are `generations` consecutive
    completions; deviations are unbiased, as TRL's."""
    grouped = rewards.view(-1, generations)
    mean = grouped.mean(dim=1).repeat_interleave(generations)
    group_std = grouped.std(dim=1).repeat_interleave(generations) if generations > 1 else torch.zeros_like(rewards)
    std = rewards.std().expand_as(rewards) if scale == "batch" and rewards.numel() > 1 else group_std
    if scale == "batch" and rewards.numel() <= 1:
        std = torch.zeros_like(rewards)
    advantages = rewards - mean
    if scale != "none":
        advantages = advantages / (std + 1e-4)
    return advantages, torch.isclose(std, torch.zeros_like(std))


def rollout_batch(
    rollout: Mapping[str, Any], generations: int, scale: str = "group", pad_id: int = 0
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """`(x, y)` of one GRPO step on `rollout` = {"prompt_ids": P prompts, "completion_ids": P x G
    completions (G per prompt, in order), "rewards": P x G floats}: row r is prompt r // G then
    completion r, right-padded with `pad_id`; x = {"input_ids", "attention_mask"}, y = {"labels" (the
    completion's tokens, -100 elsewhere), "advantages", "rewards", "zero_std"}.

    Raises:
        BatchError: a column is missing, or the counts do not make P groups of G.
    """
    if not isinstance(rollout, Mapping) or any(c not in rollout for c in COLUMNS):
        raise BatchError(
            f"a GRPO step takes {{{', '.join(map(repr, COLUMNS))}}}: P prompts' token ids, P x G completions' "
            f"(G = num_generations per prompt, in order) and their P x G rewards; got "
            f"{sorted(rollout) if isinstance(rollout, Mapping) else type(rollout).__name__}"
        )
    prompts, completions = list(rollout["prompt_ids"]), list(rollout["completion_ids"])
    rewards = torch.as_tensor(rollout["rewards"], dtype=torch.float32).flatten()
    if not prompts or len(completions) != len(prompts) * generations or rewards.numel() != len(completions):
        raise BatchError(
            f"{len(prompts)} prompts with num_generations={generations} need {len(prompts) * generations} completions "
            f"and as many rewards; got {len(completions)} completions and {rewards.numel()} rewards"
        )
    if not torch.isfinite(rewards).all():
        bad = int((~torch.isfinite(rewards)).nonzero()[0])
        raise BatchError(
            f"reward {bad} is {float(rewards[bad])}: give finite rewards (one NaN or inf makes its whole group's "
            f"advantages NaN); a reward function that abstains returns None for that completion"
        )
    empty = [p for p, prompt in enumerate(prompts) if len(prompt) == 0]
    if empty:
        raise BatchError(f"prompt {empty[0]}'s prompt_ids is empty: a prompt needs at least one token")
    rows, lengths = [], []
    for r, completion in enumerate(completions):
        completion = [int(t) for t in completion]
        if not completion:
            raise BatchError(f"completion {r} is empty: a completion needs at least one token")
        rows.append([int(t) for t in prompts[r // generations]] + completion)
        lengths.append(len(completion))
    x, labels = completion_rows(rows, lengths, pad_id)
    advantages, zero_std = group_advantages(rewards, generations, scale)
    return x, {"labels": labels, "advantages": advantages, "rewards": rewards, "zero_std": zero_std}


def completions_of(
    sequences: torch.Tensor, prompt_width: int, eos_token_id: int | None, pad_id: int | None = None
) -> list[list[int]]:
    """Each generated row's completion: its tokens after the (left-padded) prompt, up to and with
    its first `eos_token_id` (the rest is what generation pads finished rows with)."""
    out = []
    for row in sequences[:, prompt_width:].tolist():
        if eos_token_id is not None and eos_token_id in row:
            row = row[: row.index(eos_token_id) + 1]
        out.append(row)
    return out


def check_rollout_prompts(prompts: Sequence[Any]) -> list[list[int]]:
    """Prompt records' `prompt_ids` (a GRPO fit's batch: a list of {"prompt_ids", ...} records).

    Raises:
        BatchError: not a non-empty list of records with prompt_ids.
    """
    if not isinstance(prompts, Sequence) or not prompts or not all(isinstance(p, Mapping) for p in prompts):
        raise BatchError(f"a GRPO fit's batch is a list of prompt records {{'prompt_ids', ...}}; got {prompts!r:.80}")
    missing = [i for i, p in enumerate(prompts) if not p.get("prompt_ids")]
    if missing:
        raise BatchError(f"prompt records {missing[:5]} have no prompt_ids (a list of token ids, at least one)")
    return [[int(t) for t in p["prompt_ids"]] for p in prompts]
