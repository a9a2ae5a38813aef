"""The Trainer: the driver-side object a script or a notebook holds.

It splits the layer specs into stages, starts one StageActor per stage, and runs
one optimizer step per `step(x, y)` call through the engine. It never builds the
whole model; `state_dict()` gathers the stages' weights under the keys
`nn.Sequential(*layers).state_dict()` would use.
"""

from __future__ import annotations

import functools
import os
import threading
import uuid
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, Concatenate, ParamSpec, TypeVar

import torch

from raypipe.checkpoint import lock as root_lock
from raypipe.checkpoint.storage import is_uri
from raypipe.config import TrainConfig, check_reconfigurable
from raypipe.core.errors import ConfigError
from raypipe.core.layers import LayerSpec, LossFunction
from raypipe.driver import adapter_io, chunks, export, planned, whole_weights
from raypipe.driver.actor_group import ActorGroup
from raypipe.driver.cluster import live_trainers
from raypipe.driver.feeds import make_feed
from raypipe.driver.inference import forward
from raypipe.driver.inference.objective import objective_batch
from raypipe.driver.links import replan
from raypipe.driver.run import chunk_trial, controller
from raypipe.driver.run import step as one_step
from raypipe.driver.run_state import RunState
from raypipe.models.model import Model, resolve
from raypipe.observe.loggers import Loggers, run_params
from raypipe.observe.progress import Progress
from raypipe.observe.timeline import Timeline
from raypipe.planning.links import Link

if TYPE_CHECKING:
    import numpy as np
    from ray.data import Dataset

P = ParamSpec("P")
R = TypeVar("R")


def _one_call_at_a_time(method: Callable[Concatenate[Trainer, P], R]) -> Callable[Concatenate[Trainer, P], R]:
    """Makes a Trainer method wait for any other thread's call to the actors to end first: every
    actor must receive the steps in one order (two threads' `step`s interleaved at the actors
    would train one stage on one batch's activations and the next on another's targets)."""

    @functools.wraps(method)
    def serialised(self: Trainer, *args: P.args, **kwargs: P.kwargs) -> R:
        with self._one_call:
            return method(self, *args, **kwargs)

    return serialised


def driver_path(path: str | os.PathLike) -> str:
    """A local path as the driver means it (absolute, from the driver's working directory, which a
    notebook or script may have changed since Ray started the actors in theirs); a URI as given."""
    return str(path) if is_uri(path) else os.path.abspath(os.fspath(path))


def as_given(given: str | os.PathLike | None, path: Path) -> Path:
    """`path`, found under `driver_path(given)`, in the form the caller gave: relative to the working
    directory when `given` was a relative path (`save("runs/x")` returns `runs/x/step-<N>`); as it is
    when nothing was given (the config's directory)."""
    if not given or is_uri(given) or os.path.isabs(os.fspath(given)):
        return path
    return Path(os.path.relpath(path))


class Trainer:
    """Trains a model given as a list of layer specs, split into pipeline stages on Ray actors.

    Args:
        layers: `LayerSpec`s or zero-argument callables returning `nn.Module`s, in order; or a
            model object (`raypipe.models.model.Model`, e.g. from `raypipe.models.hf.from_pretrained`)
            carrying its layers, loss and tied weights.
        loss_fn: `loss_fn(output, target) -> scalar tensor`, a mean over the microbatch; a
            model object's own loss when omitted.
        config: how to split and train; `TrainConfig()` when omitted.
        sample: a batch `(x, y)` like the training batches; needed by `partition="profile"` and
            `schedule="auto"`, which time every layer on its microbatches on each device kind
            and split (and choose) by the times (see `plan_report`).
        log: where the profiled plan is printed.

    From several threads, its calls that reach the actors (`step`, `fit`, `save`, ...) take turns.

    Raises:
        ConfigError: the config does not fit the model (e.g. a bad shard plan).
        PlacementError: an actor could not be placed within `config.actor_start_timeout`.
        StageError: a stage failed to build its layers.
    """

    def __init__(
        self,
        layers: Sequence[LayerSpec | Callable[[], torch.nn.Module]] | Model,
        loss_fn: LossFunction | None = None,
        config: TrainConfig | None = None,
        sample: tuple[object, object] | None = None,
        log: Callable[[str], None] = print,
    ) -> None:
        self._one_call = threading.RLock()  # `_one_call_at_a_time`; re-entrant: on_step may evaluate
        config = config if config is not None else TrainConfig()
        if not isinstance(config, TrainConfig):
            raise TypeError(f"config must be a TrainConfig, got {type(config).__name__}")
        self.model, loss_fn, self.specs, config = resolve(layers, loss_fn, config)
        run_id = uuid.uuid4().hex  # a resume takes its checkpoint's as the trainer starts
        run_name = config.name or f"run-{run_id[:8]}"  # a new run's TensorBoard folder ends with the same hex
        #: this process's hold on `config.checkpoint_dir` while the trainer lives (`raypipe.checkpoint.lock`)
        self.root_lock = live_trainers.hold_root(config.checkpoint_dir, run_name, self)  # released with the trainer
        try:
            _start(self, config, loss_fn, sample, run_name, run_id, log)
        except BaseException:
            root_lock.release(self.root_lock)
            raise

    # ----- the run and its actors, as a script reads them ----------------------------

    config = property(lambda self: self.group.config, doc="The run's settings (`reconfigure` changes them).")
    plan = property(lambda self: self.group.plan, doc="The layer range [start, end) of each (virtual) stage.")
    plan_report = property(lambda self: self.group.report, doc="A profiled plan's timings and predictions, or None.")
    topology = property(lambda self: self.group.topology, doc="Which actor is which stage, replica, tp rank.")
    names = property(lambda self: self.group.names, doc='Every actor\'s name, rank order: "stage{s}-dp{d}-tp{t}".')
    run_name = property(lambda self: self.state.run_name, doc="The run's name (`config.name`, or `run-<hex>`).")
    run_id = property(lambda self: self.state.run_id, doc="The run's identity in its checkpoints; a load takes theirs.")
    restored_from = property(lambda self: self.state.restored_from, doc="The checkpoint last loaded, and its step.")
    restarts = property(lambda self: self.state.restarts, doc="Recoveries and save retries spent of max_restarts.")
    loggers = property(lambda self: self.state.loggers, doc="The loggers `config.loggers` names.")
    step_count = property(
        lambda self: self.state.step_count,
        lambda self, value: setattr(self.state, "step_count", value),
        doc="Optimizer steps applied so far (a load sets it to the checkpoint's step).",
    )

    # ----- public API -------------------------------------------------------------

    num_stages = property(lambda self: self.config.pp, doc="Pipeline stages (pp).")
    stage_names = property(
        lambda self: [self.names[r] for r in self.topology.lead_ranks()],
        doc="One actor name per stage (replica 0, tp rank 0), e.g. for labelling stages.",
    )

    @_one_call_at_a_time
    def step(self, x: object, y: object = None) -> dict[str, Any]:
        """Runs one optimizer step on the batch `(x, y)`, split into microbatches (`fit` batches are the same).

        `x` is a tensor, or a tuple or dict of them (`{"input_ids": ..., "attention_mask": ...}`), cut along dim 0;
        or a list of the step's microbatches (dp x microbatches of them, whose shapes may differ) with a list `y`
        of their targets. Under `config.objective` pair records (DPO) or a generation batch (GRPO): docs/preference.md.

        Returns:
            A dict with `loss` (mean of the microbatch losses), `lr`, `grad_norm` (global, before clipping),
            `step_time` (s), `samples`, `samples_per_s`, `tokens` / `tokens_per_s` when `x` holds token ids, `pp`
            and `dp` (the topology it ran on), `warmup` (True for the actors' first step since they started
            or were reconfigured: its time and bubbles include first allocations, so read later steps'), and
            `stages`: per stage its timings, bubble, memory, bytes sent (`metrics.stage_metrics`). Recorded
            by `config.loggers`.

        Raises:
            BatchError: the batch cannot be split into dp x microbatches equal parts.
            StageError: an action failed on a stage (its message names stage and action).
            StepTimeoutError: no action finished for `config.step_timeout` seconds.
        """
        x, y = objective_batch(self.group, x) if self.config.objective else (x, y)  # pairs or a generation batch: rows
        return one_step.train_step(self.group, self.state, x, y)

    @_one_call_at_a_time
    def fit(
        self,
        batches: Callable[[int], tuple[object, object]] | Iterable[tuple[object, object]] | Dataset,
        steps: int,
        on_step: Callable[[dict[str, Any]], None] | None = None,
        log: Callable[[str], None] = print,
        progress: bool | Progress = False,
        overlap: bool | None = None,
        batch_size: int | None = None,
        collate: Callable[[dict[str, np.ndarray]], tuple[object, object]] | None = None,
    ) -> list[dict[str, Any]]:
        """Trains until `step_count == steps`, surviving actor deaths.

        Args:
            batches: `batches(step) -> (x, y)`, the batch of a 0-based step, a function of the step
                alone (steps replayed after a recovery see the same data); or an iterable of
                `(x, y)`, batch k for step k; or a `ray.data.Dataset` read `batch_size` rows a step,
                in order, beside the actors: its batches never pass through the driver
                (`raypipe.driver.feeds`; `collate(numpy columns) -> (x, y)`, by default columns
                x and y, or input_ids and labels, or input_ids alone as next-token sequences).
            steps: the step count to reach.
            on_step: called with each step's metrics.
            log: where recovery messages go.
            progress: show a tqdm bar (terminal or notebook) with loss and tokens/s; or a
                `raypipe.observe.progress.Progress` the caller made (and closes).
            overlap: keep the next step queued at the actors while the driver waits for the current
                one (engine "p2p"; the same results). None: when there is no `on_step`, which would
                otherwise see a step's metrics while the next one runs (True if it only reads them).

        Returns:
            The metrics of every step run by this call (replayed steps appear again).

        Raises:
            ActorDiedError: an actor died more than `config.max_restarts` times; the
                message says which, why, and where the last checkpoint is.
        """
        feed = make_feed(self.group, batches, batch_size, collate)
        return controller.fit_with(self.group, self.state, feed, steps, on_step, log, progress, overlap)

    def log(self, values: dict[str, float], step: int | None = None) -> None:
        """Records your own scalars (`{"val/loss": 1.2}`) with `config.loggers` at `step` (default: steps taken)."""
        self.loggers.log(self.step_count if step is None else step, {k: float(v) for k, v in values.items()})

    @_one_call_at_a_time
    def save(self, path: str | None = None) -> Path:
        """Saves weights, optimizer state, step and RNG state, all actors in lock-step, under
        `path` (`config.checkpoint_dir` when omitted; a directory or a URI); returns `<root>/step-<N>`."""
        root = driver_path(path) if path else self.config.checkpoint_dir
        if root is None:
            raise ConfigError("Trainer.save needs a path, or TrainConfig.checkpoint_dir set.")
        return as_given(path, self.group.save(root, self.state))

    @_one_call_at_a_time
    def load(self, path: str, step: int | None = None, log: Callable[[str], None] = print) -> Path:
        """Restores a checkpoint saved by any topology; training continues from its step.

        `path` is a checkpoint directory (`.../step-N`) or a root holding several: the newest valid one
        (or `step`'s) is restored, invalid ones reported; it continues the run that saved it (its run id;
        `checkpoints.set_aside_future`). Returns the directory.

        Raises:
            CheckpointError: nothing valid to restore (missing, truncated, altered files), or a
                checkpoint that does not fit the model (then nothing was loaded: all or nothing).
        """
        return as_given(path, self.group.load(driver_path(path), step, self.state, log))

    @_one_call_at_a_time
    def evaluate(self, x: torch.Tensor, y: object) -> float:
        """The mean loss on `(x, y)` without training (eval mode, no gradients, weights unchanged)."""
        with self.group.whole_weights():
            return forward.evaluate(self.group, x, y)

    @_one_call_at_a_time
    def predict(self, x: torch.Tensor) -> torch.Tensor:
        """The model's output for `x` (eval mode, no gradients), run through the pipeline."""
        with self.group.whole_weights():
            return forward.predict(self.group, x)

    def timeline(self, planned: bool = False) -> Timeline:
        """The last step's schedule as each stage ran it (from the actors' own timestamps), with
        `.breakdown` saying where its time went (`raypipe.observe.step_breakdown`). With `planned=True`,
        the current schedule as planned instead, each forward and backward lasting what they took
        on average in the last step (1 and 2 ticks before any step). Save it with
        `.save("t.svg" | "t.png" | "t.json")`; a notebook shows it inline."""
        c, state = self.config, self.state
        when = "planned" if planned else f"step {self.step_count} as measured"
        title = f"{c.schedule}, pp={c.pp}, m={c.microbatches}: {when}"
        args = (self.group.schedule, state.last_events, title, self.stage_names, planned, state.last_step_seconds)
        return Timeline.of_run(*args)

    @_one_call_at_a_time
    def save_pretrained(self, directory: str, merge_adapters: bool = False) -> Path:
        """Writes the model in its library's format (`driver.export`: a directory transformers loads,
        for its models and the reference GPT), LoRA adapters folded in with `merge_adapters`."""
        stages = chunks.inference_group(self.topology, self.group.actors, self.names)[0]  # with the ep ranks' experts
        with self.group.whole_weights():
            export.save_pretrained(
                self.model, stages, self.specs, driver_path(directory), self.config.tp, merge_adapters
            )
        return Path(directory)

    @_one_call_at_a_time
    def save_adapter(self, directory: str) -> Path:
        """Writes the LoRA adapters in peft's format (`peft.PeftModel.from_pretrained(base, dir)`)."""
        with self.group.whole_weights():
            adapter_io.save(self.group.replica0()[0], self.model, self.config.lora, driver_path(directory))
        return Path(directory)

    @_one_call_at_a_time
    def load_adapter(self, directory: str) -> None:
        """Loads LoRA adapters in peft's format into every stage (training continues from them)."""
        load = functools.partial(adapter_io.load_group, directory=driver_path(directory))
        load(self.group)
        self.state.loads.append((self.step_count, f"the adapters loaded from {directory}", load))  # for a recovery

    @_one_call_at_a_time
    def generate(
        self,
        input_ids: torch.Tensor,
        max_new_tokens: int = 20,
        temperature: float = 0.0,
        top_k: int | None = None,
        attention_mask: torch.Tensor | None = None,
        eos_token_id: int | None = None,
        seed: int | None = None,
        top_p: float = 1.0,
    ) -> torch.Tensor:
        """The prompt `input_ids` followed by up to `max_new_tokens` tokens generated through the pipeline:
        greedy by default, else sampled at `temperature` from the `top_k` most likely, then the `top_p`
        nucleus (`driver.inference.generation`). The model's output must be logits (batch, sequence, vocab)."""
        from raypipe.driver.inference.generation import generate_on

        label = f"generating {input_ids.shape[0]} row{'s' if input_ids.shape[0] > 1 else ''}"
        how = (max_new_tokens, temperature, top_k, self.model.kv_cache, attention_mask, eos_token_id, seed, top_p)
        return generate_on(self.group, label, input_ids, *how)

    @_one_call_at_a_time
    def state_dict(self, keys: str = "raypipe") -> dict[str, torch.Tensor]:
        """The full model's weights, keyed as `nn.Sequential(*layers).state_dict()` (`keys="transformers"`:
        a transformers model's by transformers' own names), tp shards and ep experts merged."""
        with self.group.whole_weights():
            state = whole_weights.merged_replicas(
                self.topology.grid(self.group.actors), "state_dict", self.config.tp, self.config.ep
            )
        return whole_weights.named(state, keys, self.model, self.specs)

    @_one_call_at_a_time
    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Loads full-model weights (keys as `state_dict()` gives them) into every stage.

        Raises:
            KeyError: a key names no layer of this model, or a stage's key is missing.
        """
        load = functools.partial(whole_weights.load_group, state=state)
        load(self.group)
        self.state.loads.append((self.step_count, "the state dict loaded", load))  # what a recovery restores

    @_one_call_at_a_time
    def gradients(self) -> dict[str, torch.Tensor]:
        """The last step's gradients, keyed like `state_dict()` (as the optimizer used them)."""
        with self.group.whole_weights(gradients=True):
            return whole_weights.merged_replicas(
                self.topology.grid(self.group.actors), "gradients", self.config.tp, self.config.ep
            )

    @_one_call_at_a_time
    def reconfigure(self, **changes: object) -> None:
        """Changes training settings between steps, keeping the actors and weights.

        Fields: those in `raypipe.config.validation.RECONFIGURABLE` (microbatches, schedule, optimizer,
        precision, zero, ... and the timeout, checkpoint, restart and non-finite policies). Optimizer
        state is kept while the optimizer's name stays (hyperparameters updated in place).

        Raises:
            ConfigError: for a field that needs a new Trainer (pp, shard_plan, ...) or a bad value.
        """
        check_reconfigurable(changes, self.config)
        new = self.config.replace(**replan.with_chosen_warmup(self.group, changes))
        with root_lock.moving(self.root_lock, new.checkpoint_dir, self.run_name) as held:  # refused if in use
            self.group.reconfigure(new)
        self.root_lock = held

    @_one_call_at_a_time
    def reset_optimizer(self) -> None:
        """Drops every stage's optimizer state (momentum, Adam moments, loss scale)."""
        self.group.configure(reset_optimizer=True)

    @_one_call_at_a_time
    def stage_info(self) -> list[dict[str, Any]]:
        """Per actor: name, layers, node, device, threads, `links` and `link_rates` (`ActorGroup.info`)."""
        return self.group.info()

    @_one_call_at_a_time
    def links(self) -> list[Link]:
        """Measures now both ways of each link between neighbouring stages on different nodes (`links.measure`)."""
        return self.group.measure_links()

    def shutdown(self) -> None:
        """Stops every actor this trainer started and closes its loggers. Safe to call twice."""
        self.group.shutdown()
        self.loggers.close()
        live_trainers.discard(self)
        root_lock.release(self.root_lock)

    def __enter__(self) -> Trainer:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:  # `with Trainer(...) as t:` shuts down on leaving
        if error is not None:  # the loggers record a run that ended in an error as such
            self.loggers.ended(error)
        self.shutdown()

    def __repr__(self) -> str:
        c, running = self.config, "running" if self.group.running else "shut down"
        return (
            f"Trainer(run={self.run_name!r}, pp={c.pp}, dp={c.dp}, tp={c.tp}, schedule={c.schedule!r}, "
            f"microbatches={c.microbatches}, plan={self.plan}, steps={self.step_count}, {running})"
        )


def _start(
    trainer: Trainer,
    config: TrainConfig,
    loss_fn: Callable,
    sample: tuple[object, object] | None,
    run_name: str,
    run_id: str,
    log: Callable,
) -> None:
    """Plans `trainer`'s run, starts its actors and, with `config.resume`, loads its checkpoint."""
    asked = config  # before "auto" is chosen: the links may choose again
    config, plan, report = planned.plan(trainer.specs, loss_fn, config, sample, log, trainer.model)
    #: the running actors: names, topology, schedule, engine; every call that reaches them
    trainer.group = ActorGroup(config, trainer.specs, plan, loss_fn, run_name, trainer.model, log)
    trainer.group.report = report
    #: the run's identity, progress and records (step count, restarts, loggers)
    trainer.state = RunState(
        run_name,
        run_id,
        Loggers(config, run_name, lambda: run_params(trainer.config, run_name, trainer.plan, trainer.run_id)),
    )
    live_trainers.replace_same_name(run_name, trainer)
    trainer.group.start()  # and measures the links between its stages (`config.probe_links`)
    live_trainers.add(trainer)
    if report is not None:  # a profiled plan: made again for the links measured
        replan.follow_links(trainer.group, asked, log)
    if asked.extra_warmup is None and asked.schedule != "auto":  # "auto" weighs it on the measured links
        trainer.group.warmup_chosen = replan.overlap_links(trainer.group, log)
    if asked.sequence_chunks == "auto" and sample is not None:  # the planner's k, timed against none
        chunk_trial.settle(trainer.group, trainer.state.step_count, sample, log)
    if config.resume is not False and config.checkpoint_dir is not None:  # the config needs both
        try:
            trainer.load(config.checkpoint_dir, step=None if config.resume is True else config.resume, log=log)
        except BaseException:
            trainer.shutdown()
            raise
