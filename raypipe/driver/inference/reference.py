"""A DPO step's batch (`TrainConfig.objective` "dpo"): the pairs made into rows
(`objectives.pair_batch`) and the reference policy's log-probabilities of every row, measured in a
forward-only pass through the pipeline (`StageActor.forward_only(..., reference=kind)`), as the
target the step trains against; and the run's reference policy, which GRPO's KL term uses too."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from raypipe.checkpoint.layout import CheckpointError
from raypipe.data.batches import split_batch
from raypipe.driver.inference.forward import run_forward
from raypipe.driver.results import gather
from raypipe.errors import BatchError
from raypipe.objectives import pair_batch


def preference_batch(group: Any, records: Sequence[Mapping[str, Any]]) -> tuple[dict[str, torch.Tensor], dict]:
    """`(x, y)` of one step on the pair `records` for `group` (an `ActorGroup`): y holds the rows'
    labels and their reference log-probs.

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
    kind = reference_kind(group)
    inputs, targets = split_batch(x, {"labels": labels}, c.microbatches, 1, c.microbatches)
    reference = torch.cat(run_forward(*group.inference_path(), inputs, targets, c.step_timeout, reference=kind))
    return x, {"labels": labels, "ref_logps": reference}


def reference_kind(group: Any) -> str:
    """The run's reference policy: captured on every actor before its first preference step (the
    weights as they stand: a new adapter's, or one loaded first), kept in its checkpoints' manifest.

    Raises:
        CheckpointError: the run resumed from a checkpoint of a run that started from a loaded
            adapter, whose copy checkpoints do not hold.
    """
    if group.reference_kind is None:
        kinds = gather([a.capture_reference.remote() for a in group.actors], "reference", group.actors, group.names)
        group.reference_kind = "adapters_off" if set(kinds) == {"adapters_off"} else "frozen_copy"
    if group.reference_kind == "not_saved":
        raise CheckpointError(
            f"this {group.config.objective['name'].upper()} run resumed from a checkpoint of a run that started from "
            "a loaded adapter: its reference policy, that adapter, is not in checkpoints (a new adapter's, the "
            "adapters off, is). Start a new run from the adapter you started from (load_adapter before the first step)."
        )
    return group.reference_kind
