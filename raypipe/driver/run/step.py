"""One step's life on the driver: cut and sent to the actors (`submit`), waited for and booked
(`book`: the step count, metrics, the dashboard, a due checkpoint, the loggers), which comes to
one typed `Outcome`. `Trainer.step` is `train_step`; the fit loop (`controller`) books its queued
steps with `book` too.

Everything here works on the run's actors (`ActorGroup`) and its state (`RunState`), never on
the `Trainer` that holds them."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Literal

from raypipe import objectives
from raypipe.checkpoint.layout import CheckpointError
from raypipe.core.errors import ActorDiedError, NonFiniteError, StepTimeoutError
from raypipe.core.protocol import StepReport, stops_on_nonfinite
from raypipe.data.batches import prepare
from raypipe.driver.actor_group import ActorGroup, Submitted
from raypipe.driver.checkpoints import Written
from raypipe.driver.engines.step_io import StepResult
from raypipe.driver.links import advice as links_advice
from raypipe.driver.run import actor_runs
from raypipe.driver.run.interrupts import held_interrupts
from raypipe.driver.run_state import RunState
from raypipe.observe.loggers import scalars
from raypipe.observe.metrics import step_metrics


@dataclass(frozen=True, kw_only=True)
class Outcome:
    """What waiting for one submitted step came to.

    Attributes:
        kind: "booked" (it ran and counts: `metrics`); "halted" (the actors did not run it: a step
            queued behind one that failed, or past the end of an actor-driven run that ended
            early); "died" (an actor died: `error`; `metrics` when the step had run and counts
            and the actor died writing its checkpoint); "save_failed" (it ran and counts:
            `metrics`, but its due checkpoint could not be written: `error`).
        metrics: the booked step's metrics (`Trainer.step`'s return value).
        error: what stopped it (`ActorDiedError`, `SaveFailed`).
    """

    kind: Literal["booked", "halted", "died", "save_failed"]
    metrics: dict[str, Any] | None = None
    error: Exception | None = None


class SaveFailed(CheckpointError):
    """A due checkpoint could not be written; the step it follows ran and counts (`metrics`)."""

    def __init__(self, message: str, metrics: dict[str, object]) -> None:
        super().__init__(message)
        self.metrics = metrics


def submit(group: ActorGroup, x: object, y: object, index: int, after: int | None = None) -> Submitted:
    """Cuts `(x, y)` into the actors' microbatches and sends it as the step of 0-based index
    `index` (`ActorGroup.submit`); `after`: the call id of the step queued before it."""
    c = group.config
    return group.submit(prepare(x, y, c.dp, c.microbatches, group.loss_fn, group.model.vocab_size), index, after)


def train_step(group: ActorGroup, run: RunState, x: object, y: object) -> dict[str, Any] | None:
    """`Trainer.step`: one step submitted and booked; its metrics (None: halted). An interrupt
    while it runs lets the actors finish it and books it before re-raising, so `step_count` always
    matches the weights; one while its calls go out waits until all are out (`held_interrupts`).

    Raises:
        ActorDiedError, SaveFailed: as the `Outcome` says (`fit` recovers from them; a step does not).
    """
    sent: list[Submitted] = []
    try:
        with held_interrupts():
            sent.append(submit(group, x, y, run.step_count))
        outcome = book(group, run, sent[0])
    except KeyboardInterrupt:
        settle(group, run, sent)
        raise
    if outcome.error is not None:
        raise outcome.error
    return outcome.metrics


def book(group: ActorGroup, run: RunState, submitted: Submitted) -> Outcome:
    """Waits for a submitted step and books it: the step count, metrics, the dashboard's series,
    a due checkpoint, the loggers. A failure to recover from comes back as the outcome; any other
    (a timeout, a non-finite step that stops the run, a stage's error) is raised.

    Raises:
        StepTimeoutError: no action finished within `step_timeout` (the actors are stopped).
        NonFiniteError: a non-finite step with `TrainConfig.nonfinite="error"`.
    """
    try:
        result = submitted.wait(run.last_result_at)
    except ActorDiedError as died:
        submitted.done = True
        return Outcome(kind="died", error=died)
    except Exception as error:  # an interrupt leaves the step pending: `settle` waits for it
        submitted.done = True
        if isinstance(error, StepTimeoutError):
            stop(group, run)  # a stuck actor must not linger; the error names what it waited on
        raise
    submitted.done = True
    run.last_result_at = time.perf_counter()
    report = result.stage_reports[0]
    if report.halted:
        return Outcome(kind="halted")
    if report.skipped and stops_on_nonfinite(group.config):
        raise NonFiniteError(
            f"step {run.step_count + 1}: non-finite loss or gradients (microbatch losses "
            f"{[round(v, 4) for v in result.losses]}); the update was not applied, weights are those "
            f"after step {run.step_count}. Set TrainConfig.nonfinite='skip' to skip such steps."
        )
    run.step_count += 1
    metrics = recorded(group, run, submitted, result, report)
    queued = group.calls - submitted.call_id  # sent behind it (fit's overlap): they run as sent
    if run.advised_links is not group.links and links_advice.after_step(group, metrics, queued):  # a bound link
        run.advised_links = group.links
    every = group.config.checkpoint_every
    if every and run.step_count % every == 0:  # before the loggers: a logger never costs a checkpoint
        try:
            metrics["checkpoint"] = save_due(group, run, metrics, result.saved)
        except ActorDiedError as died:  # the step ran and counts; a recovery from memory does not replay it
            return Outcome(kind="died", error=died, metrics=metrics)
        except SaveFailed as failed:
            return Outcome(kind="save_failed", error=failed, metrics=metrics)
    run.loggers.log(run.step_count, scalars(metrics))
    return Outcome(kind="booked", metrics=metrics)


def recorded(
    group: ActorGroup, run: RunState, submitted: Submitted, result: StepResult, first: StepReport
) -> dict[str, object]:
    """A ran step's metrics (`Trainer.step`'s dict; `first`: the first stage's report), also on the
    dashboard and in the run's last events (`Trainer.timeline`)."""
    config = group.config
    lead_ranks = group.topology.lead_ranks()
    leads = [result.stage_reports[r] for r in lead_ranks]
    losses = result.losses if submitted.weights is None else [v * w for v, w in zip(result.losses, submitted.weights)]
    samples, tokens = result.batch or (submitted.samples, submitted.tokens)  # an actor-driven run's, else the driver's
    metrics = step_metrics(
        run.step_count, losses, result.seconds, samples, tokens, first, leads, config.precision == "fp16"
    )
    metrics["pp"], metrics["dp"] = config.pp, config.dp  # an elastic run's topology changes
    # the actors' first step since they started or were reconfigured: its time and bubbles include
    # first allocations and thread start-up, so the figures of later steps are the ones to read
    metrics["warmup"], group.warm = not group.warm, True
    reports = result.stage_reports.values() if isinstance(result.stage_reports, dict) else result.stage_reports
    sums = [m for r in reports if r.objective for m in r.objective]  # an objective's step (`objectives`)
    own = objectives.objective_for(config.objective).step_metrics(sums) if sums else {}
    own |= submitted.extra or {}  # a generation's figures (GRPO's)
    if "rows_s" in own and "tokens_per_s" in metrics:  # rows generated first: the throughput counts it all
        own["train_tokens_per_s"] = metrics["tokens_per_s"]
        metrics["tokens_per_s"] *= metrics["step_time"] / (metrics["step_time"] + own["rows_s"])
    if own:  # under TRL's names, at the top as TRL's trainers log them, and together for the loggers
        metrics |= own
        metrics["objective"] = own
    run.last_events, run.last_step_seconds = [r.events for r in leads], result.seconds
    run.record_on_dashboard(metrics, lead_ranks)
    return metrics


def save_due(group: ActorGroup, run: RunState, metrics: dict[str, object], written: Written | None = None) -> str:
    """Writes the checkpoint due after the step of `metrics` (or commits the one an actor-driven
    run `written`: its directory, each actor's part); returns where.

    Raises:
        SaveFailed: the save failed (disk full, a bucket error); the step itself stands.
        ActorDiedError: an actor died while saving (a recovery's matter).
    """
    try:
        return str(group.save(group.config.checkpoint_dir, run, written))
    except (ActorDiedError, KeyboardInterrupt):
        raise
    except Exception as error:  # noqa: BLE001
        raise SaveFailed(
            f"step {run.step_count}'s checkpoint could not be written: {type(error).__name__}: {error}", metrics
        ) from error


def settle(group: ActorGroup, run: RunState, queue: list[Submitted]) -> None:
    """Books the steps still queued when a step or `fit` stops early (an error, an interrupt):
    those behind a failed step were halted by the actors; the others ran and count, so
    `step_count` always matches the weights."""
    actor_runs.stop(group)  # an actor-driven run ends after its step under way
    for submitted in queue:
        if not submitted.done and group.running:
            try:
                book(group, run, submitted)
            except Exception:  # noqa: BLE001 - the error that stopped fit is the one to raise
                pass


def stop(group: ActorGroup, run: RunState) -> None:
    """Ends the run's actors and closes its loggers (a stuck step, a SIGTERM)."""
    group.shutdown()
    run.loggers.close()
