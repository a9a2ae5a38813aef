"""`sequence_chunks="auto"` checked by the clock (issue 76). The planner predicts each chunk count's
step from the layers timed alone, which misses what a unit costs beyond its layers (its calls,
messages and Python, paid k times a microbatch): on a 64-wide Llama at 2,048 tokens it chose k = 4
predicting 144 ms, and the step took 277 ms, slower than unchunked. So once the actors run, the
chosen k, the profiled counts next to it (half and twice) and k = 1 take real steps on the sample in
turn, and the fastest stays (the planner's where another is within a few percent of it: two steps
cannot tell them apart): "auto" never runs a k slower than not cutting at all, and where the
planner's ranking of two near counts is off (its 4 over 8 on a 6 x 128 Llama whose k 8 ran 1.47x
unchunked and k 4 1.28x), the clock settles it.

The trial steps leave nothing behind: before them every actor hands over its state (weights,
optimizer state, fp32 masters, RNG, running statistics, loss scale: the calls a recovery from
memory uses), and after them takes it back, so a run with "auto" trains exactly as one given the
kept k from the start. The planner's k runs unmeasured, and the log says why, where an actor holds
a ZeRO share of its state (it cannot be handed over), where the planner found the sample's
microbatches too big for a device's memory uncut, or where an unchunked step fails (the state is
put back all the same).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from raypipe.core.errors import StageError
from raypipe.driver.actor_group import ActorGroup
from raypipe.driver.results import gather
from raypipe.driver.run.step import submit

ROUNDS = 2  # timed steps per chunk count, after one untimed step each (its first allocations)
CLOSER = 0.05  # how much faster than the planner's count another's fastest step must be to replace it


@dataclass(frozen=True)
class Trial:
    """What the trial measured: per chunk count (the planner's first) the wall seconds of its timed steps."""

    planned: int
    seconds: dict[int, list[float]]

    @property
    def fastest(self) -> dict[int, float]:
        """Per chunk count, its fastest timed step's seconds."""
        return {k: min(s) for k, s in self.seconds.items()}

    @property
    def kept(self) -> int:
        """The chunk count to run: the planner's, unless another count's fastest timed step beats
        its fastest by more than `CLOSER` (then the fastest such), and k = 1 wherever its fastest is
        no slower than that count's. A count's fastest is its own cost, the machine's other work
        only ever slowing a step (a median of two let one step slowed by half on a 10 x 80 Llama
        keep k 4 over a k 8 29 % faster); but two steps cannot tell close counts apart, and within
        `CLOSER` the profile decides (on a 4 x 64 Llama the planner's k 4 ran 130 and 160 ms, k 8
        149 and 129, and k 8's median step in `sequence_chunks.py` came out 18 % the slower)."""
        fastest = self.fastest
        planned = fastest[self.planned]
        beats = [k for k, t in fastest.items() if k not in (1, self.planned) and t < planned * (1 - CLOSER)]
        best = min(beats, key=fastest.__getitem__) if beats else self.planned
        return 1 if fastest.get(1, float("inf")) <= fastest[best] else best

    def __str__(self) -> str:
        def steps(k: int) -> str:
            return ", ".join(f"{1000 * s:.0f}" for s in self.seconds[k]) + " ms"

        kept = self.kept
        chunked = ", ".join(f"sequence_chunks={k} {steps(k)}" for k in self.seconds if k != 1)
        verdict = f"keeping sequence_chunks={kept}" if kept > 1 else "running unchunked (sequence_chunks=1)"
        if 1 < kept != self.planned:
            verdict += f" (the planner's {self.planned} measured slower)"
        elif kept == self.planned:
            fastest = self.fastest
            close = [k for k, t in fastest.items() if k not in (1, kept) and t < fastest[kept]]
            if close:
                within = ", ".join(str(k) for k in close)
                verdict += f" (the planner's; {within} faster by less than {CLOSER:.0%}, within what two steps tell)"
        return f"sequence_chunks=auto measured on the sample: {chunked}, unchunked {steps(1)} a step; {verdict}"


def counts_to_time(planned: int, profiled: object) -> list[int]:
    """The chunk counts the trial times: the planner's, the profiled ones next to it (half and
    twice, where the planner timed the layers on them: `PlanReport.profiled_microbatches`, keyed by
    (microbatches, k)), and 1 (not cut)."""
    options = {key[1] for key in (profiled or {}) if isinstance(key, tuple)}
    return [planned, *(k for k in (planned // 2, 2 * planned) if k > 1 and k != planned and k in options), 1]


def settle(group: ActorGroup, step: int, sample: tuple[object, object], log: Callable[[str], None]) -> Trial | None:
    """Times the planner's sequence chunk count, its neighbours and k = 1 on `sample`
    (`counts_to_time`; `ROUNDS` steps each, in turn, after a first untimed one each), keeps the
    fastest (`Trial.kept`, `group.reconfigure`) and puts every actor's state back as it was; logs what it
    measured. `step`: the run's step count (the learning-rate schedule's step the trial steps run
    at). None when nothing was measured (the plan does not cut, its state cannot be put back,
    k = 1 does not fit, or a trial step failed)."""
    planned = group.config.sequence_chunks  # a number once the trainer has started ("auto" chosen)
    if not isinstance(planned, int) or planned == 1:
        return None
    c, reason = group.config, None
    if c.zero in (1, 3) and c.dp > 1:  # (what `replicas.take` cannot hand over either)
        reason = f"each replica holds a ZeRO-{c.zero} share of its stage's state, which cannot be put back"
    elif group.report is not None and not group.report.unchunked_fits:
        reason = "uncut, the sample's microbatches do not fit a device's memory"
    if reason is not None:
        log(f"sequence_chunks=auto: running the planned sequence_chunks={planned} unmeasured ({reason})")
        return None
    held = [actor.hand_over.options(num_returns=2).remote() for actor in group.actors]
    counts = counts_to_time(planned, group.report.profiled_microbatches if group.report is not None else None)
    seconds: dict[int, list[float]] = {k: [] for k in counts}
    failed = None
    try:
        for round_ in range(ROUNDS + 1):
            for k in counts:
                group.reconfigure(group.config.replace(sequence_chunks=k))
                started = time.perf_counter()
                submit(group, *sample, step).wait(started)
                if round_:
                    seconds[k].append(time.perf_counter() - started)
    except StageError as error:  # an uncut step that does not fit after all (a device's memory): keep k
        failed = error
    finally:
        gather(
            [actor.take_over.remote(step, state) for actor, (_, state) in zip(group.actors, held)],
            "putting back the state the sequence chunks' trial found",
            group.actors,
            group.names,
        )
    if failed is not None:
        group.reconfigure(group.config.replace(sequence_chunks=planned))
        log(f"sequence_chunks=auto: running the planned sequence_chunks={planned} (a trial step failed: {failed})")
        return None
    trial = Trial(planned, seconds)
    group.reconfigure(group.config.replace(sequence_chunks=trial.kept))
    log(str(trial))
    return trial
