"""An objective's step made on the driver (`TrainConfig.objective`): its records made into rows by
the objective (`Objective.rows`), every token id checked against the model's vocabulary, then the
forward-only passes it declares (`Objective.passes`: log-probabilities under the reference policy
or the policy as it stands) run through the pipeline, their answers joined into the step's target
(`Objective.finish`). An objective whose rows are generated from the policy (`generates`) makes
them in `inference.rollout` first. Nothing here asks which objective it runs.

A pass runs on the trainer's actors like a step: a lost actor raises `ActorDiedError` and a stuck
one `StepTimeoutError`, which `fit` recovers from as from a failed step (`run.controller`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from raypipe.core.errors import BatchError
from raypipe.data.batches import check_positions, check_token_ids, split_batch
from raypipe.driver.inference.forward import run_forward
from raypipe.driver.inference.reference import reference_kind
from raypipe.objectives import LogProbPass, Objective, Rows, objective_for

if TYPE_CHECKING:
    from raypipe.driver.actor_group import ActorGroup


def objective_batch(group: ActorGroup, records: Any) -> tuple[Any, dict[str, torch.Tensor]]:
    """`(x, y)` of one step of `group`'s objective on `records` (an `ActorGroup`; the records its
    objective takes: pairs, examples, a generation batch).

    Raises:
        BatchError: the records are not the objective's, hold an id outside the vocabulary, or
            do not divide into dp x microbatches.
    """
    objective = objective_for(group.config.objective)
    if objective.generates:
        from raypipe.driver.inference.rollout import grpo_batch

        return grpo_batch(group, records)
    rows = objective.rows(records)
    parts = group.config.dp * group.config.microbatches
    if rows.records % parts:
        raise BatchError(
            f"{rows.records} {objective.record}s do not divide into dp x microbatches = {group.config.dp} x "
            f"{group.config.microbatches} parts: give a multiple of {parts} {objective.record}s."
        )
    return rows.x, run_passes(group, objective, rows)


def run_passes(group: ActorGroup, objective: Objective, rows: Rows) -> dict[str, torch.Tensor]:
    """The step's target: `rows.y` with the answers of every pass `objective` declares, each run
    through the pipeline microbatch by microbatch; the ids of every part are checked first, so no
    actor sees an id outside the vocabulary."""
    parts = {"rows": (rows.x, rows.y), **rows.extra}
    for x, _ in parts.values():
        check_token_ids(x, group.model.vocab_size)
        check_positions(x["input_ids"].shape[1], group.model.max_positions, "the longest row (prompt and completion)")
    answers = {p.into: logprobs(group, p, *parts[p.rows]) for p in objective.passes()}
    return objective.finish(rows.y, answers)


def logprobs(group: ActorGroup, asked: LogProbPass, x: object, y: dict[str, torch.Tensor]) -> torch.Tensor:
    """One pass's answers for rows `(x, y)`: the loss's `reference(output, target)` of each row,
    under the reference policy or the policy as it stands."""
    c = group.config
    policy = reference_kind(group) if asked.policy == "reference" else "policy"
    inputs, targets = split_batch(x, {"labels": y["labels"]}, c.microbatches, 1, c.microbatches)
    return torch.cat(run_forward(*group.inference_path(), inputs, targets, c.step_timeout, reference=policy))
