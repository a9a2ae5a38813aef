"""What one training run knows about itself between steps, apart from the actors: its identity
(name, id), how far it got (steps booked, restarts spent, the checkpoint last restored) and what
it records (the loggers, the Ray dashboard's series, the last step's timeline events).

`Trainer` holds one; the run controller (`raypipe.driver.run`) reads and writes it, never the trainer itself."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from raypipe.observe.loggers import Loggers
from raypipe.observe.metrics import RayMetrics


@dataclass
class RunState:
    """A run's identity, progress and records.

    Attributes:
        run_name: the run's readable name (`TrainConfig.name`, or `run-<8 hex>`): actor names,
            logger runs and Ray metric tags carry it.
        run_id: the run's identity in its checkpoints (a uuid); a resume takes the resumed run's.
        loggers: `config.loggers`, opened at the first record.
        step_count: optimizer steps applied (and booked) so far.
        restarts: recoveries and save retries spent of `TrainConfig.max_restarts`.
        restored_from: the checkpoint last loaded, and its step.
        last_result_at: `time.perf_counter()` when the last step's result came back (a queued
            step's time counts from there).
        last_events: the last step's (action, start, end) per stage, for `Trainer.timeline`.
        last_step_seconds: that step's time as the driver saw it (`StepResult.seconds`).
        loads: what was loaded into the actors since the run's last checkpoint, in order: (step
            count then, what it was, `load(group)` loading it again). A recovery loads them again
            after the checkpoint (or the initial weights); a save or a checkpoint load empties it.
            A loaded state dict is held by reference (not copied) until then.
        advised_links: the links (`ActorGroup.links`, measured anew at each start) whose steps were
            looked at for a link that bounds them, and acted on or said (`links.advice.after_step`).
    """

    run_name: str
    run_id: str
    loggers: Loggers
    step_count: int = 0
    restarts: int = 0
    restored_from: tuple[Path, int] | None = None
    last_result_at: float = 0.0
    last_events: list[list[tuple]] = field(default_factory=list)
    last_step_seconds: float | None = None
    ray_metrics: RayMetrics | None = None
    loads: list[tuple[int, str, Any]] = field(default_factory=list)
    advised_links: list | None = None

    def record_on_dashboard(self, metrics: dict[str, object], lead_ranks: list[int]) -> None:
        """Exports a step's metrics to the Ray dashboard (the series are made at the first step)."""
        if self.ray_metrics is None:
            self.ray_metrics = RayMetrics(self.run_name)
        self.ray_metrics.log(metrics, lead_ranks)
