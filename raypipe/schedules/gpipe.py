"""GPipe: every microbatch's forward, then every backward (in reverse order).

Simple and bubble-equal to 1F1B, but each stage holds the activations of all
microbatches at once.
"""

from __future__ import annotations

from raypipe.schedules.actions import BACKWARD, FORWARD, Action, Schedule


def gpipe(num_stages: int, num_microbatches: int) -> Schedule:
    """Per stage: F0..F(m-1), then B(m-1)..B0.

    Backwards run last-microbatch-first so the last stage, which finished F(m-1)
    last, starts backward on the activations it made most recently.
    """
    return [
        [Action(s, FORWARD, m) for m in range(num_microbatches)]
        + [Action(s, BACKWARD, m) for m in reversed(range(num_microbatches))]
        for s in range(num_stages)
    ]
