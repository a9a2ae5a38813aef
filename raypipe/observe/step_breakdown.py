"""Where a measured step's time went: the actions, the idle time the schedule itself leaves with
those actions' durations, the waits for messages beyond that, and what surrounds the actions.

The actors time every action (`Trainer.timeline`). Replaying the schedule with each action
lasting exactly what it measured and every message arriving the moment it is made
(`schedules.timed`) gives the shortest span those actions allow in that order: what the step
spent beyond it went to moving the messages (copies, the links, processes waking up to take
them). Outside the span are the call reaching the actors, the closing agreement, the optimizer
step and the reply. Splitting a slow step this way says which lever moves it: faster layers,
another schedule or more microbatches, a faster link or transport, or fewer, longer steps.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

from raypipe.schedules import BACKWARD, INPUT_GRAD, Schedule
from raypipe.schedules.actions import Action, timed

ALL_TO_ALL = "A"  # the event of a MoE all-to-all inside an action (`Executor._timed`): part of that action


@dataclass(frozen=True)
class StepBreakdown:
    """One measured step, in ms.

    Attributes:
        busy_ms: per actor, the time its actions took.
        replay_ms: the schedule run with each action lasting what it measured and messages free.
        span_ms: from the first action's start to the last one's end, over every actor.
        step_ms: the step as the driver saw it (call to result; in `fit`, from the previous
            step's result), or None where not known or shorter than the span (a step queued behind
            another, or driven by the actors, began before that clock: nothing is said around it).
    """

    busy_ms: tuple[float, ...]
    replay_ms: float
    span_ms: float
    step_ms: float | None = None

    @property
    def schedule_idle_ms(self) -> float:
        """The busiest actor's idle time in the replay: the bubble the schedule leaves with these durations."""
        return self.replay_ms - max(self.busy_ms)

    @property
    def messages_ms(self) -> float:
        """The span beyond the replay: waits for messages that no action's duration explains."""
        return self.span_ms - self.replay_ms

    @property
    def outside_ms(self) -> float | None:
        """The step beyond its actions' span: the call, the closing agreement, the optimizer step, the reply."""
        return None if self.step_ms is None else self.step_ms - self.span_ms

    def to_dict(self) -> dict:
        return {
            **asdict(self),
            "schedule_idle_ms": self.schedule_idle_ms,
            "messages_ms": self.messages_ms,
            "outside_ms": self.outside_ms,
        }

    def __str__(self) -> str:
        step = "" if self.step_ms is None else f"step {self.step_ms:.1f} ms = "
        outside = "" if self.outside_ms is None else f" + {self.outside_ms:.1f} around the actions"
        return (
            f"{step}{max(self.busy_ms):.1f} busiest actor's actions + {self.schedule_idle_ms:.1f} the schedule's "
            f"idle time + {self.messages_ms:.1f} waiting for messages{outside}"
        )


def breakdown(
    schedule: Schedule, events: Sequence[Sequence[tuple]], step_seconds: float | None = None
) -> StepBreakdown:
    """The breakdown of a step that ran `schedule`, from each actor's events as it recorded them
    (kind, microbatch, start, end in epoch seconds, and for a whole backward that handed its
    input gradient on early the seconds after its start that it did; `Executor._timed`), one
    per action of its list in order.

    Raises:
        ValueError: the events are not one per action of the schedule (no step has run, or
            another schedule's).
    """
    measured: dict[Action, tuple] = {}
    for actor, (actions, recorded) in enumerate(zip(schedule, events, strict=True)):
        ran = [e for e in recorded if e[0] != ALL_TO_ALL]
        kinds = [e[0] for e in ran]
        if kinds != [a.kind for a in actions]:
            raise ValueError(
                f"actor {actor}'s events ({len(ran)}) are not its {len(actions)} actions of this schedule in order"
            )
        measured.update(zip(actions, ran))

    def seconds(action: Action) -> float | None:
        if action.kind == INPUT_GRAD and action not in measured:  # a whole backward's early hand-on
            event = measured.get(Action(action.stage, BACKWARD, action.microbatch))
            return event[4] if event is not None and len(event) > 4 else None
        start, end = measured[action][2:4]
        return end - start

    runs = timed(schedule, seconds, early_gradients=True)
    starts = [e[2] for actor in events for e in actor]
    ends = [e[3] for actor in events for e in actor]
    span = max(ends) - min(starts)
    if step_seconds is not None and step_seconds < span:  # the step began before the driver's clock did
        step_seconds = None  # (queued behind the one before, or run by the actors): no figure around it
    return StepBreakdown(  # the replay's actions last what they measured: their sums are the actors' busy time
        busy_ms=tuple(1000 * sum(end - start for _, start, end in run) for run in runs),
        replay_ms=1000 * max(end for run in runs for _, _, end in run),
        span_ms=1000 * span,
        step_ms=None if step_seconds is None else 1000 * step_seconds,
    )
