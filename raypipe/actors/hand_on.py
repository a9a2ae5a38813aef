"""Whether a chunk's whole backward hands its input gradient on before its weight gradients,
chosen by measuring both on the actor.

Sending early shortens every gradient chain through the pipeline by the weight gradients' time,
but it splits the backward (`split_backward`), and on a CPU the split can cost more than it saves:
on the main job's GPT (two blocks and the head, 8 x 64 tokens) a whole backward takes 9.8 ms and
the split 15.5 ms (the input half alone as long as the whole: torch's hooks keep each weight
group's incoming gradient alive, and the weight half runs one autograd call per group), so the
stage steps 10 % slower early. Where the split is free (compute that does not care, as the
simulated stages of the benchmarks) early wins 4-5 % for 1F1B. No fixed rule gets both right, so
each actor measures: after its first step (allocations, first calls), a chunk's eligible
backwards alternate whole and split until each has `SAMPLES` timings (the split's compute, not
the send between its halves; not its first, which checks the graph once and imports torch's
split), and from then on the chunk sends early when the split's fastest is within `MARGIN` of
the whole's (the fastest: what each way costs, less the other actors' preemptions). 10 % is where
sending early still paid in `benchmarks/vs_torch_pipelining.py` on 2 cores: 1F1B at t = 2 ms
gained 2 % with a split 9 % dearer; interleaved 1F1B, its split 11-15 % dearer, lost 4 %.
Either way the step computes the same gradients; only when the input gradient leaves changes.
"""

from __future__ import annotations

SAMPLES = 3  # timings of each way before the choice
MARGIN = 1.10  # the split may cost this much more than the whole backward and still be chosen


def hand_on_mode(mode: str, tp: int) -> str:
    """The mode a stage of `tp` tensor-parallel ranks runs `mode` in: under tp > 1 "measured" is
    "late", because each rank would time and choose alone while its replicated weights (norms,
    biases outside the plan) get their gradients unreduced, so ranks choosing apart could drift
    apart by rounding; "early" and "late" are the same on every rank."""
    return "late" if mode == "measured" and tp > 1 else mode


class HandOnChoice:
    """Per model chunk, early or late (`mode`: `raypipe.env.gradient_hand_on`'s "measured",
    "early" or "late"); measured ones start afresh when the actor's settings change."""

    def __init__(self, mode: str = "measured") -> None:
        self.mode = mode
        self.steps = 0  # steps begun under this choice
        self.samples: dict[int, tuple[list[float], list[float]]] = {}  # chunk -> (whole s, split s)
        self.chosen: dict[int, bool] = {}
        self.split_before: set[int] = set()  # chunks whose first split ran (not counted)

    def begin_step(self) -> None:
        self.steps += 1

    def early(self, v: int) -> bool:
        """Whether chunk `v`'s next eligible whole backward hands on early: the choice, or while
        measuring, whole and split in turn (whole first)."""
        if self.mode != "measured":
            return self.mode == "early"
        if v in self.chosen:
            return self.chosen[v]
        whole, split = self.samples.get(v, ((), ()))
        return self.steps > 1 and len(split) < len(whole)

    def record(self, v: int, split: bool, seconds: float) -> None:
        """One eligible whole backward of chunk `v` took `seconds`, `split` or not."""
        if self.mode != "measured" or v in self.chosen or self.steps <= 1:
            return
        if split and v not in self.split_before:
            self.split_before.add(v)
            return
        whole, splits = self.samples.setdefault(v, ([], []))
        (splits if split else whole).append(seconds)
        if len(whole) >= SAMPLES and len(splits) >= SAMPLES:
            self.chosen[v] = min(splits) <= MARGIN * min(whole)
