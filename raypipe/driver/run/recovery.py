"""A restart carried out: after an actor dies, `fit` replaces every actor, up to
`TrainConfig.max_restarts` times, as the run's `RecoveryPolicy` decides. The new actors take the
surviving data-parallel replicas' state when they hold the whole model at the current step
(`replicas`): the failed step is run again and none is replayed. Otherwise they restore the
newest valid checkpoint (or the initial weights; one whose files the actors find corrupt is
passed over for the next) and replay from there."""

from __future__ import annotations

import time
from collections.abc import Callable

from raypipe.checkpoint.layout import CheckpointError
from raypipe.core.errors import ActorDiedError, PlacementError
from raypipe.driver.actor_group import ActorGroup
from raypipe.driver.checkpoints import restore_point
from raypipe.driver.cluster import nodes
from raypipe.driver.run import elastic, replicas
from raypipe.driver.run.policy import RecoveryPolicy
from raypipe.driver.run_state import RunState


def recover(
    group: ActorGroup, run: RunState, error: ActorDiedError, log: Callable[[str], None], policy: RecoveryPolicy
) -> None:
    """Restarts the run's actors after `error` as `policy` decides and restores their state.

    Raises:
        ActorDiedError: the restarts are used up; says which actor died, why, and where the
            last checkpoint is.
        PlacementError: the actors cannot be placed again within `actor_start_timeout` (their
            node was lost and no other can hold them); names the lost nodes and what they held.
    """
    config = group.config
    placed = dict(group.nodes)
    gone = nodes.unreachable(placed)
    decision = policy.after_death(run, gone)
    if decision.action == "raise":
        where = restore_point(config.checkpoint_dir, run)
        raise ActorDiedError(
            f"{error} -- {decision.reason}; last checkpoint: {where[0] if where else 'none'}",
            actor=error.actor,
            cause=error.cause,
        ) from None
    run.restarts += 1
    started = time.monotonic()
    log(f"raypipe: {error}; restart {run.restarts} of {config.max_restarts}")
    held = None
    if decision.restore == "replicas":
        held = replicas.take(group, gone, run.step_count, log)  # before the survivors stop
    elif config.dp > 1:
        log(f"raypipe: not restoring from the surviving replicas: {decision.reason}")
    group.shutdown()
    if gone:
        log(f"raypipe: lost {nodes.describe(placed, gone)}; placing its actors on other nodes")
    try:
        if decision.place == "elastic":  # no node to take them within replace_wait: go on with fewer
            elastic.place(group, placed, gone, log)
        else:
            group.start()
    except PlacementError as failure:
        if not gone:
            raise
        raise PlacementError(
            f"{error.actor} died with its node ({nodes.describe(placed, gone)}), and no node "
            f"left can take its place: {failure}"
        ) from None
    starting = f"{time.monotonic() - started:.1f} s of it starting the actors"
    if held is not None and replicas.restore(group, held, log):
        log(
            f"raypipe: resumed at step {run.step_count} from the surviving replicas in "
            f"{time.monotonic() - started:.1f} s ({starting}): step {run.step_count + 1} runs again, none is replayed"
        )
        return
    where, corrupt = restore_point(config.checkpoint_dir, run), []
    while where is not None:  # the actors hash what they read: one found corrupt, the next older
        try:
            group.load(where[0], None, run, log)
            break
        except CheckpointError as invalid:
            log(f"raypipe: skipping invalid checkpoint: {invalid}")
            corrupt.append(where[0].name)
            where = restore_point(config.checkpoint_dir, run, corrupt)
    if where is None:
        run.step_count = 0  # new actors start from the initial weights
    source = str(where[0]) if where else "the initial weights"
    if run.loads:  # loaded after the last checkpoint: the trainer held those, not the checkpoint's
        source += " and " + reload(group, run)
    log(f"raypipe: resumed at step {run.step_count} from {source} in {time.monotonic() - started:.1f} s ({starting})")


def reload(group: ActorGroup, run: RunState) -> str:
    """Loads again into the new actors what was loaded since the run's last checkpoint
    (`RunState.loads`), in order; the run goes on from the step of the last. Returns what it loaded.
    The optimizer state is the checkpoint's (or fresh), as a load does not change it either."""
    for step, _, load in run.loads:
        load(group)
        run.step_count = step
    return ", then ".join(f"{what} at step {step}" for step, what, _ in run.loads)
