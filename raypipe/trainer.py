"""The Trainer: the driver-side object a script or a notebook holds.

It splits the layer specs into stages, starts one StageActor per stage, and runs
one optimizer step per `step(x, y)` call through the engine. It never builds the
whole model; `state_dict()` gathers the stages' weights under the keys
`nn.Sequential(*layers).state_dict()` would use.
"""

from __future__ import annotations

import math
import shutil
import time
import uuid
import warnings
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import ray
import torch

from raypipe import checkpoint as ckpt
from raypipe import runtime
from raypipe.actors.stage import StageActor, StageSettings
from raypipe.runtime.collective import group_backend
from raypipe.config import TrainConfig, nearest
from raypipe.runtime.compiled import CompiledStep
from raypipe.runtime.p2p import submit_step_p2p
from raypipe.runtime.refs import run_forward, run_step, submission_order
from raypipe.runtime.results import StepResult, gather, last_line
from raypipe.errors import (
    ActorDiedError,
    BatchError,
    ConfigError,
    NonFiniteError,
    PlacementError,
    RaypipeError,
    StageError,
    StepTimeoutError,
)
from raypipe.devices import ray_options
from raypipe.layers import LayerSpec, as_spec, parameter_counts
from raypipe.metrics import RayMetrics, TensorBoardLogger, stage_metrics
from raypipe.nn import ShardSpec, merge
from raypipe.nn.plan import check_stages_split, check_tensor_parallel
from raypipe.partition import Plan, make_plan
from raypipe.profile import PlanReport, profiled_plan
from raypipe.progress import Progress
from raypipe.schedules import build_schedule
from raypipe.timeline import Timeline

# Trainers of this process whose actors are running, named in placement errors.
_RUNNING: "weakref.WeakSet[Trainer]" = weakref.WeakSet()

# Fields a running trainer can change between steps; the others shape the actors.
RECONFIGURABLE = (
    "microbatches",
    "schedule",
    "optimizer",
    "lr_schedule",
    "grad_clip",
    "precision",
    "boundary_dtype",
    "zero",
    "dp_bucket_mb",
    "activation_checkpointing",
    "measure_activations",
    "step_timeout",
    "checkpoint_dir",
    "checkpoint_every",
    "keep_checkpoints",
    "max_restarts",
    "nonfinite",
    "log_dir",
)


class Trainer:
    """Trains a model given as a list of layer specs, split into pipeline stages on Ray actors.

    Args:
        layers: `LayerSpec`s or zero-argument callables returning `nn.Module`s, in order.
        loss_fn: `loss_fn(output, target) -> scalar tensor`, a mean over the microbatch.
        config: how to split and train; `TrainConfig()` when omitted.
        sample: a batch `(x, y)` like the training batches; needed by
            `partition="profile"`, which times every layer on one of its microbatches on
            each device kind and splits by the times (see `plan_report`).
        log: where the profiled plan is printed.

    Raises:
        ConfigError: the config does not fit the model (e.g. a bad shard plan).
        PlacementError: an actor could not be placed within `config.actor_start_timeout`.
        StageError: a stage failed to build its layers.
    """

    def __init__(
        self,
        layers: Sequence[LayerSpec | Callable[[], torch.nn.Module]],
        loss_fn: Callable[[torch.Tensor, Any], torch.Tensor],
        config: TrainConfig | None = None,
        sample: tuple[torch.Tensor, Any] | None = None,
        log: Callable[[str], None] = print,
    ) -> None:
        self.config = config if config is not None else TrainConfig()
        if not isinstance(self.config, TrainConfig):
            raise TypeError(f"config must be a TrainConfig, got {type(self.config).__name__}")
        if not callable(loss_fn):
            raise TypeError(f"loss_fn must be callable, got {loss_fn!r}")
        self.specs = [as_spec(layer, i) for i, layer in enumerate(layers)]
        if not self.specs:
            raise ConfigError("the model has no layers: pass at least one LayerSpec.")
        cfg = self.config
        profiled = cfg.partition == "profile" and cfg.shard_plan is None
        if profiled and sample is None:
            raise ConfigError(
                "TrainConfig.partition='profile' needs a sample batch to time the layers on: pass "
                "Trainer(..., sample=(x, y)) with a batch like those you will train on, or use "
                "partition='uniform' or 'parameters'."
            )
        counts = parameter_counts(self.specs) if cfg.partition == "parameters" and cfg.shard_plan is None else None
        # a profiled plan is replaced below, once the profilers ran; this one checks pp against the layers
        self.plan: Plan = make_plan(len(self.specs), cfg.pp, "uniform" if profiled else cfg.partition,
                                    cfg.shard_plan, counts)
        tp_splits = check_tensor_parallel(self.specs, cfg.tp)
        if not profiled:
            check_stages_split(tp_splits, self.plan, cfg.tp)
        self.plan_report: PlanReport | None = None
        self.run_name = cfg.name or f"run-{uuid.uuid4().hex[:8]}"
        self.step_count = 0
        self.restarts = 0
        self._calls = 0
        self._last_result_at = 0.0  # perf_counter() when the last step's result came back
        self._actors: list[Any] = []
        self._compiled: CompiledStep | None = None  # engine="compiled": built at the first step
        self._tensorboard: TensorBoardLogger | None = None
        self._last_events: list[list[tuple]] = []
        self._ray_metrics: RayMetrics | None = None
        self._set_schedule()

        # actors are laid out replica-major: rank = (d * pp + s) * tp + t, named "stage{s}-dp{d}-tp{t}"
        self.names = [
            f"stage{s}-dp{d}-tp{t}" for d in range(cfg.dp) for s in range(cfg.pp) for t in range(cfg.tp)
        ]
        self._loss_fn = loss_fn
        runtime.connect()
        runtime.ship_user_code(
            [loss_fn] + [s.factory for s in self.specs]
            + [type(a) for s in self.specs for a in (*s.args, *s.kwargs.values())]
        )
        if profiled:
            self.plan_report = self._profile_plan(*sample)
            self.plan = self.plan_report.plan
            log(str(self.plan_report))
            check_stages_split(tp_splits, self.plan, cfg.tp)
        self._replace_same_name()
        self._start_actors()

    # ----- public API -------------------------------------------------------------

    @property
    def num_stages(self) -> int:
        return len(self.plan)

    def _grid(self, flat: Sequence[Any]) -> list[list[list[Any]]]:
        """Actors (or names) by rank -> [replica][stage][tp rank]."""
        pp, tp = self.num_stages, self.config.tp
        return [
            [list(flat[self._rank(d, s, 0) : self._rank(d, s, 0) + tp]) for s in range(pp)]
            for d in range(len(flat) // (pp * tp))
        ]

    @property
    def _lead_ranks(self) -> list[int]:
        """Per stage, the rank of replica 0's tp rank 0: the actor whose timings stand for the stage."""
        return [self._rank(0, s, 0) for s in range(self.num_stages)]

    @property
    def stage_names(self) -> list[str]:
        """One actor name per stage (replica 0, tp rank 0), e.g. for labelling stages."""
        return [self.names[r] for r in self._lead_ranks]

    @property
    def _replicas(self) -> list[list[list[Any]]]:
        """Actors per data-parallel replica, per stage, per tp rank."""
        return self._grid(self._actors)

    @property
    def _stages(self) -> list[list[Any]]:
        """Replica 0's actors per stage (all tp ranks): weights and gradients are read from them."""
        return self._grid(self._actors)[0]

    def step(self, x: torch.Tensor, y: Any) -> dict[str, Any]:
        """Runs one optimizer step on the batch `(x, y)`, split into microbatches.

        Returns:
            A dict with `loss` (mean of the microbatch losses), `lr`, `grad_norm`
            (global, before clipping), `step_time` (s), `samples`, `samples_per_s`,
            `tokens` / `tokens_per_s` when `x` holds token ids, and `stages`: per
            stage `forward_s`, `backward_s`, `bubble` (idle fraction of the pipeline's
            compute window), `peak_memory_bytes`, `peak_stashed_microbatches` (kept
            for backward), `sent_bytes` (activations and input gradients sent to the
            neighbouring stages, in `config.boundary_dtype`) and, with
            `config.measure_activations`, `peak_stashed_bytes`.
            Written to TensorBoard when `config.log_dir` is set.

        Raises:
            BatchError: the batch cannot be split into dp x microbatches equal parts.
            StageError: an action failed on a stage (its message names stage and action).
            StepTimeoutError: no action finished for `config.step_timeout` seconds.
        """
        return self._complete(self._submit(x, y, self.step_count))

    def _submit(self, x: torch.Tensor, y: Any, index: int, after: int | None = None) -> "_Submitted":
        """Sends the step of 0-based index `index` on `(x, y)` (p2p engine) and returns while
        the actors run it; the other engines run it when it is waited for. `after`: the
        call id of the step queued before it."""
        if not self._actors:
            raise RaypipeError(f"{self!r} has no actors; build a new Trainer or call load() after a failure.")
        dp, m = self.config.dp, self.config.microbatches
        inputs, targets = self._split(x, y, dp * m)
        self._calls += 1
        split_inputs = [inputs[d * m : (d + 1) * m] for d in range(dp)]
        split_targets = [targets[d * m : (d + 1) * m] for d in range(dp)]
        args = (split_inputs, split_targets)
        timeout = self.config.step_timeout
        tokens = None if x.is_floating_point() else int(x.numel())
        call_id = self._calls
        topology = (self._replicas, self._grid(self.names), self._grid(range(len(self._actors))), self._schedule)
        if self.config.engine == "p2p":
            wait = submit_step_p2p(*topology, *args, call_id=call_id, step=index, timeout=timeout, after=after).result
        elif self.config.engine == "compiled":
            if self._compiled is None:
                self._compiled = CompiledStep(self._actors)

            def wait(since: float) -> StepResult:  # the other engines run the step while it is waited for
                return submit_step_p2p(*topology, *args, call_id=call_id, step=index, timeout=timeout,
                                       compiled=self._compiled).result(since)
        else:
            def wait(since: float) -> StepResult:
                return run_step(self._replicas, self._grid(self.names), self._schedule, *args,
                                call_id=call_id, step=index, timeout=timeout, order=self._order)
        return _Submitted(call_id, int(x.shape[0]), tokens, wait)

    def _complete(self, submitted: "_Submitted") -> dict[str, Any] | None:
        """Waits for a submitted step and books it: the step count, metrics, logs and a
        checkpoint when one is due. None when the actors halted it (a step queued behind
        one that failed)."""
        try:
            result = submitted.wait(self._last_result_at)
        except Exception as error:  # an interrupt leaves the step pending: `_settle` waits for it
            submitted.done = True
            if isinstance(error, StepTimeoutError):
                self.shutdown()  # a stuck actor must not linger; the error names what it waited on
            raise
        submitted.done = True
        self._last_result_at = time.perf_counter()
        report = result.stage_reports[0]
        if report.get("halted"):
            return None
        if report["skipped"] and self._stops_on_nonfinite:
            raise NonFiniteError(
                f"step {self.step_count + 1}: non-finite loss or gradients (microbatch losses "
                f"{[round(v, 4) for v in result.losses]}); the update was not applied, weights are those "
                f"after step {self.step_count}. Set TrainConfig.nonfinite='skip' to skip such steps."
            )
        self.step_count += 1
        samples = submitted.samples
        metrics = {
            "step": self.step_count,
            "loss": sum(result.losses) / len(result.losses),
            "lr": report["lr"],
            "grad_norm": report["grad_norm"],
            "step_time": result.seconds,
            "samples": samples,
            "samples_per_s": samples / result.seconds,
        }
        if submitted.tokens is not None:
            metrics["tokens"] = submitted.tokens
            metrics["tokens_per_s"] = submitted.tokens / result.seconds
        metrics["skipped"] = report["skipped"]
        leads = [result.stage_reports[r] for r in self._lead_ranks]
        metrics["stages"] = stage_metrics(leads)
        self._last_events = [r.get("events", []) for r in leads]
        if self.config.precision == "fp16":
            metrics["loss_scale"] = report["loss_scale"]
        if self._ray_metrics is None:
            self._ray_metrics = RayMetrics(self.run_name)
        self._ray_metrics.log(metrics, self._lead_ranks)
        if self.config.log_dir is not None:
            if self._tensorboard is None:
                self._tensorboard = TensorBoardLogger(self.config.log_dir)
            self._tensorboard.log(metrics)
        every = self.config.checkpoint_every
        if every and self.step_count % every == 0:
            metrics["checkpoint"] = str(self.save())
        return metrics

    def fit(
        self,
        batches: Callable[[int], tuple[torch.Tensor, Any]],
        steps: int,
        on_step: Callable[[dict[str, Any]], None] | None = None,
        log: Callable[[str], None] = print,
        progress: bool | Progress = False,
        overlap: bool | None = None,
    ) -> list[dict[str, Any]]:
        """Trains until `step_count == steps`, surviving actor deaths.

        Args:
            batches: `batches(step) -> (x, y)`, the batch of a 0-based step. It must be a
                function of the step alone, so steps replayed after a recovery see the
                same data.
            steps: the step count to reach.
            on_step: called with each step's metrics.
            log: where recovery messages go.
            progress: show a tqdm bar (terminal or notebook) with loss and tokens/s; or a
                `raypipe.progress.Progress` the caller made (and closes).
            overlap: keep the next step queued at the actors while the driver waits for
                the current one (engine "p2p"), so a step starts as soon as the last one
                ends instead of a driver round trip later. The default (None) overlaps
                when there is no `on_step`: with it, `on_step` sees a step's metrics while
                the next one already runs, so a callback that calls the trainer
                (`evaluate`, `save`, `reconfigure`) would act one step late; pass
                `overlap=True` when it only reads the metrics. Results are the same
                either way: a step that fails stops the one queued behind it on every
                actor, and no step is queued past a `checkpoint_every` save.

        Returns:
            The metrics of every step run by this call (replayed steps appear again).

        Raises:
            ActorDiedError: an actor died more than `config.max_restarts` times; the
                message says which, why, and where the last checkpoint is.
        """
        overlap = (on_step is None if overlap is None else overlap) and self.config.engine == "p2p"
        history = []
        bar = progress if isinstance(progress, Progress) else Progress(steps, self.step_count, bool(progress))
        log = bar.writer(log)
        queue: list[_Submitted] = []  # submitted, not yet booked; the first is the oldest
        try:
            while self.step_count < steps:
                if not queue:
                    queue.append(self._submit(*batches(self.step_count), self.step_count))
                ahead, every = self.step_count + len(queue), self.config.checkpoint_every
                if overlap and ahead < steps and not (every and ahead % every == 0):
                    queue.append(self._submit(*batches(ahead), ahead, after=queue[-1].call_id))
                try:
                    metrics = self._complete(queue[0])
                    queue.pop(0)
                except ActorDiedError as error:
                    queue.clear()  # their calls end with the actors being replaced
                    if self.restarts >= self.config.max_restarts:
                        where = self._last_checkpoint()
                        raise ActorDiedError(
                            f"{error} -- after {self.restarts} restarts (TrainConfig.max_restarts="
                            f"{self.config.max_restarts}); last checkpoint: {where or 'none'}",
                            actor=error.actor, cause=error.cause,
                        ) from None
                    self._recover(error, log)
                    bar.moved_to(self.step_count)
                    continue
                if metrics is None:
                    raise RaypipeError(f"step {self.step_count + 1} was halted by the actors, but the step "
                                       f"before it succeeded: please report this as a raypipe bug")
                history.append(metrics)
                bar.update(metrics)
                if on_step is not None:
                    on_step(metrics)
        finally:
            self._settle(queue)
            if bar is not progress:
                bar.close()
        return history

    def _settle(self, queue: list["_Submitted"]) -> None:
        """Books the steps still queued when `fit` stops early (an error, an interrupt):
        those behind a failed step were halted by the actors; the others ran and count,
        so `step_count` always matches the weights."""
        for submitted in queue:
            if not submitted.done and self._actors:
                try:
                    self._complete(submitted)
                except Exception:  # noqa: BLE001 - the error that stopped fit is the one to raise
                    pass

    def save(self, path: str | None = None) -> Path:
        """Saves weights, optimizer state, step and RNG state, all actors in lock-step.

        Args:
            path: the checkpoint root; `config.checkpoint_dir` when omitted.

        Returns:
            The checkpoint directory, `<root>/step-<N>`.
        """
        root = path or self.config.checkpoint_dir
        if root is None:
            raise ConfigError("Trainer.save needs a path, or TrainConfig.checkpoint_dir set.")
        partial = ckpt.begin(root, self.step_count)
        try:
            # every actor takes part: under ZeRO-1 each replica holds a share of the optimizer state
            parts = gather([a.save_checkpoint.remote(str(partial)) for a in self._actors], "save", self._actors, self.names)
        except BaseException:
            shutil.rmtree(partial, ignore_errors=True)
            raise
        files = {name: entry for part in parts for name, entry in part["files"].items()}
        meta = {
            "step": self.step_count,
            "data_position": self.step_count,  # batches are a function of the step
            "num_layers": len(self.specs),
            "pp": self.num_stages,
            "plan": [list(r) for r in self.plan],
            "loss_scaler": parts[0]["loss_scaler"],
            "run": self.run_name,
            "config": self.config.to_dict(),
        }
        return ckpt.commit(partial, files, meta, self.config.keep_checkpoints)

    def load(self, path: str, step: int | None = None, log: Callable[[str], None] = print) -> Path:
        """Restores a checkpoint saved by any topology; training continues from its step.

        Args:
            path: a checkpoint directory (`.../step-N`), or a root holding several, in
                which case the newest valid one is used (invalid ones are reported).
            step: with a root, the step to restore instead of the newest.

        Returns:
            The checkpoint directory restored.

        Raises:
            CheckpointError: nothing valid to restore (missing, truncated, altered files).
        """
        if step is not None:
            where, meta = ckpt.find_valid(path, step=step, warn=log)
        else:
            where, meta = ckpt.resolve(path, warn=log)
        if meta["num_layers"] != len(self.specs):
            raise ckpt.CheckpointError(
                f"{where} holds a {meta['num_layers']}-layer model; this trainer has {len(self.specs)} layers."
            )
        same_split = meta["plan"] == [list(r) for r in self.plan]
        gather(
            [a.load_checkpoint.remote(str(where), meta["loss_scaler"], same_split) for a in self._actors],
            "load", self._actors, self.names,
        )
        self.step_count = meta["step"]
        return where

    def evaluate(self, x: torch.Tensor, y: Any) -> float:
        """The mean loss on `(x, y)` without training (eval mode, no gradients, weights unchanged)."""
        inputs, targets = self._split(x, y, self.config.microbatches)
        losses = run_forward(self._stages, self._grid(self.names)[0], inputs, targets, self.config.step_timeout)
        return sum(losses) / len(losses)

    def predict(self, x: torch.Tensor) -> torch.Tensor:
        """The model's output for `x` (eval mode, no gradients), run through the pipeline."""
        inputs, _ = self._split(x, None, self.config.microbatches)
        return torch.cat(run_forward(self._stages, self._grid(self.names)[0], inputs, None, self.config.step_timeout))

    def timeline(self, planned: bool = False) -> Timeline:
        """The last step's schedule as each stage ran it (from the actors' own timestamps).

        With `planned=True`, the current schedule as planned instead, each forward and
        backward lasting what they took on average in the last step (1 and 2 ticks before
        any step). Save it with `.save("t.svg" | "t.png" | "t.json")`; a notebook shows it inline.
        """
        c = self.config
        names = self.stage_names
        if not planned:
            if not self._last_events:
                raise RaypipeError("no step has run yet: call step() first, or timeline(planned=True).")
            return Timeline.measured(self._last_events, f"{c.schedule}, pp={c.pp}, m={c.microbatches}: "
                                     f"step {self.step_count} as measured", names)
        fwd, bwd, unit = [1.0] * self.num_stages, [2.0] * self.num_stages, "ticks"
        if self._last_events:
            unit = "ms"
            for s, events in enumerate(self._last_events):
                for kind, durations in (("F", fwd), ("B", bwd)):
                    spans = [1000 * (e[3] - e[2]) for e in events if e[0] == kind]
                    durations[s] = sum(spans) / len(spans) if spans else 0.0
        planned_line = Timeline.planned(self._schedule, fwd, bwd, f"{c.schedule}, pp={c.pp}, m={c.microbatches}: planned", unit)
        planned_line.stage_names = names
        return planned_line

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The full model's weights, keyed as `nn.Sequential(*layers).state_dict()`.

        Tensor-parallel shards are merged, so the result is the same for any pp, dp and tp.
        """
        return self._merged("state_dict")

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Loads full-model weights (keys as `state_dict()` gives them) into every stage.

        Raises:
            KeyError: a key names no layer of this model, or a stage's key is missing.
        """
        parts: list[dict[str, torch.Tensor]] = [{} for _ in self.plan]
        stray = []
        for key, value in state.items():
            index = key.split(".", 1)[0]
            stage = self._stage_of(int(index)) if index.isdigit() else None
            if stage is None:
                stray.append(key)
            else:
                parts[stage][key] = value
        if stray:
            raise KeyError(
                f"load_state_dict: keys {stray[:5]} name no layer of this {len(self.specs)}-layer "
                f"model; keys look like '<layer index>.<parameter>', as state_dict() gives them."
            )
        tp = self.config.tp
        try:
            gather([a.load_state_dict.remote(parts[(i // tp) % self.num_stages]) for i, a in enumerate(self._actors)],
                   "load_state_dict")
        except StageError as error:
            raise KeyError(str(error)) from None

    def gradients(self) -> dict[str, torch.Tensor]:
        """The last step's gradients, keyed like `state_dict()` (as the optimizer used them)."""
        return self._merged("gradients")

    def _merged(self, method: str) -> dict[str, torch.Tensor]:
        """Calls `method` on replica 0's actors and merges tensor-parallel shards by key."""
        ranks = self._stages
        calls = [getattr(a, method).remote() for stage in ranks for a in stage]
        specs_refs = [stage[0].tensor_shards.remote() for stage in ranks] if self.config.tp > 1 else []
        values = gather(calls + specs_refs, method)
        parts, specs = values[: len(calls)], {}
        for part in values[len(calls) :]:
            specs.update(part)
        tp = self.config.tp
        merged: dict[str, torch.Tensor] = {}
        for s in range(len(ranks)):
            shards = parts[s * tp : (s + 1) * tp]
            for key, value in shards[0].items():
                spec = specs.get(key)
                merged[key] = merge([p[key] for p in shards], ShardSpec(*spec)) if spec else value
        return merged

    def reconfigure(self, **changes: Any) -> None:
        """Changes training settings between steps, keeping the actors and weights.

        Fields: those in `RECONFIGURABLE` (microbatches, schedule, optimizer,
        lr_schedule, grad_clip, precision, boundary_dtype, zero, activation_checkpointing,
        and the timeout, checkpoint, restart and non-finite policies). Optimizer state is
        kept when the optimizer's name stays the same (its hyperparameters are updated in
        place; switching `zero` re-shards it across the dp replicas) and reset when it changes.

        Raises:
            ConfigError: for a field that needs a new Trainer (pp, shard_plan, ...) or a bad value.
        """
        fixed = [k for k in changes if k not in RECONFIGURABLE]
        if fixed:
            names = TrainConfig.field_names()
            if fixed[0] in names:
                raise ConfigError(
                    f"TrainConfig.{fixed[0]} cannot change on a running trainer (it decides the "
                    f"actors); shut this one down and build a new Trainer. Changeable: {', '.join(RECONFIGURABLE)}."
                )
            raise ConfigError(f"unknown field {fixed[0]!r}.{nearest(fixed[0], names)}")
        self.config = self.config.replace(**changes)
        self._set_schedule()
        self._configure_actors()

    def reset_optimizer(self) -> None:
        """Drops every stage's optimizer state (momentum, Adam moments, loss scale)."""
        self._configure_actors(reset_optimizer=True)

    def stage_info(self) -> list[dict[str, Any]]:
        """Per actor (replica by replica): name, layer range, parameters, node id, pid, device, threads."""
        return gather([a.info.remote() for a in self._actors], "stage_info")

    def shutdown(self) -> None:
        """Stops every actor this trainer started. Safe to call twice."""
        if self._compiled is not None:
            self._compiled.teardown()
            self._compiled = None
        _kill(self._actors)
        self._actors = []
        if getattr(self, "_tensorboard", None) is not None:
            self._tensorboard.close()
            self._tensorboard = None
        _RUNNING.discard(self)
        if hasattr(self, "_finalizer"):
            self._finalizer.detach()

    def __enter__(self) -> "Trainer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        c = self.config
        return (
            f"Trainer(run={self.run_name!r}, pp={c.pp}, dp={c.dp}, tp={c.tp}, schedule={c.schedule!r}, "
            f"microbatches={c.microbatches}, plan={self.plan}, steps={self.step_count}, "
            f"{'running' if self._actors else 'shut down'})"
        )

    # ----- internals ----------------------------------------------------------------

    def _set_schedule(self) -> None:
        self._schedule = build_schedule(self.config.schedule, self.config.pp, self.config.microbatches)
        self._order = submission_order(self._schedule)

    @property
    def _stops_on_nonfinite(self) -> bool:
        """A non-finite step raises NonFiniteError (fp16 skips such steps as part of loss scaling)."""
        return self.config.nonfinite == "error" and self.config.precision != "fp16"

    def _settings(self) -> StageSettings:
        c = self.config
        return StageSettings(
            microbatches=c.microbatches,
            optimizer=dict(c.optimizer),
            lr_schedule=dict(c.lr_schedule),
            grad_clip=c.grad_clip,
            precision=c.precision,
            boundary_dtype=c.boundary_dtype,
            activation_checkpointing=c.activation_checkpointing,
            measure_activations=c.measure_activations,
            zero=c.zero,
            dp_bucket_bytes=max(1, int(c.dp_bucket_mb * 2**20)),
            stop_on_nonfinite=self._stops_on_nonfinite,
        )

    def _configure_actors(self, reset_optimizer: bool = False) -> None:
        settings = self._settings()
        gather([a.configure.remote(settings, reset_optimizer) for a in self._actors], "configure")

    def _cpus_per_actor(self) -> float:
        if self.config.cpus_per_actor is not None:
            return float(self.config.cpus_per_actor)
        total = ray.cluster_resources().get("CPU", 1.0)
        return min(1.0, int(100 * total / len(self.names)) / 100) or 0.01

    def _start_actors(self) -> None:
        cfg = self.config
        cpus = self._cpus_per_actor()
        threads = cfg.threads_per_actor or max(1, int(cpus))
        remote_cls = ray.remote(StageActor)
        for rank, name in enumerate(self.names):
            d, s, t = self._place(rank)
            start, end = self.plan[s]
            self._actors.append(
                remote_cls.options(
                    name=name,
                    namespace=f"raypipe-{self.run_name}",
                    num_cpus=cpus,
                    max_restarts=0,
                    max_task_retries=0,
                    **self._placement(s),
                ).remote(
                    s, cfg.pp, self.specs[start:end], start, cfg.seed, threads,
                    self._loss_fn if s == cfg.pp - 1 else None, name, d, cfg.dp, t, cfg.tp,
                    self._stage_kinds[s], cfg.allow_cpu_fallback,
                )
            )
        try:
            self._wait_for_actors(cpus)
            if cfg.dp > 1 or cfg.tp > 1 or (cfg.engine != "refs" and cfg.pp > 1):
                self._join_world()
            self._configure_actors()
        except BaseException:
            self.shutdown()
            raise
        # a trainer dropped without shutdown() (a re-run notebook cell) frees its actors
        self._finalizer = weakref.finalize(self, _kill, list(self._actors))
        self._finalizer.atexit = False  # at exit Ray ends the actors with the driver
        _RUNNING.add(self)

    def _replace_same_name(self) -> None:
        """Shuts down a running trainer of this process with the same run name.

        Its actors hold the names this one needs; in a notebook this is the trainer
        of the cell being run again.
        """
        for other in list(_RUNNING):
            if other is not self and other.run_name == self.run_name and other._actors:
                warnings.warn(f"raypipe: shutting down the running trainer named {self.run_name!r} of this "
                              f"process to reuse its name ({other!r})", stacklevel=3)
                other.shutdown()

    @property
    def _stage_kinds(self) -> list[str]:
        return self.config.stage_kinds()

    def _profile_plan(self, x: torch.Tensor, y: Any) -> PlanReport:
        """Times every layer on each device kind of the run and splits by those times."""
        cfg = self.config
        inputs, targets = self._split(x, y, cfg.dp * cfg.microbatches)
        return profiled_plan(self.specs, self._loss_fn, inputs[0], targets[0], cfg, self._cpus_per_actor())

    def _placement(self, stage: int) -> dict[str, Any]:
        """Ray options placing a stage on a node of its accelerator kind (none for cpu)."""
        return ray_options(self._stage_kinds[stage], self.config.gpus_per_actor)

    def _place(self, rank: int) -> tuple[int, int, int]:
        """(dp replica, stage, tp rank) of an actor rank; the inverse of `_rank`."""
        pp, tp = self.config.pp, self.config.tp
        return rank // (pp * tp), (rank // tp) % pp, rank % tp

    def _rank(self, d: int, s: int, t: int) -> int:
        """The actor rank of replica d, stage s, tp rank t (replica-major, then stage, then tp)."""
        return (d * self.config.pp + s) * self.config.tp + t

    def _join_world(self) -> None:
        """Rendezvous through Ray: rank 0 publishes an address, every actor joins the world.

        Each actor is in one dp group (its stage and tp rank across replicas) and one tp
        group (its stage's ranks within its replica); the groups overlap in membership.
        """
        pp, dp, tp = self.config.pp, self.config.dp, self.config.tp
        address, port = gather([self._actors[0].rendezvous_address.remote()], "rendezvous")[0]
        dp_groups = [[self._rank(d, s, t) for d in range(dp)] for s in range(pp) for t in range(tp)]
        tp_groups = [[self._rank(d, s, t) for t in range(tp)] for d in range(dp) for s in range(pp)]
        groups = [g for g in dp_groups + tp_groups if len(g) > 1]
        backends = [group_backend([self._devices[r] for r in g]) for g in groups]
        joins = []
        for r, actor in enumerate(self._actors):
            d, s, t = self._place(r)
            neighbours = [self._rank(d, n, t) for n in (s - 1, s + 1) if 0 <= n < pp]
            joins.append(actor.join.remote(
                address, port, len(self._actors), r, groups, dp_groups[s * tp + t], tp_groups[d * pp + s],
                self.config.step_timeout, backends, neighbours, self.config.same_node_transport,
            ))
        gather(joins, "rendezvous", self._actors, self.names)

    def _recover(self, error: ActorDiedError, log: Callable[[str], None]) -> None:
        """Replaces every actor and restores the last valid checkpoint (or the initial weights)."""
        self.restarts += 1
        started = time.monotonic()
        log(f"raypipe: {error}; restart {self.restarts} of {self.config.max_restarts}")
        self.shutdown()
        self._start_actors()
        where = self._last_checkpoint()
        if where is not None:
            self.load(str(where), log=log)
        else:
            self.step_count = 0  # new actors start from the initial weights
        log(
            f"raypipe: resumed at step {self.step_count} from {where or 'the initial weights'} "
            f"in {time.monotonic() - started:.1f} s"
        )

    def _last_checkpoint(self) -> Path | None:
        if self.config.checkpoint_dir is None:
            return None
        try:
            return ckpt.find_valid(self.config.checkpoint_dir, warn=lambda _: None)[0]
        except ckpt.CheckpointError:
            return None

    def _wait_for_actors(self, cpus: float) -> None:
        refs = [a.info.remote() for a in self._actors]
        deadline = time.monotonic() + self.config.actor_start_timeout
        pending = list(refs)
        devices: list[str] = [""] * len(refs)
        while pending:
            ready, pending = ray.wait(pending, num_returns=len(pending), timeout=max(0.0, deadline - time.monotonic()))
            for ref in ready:
                rank = refs.index(ref)
                try:
                    devices[rank] = ray.get(ref)["device"]
                except ray.exceptions.RayActorError as error:
                    raise StageError(
                        f"{self.names[rank]} (layers {self.plan[self._place(rank)[1]]}) could not start: "
                        f"{last_line(error)}"
                    ) from None
            if pending and time.monotonic() >= deadline:
                waiting = [self.names[refs.index(r)] for r in pending]
                asked = "; ".join(
                    f"{n} (stage {self._place(self.names.index(n))[1]}) asked for "
                    f"{ {'CPU': cpus, **self._placement(self._place(self.names.index(n))[1])} }"
                    for n in waiting[:6]
                )
                others = [repr(t) for t in list(_RUNNING) if t is not self and t._actors]
                hint = (
                    f" Other trainers of this process still hold actors: {'; '.join(others)}; "
                    f"call .shutdown() on those you are done with."
                    if others else ""
                )
                for ref in pending:  # never leave a pending actor behind
                    ray.kill(self._actors[refs.index(ref)], no_restart=True)
                raise PlacementError(
                    f"actors {waiting} were not placed within {self.config.actor_start_timeout:.0f} s "
                    f"(TrainConfig.actor_start_timeout): {asked}. The cluster offers: {_cluster_offer()}; "
                    f"{ray.available_resources()} free in all. Free resources, lower cpus_per_actor or "
                    f"gpus_per_actor, add a node of the missing kind (`ray start ... $(raypipe node-resources)`), "
                    f"or change TrainConfig.devices.{hint}"
                )
        self._devices = devices  # each actor's torch device, which picks its groups' backends

    def _split(self, x: torch.Tensor, y: Any, parts: int) -> tuple[list[torch.Tensor], list[Any]]:
        """Splits a batch into `parts` equal chunks (dp replicas x microbatches for a step)."""
        if not torch.is_tensor(x):
            raise BatchError(f"x must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() == 0:
            raise BatchError("x must have a batch dimension (dim 0)")
        batch = x.shape[0]
        if torch.is_tensor(y) and (y.dim() == 0 or y.shape[0] != batch):
            raise BatchError(
                f"x has {batch} samples but y has shape {tuple(y.shape)}: give one target per sample (y.shape[0] == {batch})."
            )
        if y is None:
            parts = math.gcd(batch, parts)  # inference: any split works
        elif batch % parts:
            dp, m = self.config.dp, self.config.microbatches
            into = f"dp={dp} x microbatches={m} = {parts}" if parts == dp * m and dp > 1 else f"microbatches={parts}"
            options = [d for d in range(1, batch + 1) if batch % d == 0]
            raise BatchError(
                f"a batch of {batch} samples cannot be split into {into} equal parts: "
                f"use a batch size divisible by {parts} (e.g. {max(parts, batch - batch % parts)})"
                + (f", or microbatches in {options}." if dp == 1 else ".")
            )
        # clone: a view would carry the whole batch's storage through the object store
        inputs = [c.clone() for c in x.split(batch // parts)]
        targets = [c.clone() for c in y.split(batch // parts)] if torch.is_tensor(y) else [y] * len(inputs)
        return inputs, targets

    def _stage_of(self, layer: int) -> int | None:
        for s, (start, end) in enumerate(self.plan):
            if start <= layer < end:
                return s
        return None


def _cluster_offer() -> str:
    """Each alive node's CPUs, GPUs, accelerator resources and raypipe labels, for placement errors."""
    parts = []
    for node in ray.nodes():
        if not node.get("Alive"):
            continue
        res = {k: v for k, v in sorted(node.get("Resources", {}).items()) if k in ("CPU", "GPU", "cuda", "rocm", "mps")}
        labels = {k: v for k, v in (node.get("Labels") or {}).items() if k.startswith("raypipe.io/")}
        parts.append(f"node {node['NodeID'][:8]} {res}{' ' + str(labels) if labels else ''}")
    return "; ".join(parts) or "no alive nodes"


def _kill(actors: Sequence[Any]) -> None:
    for actor in actors:
        try:
            ray.kill(actor, no_restart=True)
        except Exception:  # already dead, or Ray already shut down
            pass


@dataclass
class _Submitted:
    """A step sent to the actors and not yet booked by `Trainer._complete`."""

    call_id: int
    samples: int
    tokens: int | None  # token ids in the batch; None for float inputs
    wait: Callable[[float], StepResult]  # wait(since) -> the step's result
    done: bool = False
