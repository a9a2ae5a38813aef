"""Actions, the unit of a pipeline schedule, with the validator and the grid printer.

A schedule is plain data: one ordered list of `Action`s per stage. Each stage runs
its list in order; an action may start once the actions it depends on (on other
stages) have finished. The engine that drives actors, the validator below and the
timeline plots all read the same object.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from raypipe.errors import ScheduleError

FORWARD = "F"
BACKWARD = "B"
KINDS = (FORWARD, BACKWARD)


@dataclass(frozen=True, order=True)
class Action:
    """One forward or backward of one microbatch on one stage, printed as `1F3`."""

    stage: int
    kind: str
    microbatch: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.microbatch}"

    __repr__ = __str__


Schedule = list[list[Action]]


def dependencies(action: Action, num_stages: int) -> list[Action]:
    """The actions on *other* stages that must finish before `action` can start.

    Same-stage order is the schedule's own business: forward before backward of a
    microbatch on one stage is checked by `validate`, not here.
    """
    s, m = action.stage, action.microbatch
    if action.kind == FORWARD:
        return [Action(s - 1, FORWARD, m)] if s > 0 else []
    return [Action(s + 1, BACKWARD, m)] if s < num_stages - 1 else []


def simulate(schedule: Schedule, num_stages: int) -> list[list[Action | None]]:
    """Runs the schedule with every action taking one tick.

    Returns:
        The grid: one row per tick, one column per stage, `None` where a stage idles.

    Raises:
        ScheduleError: when no stage can make progress before all actions ran
            (a deadlock); the message shows the grid so far and the stuck actions.
    """
    done: set[Action] = set()
    position = [0] * num_stages
    grid: list[list[Action | None]] = []
    total = sum(len(actions) for actions in schedule)
    while len(done) < total:
        row: list[Action | None] = []
        for stage, actions in enumerate(schedule):
            nxt = actions[position[stage]] if position[stage] < len(actions) else None
            ready = nxt is not None and all(d in done for d in dependencies(nxt, num_stages))
            row.append(nxt if ready else None)
        if not any(row):
            stuck = {
                s: actions[position[s]]
                for s, actions in enumerate(schedule)
                if position[s] < len(actions)
            }
            waits = "; ".join(
                f"stage {s} waits at {a} for {', '.join(map(str, dependencies(a, num_stages)))}"
                for s, a in stuck.items()
            )
            raise ScheduleError(
                f"schedule deadlocks after {len(grid)} ticks: {waits}\n"
                + format_grid(grid, num_stages, stuck=stuck)
            )
        for stage, action in enumerate(row):
            if action is not None:
                done.add(action)
                position[stage] += 1
        grid.append(row)
    return grid


def validate(schedule: Schedule, num_stages: int, num_microbatches: int) -> None:
    """Checks a schedule is complete, well ordered and deadlock free.

    Every stage must run each microbatch's forward and backward exactly once, the
    forward first, and a simulated run must finish.

    Raises:
        ScheduleError: naming the stage and action that break a rule.
    """
    if len(schedule) != num_stages:
        raise ScheduleError(f"schedule has {len(schedule)} stage lists, expected {num_stages}")
    expected = {(k, m) for k in KINDS for m in range(num_microbatches)}
    for stage, actions in enumerate(schedule):
        seen: set[tuple[str, int]] = set()
        for index, action in enumerate(actions):
            key = (action.kind, action.microbatch)
            where = f"stage {stage}, position {index} ({action})"
            if action.stage != stage:
                raise ScheduleError(f"{where}: action belongs to stage {action.stage}")
            if key not in expected:
                raise ScheduleError(
                    f"{where}: unknown kind or microbatch out of range 0..{num_microbatches - 1}"
                )
            if key in seen:
                raise ScheduleError(f"{where}: runs twice")
            if action.kind == BACKWARD and (FORWARD, action.microbatch) not in seen:
                raise ScheduleError(f"{where}: backward before its forward")
            seen.add(key)
        missing = sorted(expected - seen)
        if missing:
            names = ", ".join(f"{stage}{k}{m}" for k, m in missing)
            raise ScheduleError(f"stage {stage} never runs {names}")
    simulate(schedule, num_stages)


def peak_in_flight(actions: Sequence[Action]) -> int:
    """The most microbatches one stage holds activations for (forwarded, not yet backwarded)."""
    live = peak = 0
    for action in actions:
        live += 1 if action.kind == FORWARD else -1
        peak = max(peak, live)
    return peak


def format_grid(
    grid: Sequence[Sequence[Action | None]],
    num_stages: int,
    stuck: dict[int, Action] | None = None,
) -> str:
    """Draws the stage x time grid, one line per stage; `.` is an idle tick.

    A stuck action (from a deadlock) is shown after the grid in brackets on its stage.
    """
    width = max([len(str(a)) for row in grid for a in row if a] + [3])
    lines = []
    for stage in range(num_stages):
        cells = [(str(row[stage]) if row[stage] else ".").rjust(width) for row in grid]
        tail = f"  [{stuck[stage]} stuck]" if stuck and stage in stuck else ""
        lines.append(f"stage {stage}: " + " ".join(cells) + tail)
    return "\n".join(lines)


def format_schedule(schedule: Schedule) -> str:
    """The schedule as its simulated grid (unit-time actions), for printing."""
    return format_grid(simulate(schedule, len(schedule)), len(schedule))
