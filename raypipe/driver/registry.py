"""The trainers of this process whose actors are running: named in placement errors (their
actors may be what holds the cluster's resources), and replaced when a new trainer takes
the same run name (in a notebook, the trainer of the cell being run again)."""

from __future__ import annotations

import warnings
import weakref
from typing import Any

_RUNNING: weakref.WeakSet[Any] = weakref.WeakSet()


def add(trainer: Any) -> None:
    _RUNNING.add(trainer)


def discard(trainer: Any) -> None:
    _RUNNING.discard(trainer)


def others_holding_actors(group: Any) -> list[str]:
    """The running trainers of this process but the one of `group` (an `ActorGroup`), as their reprs."""
    return [repr(t) for t in list(_RUNNING) if t.group is not group and t.group.running]


def replace_same_name(trainer: Any) -> None:
    """Shuts down a running trainer of this process with `trainer`'s run name: its actors
    hold the names the new one needs."""
    for other in list(_RUNNING):
        if other is not trainer and other.run_name == trainer.run_name and other.group.running:
            warnings.warn(
                f"raypipe: shutting down the running trainer named {trainer.run_name!r} of this "
                f"process to reuse its name ({other!r})",
                stacklevel=3,
            )
            other.shutdown()
