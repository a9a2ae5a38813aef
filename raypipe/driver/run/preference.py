"""A preference step on the driver (`TrainConfig.objective` "dpo"): the pairs made into rows
(`objectives.pair_batch`), the reference policy's log-probabilities of every row measured in a
forward-only pass through the pipeline, then one training step on rows and reference together,
whose metrics carry TRL's (`objectives.step_metrics`, from the last stages' reports)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from raypipe.data.batches import split_batch
from raypipe.driver.actor_group import ActorGroup
from raypipe.driver.inference.forward import run_forward
from raypipe.driver.run.step import train_step
from raypipe.driver.run_state import RunState
from raypipe.errors import BatchError, ConfigError
from raypipe.objectives import pair_batch


def dpo_step(group: ActorGroup, run: RunState, records: Sequence[Mapping[str, Any]], y: Any = None) -> dict[str, Any]:
    """One DPO step on the pair `records` (`Trainer.step` under objective "dpo"; `y` unused).

    Raises:
        BatchError: the records are not pairs of token ids, or their number does not divide into
            dp x microbatches (a pair's two rows always share a microbatch).
    """
    c = group.config
    x, labels = pair_batch(records)
    parts = c.dp * c.microbatches
    if len(records) % parts:
        raise BatchError(
            f"{len(records)} pairs do not divide into dp x microbatches = {c.dp} x {c.microbatches} parts: a pair's "
            f"chosen and rejected rows share a microbatch, so give a multiple of {parts} pairs."
        )
    inputs, targets = split_batch(x, {"labels": labels}, c.microbatches, 1, c.microbatches)
    reference = torch.cat(run_forward(*group.inference_path(), inputs, targets, c.step_timeout, reference=True))
    return train_step(group, run, x, {"labels": labels, "ref_logps": reference})


def refuse_fit(config: Any) -> None:
    """`fit` runs next-token steps only, for now.

    Raises:
        ConfigError: `config.objective` is set.
    """
    if config.objective is not None:
        raise ConfigError(
            f"fit does not run a {config.objective['name']!r} objective yet: call trainer.step(pairs) in a loop "
            f"(each step measures its pairs against the reference policy first)"
        )
