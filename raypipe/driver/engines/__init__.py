"""The engines behind one small interface: `submit` a step, then wait for its result.

- "p2p": one call per actor per step carrying its action list; the step starts at once
  and the returned wait collects it (so `fit` can queue the next step behind it).
- "compiled": the same step issued through a Ray Compiled Graph, run when waited for.
- "refs": one Ray call per action with boundaries as object references, run when waited for.

Every engine raises the same typed root cause when a step fails (`results.root_failure`,
`StageError`, `ActorDiedError`, `StepTimeoutError`).
"""

from __future__ import annotations

from collections.abc import Callable

from raypipe.driver.engines.compiled import CompiledStep
from raypipe.driver.engines.p2p import submit_step_p2p
from raypipe.driver.engines.refs import run_step
from raypipe.driver.engines.step_io import StepInput, StepResult, StepTarget

__all__ = ["ENGINES", "Engine", "StepInput", "StepTarget", "Wait", "make_engine"]

Wait = Callable[[float], StepResult]  # wait(since) -> the step's result; `since` starts its clock


class Engine:
    """Runs steps on a trainer's actors."""

    def submit(self, target: StepTarget, step: StepInput, after: int | None = None) -> Wait:
        """Sends the step (or prepares it) and returns how to wait for its result. `after`:
        the call id of a step still running that this one queues behind (p2p only)."""
        raise NotImplementedError

    def close(self) -> None:
        """Releases what the engine built on the actors (before they are stopped or replaced)."""


class P2PEngine(Engine):
    def submit(self, target: StepTarget, step: StepInput, after: int | None = None) -> Wait:
        return submit_step_p2p(target, step, after=after).result


class CompiledEngine(Engine):
    def __init__(self) -> None:
        self.graph: CompiledStep | None = None  # built at the first step, over the actors of that step

    def submit(self, target: StepTarget, step: StepInput, after: int | None = None) -> Wait:
        if self.graph is None:
            self.graph = CompiledStep([a for stages in target.replicas for ranks in stages for a in ranks])

        def wait(since: float) -> StepResult:
            return submit_step_p2p(target, step, compiled=self.graph).result(since)

        return wait

    def close(self) -> None:
        if self.graph is not None:
            self.graph.teardown()
            self.graph = None


class RefsEngine(Engine):
    def submit(self, target: StepTarget, step: StepInput, after: int | None = None) -> Wait:
        def wait(since: float) -> StepResult:
            return run_step(target, step)

        return wait


# the registry: one line an engine; what each can do is declared beside the config (`config.engines`)
ENGINES: dict[str, type[Engine]] = {"p2p": P2PEngine, "compiled": CompiledEngine, "refs": RefsEngine}


def make_engine(name: str) -> Engine:
    return ENGINES[name]()
