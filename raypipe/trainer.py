"""The Trainer: the driver-side object a script or a notebook holds.

It splits the layer specs into stages, starts one StageActor per stage, and runs
one optimizer step per `step(x, y)` call through the engine. It never builds the
whole model; `state_dict()` gathers the stages' weights under the keys
`nn.Sequential(*layers).state_dict()` would use.
"""

from __future__ import annotations

import uuid
import weakref
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from raypipe import driver
from raypipe.actors.settings import StageSettings, check_reconfigurable
from raypipe.config import TrainConfig
from raypipe.data.batches import loss_weights, split_batch
from raypipe.driver import checkpoints, chunks, fitting, placement, registry, weights
from raypipe.driver.engines import Engine, make_engine
from raypipe.driver.engines.refs import run_forward, submission_order
from raypipe.driver.feeds import make_feed
from raypipe.driver.results import gather
from raypipe.driver.topology import Topology
from raypipe.errors import ConfigError
from raypipe.layers import LayerSpec
from raypipe.loggers import Loggers, run_params
from raypipe.metrics import RayMetrics
from raypipe.model import Model, resolve
from raypipe.nn.plan import check_stages_split
from raypipe.planning.autoschedule import plan_run
from raypipe.planning.partition import first_plan
from raypipe.planning.profiling import PlanReport
from raypipe.progress import Progress
from raypipe.schedules import build_schedule
from raypipe.timeline import Timeline


class Trainer:
    """Trains a model given as a list of layer specs, split into pipeline stages on Ray actors.

    Args:
        layers: `LayerSpec`s or zero-argument callables returning `nn.Module`s, in order; or a
            model object (`raypipe.model.Model`, e.g. from `raypipe.models.hf.from_pretrained`)
            carrying its layers, loss and tied weights.
        loss_fn: `loss_fn(output, target) -> scalar tensor`, a mean over the microbatch; a
            model object's own loss when omitted.
        config: how to split and train; `TrainConfig()` when omitted.
        sample: a batch `(x, y)` like the training batches; needed by `partition="profile"` and
            `schedule="auto"`, which time every layer on its microbatches on each device kind
            and split (and choose) by the times (see `plan_report`).
        log: where the profiled plan is printed.

    Raises:
        ConfigError: the config does not fit the model (e.g. a bad shard plan).
        PlacementError: an actor could not be placed within `config.actor_start_timeout`.
        StageError: a stage failed to build its layers.
    """

    def __init__(
        self,
        layers: Sequence[LayerSpec | Callable[[], torch.nn.Module]] | Model,
        loss_fn: Callable[[torch.Tensor, Any], torch.Tensor] | None = None,
        config: TrainConfig | None = None,
        sample: tuple[torch.Tensor, Any] | None = None,
        log: Callable[[str], None] = print,
    ) -> None:
        self.config = config if config is not None else TrainConfig()
        if not isinstance(self.config, TrainConfig):
            raise TypeError(f"config must be a TrainConfig, got {type(self.config).__name__}")
        self.model, loss_fn, self.specs, self.config = resolve(layers, loss_fn, self.config)
        cfg = self.config
        checkpoints.check_new_run(cfg.checkpoint_dir, cfg.resume)  # before any actor (the profiler's too) starts
        self.plan, tp_splits, profiled = first_plan(self.specs, cfg, sample is not None)
        self.plan_report: PlanReport | None = None
        self.run_name = cfg.name or f"run-{uuid.uuid4().hex[:8]}"
        self.run_id = uuid.uuid4().hex  # the run's identity in its checkpoints; a resume takes the resumed run's
        self.restored_from: tuple[Path, int] | None = None  # the checkpoint last loaded, and its step
        self.step_count = self.restarts = self._calls = 0
        self._last_result_at = 0.0  # perf_counter() when the last step's result came back
        self._actors: list[Any] = []
        self._engine: Engine = make_engine(cfg.engine)
        self.loggers = Loggers(cfg, self.run_name, lambda: run_params(self.config, self.run_name, self.plan))
        self._last_events: list[list[tuple]] = []
        self._ray_metrics: RayMetrics | None = None
        self.topology = Topology(cfg.pp, cfg.dp, cfg.tp, cfg.ep)  # rank = (d * pp + s) * tp + t
        self.names = self.topology.names()  # "stage{s}-dp{d}-tp{t}"
        self._loss_fn = loss_fn
        driver.connect()
        driver.ship_user_code(
            [loss_fn]
            + [s.factory for s in self.specs]
            + [type(a) for s in self.specs for a in (*s.args, *s.kwargs.values())]
        )
        if profiled:  # time every layer on each device kind of the run and split by those times
            self.config, self.plan_report = plan_run(
                self.specs, loss_fn, sample, cfg, placement.cpus_per_actor(cfg, len(self.names)), log
            )
            self.plan = self.plan_report.plan
            check_stages_split(tp_splits, self.plan, cfg.tp)
        self._set_schedule()
        registry.replace_same_name(self)
        self._start_actors()
        if cfg.resume is not False:
            try:
                self.load(cfg.checkpoint_dir, step=None if cfg.resume is True else cfg.resume, log=log)
            except BaseException:
                self.shutdown()
                raise

    # ----- public API -------------------------------------------------------------

    @property
    def num_stages(self) -> int:
        return self.config.pp

    @property
    def stage_names(self) -> list[str]:
        """One actor name per stage (replica 0, tp rank 0), e.g. for labelling stages."""
        return [self.names[r] for r in self.topology.lead_ranks()]

    def step(self, x: torch.Tensor, y: Any) -> dict[str, Any]:
        """Runs one optimizer step on the batch `(x, y)`, split into microbatches.

        `x` is a tensor, or a tuple or dict of them (`{"input_ids": ..., "attention_mask": ...}`),
        cut along dim 0; or a list of the step's microbatches (dp x microbatches of them, whose
        shapes may differ) with a list `y` of their targets.

        Returns:
            A dict with `loss` (mean of the microbatch losses), `lr`, `grad_norm` (global,
            before clipping), `step_time` (s), `samples`, `samples_per_s`, `tokens` /
            `tokens_per_s` when `x` holds token ids, and `stages`: per stage its timings, bubble,
            memory and bytes sent (`raypipe.metrics.stage_metrics`). Recorded by `config.loggers`.

        Raises:
            BatchError: the batch cannot be split into dp x microbatches equal parts.
            StageError: an action failed on a stage (its message names stage and action).
            StepTimeoutError: no action finished for `config.step_timeout` seconds.
        """
        return fitting.step(self, x, y)

    def fit(
        self,
        batches: Callable[[int], tuple[torch.Tensor, Any]] | Iterable[tuple[torch.Tensor, Any]] | Any,
        steps: int,
        on_step: Callable[[dict[str, Any]], None] | None = None,
        log: Callable[[str], None] = print,
        progress: bool | Progress = False,
        overlap: bool | None = None,
        batch_size: int | None = None,
        collate: Callable[[dict[str, Any]], tuple[Any, Any]] | None = None,
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
                `raypipe.progress.Progress` the caller made (and closes).
            overlap: keep the next step queued at the actors while the driver waits for the current
                one (engine "p2p"; the same results). None: when there is no `on_step`, which would
                otherwise see a step's metrics while the next one runs (True if it only reads them).

        Returns:
            The metrics of every step run by this call (replayed steps appear again).

        Raises:
            ActorDiedError: an actor died more than `config.max_restarts` times; the
                message says which, why, and where the last checkpoint is.
        """
        overlap = (on_step is None if overlap is None else overlap) and self.config.engine == "p2p"
        bar = progress if isinstance(progress, Progress) else Progress(steps, self.step_count, bool(progress))
        feed = make_feed(self, batches, batch_size, collate)
        try:
            return fitting.fit(self, feed, steps, on_step, bar.writer(log), bar, overlap)
        finally:
            feed.close()
            if bar is not progress:
                bar.close()

    def log(self, values: dict[str, float], step: int | None = None) -> None:
        """Records your own scalars (`{"val/loss": 1.2}`) with `config.loggers` at `step` (default: steps taken)."""
        self.loggers.log(self.step_count if step is None else step, {k: float(v) for k, v in values.items()})

    def save(self, path: str | None = None) -> Path:
        """Saves weights, optimizer state, step and RNG state, all actors in lock-step, under
        `path` (`config.checkpoint_dir` when omitted; a directory or a URI); returns `<root>/step-<N>`."""
        root = path or self.config.checkpoint_dir
        if root is None:
            raise ConfigError("Trainer.save needs a path, or TrainConfig.checkpoint_dir set.")
        meta = checkpoints.run_meta(
            self.step_count,
            len(self.specs),
            self.plan,
            self.run_name,
            self.run_id,
            self.config,
            self.model.identity() if self.config.lora else None,
        )
        return checkpoints.save(self._actors, self.names, root, self.step_count, meta, self.config.keep_checkpoints)

    def load(self, path: str, step: int | None = None, log: Callable[[str], None] = print) -> Path:
        """Restores a checkpoint saved by any topology; training continues from its step.

        `path` is a checkpoint directory (`.../step-N`) or a root holding several: the newest
        valid one (or `step`'s) is restored, invalid ones are reported. Returns the directory.

        It continues the run that saved it (its run id; `checkpoints.set_aside_future`).

        Raises:
            CheckpointError: nothing valid to restore (missing, truncated, altered files), or a
                checkpoint that does not fit the model (then nothing was loaded: all or nothing).
        """
        where, meta = checkpoints.load(
            self._actors,
            self.names,
            path,
            step,
            len(self.specs),
            self.plan,
            log,
            self.model.identity() if self.config.lora else None,
            self.config.optimizer.get("name"),
        )
        self.step_count = meta["step"]
        self.run_id = meta.get("run_id") or self.run_id  # checkpoints from before run ids: this run goes on
        self.restored_from = (where, self.step_count)
        checkpoints.set_aside_future(self.config.checkpoint_dir, self.run_id, self.step_count, log)
        return where

    def evaluate(self, x: torch.Tensor, y: Any) -> float:
        """The mean loss on `(x, y)` without training (eval mode, no gradients, weights unchanged)."""
        inputs, targets = self._split(x, y, self.config.microbatches)
        losses = run_forward(*self._inference_path(), inputs, targets, self.config.step_timeout)
        weights = loss_weights(self._loss_fn, [targets])  # a loss over counted tokens: their mean
        return sum(v * w for v, w in zip(losses, weights[0] if weights else [1.0] * len(losses))) / len(losses)

    def predict(self, x: torch.Tensor) -> torch.Tensor:
        """The model's output for `x` (eval mode, no gradients), run through the pipeline."""
        inputs, _ = self._split(x, None, self.config.microbatches)
        return torch.cat(run_forward(*self._inference_path(), inputs, None, self.config.step_timeout))

    def timeline(self, planned: bool = False) -> Timeline:
        """The last step's schedule as each stage ran it (from the actors' own timestamps).

        With `planned=True`, the current schedule as planned instead, each forward and
        backward lasting what they took on average in the last step (1 and 2 ticks before
        any step). Save it with `.save("t.svg" | "t.png" | "t.json")`; a notebook shows it inline.
        """
        c = self.config
        title = f"{c.schedule}, pp={c.pp}, m={c.microbatches}: " + (
            "planned" if planned else f"step {self.step_count} as measured"
        )
        return Timeline.of_run(self._schedule, self._last_events, title, self.stage_names, planned)

    def save_pretrained(self, directory: str, merge_adapters: bool = False) -> Path:
        """Writes the model in its library's format (`Model.save_pretrained`: a directory transformers
        loads, for its models and the reference GPT), LoRA adapters folded in with `merge_adapters`."""
        stages = chunks.inference_group(self.topology, self._actors, self.names)[0]  # with the ep ranks' experts
        self.model.save_pretrained(stages, self.specs, str(directory), self.config.tp, merge_adapters)
        return Path(directory)

    def save_adapter(self, directory: str) -> Path:
        """Writes the LoRA adapters in peft's format (`peft.PeftModel.from_pretrained(base, dir)`)."""
        from raypipe.models.hf import adapters

        adapters.save(self._replica0()[0], self.specs, self.model, self.config.lora, str(directory))
        return Path(directory)

    def load_adapter(self, directory: str) -> None:
        """Loads LoRA adapters in peft's format into every stage (training continues from them)."""
        from raypipe.models.hf import adapters

        adapters.load(
            self._actors,
            self._replica0()[0],
            self.specs,
            self.model,
            chunks.actor_plan(self.plan, self._schedule),
            str(directory),
        )

    def generate(
        self,
        input_ids: torch.Tensor,
        max_new_tokens: int = 20,
        temperature: float = 0.0,
        top_k: int | None = None,
        attention_mask: torch.Tensor | None = None,
        eos_token_id: int | None = None,
        seed: int | None = None,
    ) -> torch.Tensor:
        """The prompt `input_ids` followed by up to `max_new_tokens` tokens generated through the
        pipeline: greedy by default, else sampled at `temperature` from the `top_k` most likely
        (`raypipe.driver.generation`). The model's output must be logits (batch, sequence, vocab)."""
        from raypipe.driver.generation import generate

        return generate(
            *self._inference_path(),
            input_ids,
            max_new_tokens,
            temperature,
            top_k,
            self.model.kv_cache,
            self.config.step_timeout,
            attention_mask,
            eos_token_id,
            seed,
        )

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The full model's weights, keyed as `nn.Sequential(*layers).state_dict()`, tp shards and ep experts merged."""
        return weights.merged_replicas(self.topology.grid(self._actors), "state_dict", self.config.tp, self.config.ep)

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Loads full-model weights (keys as `state_dict()` gives them) into every stage.

        Raises:
            KeyError: a key names no layer of this model, or a stage's key is missing.
        """
        weights.load_into(self._actors, state, chunks.actor_plan(self.plan, self._schedule), self.config.tp)

    def gradients(self) -> dict[str, torch.Tensor]:
        """The last step's gradients, keyed like `state_dict()` (as the optimizer used them)."""
        return weights.merged_replicas(self.topology.grid(self._actors), "gradients", self.config.tp, self.config.ep)

    def reconfigure(self, **changes: Any) -> None:
        """Changes training settings between steps, keeping the actors and weights.

        Fields: those in `raypipe.actors.settings.RECONFIGURABLE` (microbatches, schedule, optimizer,
        precision, zero, ... and the timeout, checkpoint, restart and non-finite policies). Optimizer
        state is kept while the optimizer's name stays (hyperparameters updated in place).

        Raises:
            ConfigError: for a field that needs a new Trainer (pp, shard_plan, ...) or a bad value.
        """
        check_reconfigurable(changes)
        config = self.config.replace(**changes)
        self._set_schedule(config)  # refuses other chunks before anything changes
        self.config = config
        self._configure_actors()

    def reset_optimizer(self) -> None:
        """Drops every stage's optimizer state (momentum, Adam moments, loss scale)."""
        self._configure_actors(reset_optimizer=True)

    def stage_info(self) -> list[dict[str, Any]]:
        """Per actor: name, layers, parameters, node, pid, device, threads, `links` (neighbour -> transport)."""
        return placement.name_links(gather([a.info.remote() for a in self._actors], "stage_info"), self.names)

    def shutdown(self) -> None:
        """Stops every actor this trainer started. Safe to call twice."""
        self._engine.close()
        placement.kill(self._actors)
        self._actors = []
        self.loggers.close()
        registry.discard(self)
        if hasattr(self, "_finalizer"):
            self._finalizer.detach()

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, *exc: Any) -> None:  # `with Trainer(...) as t:` shuts down on leaving
        if exc[1] is not None:  # the loggers record a run that ended in an error as such
            self.loggers.ended(exc[1])
        self.shutdown()

    def __repr__(self) -> str:
        c = self.config
        return (
            f"Trainer(run={self.run_name!r}, pp={c.pp}, dp={c.dp}, tp={c.tp}, schedule={c.schedule!r}, "
            f"microbatches={c.microbatches}, plan={self.plan}, steps={self.step_count}, "
            f"{'running' if self._actors else 'shut down'})"
        )

    # ----- internals ----------------------------------------------------------------

    def _replica0(self) -> tuple[list[list[Any]], list[list[str]]]:
        """Replica 0's actors and their names, per stage and tp rank: where inference runs."""
        return self.topology.grid(self._actors)[0], self.topology.grid(self.names)[0]

    def _inference_path(self) -> tuple[list, list, list[int] | None]:
        return chunks.inference_path(*chunks.inference_group(self.topology, self._actors, self.names), self._schedule)

    def _set_schedule(self, config: TrainConfig | None = None) -> None:
        c = config or self.config
        schedule = build_schedule(c.schedule, c.pp, c.microbatches, c.chunks)
        if self._actors:
            chunks.check_same_layout(self._schedule, schedule, c.schedule)
        self._schedule, self._order = schedule, submission_order(schedule)

    def _configure_actors(self, reset_optimizer: bool = False) -> None:
        settings = StageSettings.from_config(self.config)
        gather([a.configure.remote(settings, reset_optimizer) for a in self._actors], "configure")

    def _start_actors(self) -> None:
        """Starts, places and joins every actor; a failure stops those already started."""
        self._engine = make_engine(self.config.engine)
        self._actors = placement.start_gang(
            self.config,
            self.topology,
            self.names,
            self.specs,
            self.plan,
            self._schedule,
            self._loss_fn,
            self.run_name,
            lambda: registry.others_holding_actors(self),
            self.model.tied,
        )
        try:
            self._configure_actors()
        except BaseException:
            self.shutdown()
            raise
        # a trainer dropped without shutdown() (a re-run notebook cell) frees its actors
        self._finalizer = weakref.finalize(self, placement.kill, list(self._actors))
        self._finalizer.atexit = False  # at exit Ray ends the actors with the driver
        registry.add(self)

    def _split(self, x: torch.Tensor, y: Any, parts: int) -> tuple[list[torch.Tensor], list[Any]]:  # dp x m parts
        return split_batch(x, y, parts, self.config.dp, self.config.microbatches)
