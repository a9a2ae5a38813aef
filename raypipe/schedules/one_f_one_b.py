"""1F1B (PipeDream-Flush): warm-up forwards, then alternate one forward and one backward.

Stage s runs min(p - s - 1, m) warm-up forwards, then pairs of (forward, backward)
while forwards remain, then the remaining backwards. Its bubble equals GPipe's, but
stage s never holds more than p - s microbatches of activations.

`extra_warmup` e lets every stage but the last run e more forwards ahead (p - s - 1 + e, at
most m): over a slow link a stage then keeps its link busy with the next microbatches'
activations while the round trip of the first one's (its activation out, its gradient back)
is under way, instead of waiting for that gradient with one microbatch in flight. Each
stage but the last holds e more microbatches' activations at its peak.
"""

from __future__ import annotations

from raypipe.schedules.actions import BACKWARD, FORWARD, Action, Schedule


def one_f_one_b(num_stages: int, num_microbatches: int, extra_warmup: int = 0, sequence_chunks: int = 1) -> Schedule:
    """The 1F1B schedule as per-stage ordered action lists.

    `sequence_chunks` k > 1 (Seq1F1B): the unit is a microbatch's sequence chunk, unit u being chunk
    u % k of microbatch u // k (`num_microbatches` counts units); a microbatch's chunks run forward
    in order and backward in reverse (each chunk's backward gives the chunks before it the gradient
    of their keys and values), so every stage, the last too, runs k - 1 forwards more before its
    first backward."""
    k = sequence_chunks
    schedule: Schedule = []
    for s in range(num_stages):
        warmup = min(warmup_forwards(num_stages, num_microbatches, s, extra_warmup) + k - 1, num_microbatches)
        backwards = backward_order(num_microbatches, k)
        actions = [Action(s, FORWARD, m) for m in range(warmup)]
        for i in range(num_microbatches - warmup):
            actions.append(Action(s, FORWARD, warmup + i))
            actions.append(Action(s, BACKWARD, backwards[i]))
        actions += [Action(s, BACKWARD, backwards[i]) for i in range(num_microbatches - warmup, num_microbatches)]
        schedule.append(actions)
    return schedule


def warmup_forwards(num_stages: int, num_microbatches: int, stage: int, extra_warmup: int = 0) -> int:
    """The forwards stage `stage` runs before its first backward under 1F1B's order: p - s - 1, and
    `extra_warmup` more on every stage but the last (whose backward follows its forward at once)."""
    extra = extra_warmup if stage < num_stages - 1 else 0
    return min(num_stages - stage - 1 + extra, num_microbatches)


def backward_order(units: int, sequence_chunks: int) -> list[int]:
    """The units in the order their backwards run under a 1F1B-ordered schedule: microbatch by
    microbatch, each one's `sequence_chunks` chunks in reverse (the identity for 1)."""
    k = sequence_chunks
    return [u - u % k + (k - 1 - u % k) for u in range(units)]
