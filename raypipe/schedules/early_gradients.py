"""Whether a schedule's step ends sooner with its whole backwards split and their input gradients
handed on early (the weight gradients after), from what each action costs: what an actor asks
with its own timings (`raypipe.actors.step.hand_on`) and the planner with profiled layers
(`raypipe.planning.profiling`). Pure arithmetic on the schedule's action lists (`actions.timed`)."""

from __future__ import annotations

from raypipe.schedules.actions import BACKWARD, FORWARD, INPUT_GRAD, Action, Schedule, timed


def hand_on_mode(mode: str, tp: int) -> str:
    """The mode a stage of `tp` tensor-parallel ranks runs `mode` in: under tp > 1 "measured" is
    "late", because each rank would time and choose alone while its replicated weights (norms,
    biases outside the plan) get their gradients unreduced, so ranks choosing apart could drift
    apart by rounding; "early" and "late" are the same on every rank."""
    return "late" if mode == "measured" and tp > 1 else mode


def early_is_faster(schedule: Schedule, forward_s: float, whole_s: float, input_s: float, weight_s: float) -> bool:
    """Whether `schedule`'s step ends sooner with its whole backwards split and handed on early
    than run whole, every chunk of every actor costing as given (`schedules.timed`; the split
    halves cost the same in its I and W actions either way; a first stage's backward stays whole)."""
    late = {FORWARD: forward_s, BACKWARD: whole_s, INPUT_GRAD: input_s}
    early = {**late, BACKWARD: input_s + weight_s}

    def span(costs: dict[str, float], hand_on: bool) -> float:
        def cost(action: Action) -> float:
            first_whole = action.kind == BACKWARD and action.stage == 0
            return costs.get(action.kind, weight_s) if not first_whole else whole_s

        return max(end for actor in timed(schedule, cost, early_gradients=hand_on) for *_, end in actor)

    return span(early, True) < span(late, False)
