"""Zero-bubble schedules (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024): each backward
is split into I, the input gradient the previous stage waits for, and W, the weight gradient
nothing waits for, and the Ws fill what would be the bubble.

With F, I and W of equal cost t, 1F1B idles (p - 1) * 3t per actor and step; ZB-H1 idles
(p - 1) * t at the same peak memory as 1F1B's first stage (p microbatches' activations on
every actor); ZB-V, two chunks per actor in a V, idles only while the first forwards fill
the pipe (actor s waits s chunk-forwards), also at p microbatches' memory (2p chunk halves).
`raypipe.schedules.bubble` computes these from the lists; the tests compare them with the
formulas.
"""

from __future__ import annotations

from raypipe.schedules.actions import FORWARD, INPUT_GRAD, WEIGHT_GRAD, Action, Schedule
from raypipe.schedules.one_f_one_b import backward_order, warmup_forwards


def zb_h1(num_stages: int, num_microbatches: int, extra_warmup: int = 0, sequence_chunks: int = 1) -> Schedule:
    """ZB-H1: 1F1B's warm-up and order with each backward split, actor s deferring its weight
    gradients by s steps so they fill the cool-down's bubble (the paper's handcrafted H1);
    `extra_warmup` and `sequence_chunks` (units, backwards in reverse chunk order) as in
    `one_f_one_b`."""
    p, m = num_stages, num_microbatches
    order = backward_order(m, sequence_chunks)
    schedule: Schedule = []
    for s in range(p):
        warmup = min(warmup_forwards(p, m, s, extra_warmup) + sequence_chunks - 1, m)
        actions = [Action(s, FORWARD, i) for i in range(warmup)]
        weights = 0
        for i in range(m - warmup):
            actions += [Action(s, FORWARD, warmup + i), Action(s, INPUT_GRAD, order[i])]
            if i >= s:
                actions.append(Action(s, WEIGHT_GRAD, order[weights]))
                weights += 1
        for i in range(m - warmup, m):
            actions.append(Action(s, INPUT_GRAD, order[i]))
            actions.append(Action(s, WEIGHT_GRAD, order[weights]))
            weights += 1
        actions += [Action(s, WEIGHT_GRAD, order[i]) for i in range(weights, m)]
        schedule.append(actions)
    return schedule


def zb_v(num_stages: int, num_microbatches: int) -> Schedule:
    """ZB-V: actor s holds virtual stages s (chunk 0) and 2p - 1 - s (chunk 1); the order is the
    paper's (as torch.distributed.pipelining's ScheduleZBVZeroBubble builds it): fill chunk 0,
    turn at the V's bottom, then F/I/W of both chunks in step, weight gradients last.
    Planned for at least 2p - 1 microbatches; fewer keep the order with the missing ones left out."""
    p, m = num_stages, num_microbatches
    planned = max(2 * p - 1, m)
    schedule: Schedule = []
    for s in range(p):
        stages = (s, 2 * p - 1 - s)
        actions: list[Action] = []
        forwards, inputs = [0, 0], [0, 0]

        def add(chunk: int, kind: str, counter: list[int]) -> None:
            actions.append(Action(stages[chunk], kind, counter[chunk]))
            counter[chunk] += 1

        def whole_backward(chunk: int) -> None:
            actions.append(Action(stages[chunk], INPUT_GRAD, inputs[chunk]))
            add(chunk, WEIGHT_GRAD, inputs)

        for _ in range(2 * (p - s) - 1):
            add(0, FORWARD, forwards)
        for _ in range(s):
            add(1, FORWARD, forwards)
            add(0, FORWARD, forwards)
        for _ in range(p - s):
            add(1, FORWARD, forwards)
            whole_backward(1)
        while forwards[1] < forwards[0] or forwards[0] < planned:
            if forwards[0] < planned:
                add(0, FORWARD, forwards)
            whole_backward(0)
            add(1, FORWARD, forwards)
            whole_backward(1)
        weights = list(inputs)
        for _ in range(s):
            add(0, INPUT_GRAD, inputs)
            add(1, INPUT_GRAD, inputs)
        for _ in range(p - s):
            add(0, INPUT_GRAD, inputs)
            add(0, WEIGHT_GRAD, weights)
        for chunk in (1, 0):
            while weights[chunk] < inputs[chunk]:
                add(chunk, WEIGHT_GRAD, weights)
        schedule.append([a for a in actions if a.microbatch < m])
    return schedule
