"""DualPipeV (DeepSeek-V3's DualPipe cut in half, as torch.distributed.pipelining's
`ScheduleDualPipeV` builds it from deepseek-ai/DualPipe): two chunks per actor in a V, actor s
holding virtual stages s and 2p - 1 - s as in ZB-V, and in the steady state each forward of
one chunk paired with a whole backward of the other (`F&B`), so that one microbatch's
communication (its boundary sends, a MoE layer's all-to-all) can hide under the other's compute.

Its bubble per actor is DeepSeek's (PP/2 - 1)(F&B + B - 3W) with PP = 2p, the virtual stages
of the V, F, B and W one chunk's forward, whole backward and weight gradient, and F&B an
overlapped pair run as one block (`timed` with an "F&B" cost): equal to it when F&B = F + B and
F <= I (tests/unit/test_schedules.py), against 1F1B's (PP - 1)(F + B) over as many stages.

As data, a pair is its two actions one after the other, `F` of one chunk then `B` of the other
(`actions.overlapped_pairs` finds them). The engines run the forward, post its send, and run
the backward while the send is on its way (the backward's gradient was posted as a receive
before the forward began): on a CPU, where two computations cannot overlap, the communication
still hides under compute, and the forward's output leaves before the pair ends, so the
sequential pair's bubble, (p - 1)(F + B - 2W) where I <= F, is below the block's. Needs at least
2p microbatches for its steady state; fewer keep the order with the missing ones left out.
"""

from __future__ import annotations

from raypipe.schedules.actions import BACKWARD, FORWARD, INPUT_GRAD, WEIGHT_GRAD, Action, Schedule


def dualpipe_v(num_stages: int, num_microbatches: int) -> Schedule:
    """The DualPipeV order of each actor, step by step as torch (and DualPipe's reference code)
    writes it: fill chunk 0, turn at the V's bottom with zero-bubble backwards, the steady state
    of F&B pairs, then the cool-down whose later backwards split into I and W to fill its bubble."""
    p, m = num_stages, num_microbatches
    planned = max(2 * p, m)
    return [[a for a in _actor(p, planned, s) if a.microbatch < m] for s in range(p)]


def _actor(p: int, m: int, s: int) -> list[Action]:
    stage = (s, 2 * p - 1 - s)
    actions: list[Action] = []
    count: dict[tuple[int, str], int] = {}  # (chunk, F or I) -> the next microbatch
    weights: list[tuple[int, int]] = []  # (virtual stage, microbatch) awaiting their W

    def add(chunk: int, kind: str) -> None:
        key = (chunk, FORWARD if kind == FORWARD else INPUT_GRAD)
        mb = count.get(key, 0)
        count[key] = mb + 1
        actions.append(Action(stage[chunk], kind, mb))
        if kind == INPUT_GRAD:
            weights.append((stage[chunk], mb))

    def pending_weight() -> None:
        if weights:
            actions.append(Action(weights[0][0], WEIGHT_GRAD, weights.pop(0)[1]))

    for _ in range(2 * (p - s - 1)):  # 1: chunk 0 fills the pipe
        add(0, FORWARD)
    for _ in range(s + 1):  # 2: both chunks
        add(0, FORWARD)
        add(1, FORWARD)
    for _ in range(p - s - 1):  # 3: the V's bottom, zero-bubble
        add(1, INPUT_GRAD)
        pending_weight()
        add(1, FORWARD)
    for _ in range(m - 2 * p + s + 1):  # 4: the steady state, F0&B1 then F1&B0
        add(0, FORWARD)
        add(1, BACKWARD)
        add(1, FORWARD)
        add(0, BACKWARD)
    for _ in range(p - s - 1):  # 5: B1, then F1&B0
        add(1, BACKWARD)
        add(1, FORWARD)
        add(0, BACKWARD)
    split = False
    for i in range(s + 1):  # 6: B1 B0, the second half split into I and W
        split = split or (i == (s + 1) // 2 and s % 2 == 1)
        add(1, INPUT_GRAD if split else BACKWARD)
        split = split or (i == (s + 1) // 2 and s % 2 == 0)
        add(0, INPUT_GRAD if split else BACKWARD)
    for _ in range(p - s - 1):  # 7: W then B0
        pending_weight()
        add(0, INPUT_GRAD if split else BACKWARD)
    for _ in range(s + 1):  # 8: the last weight gradients
        pending_weight()
    return actions
