"""Where recovery happens: after an actor dies, `fit` replaces every actor, restores the
newest valid checkpoint (or the initial weights) and replays from there, up to
`TrainConfig.max_restarts` times."""

from __future__ import annotations

import time
from typing import Any, Callable

from raypipe.errors import ActorDiedError
from raypipe.runtime.checkpoints import last_valid


def recover(trainer: Any, error: ActorDiedError, log: Callable[[str], None]) -> None:
    """Restarts `trainer`'s actors after `error` and restores its last checkpoint.

    Raises:
        ActorDiedError: the restarts are used up; says which actor died, why, and where the
            last checkpoint is.
    """
    config = trainer.config
    if trainer.restarts >= config.max_restarts:
        where = last_valid(config.checkpoint_dir)
        raise ActorDiedError(
            f"{error} -- after {trainer.restarts} restarts (TrainConfig.max_restarts="
            f"{config.max_restarts}); last checkpoint: {where or 'none'}",
            actor=error.actor, cause=error.cause,
        ) from None
    trainer.restarts += 1
    started = time.monotonic()
    log(f"raypipe: {error}; restart {trainer.restarts} of {config.max_restarts}")
    trainer.shutdown()
    trainer._start_actors()
    where = last_valid(config.checkpoint_dir)
    if where is not None:
        trainer.load(where, log=log)
    else:
        trainer.step_count = 0  # new actors start from the initial weights
    log(f"raypipe: resumed at step {trainer.step_count} from {where or 'the initial weights'} "
        f"in {time.monotonic() - started:.1f} s")
