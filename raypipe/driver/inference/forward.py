"""Forward-only passes for `Trainer.evaluate` and `Trainer.predict`, under every engine: each
microbatch goes through one replica's stages as a chain of actor calls whose outputs pass
straight to the next stage as object references (the weights stay where they are; no gradient
is kept)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from raypipe.data.batches import loss_weights, split_batch
from raypipe.driver.results import gather, wait_for_progress
from raypipe.schedules import FORWARD, Action
from raypipe.transport.wire import pack, unpack

if TYPE_CHECKING:
    from raypipe.driver.actor_group import ActorGroup


def run_forward(
    stages: Sequence[Sequence[Any]],
    names: Sequence[Sequence[str]],
    chunks: Sequence[int] | None,
    inputs: Sequence[torch.Tensor],
    targets: Sequence[object] | None,
    timeout: float,
    reference: str | None = None,
) -> list[Any]:
    """Forward-only pass of every microbatch through all stages (evaluation, inference).

    `stages` holds each stage's tp ranks, in virtual-stage order with model chunks (`chunks`: the
    chunk each runs, else None); every rank runs, rank 0's output goes on. With `reference` (its
    kind), the stages run as a preference run's reference policy (`StageActor.forward_only`).

    Returns:
        Per microbatch: the last stage's loss (when targets are given; with `reference`, the loss
        function's `reference` values) or its output.
    """
    results, pending = [], {}
    inputs, targets = pack(inputs), pack(targets)
    for m, x in enumerate(inputs):
        ref = x
        for s, ranks in enumerate(stages):
            target = targets[m] if targets is not None and s == len(stages) - 1 else None
            v = None if chunks is None else chunks[s]
            refs = [actor.forward_only.remote(ref, target, v, reference) for actor in ranks]
            for t, r in enumerate(refs):
                pending[r] = (names[s][t], str(Action(s, FORWARD, m)))
            ref = refs[0]
        results.append(ref)
    wait_for_progress(pending, timeout, "inference")
    flat = [a for ranks in stages for a in ranks]
    return unpack(gather(results, "inference", flat, [n for ranks in names for n in ranks]))


def evaluate(group: ActorGroup, x: object, y: object) -> float:
    """The mean loss of `group`'s model (an `ActorGroup`) on `(x, y)`: per microbatch, weighed by
    its counted tokens when the loss counts them."""
    c = group.config
    inputs, targets = split_batch(x, y, c.microbatches, c.dp, c.microbatches)
    losses = run_forward(*group.inference_path(), inputs, targets, c.step_timeout)
    weights = loss_weights(group.loss_fn, [targets])  # a loss over counted tokens: their mean
    return sum(v * w for v, w in zip(losses, weights[0] if weights else [1.0] * len(losses))) / len(losses)


def predict(group: ActorGroup, x: object) -> torch.Tensor:
    """`group`'s model's output for `x`, microbatch by microbatch, concatenated."""
    c = group.config
    inputs, _ = split_batch(x, None, c.microbatches, c.dp, c.microbatches)
    return torch.cat(run_forward(*group.inference_path(), inputs, None, c.step_timeout))
