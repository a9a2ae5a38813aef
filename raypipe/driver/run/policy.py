"""What a failure during `fit` leads to, decided in one place: Ray Train's `FailurePolicy` ->
`FailureDecision` shape. The policy reads the run's settings and what it has spent; carrying a
decision out is `recovery`'s (new actors) or the loop's (a checkpoint written again)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from raypipe.config import TrainConfig
from raypipe.driver.run.replicas import why_not
from raypipe.driver.run_state import RunState


@dataclass(frozen=True, kw_only=True)
class Decision:
    """What the run does after a failure.

    Attributes:
        action: "raise" (the failure ends `fit`; `reason` says why), "restart" (every actor
            replaced, placed as `place` says, its state from `restore`), or "retry_save" (the
            due checkpoint written again).
        place: "replace": the same topology, waiting `actor_start_timeout` for room; "elastic":
            a node was lost and the run is elastic: the same topology when nodes take the lost
            actors within `replace_wait`, else the largest smaller one that places.
        restore: "replicas": the surviving data-parallel replicas' memory when it covers the
            model at the current step (the failed step runs again, none is replayed), else as
            "checkpoint": the newest valid checkpoint (or the initial weights), then replay.
        reason: for "raise", why; for a restart from a checkpoint where replicas exist, why not
            from them.
    """

    action: Literal["raise", "restart", "retry_save"]
    place: Literal["replace", "elastic"] = "replace"
    restore: Literal["replicas", "checkpoint"] = "checkpoint"
    reason: str = ""


class RecoveryPolicy:
    """Restarts and save retries share `TrainConfig.max_restarts`; a lost node shrinks an elastic
    run; the survivors' memory is preferred to a checkpoint wherever a replica holds a copy."""

    def __init__(self, config: TrainConfig) -> None:
        self.config = config

    @property
    def limit(self) -> int:
        """Restarts and save retries allowed in all (`TrainConfig.max_restarts`)."""
        return self.config.max_restarts

    def after_death(self, run: RunState, gone: set[str]) -> Decision:
        """An actor died; `gone`: the nodes lost with it (none when only the process died)."""
        c = self.config
        if run.restarts >= self.limit:
            return Decision(action="raise", reason=self.spent(run))
        place = "elastic" if gone and c.elastic else "replace"
        unavailable = why_not(c)
        restore = "replicas" if unavailable is None else "checkpoint"
        return Decision(action="restart", place=place, restore=restore, reason=unavailable or "")

    def after_save_failure(self, run: RunState) -> Decision:
        """A due checkpoint could not be written (the step itself counts)."""
        if run.restarts >= self.limit:
            return Decision(action="raise", reason=self.spent(run))
        return Decision(action="retry_save")

    def spent(self, run: RunState) -> str:
        """Why no restart is left, as an error names it."""
        return f"after {run.restarts} restarts (TrainConfig.max_restarts={self.limit})"
