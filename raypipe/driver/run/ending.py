"""What a run leaves when `fit` stops: after Ctrl-C or SIGTERM a checkpoint of the last
completed step (SIGTERM also stops the actors), and at a job's normal end its last step saved."""

from __future__ import annotations

from collections.abc import Callable

from raypipe.checkpoint import layout as ckpt
from raypipe.driver.actor_group import ActorGroup
from raypipe.driver.run.interrupts import Terminated
from raypipe.driver.run.step import stop
from raypipe.driver.run_state import RunState


def interrupted(group: ActorGroup, run: RunState, error: KeyboardInterrupt, log: Callable[[str], None]) -> None:
    """After Ctrl-C or SIGTERM stopped `fit` (its queued steps booked): a checkpoint of the last
    completed step where checkpoint_dir is set; on SIGTERM the actors stop (the loggers closed as
    KILLED, the placement group released) since the process is being stopped. A Ctrl-C keeps the
    actors: a notebook goes on from here."""
    cause = "SIGTERM" if isinstance(error, Terminated) else "an interrupt"
    root = group.config.checkpoint_dir
    done = saved_already(group, run)
    error.reported = True  # the job's entry point adds no line of its own (`raypipe.job.stop_code`)
    if done is not None:
        log(f"raypipe: stopped by {cause} after step {run.step_count}, whose checkpoint {done} is complete")
    elif root is not None and group.running and run.step_count > 0:
        try:
            log(f"raypipe: stopped by {cause} after step {run.step_count}; saved {group.save(root, run)}")
        except BaseException as failure:  # noqa: BLE001 - the interrupt is what fit re-raises
            log(
                f"raypipe: stopped by {cause} after step {run.step_count}; its checkpoint could not be "
                f"written: {type(failure).__name__}: {failure}"
            )
    if root is None:
        log(f"raypipe: stopped by {cause} after step {run.step_count} (no checkpoint_dir: nothing saved)")
    if isinstance(error, Terminated):
        stop(group, run)


def saved_already(group: ActorGroup, run: RunState) -> object:
    """The run's complete checkpoint of its current step in its checkpoint_dir, or None."""
    root = group.config.checkpoint_dir
    done = ckpt.location(root) / ckpt.checkpoint_name(run.step_count) if root is not None else None
    if done is not None and ckpt.manifest_of(done) is not None and ckpt.run_of(done) == run.run_id:
        return done
    return None


def save_last(group: ActorGroup, run: RunState) -> object:
    """At a run's normal end: its last step's checkpoint, written unless it is there already (a
    run of 60 steps saving every 50 ends with step 60 saved too); None without a checkpoint_dir."""
    if group.config.checkpoint_dir is None or run.step_count == 0:
        return None
    return saved_already(group, run) or group.save(group.config.checkpoint_dir, run)
