"""The main job: train a model on a local corpus, from one YAML file.

A job file holds the TrainConfig fields (optionally in sections) plus three job
sections: `model` (the reference GPT's fields, or `hf:` a transformers model:
`raypipe.models.registry`), `data` (where tokens come from) and `job` (steps, batch
size, logging, export). `raypipe train FILE` and `examples/train.py` run it.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from raypipe.checkpoint import layout as ckpt
from raypipe.checkpoint.storage import redact_values
from raypipe.config import TrainConfig, apply_overrides, load_yaml
from raypipe.config.checks import check_whole_number
from raypipe.config.settings import ObjectiveSettings
from raypipe.core.errors import ConfigError, RaypipeError, nearest
from raypipe.data import TokenDataset
from raypipe.data.job_source import DataConfig
from raypipe.driver import outputs
from raypipe.driver.run import ending
from raypipe.models.registry import JobModel, job_model
from raypipe.observe.progress import Progress
from raypipe.planning.partition import is_profiled


@dataclass(frozen=True)
class JobSettings:
    """How long to train and how to report.

    Attributes:
        steps: optimizer steps to run.
        batch_size: samples per step (split into microbatches).
        log_every: print a line every this many steps.
        eval_every: compute validation loss every this many steps (0: only at the end).
        eval_batches: batches averaged for a validation loss.
        sample_tokens: tokens to sample from the trained model at the end (0: none).
        progress: a live progress bar on a terminal or in a notebook; plain log lines
            either way, and only those where no one watches a terminal (`ray job submit`).
        save_pretrained: a directory to export the trained model to in its library's format
            (transformers models; `Trainer.save_pretrained`), or None.
        prompt: the text samples continue; sample_before: also sample before training.
        save_adapter: in a LoRA run, a directory for the adapters in peft's format (and
            save_pretrained then writes the model with the adapters merged in).
    """

    steps: int = 200
    batch_size: int = 16
    log_every: int = 10
    eval_every: int = 0
    eval_batches: int = 4
    sample_tokens: int = 200
    progress: bool = True
    save_pretrained: str | None = None
    prompt: str = "def "
    sample_before: bool = False
    save_adapter: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.progress, bool):
            raise ConfigError(f"job.progress={self.progress!r} is invalid: give true or false.")
        for f in dataclasses.fields(self):
            if f.name in ("progress", "save_pretrained", "prompt", "sample_before", "save_adapter"):
                continue
            minimum = 1 if f.name in ("steps", "batch_size", "log_every", "eval_batches") else 0
            check_whole_number(f"job.{f.name}", getattr(self, f.name), minimum)


@dataclass
class JobConfig:
    """A whole job: model, data, job settings and the training config."""

    model: JobModel = field(default_factory=lambda: job_model(None))
    data: DataConfig = field(default_factory=DataConfig)
    job: JobSettings = field(default_factory=JobSettings)
    train: TrainConfig = field(default_factory=TrainConfig)

    @classmethod
    def from_yaml(cls, path: str | Path, overrides: Iterable[str] = ()) -> JobConfig:
        """Loads a job file, applying `key=value` overrides (e.g. `model.n_layer=2`, `pp=1`)."""
        raw = apply_overrides(load_yaml(path), overrides)
        return cls(
            model=job_model(raw.get("model")),
            data=_section(DataConfig, "data", raw.get("data")),
            job=_section(JobSettings, "job", raw.get("job")),
            train=TrainConfig.from_dict(raw),
        )


def _section(cls: type, name: str, values: Mapping[str, Any] | None) -> Any:
    values = dict(values or {})
    names = [f.name for f in dataclasses.fields(cls)]
    for key in values:
        if key not in names:
            raise ConfigError(f"unknown field {name}.{key}: {name} takes {', '.join(names)}.{nearest(str(key), names)}")
    return cls(**values)


def run(
    config: JobConfig,
    log: Callable[[str], None] = print,
    resume: bool = False,
    resume_step: int | None = None,
    on_metrics: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Trains the job's model as its config says and reports progress through `log`.

    Args:
        resume: continue from the newest valid checkpoint in `checkpoint_dir`.
        resume_step: continue from the checkpoint of this step.
        on_metrics: called with every step's metrics (`Trainer.step`'s dict), while the
            next step already runs (`Trainer.fit(overlap=True)`).

    Returns:
        A summary: the per-step losses, the first and last validation loss, mean tokens/s.
    """
    from raypipe.trainer import Trainer

    model, job, train = config.model, config.job, config.train
    train, job, root, why = outputs.durable(train, job)  # relative outputs that outlive a `ray job submit`
    if any(p is not None for p in (train.checkpoint_dir, train.log_dir, job.save_pretrained, job.save_adapter)):
        log(f"raypipe: outputs under {root} ({why})")
    if (resume or resume_step is not None) and train.checkpoint_dir is None:
        raise ConfigError("resuming needs checkpoint_dir in the config (or --set checkpoint_dir=PATH).")
    if resume or resume_step is not None:
        train = train.replace(resume=True if resume_step is None else resume_step)
    if train.resume is not False and train.checkpoint_dir is not None:  # fail before any actor starts
        ckpt.find_valid(train.checkpoint_dir, step=None if train.resume is True else train.resume, warn=lambda _: None)
    records = _objective_data(config.data.source, train.objective)  # the objective's records ("pairs", "prompts")
    tokenizer = model.tokenizer() if config.data.source in ("sft", "pairs", "prompts") else None
    if (
        records and train.objective is not None and train.objective.get("tokenizer", "") is None
    ):  # an objective's scoring reads text (GRPO's rewards)
        train = train.replace(objective={**train.objective, "tokenizer": tokenizer})
    dataset = config.data.dataset(model.block_size, tokenizer)
    train_set, val_set = dataset.split(config.data.val_fraction) if config.data.val_fraction else (dataset, None)
    val_set = None if records else val_set  # DPO and GRPO runs report their rewards instead of a validation loss

    def batch(data: Any, k: int, seed: int) -> Any:
        if records:  # the step's pair records, or a generation batch's prompt records: the trainer does the rest
            return data.batch(k, job.batch_size, seed=seed)
        x, y = data.batch(k, job.batch_size, seed=seed)
        return (x, model.targets(x, y)) if isinstance(data, TokenDataset) else (x, y)  # SFT: labels as given

    log(
        f"raypipe: {model.describe()}; "
        f"{len(train_set):,} training tokens; pp={train.pp}, dp={train.dp}{f' (ep={train.ep})' if train.ep > 1 else ''}, tp={train.tp}, schedule={train.schedule}, "  # noqa: E501
        f"microbatches={train.microbatches}"
        f"{f', sequence_chunks={train.sequence_chunks}' if train.sequence_chunks != 1 else ''}, "
        f"batch {job.batch_size} x {model.block_size} tokens"
    )
    losses: list[float] = []
    rates: list[float] = []
    margins: list[float] = []  # a DPO run's rewards/margins, step by step
    rewards: list[float] = []  # a GRPO run's mean reward, generation batch by generation batch
    window: list[dict[str, Any]] = []  # the objective's figures of each step since the last log line

    def on_step(metrics: dict[str, Any]) -> None:
        step = metrics["step"]
        losses.append(metrics["loss"])
        if "rewards/margins" in metrics:
            margins.append(metrics["rewards/margins"])
        if "generation_s" in metrics:
            rewards.append(metrics["reward"])
        if on_metrics is not None:
            on_metrics(metrics)
        if not metrics["warmup"]:  # a warm-up step's time includes first allocations: not in the rate
            rates.append(metrics["tokens_per_s"])
        window.append(metrics.get("objective", {}))
        if step % job.log_every == 0 or len(losses) == 1 or step == job.steps:
            log(
                f"step {step:4d} | loss {metrics['loss']:.4f} | lr {metrics['lr']:.2e} | "
                f"grad norm {metrics['grad_norm']:.3f} | {metrics['tokens_per_s']:,.0f} tok/s | "
                f"{1000 * metrics['step_time']:.0f} ms"
                + _objective_line(train.objective, metrics, window)
                + (" | warm-up" if metrics["warmup"] else "")
            )
            window.clear()
        if "checkpoint" in metrics:
            log(f"step {step:4d} | saved {metrics['checkpoint']}")

    if config.data.uses_ray_data() and train.cpus_per_actor is None:
        train = _leave_a_cpu_for_ray_data(train)
    profile_batch = batch(train_set, 0, train.seed) if is_profiled(train) else None
    with Trainer(model.build(), config=train, sample=profile_batch, log=log) as trainer:
        trainer.loggers.add_params(
            {
                "model": model.describe(),
                "data": redact_values(dataclasses.asdict(config.data)),
                "job": dataclasses.asdict(job),
            }
        )
        for line in outputs.watch_lines(trainer.run_name, train.log_dir):
            log(line)
        lead = [i for i in trainer.stage_info() if i["dp_rank"] == 0 and i["tp_rank"] == 0]
        held = [i["layers"] if isinstance(i["layers"], list) else [i["layers"]] for i in lead]  # ranges: model chunks
        log(
            "stages: "
            + ", ".join(
                f"{i['name']} layers " + " + ".join(f"[{a}, {b})" for a, b in ranges) for i, ranges in zip(lead, held)
            )
        )
        if len(trainer.names) > trainer.num_stages:
            ep = f" (ep {train.ep}: each MoE layer's experts split over {train.ep} replicas)" if train.ep > 1 else ""
            log(
                f"actors: {len(trainer.names)} = pp {train.pp} x dp {train.dp} x tp {train.tp}{ep}: {', '.join(trainer.names)}"  # noqa: E501
            )
        if trainer.restored_from is not None:  # TrainConfig.resume: the trainer restored it as it started
            log(f"resumed from {trainer.restored_from[0]} at step {trainer.step_count}")
        validation = (lambda: _validation_loss(trainer, lambda k: batch(val_set, k, 12345), job)) if val_set else None
        first_val = validation() if validation else None
        if job.sample_before and job.sample_tokens:
            log("sample before training:\n" + _sample(trainer, config))
        if first_val is not None:
            log(f"step {trainer.step_count:4d} | val loss {first_val:.4f}")
        source = lambda step: batch(train_set, step, train.seed)  # noqa: E731 - made and cut on the driver
        if config.data.uses_ray_data():
            from raypipe.data.ray_source import token_batches

            x, y = train_set.batch(0, 1, train.seed)
            source = token_batches(train_set, job.batch_size, train.seed, job.steps, model.targets(x, y) is x)
            log(f"data: {job.steps} batches through Ray Data, cut beside the actors (data.reader={config.data.reader})")
        started = time.perf_counter()
        bar = Progress(job.steps, trainer.step_count, job.progress)
        plain_log, log = log, bar.writer(log)
        evals = range(job.eval_every, job.steps, job.eval_every) if val_set and job.eval_every else ()
        try:
            # on_step only reads the metrics, so fit may keep the next step queued (overlap); it
            # stops at each evaluation, which must see the weights of that step and no later
            for stop in [*evals, job.steps]:
                if trainer.step_count >= stop:
                    continue
                trainer.fit(source, stop, on_step, log, progress=bar, overlap=True, batch_size=job.batch_size)
                if stop < job.steps:
                    log(f"step {stop:4d} | val loss {validation():.4f}")
        finally:
            bar.close()
            log = plain_log
        elapsed = time.perf_counter() - started
        went = trainer.timeline().breakdown if trainer.state.last_events else None  # before evaluation
        final = ending.save_last(trainer.group, trainer.state)  # a normal end leaves its last step saved
        if final is not None:
            log(f"step {trainer.step_count:4d} | the last step's checkpoint: {final}")
        last_val = validation() if validation else None
        if last_val is not None:
            log(f"step {job.steps:4d} | val loss {last_val:.4f}")
        sample = _sample(trainer, config) if job.sample_tokens else None
        if job.save_adapter:
            log(f"saved the adapters (peft's format) to {trainer.save_adapter(job.save_adapter)}")
        if job.save_pretrained:
            merged = trainer.save_pretrained(job.save_pretrained, merge_adapters=train.lora is not None)
            model.save_tokenizer(job.save_pretrained)
            log(f"saved the trained model{' (adapters merged)' if train.lora else ''} to {merged}")
    if losses:
        head = sum(losses[:10]) / len(losses[:10])
        tail = sum(losses[-10:]) / len(losses[-10:])
        log(
            f"done: {len(losses)} steps in {elapsed:.1f} s; mean loss of the first 10 steps {head:.4f}, "
            f"of the last 10 {tail:.4f}; {sum(rates) / max(1, len(rates)):,.0f} tok/s"
            + _first_and_last("reward margin", "steps", margins)
            + _first_and_last("reward", "generation batches", rewards)
        )
    if losses and went is not None:  # where the time goes, in the terms of docs/watching.md
        log(f"the last step: {went}")
    if sample is not None:
        log("sample:\n" + sample)
    summary = {"losses": losses, "val_first": first_val, "val_last": last_val, "tokens_per_s": rates}
    return {**summary, "margins": margins, "rewards": rewards}


def _objective_data(source: str, objective: ObjectiveSettings | None) -> str | None:
    """The records an objective's job trains on (its `data_source`: "pairs", "prompts"); None for tokens.

    Raises:
        ConfigError: the data source and the objective do not go together.
    """
    from raypipe.objectives import OBJECTIVES

    wanted = OBJECTIVES[objective["name"]].data_source if objective else None
    readers = {kind.data_source for kind in OBJECTIVES.values()}
    records = source if source in readers else None
    if records != wanted:
        names = {r: "|".join(sorted(k.name for k in OBJECTIVES.values() if k.data_source == r)) for r in readers}
        pairs = "; ".join(f"{r!r} with objective {{name: {names[r]}}}" for r in sorted(readers))
        raise ConfigError(
            f"data.source {source!r} and objective {objective and objective['name']!r} do not go together: each "
            f"objective reads its own records ({pairs}), and the token sources train without one"
        )
    return records


def _objective_line(objective: dict[str, Any] | None, metrics: dict[str, Any], window: list[dict[str, Any]]) -> str:
    """An objective's figures for the job's log line (its own words: `Objective.log_line`), each the
    mean over the steps since the last line (`window`), as TRL's trainers log them: one step's
    accuracy over a handful of pairs moves by large jumps."""
    from raypipe.objectives import objective_for

    if objective is None:
        return ""
    means = {}
    for key, value in metrics.get("objective", {}).items():
        seen = [w[key] for w in window if isinstance(w.get(key), (int, float))]
        if isinstance(value, (int, float)) and seen:
            means[key] = sum(seen) / len(seen)
    line = objective_for(objective).log_line({**metrics, **means})
    return f"{line} (means of {len(window)} steps)" if line and len(window) > 1 else line


def _first_and_last(what: str, of: str, values: list[float]) -> str:
    """ "; mean <what> of the first 10 <of> ..., of the last 10 ..." (nothing without values)."""
    if not values:
        return ""
    first, last = values[:10], values[-10:]
    return (
        f"; mean {what} of the first 10 {of} {sum(first) / len(first):.3f}, of the last 10 {sum(last) / len(last):.3f}"
    )


def _leave_a_cpu_for_ray_data(train: TrainConfig) -> TrainConfig:
    """The config with the actors fitted into the cluster's CPUs but one, which Ray Data's tasks
    need to make the dataset's blocks (the default fits them into all)."""
    import ray

    from raypipe.driver import connect

    connect()
    actors = train.pp * train.dp * train.tp
    spare = ray.cluster_resources().get("CPU", 1.0) - 1.0
    return train.replace(cpus_per_actor=max(0.01, min(1.0, int(100 * spare / actors) / 100)))


def _validation_loss(
    trainer: Any, batches: Callable[[int], tuple[torch.Tensor, torch.Tensor]], job: JobSettings
) -> float:
    """Mean loss over fixed validation batches, computed through the pipeline, and logged as val/loss."""
    losses = [trainer.evaluate(*batches(k)) for k in range(job.eval_batches)]
    mean = sum(losses) / len(losses)
    trainer.log({"val/loss": mean})  # to config.loggers, at the step it was taken after
    return mean


def _sample(trainer: Any, config: JobConfig) -> str:
    """Text sampled from the trained model, one pipeline pass per new token."""
    from raypipe.data import ByteTokenizer

    generator = torch.Generator().manual_seed(config.train.seed)
    if trainer.model.kv_cache:  # each new token through the pipeline alone, against per-stage KV caches
        tokenizer = config.model.tokenizer()
        idx = torch.tensor([tokenizer.encode(config.job.prompt, add_special_tokens=False)], dtype=torch.long)
        new = min(config.job.sample_tokens, config.model.block_size - idx.shape[1])
        return tokenizer.decode(trainer.generate(idx, new, temperature=0.8, seed=config.train.seed)[0].tolist())
    tokenizer = ByteTokenizer()
    idx = torch.tensor([tokenizer.encode(config.job.prompt)], dtype=torch.long)
    for _ in range(config.job.sample_tokens):
        logits = trainer.predict(idx[:, -config.model.block_size :])[:, -1, :] / 0.8
        idx = torch.cat([idx, torch.multinomial(torch.softmax(logits, -1), 1, generator=generator)], dim=1)
    return tokenizer.decode(idx[0].tolist())


def add_resume_arguments(parser: argparse.ArgumentParser) -> None:
    """`--resume` / `--resume-step N`, shared by `raypipe train` and examples/train.py."""
    group = parser.add_mutually_exclusive_group()
    group.add_argument(
        "--resume", action="store_true", help="continue from the newest valid checkpoint in checkpoint_dir"
    )
    group.add_argument("--resume-step", type=int, metavar="N", help="continue from the checkpoint of step N")


def main(argv: list[str] | None = None) -> int:
    """`examples/train.py --config FILE [--set key=value ...]`."""
    parser = argparse.ArgumentParser(description="Train the reference GPT with raypipe.")
    parser.add_argument("--config", required=True, help="job YAML, e.g. examples/configs/gpt_pp2.yaml")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a field, e.g. --set microbatches=8 --set model.n_layer=2",
    )
    add_resume_arguments(parser)
    args = parser.parse_args(argv)
    try:
        config = JobConfig.from_yaml(args.config, args.set)
        run(config, log=lambda line: print(line, flush=True), resume=args.resume, resume_step=args.resume_step)
    except RaypipeError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as stop:
        return stop_code(stop)
    return 0


def stop_code(stop: KeyboardInterrupt) -> int:
    """A job stopped by Ctrl-C or SIGTERM (`ray job stop`) ends without a traceback: `fit` has said
    in one line where it saved (else this says it stopped), and the exit code is the shell's for
    the signal (130 for SIGINT, 143 for SIGTERM)."""
    from raypipe.driver.run.interrupts import Terminated

    terminated = isinstance(stop, Terminated)
    if not getattr(stop, "reported", False):
        print(f"raypipe: stopped by {'SIGTERM' if terminated else 'an interrupt'}", flush=True)
    return 143 if terminated else 130
