"""Where an actor-driven run's steps are booked for the driver: a small asyncio Ray actor that
starts the run (one call per stage actor, which it then watches), that the reporting actors tell
each step's outcome (`report`), and that the driver asks for the steps done and the calls that
failed (`wait`). The driver makes one call per step and holds no call per actor, whatever the
number of actors (a Ray driver spends CPU for each call it has in flight, for as long as it is).

Each step needs one report from every stage lead and from the last stage's tp rank 0 of every
replica (the losses); a step that saves a checkpoint needs every actor's part of it too. Its
seconds are those of the lowest reporting rank, between the end of its step before and its own."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from raypipe.core.protocol import RunCall, RunStep, StepReport

if TYPE_CHECKING:
    import ray
    from ray.actor import ActorHandle


class StepBoard:
    """The steps of the current run, kept until the driver has taken them."""

    def __repr__(self) -> str:  # the Ray dashboard shows it; Ray reads it once, as the actor starts
        return "StepBoard(each step's reports from the stage actors)"

    def __init__(self) -> None:
        self.run = -1  # the call id of the run being booked
        self.calls: list[ray.ObjectRef] = []  # the run's calls, one per stage actor, in rank order
        self.failed: list[int] = []  # ranks whose call ended with an error, in the order they ended
        self.running = 0  # calls not yet ended
        self.changed = asyncio.Event()  # a call ended
        self.expected: set[int] = set()  # ranks that report every step
        self.savers: set[int] = set()  # every rank: each reports the steps it saves
        self.saving: set[int] = set()  # the run's saving steps
        self.reports: dict[int, dict[int, tuple[StepReport, dict | None, Any]]] = {}  # step -> rank -> ...
        self.done: dict[int, RunStep] = {}
        self.ready: dict[int, asyncio.Event] = {}

    async def begin(
        self, run: int, reporters: list[int], saving: list[int], calls: list[tuple[ActorHandle, RunCall]]
    ) -> None:
        """Starts run `run`: `calls` are (stage actor, its `RunCall`) in rank order (earlier runs'
        leftovers are dropped)."""
        self.run, self.expected, self.savers, self.saving = run, set(reporters), set(range(len(calls))), set(saving)
        self.reports, self.done, self.ready = {}, {}, {}
        self.failed, self.running, self.changed = [], len(calls), asyncio.Event()
        self.calls = [actor.run_steps.remote(call) for actor, call in calls]
        for rank, ref in enumerate(self.calls):
            asyncio.get_running_loop().create_task(self._watch(run, rank, ref))

    async def _watch(self, run: int, rank: int, ref: ray.ObjectRef) -> None:
        try:
            await ref
            failed = False
        except Exception:  # noqa: BLE001 - the driver reads the error from the call itself
            failed = True
        if run == self.run:
            self.failed += [rank] if failed else []
            self.running -= 1
            self.changed.set()

    async def report(self, run: int, told: list[tuple]) -> None:
        """Steps' outcomes from one actor, each (step, rank, its report, its checkpoint part when the
        step saves (else None), on the losses' reporters (samples, tokens, weighted losses), the
        step's seconds on that actor (from the end of the step before, or the run's start))."""
        for step, rank, report, saved, batch, seconds in told:
            self._report(run, step, rank, (report, saved, batch, seconds))

    def _report(self, run: int, step: int, rank: int, told: tuple) -> None:
        if run != self.run:
            return
        got = self.reports.setdefault(step, {})
        got[rank] = told
        if self._needed(step) <= set(got):
            losses, samples, tokens = [], 0, None
            for r in sorted(got):
                if got[r][2] is not None:
                    samples, tokens, mine = got[r][2]
                    losses.extend(mine)
            reports = {r: v[0] for r, v in got.items() if r in self.expected}
            saves = {r: v[1] for r, v in got.items() if v[1] is not None}
            seconds = got[min(got)][3]  # the lowest rank's clock (stage 0's lead): one actor's steps
            self.done[step] = RunStep(step, reports, losses, samples, tokens, saves, seconds)
            del self.reports[step]
            self.event(step).set()

    def _needed(self, step: int) -> set[int]:
        """The ranks whose report step `step` waits for (every actor's on a saving step)."""
        return self.expected | (self.savers if step in self.saving else set())

    def event(self, step: int) -> asyncio.Event:
        return self.ready.setdefault(step, asyncio.Event())

    async def wait(self, run: int, step: int, timeout: float) -> tuple[list[RunStep], list[tuple[int, object]], bool]:
        """The run's done steps from `step` on, in order; the calls that failed so far, as (rank,
        the call's reference); whether every call has ended. Waits up to `timeout` s for `step` or
        for a call to end. Asking from `step` drops the steps before it: the driver has them (a
        wait it gave up on may still answer later, so answering takes nothing away)."""
        if run != self.run:
            return [], [], True
        for old in [k for k in self.done if k < step]:
            del self.done[old]
            self.ready.pop(old, None)
        if step not in self.done and not self.failed and self.running:
            self.changed.clear()
            done, pending = await asyncio.wait(
                [asyncio.ensure_future(e.wait()) for e in (self.event(step), self.changed)],
                timeout=timeout,
                return_when=asyncio.FIRST_COMPLETED,
            )
            for task in pending:
                task.cancel()
        taken = []
        while step in self.done:
            taken.append(self.done[step])
            step += 1
        return taken, [(rank, self.calls[rank]) for rank in self.failed], self.running == 0

    async def missing(self, run: int, step: int) -> list[int]:
        """The ranks whose report of `step` has not come (for a stuck step's message)."""
        got = self.reports.get(step, {})
        return sorted(self._needed(step) - set(got)) if run == self.run else []
