"""Interleaved 1F1B (Megatron-LM): each actor holds `chunks` model chunks, chunk c of actor s
being virtual stage c * p + s, and runs 1F1B over them in groups of p microbatches.

The bubble shrinks by the number of chunks: (p - 1) / (v * m + p - 1) of the step with
v chunks, against 1F1B's (p - 1) / (m + p - 1), at the cost of v times as many boundary
sends and up to (v - 1) * p + 2 * (p - 1 - s) + 1 chunk-microbatches in flight on actor s.
"""

from __future__ import annotations

from raypipe.core.errors import ScheduleError
from raypipe.schedules.actions import BACKWARD, FORWARD, Action, Schedule


def interleaved_1f1b(num_stages: int, num_microbatches: int, chunks: int = 2) -> Schedule:
    """Megatron's interleaved order: the k-th forward of an actor is chunk (k // p) mod v of
    microbatch (k // (p v)) p + k mod p; backwards walk the chunks the other way.

    Raises:
        ScheduleError: the microbatches do not divide into groups of p (Megatron's rule).
    """
    p, m, v = num_stages, num_microbatches, chunks
    if m % p:
        options = " or ".join(str(n) for n in sorted({max(p, m - m % p), m + p - m % p}))
        raise ScheduleError(
            f"interleaved-1f1b needs microbatches divisible by pp: got microbatches={m}, pp={p}; "
            f"use microbatches={options}"
        )

    def action(k: int, s: int, kind: str) -> Action:
        chunk = (k // p) % v
        if kind == BACKWARD:
            chunk = v - 1 - chunk
        return Action(chunk * p + s, kind, (k // (p * v)) * p + k % p)

    schedule: Schedule = []
    total = m * v
    for s in range(p):
        warmup = min((v - 1) * p + 2 * (p - 1 - s), total)
        actions = [action(k, s, FORWARD) for k in range(warmup)]
        for i in range(total - warmup):
            actions += [action(warmup + i, s, FORWARD), action(i, s, BACKWARD)]
        actions += [action(k, s, BACKWARD) for k in range(total - warmup, total)]
        schedule.append(actions)
    return schedule
