"""The StageActor's calls under the "refs" engine, one per action (and inference): boundaries
arrive and leave as values Ray carries, where the p2p engine's single call per step
(`StageActor.run_actions`) exchanges them with the neighbours itself. A base class of
`StageActor`, using its executor, optimizer state and tp group."""

from __future__ import annotations

import math
from typing import Any

from raypipe.actors.inference_passes import forward_only
from raypipe.transport.tree import map_tensors
from raypipe.transport.wire import pack, unpack


class RefsCalls:
    """forward / backward per microbatch, then reduce_gradients, grad_stats and optimizer_step;
    forward_only for inference."""

    def forward(self, call_id: int, microbatch: int, x: Any, target: Any = None, weight: float = 1.0) -> Any:
        """Runs the stage on one microbatch and keeps what its backward needs.

        Returns:
            The output activation (detached, in `boundary_dtype`) on inner stages; the
            microbatch's unscaled loss as a float on the last stage. tp ranks other
            than 0 return None: they end with the same activation, and the next stage
            gets one copy.
        """
        self.executor.begin(call_id)
        out = self.executor.forward(microbatch, unpack(x), unpack(target), weight)
        return pack(to_host(out)) if self.is_last or self.tp.rank == 0 else None

    def backward(self, call_id: int, microbatch: int, grad: Any = None) -> Any:
        """Back-propagates one microbatch, frees its activations, returns the input gradient
        (None on the first stage, and on tp ranks other than 0)."""
        grad_in = self.executor.backward(microbatch, unpack(grad))
        return pack(to_host(grad_in)) if self.tp.rank == 0 else None

    def reduce_gradients(self) -> None:
        """Averages this stage's gradients over its data-parallel replicas, in buckets.

        The refs engine queues it right after the stage's own last backward, so a stage
        reduces while earlier stages are still running backward. Every replica
        reaches it even when a step failed (it takes no references), so the
        collective never waits for a peer that skipped it.
        """
        self.optim.reduce_gradients()

    def grad_stats(self, *finished: Any) -> tuple[float, bool]:
        """Unscales fp16 gradients and returns (sum of squared gradients, all finite).

        `finished` are the first stage's backward results: Ray runs this only once all
        of them succeeded, so a failed step never reaches the optimizer.
        """
        self.optim.reduce_tied()
        return self.optim.grad_stats(self.executor.losses_finite)

    def optimizer_step(self, step: int, *stats: tuple[float, bool]) -> Any:  # a `StepReport`
        """One optimizer step from every actor's gradient statistics (same on all actors).

        `stats` come replica by replica, each replica's stages in order, each stage's
        tp ranks in order.

        Non-finite statistics (a NaN or infinite gradient or loss anywhere) skip the
        update on every stage alike; under fp16 they also halve the loss scale.
        """
        finite = all(s[1] for s in stats)  # every actor of every replica
        # each actor's share counts every gradient once (`OptimizerState.norm_share`)
        total_norm = math.sqrt(sum(s[0] for s in stats)) if finite else math.nan
        return self._apply_step(step, total_norm, finite, None)

    def forward_only(self, x: Any, target: Any = None, v: int | None = None) -> Any:
        """Inference through this stage's chunk `v` (eval mode, no activations kept).

        Returns the output, or on the last stage the loss as a float when a target is given;
        None on tp ranks other than 0 (their output is rank 0's).
        """
        out = forward_only(self.executor, unpack(x), unpack(target), v)
        if isinstance(out, float):  # the loss
            return out
        return pack(to_host(out)) if self.tp.rank == 0 else None


def to_host(value: Any) -> Any:
    """Boundary values cross to other stages (maybe another kind of device) through host
    memory; anything but a device tensor (a loss as a float, None) passes unchanged."""
    return map_tensors(lambda t: t.cpu() if t.device.type != "cpu" else t, value)
