"""1F1B (PipeDream-Flush): warm-up forwards, then alternate one forward and one backward.

Stage s runs min(p - s - 1, m) warm-up forwards, then pairs of (forward, backward)
while forwards remain, then the remaining backwards. Its bubble equals GPipe's, but
stage s never holds more than p - s microbatches of activations.
"""

from __future__ import annotations

from raypipe.schedules.actions import BACKWARD, FORWARD, Action, Schedule


def one_f_one_b(num_stages: int, num_microbatches: int) -> Schedule:
    """The 1F1B schedule as per-stage ordered action lists."""
    schedule: Schedule = []
    for s in range(num_stages):
        warmup = min(num_stages - s - 1, num_microbatches)
        actions = [Action(s, FORWARD, m) for m in range(warmup)]
        for i in range(num_microbatches - warmup):
            actions.append(Action(s, FORWARD, warmup + i))
            actions.append(Action(s, BACKWARD, i))
        actions += [Action(s, BACKWARD, m) for m in range(num_microbatches - warmup, num_microbatches)]
        schedule.append(actions)
    return schedule
