"""A stage's calls under the "refs" engine, one per action: boundaries arrive and leave as values
Ray carries, where the p2p engine's single call per step (`Stage.step`) exchanges them with the
neighbours itself. A part of `StageActor`, over its `Stage`'s executor, optimizer state and tp
group."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from raypipe.transport.tree import to_host
from raypipe.transport.wire import pack, unpack

if TYPE_CHECKING:
    from raypipe.actors.stage import Stage


class RefsCalls:
    """forward / backward per microbatch, then reduce_gradients, grad_stats and optimizer_step."""

    def __init__(self, stage: Stage) -> None:
        self.stage = stage

    def forward(self, call_id: int, microbatch: int, x: object, target: object = None, weight: float = 1.0) -> object:
        """Runs the stage on one microbatch and keeps what its backward needs.

        Returns:
            The output activation (detached, in `boundary_dtype`) on inner stages; the
            microbatch's unscaled loss as a float on the last stage. tp ranks other
            than 0 return None: they end with the same activation, and the next stage
            gets one copy.
        """
        self.stage.executor.begin(call_id)
        out = self.stage.executor.forward(microbatch, unpack(x), unpack(target), weight)
        return pack(to_host(out)) if self.stage.is_last or self.stage.tp.rank == 0 else None

    def backward(self, call_id: int, microbatch: int, grad: object = None) -> object:
        """Back-propagates one microbatch, frees its activations, returns the input gradient
        (None on the first stage, and on tp ranks other than 0)."""
        grad_in = self.stage.executor.backward(microbatch, unpack(grad))
        return pack(to_host(grad_in)) if self.stage.tp.rank == 0 else None

    def reduce_gradients(self) -> None:
        """Averages this stage's gradients over its data-parallel replicas, in buckets.

        The refs engine queues it right after the stage's own last backward, so a stage
        reduces while earlier stages are still running backward. Every replica
        reaches it even when a step failed (it takes no references), so the
        collective never waits for a peer that skipped it.
        """
        self.stage.optim.reduce_gradients()

    def grad_stats(self, *finished: object) -> tuple[float, bool]:
        """Unscales fp16 gradients and returns (sum of squared gradients, all finite).

        `finished` are the first stage's backward results: Ray runs this only once all
        of them succeeded, so a failed step never reaches the optimizer.
        """
        self.stage.optim.reduce_tied()
        return self.stage.optim.grad_stats(self.stage.executor.losses_finite)

    def optimizer_step(self, step: int, *stats: tuple[float, bool]) -> object:  # a `StepReport`
        """One optimizer step from every actor's gradient statistics (same on all actors).

        `stats` come replica by replica, each replica's stages in order, each stage's
        tp ranks in order.

        Non-finite statistics (a NaN or infinite gradient or loss anywhere) skip the
        update on every stage alike; under fp16 they also halve the loss scale.
        """
        finite = all(s[1] for s in stats)  # every actor of every replica
        # each actor's share counts every gradient once (`OptimizerState.norm_share`)
        total_norm = math.sqrt(sum(s[0] for s in stats)) if finite else math.nan
        return self.stage.apply_step(step, total_norm, finite, None)
