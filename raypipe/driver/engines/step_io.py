"""What every engine is given for one step, what it runs on (`StepTarget`) and with what data
(`StepInput`), and what it gives back (`StepResult`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from raypipe.core.protocol import StepReport
from raypipe.schedules import Action, Schedule

if TYPE_CHECKING:
    from ray.actor import ActorHandle

    from raypipe.driver.checkpoints import Written


@dataclass
class StepTarget:
    """What a step runs on: the actors, their names and world ranks as [replica][stage][tp
    rank], the schedule and its submission order (for the refs engine)."""

    replicas: list[list[list[ActorHandle]]]
    names: list[list[list[str]]]
    ranks: list[list[list[int]]]
    schedule: Schedule
    order: list[Action]


@dataclass
class StepInput:
    """One step's data and identity: per replica, one input and one target per microbatch.

    `weights`: per replica and microbatch, its loss weight relative to an equal share (a
    loss that counts tokens, `raypipe.data.batches.loss_weights`), or None for equal shares.
    `varying`: the microbatches differ in shape, so boundary messages describe themselves.
    """

    inputs: Sequence[Sequence[Any]]
    targets: Sequence[Sequence[Any]]
    call_id: int
    step: int  # 0-based optimizer step (drives the learning-rate schedule)
    timeout: float
    weights: Sequence[Sequence[float]] | None = None
    varying: bool = False
    # instead of inputs and targets: per replica, references to its packed inputs and targets in
    # Ray's object store (a dataset reader stored them; the actors fetch them, the driver never does)
    packed: Sequence[tuple[object, object]] | None = None

    def packed_batches(self) -> list[tuple[object, object]]:
        """Per replica (packed inputs, packed targets) as they travel to the actors: stored ones as
        references, else packed here (`pack_microbatches`)."""
        from raypipe.transport.wire import pack_microbatches

        if self.packed is not None:
            return list(self.packed)
        return [(pack_microbatches(list(x)), pack_microbatches(list(y))) for x, y in zip(self.inputs, self.targets)]


@dataclass
class StepResult:
    """What one step produced: per-microbatch losses and each stage's optimizer report."""

    losses: list[float]
    stage_reports: list[StepReport] | dict[int, StepReport]  # by world rank (an actor-driven run: its reporters')
    seconds: float
    batch: tuple[int, int | None] | None = None  # an actor-driven run's (samples, tokens), its losses weighted
    saved: Written | None = None  # an actor-driven run's checkpoint of the step: (its directory, each actor's part)
