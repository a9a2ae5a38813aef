"""Whether a chunk's whole backward hands its input gradient on before its weight gradients,
chosen by measuring both on the actor.

Sending early shortens every gradient chain through the pipeline by the weight gradients' time,
but it splits the backward (`split_backward`), and on a CPU the split can cost more than it saves:
on the main job's GPT (two blocks and the head, 8 x 64 tokens) a whole backward takes 9.8 ms and
the split 15.5 ms (the input half alone as long as the whole: torch's hooks keep each weight
group's incoming gradient alive, and the weight half runs one autograd call per group), so the
stage steps 10 % slower early. Where the split is free (compute that does not care, as the
simulated stages of the benchmarks) early wins 4-5 % for 1F1B. No fixed margin gets every
schedule right either: on the same simulated stages a split 9 % dearer still gains 1F1B 2 % at
t = 2 ms, where every gradient chain crosses the pipeline, while interleaved 1F1B and DualPipeV
lose 2-3 % (their other chunk's work fills the wait the early gradient would save, so only the
split's cost is left). So each actor measures, and asks its schedule: after its first step (allocations, first calls), a
chunk's eligible backwards alternate whole and split until each has `SAMPLES` timings (the split's
compute, not the send between its halves; not its first, which checks the graph once and imports
torch's split), and from then on the chunk sends early where the step's action lists, timed with
every chunk costing what this one measured (its fastest forward, whole backward, split halves: what
each costs, less the other actors' preemptions), end sooner early than late (`early_is_faster`).
Without the schedule the split must be within `MARGIN` of the whole backward. Either way the step
computes the same gradients; only when the input gradient leaves changes.
"""

from __future__ import annotations

from typing import Any

from raypipe.schedules.early_gradients import early_is_faster

SAMPLES = 3  # timings of each way before the choice
MARGIN = 1.10  # without a schedule to time: the split may cost this much more than the whole backward
TIMED_MICROBATCHES_PER_STAGE = 4  # a long schedule is timed with 4 microbatches per stage: its sign, not its size


def timed_schedule(spec: tuple | None) -> object:
    """The schedule `early_is_faster` times for `spec` (`StageSettings.schedule_spec`: name, pp,
    microbatches, chunks, extra warm-up and, optionally, sequence chunks), with at most
    `TIMED_MICROBATCHES_PER_STAGE` x pp microbatches, so that the timing stays milliseconds on long
    pipelines; None without a spec (or one that does not build: the choice then falls back to
    `MARGIN`)."""
    if spec is None:
        return None
    from raypipe.core.errors import ScheduleError
    from raypipe.schedules import build_schedule

    name, pp, m, chunks, extra_warmup, *sequence = spec
    for microbatches in (min(m, TIMED_MICROBATCHES_PER_STAGE * pp), m):  # whole where fewer do not build
        try:
            return build_schedule(name, pp, microbatches, chunks, extra_warmup, *sequence)
        except ScheduleError:
            continue
    return None


class HandOnChoice:
    """Per model chunk, early or late (`mode`: `raypipe.core.env.gradient_hand_on`'s "measured",
    "early" or "late"); measured ones start afresh when the actor's settings change. `spec`: the
    step's schedule as `StageSettings.schedule_spec`, built at the first choice (`timed_schedule`)."""

    def __init__(self, mode: str = "measured", spec: tuple | None = None) -> None:
        self.mode, self.spec = mode, spec
        self.schedule: Any = None  # built from `spec` at the first choice
        self.steps = 0  # steps begun under this choice
        # chunk -> (whole backwards' s, splits' (s, input half's s))
        self.samples: dict[int, tuple[list[float], list[tuple[float, float]]]] = {}
        self.forward_s: dict[int, float] = {}  # chunk -> its fastest forward while measuring
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

    def measuring(self, v: int) -> bool:
        return self.mode == "measured" and v not in self.chosen and self.steps > 1

    def forward(self, v: int, seconds: float) -> None:
        """A forward of chunk `v` took `seconds`."""
        if self.measuring(v):
            self.forward_s[v] = min(seconds, self.forward_s.get(v, seconds))

    def record(self, v: int, split: bool, seconds: float, input_s: float = 0.0) -> None:
        """One eligible whole backward of chunk `v` took `seconds`, `split` (its input half
        `input_s` of them) or not."""
        if not self.measuring(v):
            return
        if split and v not in self.split_before:
            self.split_before.add(v)
            return
        whole, splits = self.samples.setdefault(v, ([], []))
        if split:
            splits.append((seconds, input_s))
        else:
            whole.append(seconds)
        if len(whole) >= SAMPLES and len(splits) >= SAMPLES:
            fastest, (split_s, input_part) = min(whole), min(splits)
            if self.schedule is None:
                self.schedule = timed_schedule(self.spec)
            if self.schedule is None or v not in self.forward_s:
                self.chosen[v] = split_s <= MARGIN * fastest
            else:
                self.chosen[v] = early_is_faster(
                    self.schedule, self.forward_s[v], fastest, input_part, split_s - input_part
                )
