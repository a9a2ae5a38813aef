"""Pipeline schedules: functions `(num_stages, num_microbatches) -> list[list[Action]]`."""

from __future__ import annotations

from typing import Callable

from raypipe.schedules.actions import (
    BACKWARD,
    FORWARD,
    Action,
    Schedule,
    format_grid,
    format_schedule,
    peak_in_flight,
    simulate,
    validate,
)
from raypipe.schedules.gpipe import gpipe
from raypipe.schedules.one_f_one_b import one_f_one_b

SCHEDULES: dict[str, Callable[[int, int], Schedule]] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
}


def build_schedule(name: str, num_stages: int, num_microbatches: int) -> Schedule:
    """Builds and validates the named schedule.

    Raises:
        KeyError: for an unknown name (the config validates names before this).
        ScheduleError: if the schedule is invalid for these sizes.
    """
    schedule = SCHEDULES[name](num_stages, num_microbatches)
    validate(schedule, num_stages, num_microbatches)
    return schedule


__all__ = [
    "Action",
    "BACKWARD",
    "FORWARD",
    "SCHEDULES",
    "Schedule",
    "build_schedule",
    "format_grid",
    "format_schedule",
    "gpipe",
    "one_f_one_b",
    "peak_in_flight",
    "simulate",
    "validate",
]
