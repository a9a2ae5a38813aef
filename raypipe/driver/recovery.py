"""Where recovery happens: after an actor dies, `fit` replaces every actor, restores the
newest valid checkpoint (or the initial weights) and replays from there, up to
`TrainConfig.max_restarts` times."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from raypipe.driver import nodes
from raypipe.driver.checkpoints import last_valid
from raypipe.errors import ActorDiedError, PlacementError


def recover(trainer: Any, error: ActorDiedError, log: Callable[[str], None]) -> None:
    """Restarts `trainer`'s actors after `error` and restores its last checkpoint.

    Raises:
        ActorDiedError: the restarts are used up; says which actor died, why, and where the
            last checkpoint is.
        PlacementError: the actors cannot be placed again within `actor_start_timeout` (their
            node was lost and no other can hold them); names the lost nodes and what they held.
    """
    config = trainer.config
    if trainer.restarts >= config.max_restarts:
        where = restore_point(trainer)
        raise ActorDiedError(
            f"{error} -- after {trainer.restarts} restarts (TrainConfig.max_restarts="
            f"{config.max_restarts}); last checkpoint: {where[0] if where else 'none'}",
            actor=error.actor,
            cause=error.cause,
        ) from None
    trainer.restarts += 1
    started = time.monotonic()
    log(f"raypipe: {error}; restart {trainer.restarts} of {config.max_restarts}")
    placed = nodes.held(trainer._actors, trainer.names)
    trainer.shutdown()
    gone = nodes.unreachable(placed)
    if gone:
        log(f"raypipe: lost {nodes.describe(placed, gone)}; placing its actors on other nodes")
    try:
        trainer._start_actors()
    except PlacementError as failure:
        if not gone:
            raise
        raise PlacementError(
            f"{error.actor} died with its node ({nodes.describe(placed, gone)}), and no node "
            f"left can take its place: {failure}"
        ) from None
    where = restore_point(trainer)
    if where is not None:
        trainer.load(where[0], log=log)
    else:
        trainer.step_count = 0  # new actors start from the initial weights
    log(
        f"raypipe: resumed at step {trainer.step_count} from {where[0] if where else 'the initial weights'} "
        f"in {time.monotonic() - started:.1f} s"
    )


def restore_point(trainer: Any) -> tuple[Any, int] | None:
    """What a recovery restores: the newest of the run's own valid checkpoints in checkpoint_dir and
    the checkpoint the trainer was last loaded from (a resume from elsewhere), or None (the initial
    weights). Never another run's checkpoint, whatever its step."""
    found = [p for p in (last_valid(trainer.config.checkpoint_dir, trainer.run_id), trainer.restored_from) if p]
    return max(found, key=lambda p: p[1]) if found else None
