"""Exceptions raypipe raises. Each says what was wrong, where, and what to do."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class RaypipeError(Exception):
    """Base class of every error raypipe raises on purpose."""


class ConfigError(RaypipeError, ValueError):
    """A configuration field has a bad value; the message names the field and the fix."""


class ScheduleError(RaypipeError):
    """A pipeline schedule is malformed or would deadlock; the message shows the grid."""


class BatchError(RaypipeError, ValueError):
    """A batch handed to `Trainer.step` cannot be split as the config asks."""


class PlacementError(RaypipeError):
    """A stage actor could not be placed on the cluster within the allowed time."""


class StageError(RaypipeError):
    """An action failed inside a stage actor; the message names the stage and action."""


class StepTimeoutError(RaypipeError):
    """A step made no progress in time; the message lists the pending actions."""


class ActorDiedError(StageError):
    """A stage actor's process died (killed, out of memory, node lost).

    Attributes:
        actor: the actor's name, e.g. "stage1-dp0-tp0".
        cause: Ray's account of the death.
    """

    def __init__(self, message: str, actor: str = "?", cause: str = "") -> None:
        super().__init__(message)
        self.actor, self.cause = actor, cause


class NonFiniteError(RaypipeError):
    """A loss or gradient was NaN or infinite (with TrainConfig.nonfinite="error")."""


def nearest(name: str, choices: Iterable[str]) -> str:
    """A 'did you mean' hint for a misspelt name in an error's message, or an empty string."""
    match = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.5)
    return f" Did you mean {match[0]!r}?" if match else ""
