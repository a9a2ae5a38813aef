"""The trainers of this process whose actors are running: named in placement errors (their
actors may be what holds the cluster's resources), and replaced when a new trainer takes
the same run name (in a notebook, the trainer of the cell being run again)."""

from __future__ import annotations

import warnings
import weakref
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from raypipe.checkpoint.lock import RootLock

_RUNNING: weakref.WeakSet[Any] = weakref.WeakSet()


def add(trainer: object) -> None:
    _RUNNING.add(trainer)


def discard(trainer: object) -> None:
    _RUNNING.discard(trainer)


def others_holding_actors(group: object) -> list[str]:
    """The running trainers of this process but the one of `group` (an `ActorGroup`), as their reprs."""
    return [repr(t) for t in list(_RUNNING) if t.group is not group and t.group.running]


def replace_same_name(run_name: str, trainer: object) -> bool:
    """Shuts down a running trainer of this process named `run_name` other than `trainer`: its
    actors hold the names the new one needs (and its checkpoint_dir). Returns whether there was one."""
    replaced = False
    for other in list(_RUNNING):
        if other is not trainer and other.run_name == run_name and other.group.running:
            warnings.warn(
                f"raypipe: shutting down the running trainer named {run_name!r} of this "
                f"process to reuse its name ({other!r})",
                stacklevel=3,
            )
            other.shutdown()
            replaced = True
    return replaced


def hold_root(root: str | None, run_name: str, trainer: object) -> RootLock | None:
    """This run's hold on its checkpoint root (`raypipe.checkpoint.lock`; None without one), taken
    from the trainer of the same name in this process if that one holds it (a notebook cell run
    again: that trainer is shut down, as `replace_same_name` does).

    Raises:
        CheckpointError: another live run holds the root.
    """
    from raypipe.checkpoint import lock
    from raypipe.checkpoint.files import CheckpointError

    try:
        held = lock.hold(root, run_name)
    except CheckpointError:
        if not replace_same_name(run_name, trainer):
            raise
        held = lock.hold(root, run_name)
    if held is not None:  # a trainer dropped without shutdown() (a re-run notebook cell) lets it go
        weakref.finalize(trainer, held.release).atexit = False
    return held
