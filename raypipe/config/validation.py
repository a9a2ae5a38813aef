"""Whether a `TrainConfig` is valid: every field checked when the config is built, each error
naming the field, the value and the fix (`raypipe.config.checks`), and the allowed values of the
fields that name a choice."""

from __future__ import annotations

from typing import Any

from raypipe.checkpoint.storage import check_available, is_uri, split_uri
from raypipe.config.checks import (
    check_choice,
    check_devices,
    check_int,
    check_lr_schedule,
    check_optimizer,
    check_positive,
    check_shard_plan,
    fail,
    is_int,
)
from raypipe.config.choices import (
    DEVICE_LINKS,
    NONFINITE_POLICIES,
    PARTITION_NAMES,
    PLACEMENTS,
    PRECISIONS,
    SAME_NODE_TRANSPORTS,
)
from raypipe.config.engines import ENGINES, engine_kind, engines_that
from raypipe.config.loggers import check_loggers
from raypipe.config.objective import check_objective
from raypipe.core.errors import ScheduleError
from raypipe.nn import lora
from raypipe.schedules import SCHEDULES, SEQUENCE_CHUNKED, build_schedule
from raypipe.transport.compress import CODECS

SCHEDULE_NAMES = (*SCHEDULES, "auto")  # auto: chosen from profiled layers (`raypipe.planning.autoschedule`)


def validate(c: Any) -> None:
    """Checks every field of the `TrainConfig` `c`, normalising a few in place (lists for tuples,
    dicts copied); raises ConfigError naming the field, the value and the fix."""
    check_int("pp", c.pp, 1)
    check_int("dp", c.dp, 1)
    check_int("tp", c.tp, 1)
    check_int("ep", c.ep, 1)
    if c.dp % c.ep:
        raise fail(
            "ep",
            c.ep,
            f"expert-parallel ranks are carved out of the dp={c.dp} replicas: use an ep "
            f"that divides dp (e.g. ep={c.dp}), or raise dp to a multiple of {c.ep}.",
        )
    if c.ep > 1 and not engine_kind(c.engine).whole_step_calls:
        raise fail(
            "engine",
            c.engine,
            f"ep > 1 runs on the {engines_that('whole_step_calls')} engines (a MoE layer's all-to-all needs every "
            "replica of its ep group inside one step call): use engine='p2p'.",
        )
    if c.zero not in (0, 1, 3) or isinstance(c.zero, bool):
        raise fail(
            "zero",
            c.zero,
            "give 0 (off), 1 (shard optimizer state across dp replicas) or 3 (shard the weights, "
            "gradients and optimizer state, each layer gathered when it runs).",
        )
    if c.zero == 3:
        check_zero3(c)
    check_positive("dp_bucket_mb", c.dp_bucket_mb)
    check_int("microbatches", c.microbatches, 1)
    check_choice("schedule", c.schedule, SCHEDULE_NAMES)
    if c.chunks is not None:
        check_int("chunks", c.chunks, 1)
    check_int("extra_warmup", c.extra_warmup, 0)
    check_sequence_chunks(c)
    check_schedule(c)
    check_shard_plan(c.shard_plan, c.pp, c.num_chunks())
    if c.shard_plan is not None:
        c.shard_plan = [list(r) for r in c.shard_plan]
    check_choice("partition", c.partition, PARTITION_NAMES)
    check_optimizer(c.optimizer)
    c.optimizer = dict(c.optimizer)
    check_lr_schedule(c.lr_schedule)
    c.lr_schedule = dict(c.lr_schedule)
    check_positive("grad_clip", c.grad_clip, allow_none=True)
    c.objective = check_objective(c.objective, c.actor_steps)
    check_choice("precision", c.precision, PRECISIONS)
    check_choice("boundary_dtype", c.boundary_dtype, PRECISIONS)
    check_choice("engine", c.engine, tuple(ENGINES))
    if c.actor_steps != "auto" and not (is_int(c.actor_steps) and c.actor_steps >= 0):
        raise fail("actor_steps", c.actor_steps, 'give "auto" or a whole number >= 0 (0: the driver steps).')
    if c.actor_steps not in (0, "auto") and not engine_kind(c.engine).actor_steps:
        raise fail(
            "actor_steps",
            c.actor_steps,
            f"actor-driven runs use the {engines_that('actor_steps')} engine, not {c.engine!r}: set "
            "engine='p2p' or actor_steps=0.",
        )
    check_choice("same_node_transport", c.same_node_transport, SAME_NODE_TRANSPORTS)
    check_choice("device_links", c.device_links, DEVICE_LINKS)
    check_choice("compress_activations", c.compress_activations, CODECS)
    check_choice("compress_gradients", c.compress_gradients, CODECS)
    if not isinstance(c.probe_links, bool):
        raise fail("probe_links", c.probe_links, "give true or false.")
    if not isinstance(c.activation_checkpointing, bool):
        raise fail("activation_checkpointing", c.activation_checkpointing, "give true or false.")
    if not isinstance(c.measure_activations, bool):
        raise fail("measure_activations", c.measure_activations, "give true or false.")
    check_compile(c)
    check_int("seed", c.seed, 0)
    check_positive("cpus_per_actor", c.cpus_per_actor, allow_none=True)
    if c.threads_per_actor is not None:
        check_int("threads_per_actor", c.threads_per_actor, 1)
    check_positive("actor_start_timeout", c.actor_start_timeout)
    check_choice("placement", c.placement, PLACEMENTS)
    check_positive("step_timeout", c.step_timeout)
    if c.name is not None and (not isinstance(c.name, str) or not c.name):
        raise fail("name", c.name, "give a non-empty string or null.")
    if c.checkpoint_dir is not None and (not isinstance(c.checkpoint_dir, str) or not c.checkpoint_dir):
        raise fail("checkpoint_dir", c.checkpoint_dir, "give a directory path, a URI (s3://bucket/run) or null.")
    if is_uri(c.checkpoint_dir):
        split_uri(c.checkpoint_dir)  # a URI it cannot read is refused here, its secret unshown
        check_available(c.checkpoint_dir, "checkpoint_dir")
    check_int("checkpoint_every", c.checkpoint_every, 0)
    if c.checkpoint_every and c.checkpoint_dir is None:
        raise fail("checkpoint_every", c.checkpoint_every, "set checkpoint_dir too, or use 0.")
    check_int("keep_checkpoints", c.keep_checkpoints, 0)
    if not isinstance(c.resume, bool) and not (isinstance(c.resume, int) and c.resume >= 0):
        raise fail("resume", c.resume, "give true (the newest checkpoint), a step number, or false (a new run).")
    if c.resume is not False and c.checkpoint_dir is None:
        raise fail("resume", c.resume, "resuming needs checkpoint_dir (the run's checkpoints); set it.")
    check_int("max_restarts", c.max_restarts, 0)
    check_elastic(c)
    check_choice("nonfinite", c.nonfinite, NONFINITE_POLICIES)
    check_devices(c.devices, c.pp)
    if isinstance(c.devices, (list, tuple)):
        c.devices = list(c.devices)
    check_positive("gpus_per_actor", c.gpus_per_actor)
    if not isinstance(c.allow_cpu_fallback, bool):
        raise fail("allow_cpu_fallback", c.allow_cpu_fallback, "give true or false.")
    if c.log_dir is not None and (not isinstance(c.log_dir, str) or not c.log_dir):
        raise fail("log_dir", c.log_dir, "give a directory path or null.")
    c.loggers = check_loggers(c.loggers)
    c.lora = lora.check(c.lora, c.tp)
    c.quantize = lora.check_quantize(c.quantize, c.lora, c.stage_kinds())


def check_elastic(c: Any) -> None:
    """The recovery switches are booleans, the elastic limits fit the topology, and a shrink has
    restarts to spend."""
    for name in ("elastic", "restore_from_replicas"):
        if not isinstance(getattr(c, name), bool):
            raise fail(name, getattr(c, name), "give true or false.")
    check_int("min_pp", c.min_pp, 1)
    check_int("min_dp", c.min_dp, 1)
    check_positive("replace_wait", c.replace_wait)
    if c.min_pp > c.pp:
        raise fail("min_pp", c.min_pp, f"the fewest stages an elastic run shrinks to: give at most pp={c.pp}.")
    if c.min_dp > c.dp:
        raise fail("min_dp", c.min_dp, f"the fewest replicas an elastic run shrinks to: give at most dp={c.dp}.")
    if c.elastic and c.max_restarts < 1:
        raise fail(
            "elastic",
            c.elastic,
            "an elastic run rebuilds its actors after a loss, which spends TrainConfig.max_restarts: "
            "set max_restarts >= 1 (e.g. 3).",
        )


def check_zero3(c: Any) -> None:
    """ZeRO-3 fits the other fields: the engines that run a step in one call, no quantized base, no
    expert parallelism (its experts are sharded by ep already)."""
    if not engine_kind(c.engine).whole_step_calls:
        raise fail(
            "engine",
            c.engine,
            "zero=3 gathers each layer among the dp replicas inside the step, which needs the whole "
            f"step in one call per actor, as the {engines_that('whole_step_calls')} engines send it: use engine='p2p'.",
        )
    if c.quantize is not None:
        raise fail("quantize", c.quantize, "a quantized base is not sharded by zero=3: use zero=0 or 1 with quantize.")
    if c.ep > 1:
        raise fail("ep", c.ep, "zero=3 does not shard expert-parallel layers yet: use zero=1 with ep > 1.")
    if c.objective is not None:  # its passes and reference copy read whole layers, which zero=3 holds in slices
        raise fail(
            "zero",
            c.zero,
            "TrainConfig.objective's reference policy and its passes before each step read whole layers, which "
            "zero=3 keeps sliced among the replicas: use zero=1 (or 0) with an objective.",
        )


def check_compile(c: Any) -> None:
    """torch.compile'd layers fit the other fields: not where a layer's call runs collectives or
    gathers (tp, ep, zero=3) or bitsandbytes kernels (quantize), which are not tested compiled."""
    if not isinstance(c.compile, bool):
        raise fail("compile", c.compile, "give true or false.")
    if not c.compile:
        return
    for name, bad, why in (
        ("tp", c.tp > 1, "its layers all-reduce inside their call"),
        ("ep", c.ep > 1, "its MoE layers exchange tokens by all-to-all inside their call"),
        ("zero", c.zero == 3, "zero=3 gathers each layer in hooks around its call"),
        ("quantize", c.quantize is not None, "bitsandbytes' kernels are not compiled"),
    ):
        if bad:
            raise fail(name, getattr(c, name), f"compile=True is not supported with it yet ({why}): use compile=False.")


def check_schedule(c: Any) -> None:
    """The schedule fits the other fields: its chunks, its engine, pp and microbatches."""
    if c.schedule == "auto":
        for name in ("chunks", "shard_plan"):
            if getattr(c, name) is not None:
                raise fail(
                    name,
                    getattr(c, name),
                    "schedule='auto' chooses the split and chunks itself: leave it unset, or name a schedule.",
                )
        return
    kind = SCHEDULES[c.schedule]
    if c.chunks is not None and kind.chunks is not None and c.chunks != kind.chunks:
        raise fail(
            "chunks",
            c.chunks,
            f"schedule {c.schedule!r} always runs {kind.chunks} per actor: "
            f"leave chunks unset, or use schedule='interleaved-1f1b'.",
        )
    if (c.num_chunks() > 1 or kind.split_backward) and not engine_kind(c.engine).whole_step_calls:
        raise fail(
            "engine",
            c.engine,
            f"schedule {c.schedule!r} runs on the {engines_that('whole_step_calls')} engines "
            f"(its chunks and split backwards live inside one call per step): "
            f"use engine='p2p'.",
        )
    try:
        units = c.sequence_chunks if c.sequence_chunks != "auto" else 1  # "auto": chosen when the trainer starts
        build_schedule(c.schedule, c.pp, c.microbatches, c.chunks, c.extra_warmup, units)
    except ScheduleError as error:
        field = "extra_warmup" if "extra_warmup" in str(error) else "microbatches"
        raise fail(field, getattr(c, field), str(error)) from None


def check_sequence_chunks(c: Any) -> None:
    """sequence_chunks is a whole number or "auto", and what it runs with can run on chunks."""
    auto = c.sequence_chunks == "auto"
    if not auto and not (is_int(c.sequence_chunks) and c.sequence_chunks >= 1):
        raise fail("sequence_chunks", c.sequence_chunks, 'give a whole number >= 1 (1: not cut) or "auto".')
    if c.sequence_chunks == 1:
        return
    if auto and c.shard_plan is not None:
        raise fail(
            "sequence_chunks",
            c.sequence_chunks,
            "'auto' times the layers on each chunk count and splits them by those times: leave shard_plan unset, "
            "or give sequence_chunks a number.",
        )
    if c.schedule not in SEQUENCE_CHUNKED and not (auto and c.schedule == "auto"):
        raise fail(
            "sequence_chunks",
            c.sequence_chunks,
            f"schedule {c.schedule!r} does not run sequence chunks: use schedule='1f1b' (or 'gpipe', 'zb-h1'), "
            f"or sequence_chunks=1.",
        )
    if c.compile:
        raise fail(
            "sequence_chunks",
            c.sequence_chunks,
            "not with compile=True (the chunk's keys and values are kept outside the compiled graph): use one of them.",
        )
    if c.objective is not None:  # every registered objective scores whole completions
        raise fail(
            "sequence_chunks",
            c.sequence_chunks,
            "an objective's loss (TrainConfig.objective) is over whole sequences (their summed log-probabilities), "
            "not a sum over tokens: use sequence_chunks=1.",
        )


# TrainConfig fields a running trainer can change between steps (`Trainer.reconfigure`);
# the others shape the actors.
RECONFIGURABLE = (
    "actor_steps",
    "microbatches",
    "sequence_chunks",
    "schedule",
    "extra_warmup",
    "optimizer",
    "lr_schedule",
    "grad_clip",
    "precision",
    "boundary_dtype",
    "compress_activations",
    "compress_gradients",
    "zero",
    "dp_bucket_mb",
    "activation_checkpointing",
    "compile",
    "measure_activations",
    "step_timeout",
    "checkpoint_dir",
    "checkpoint_every",
    "keep_checkpoints",
    "max_restarts",
    "restore_from_replicas",
    "elastic",
    "min_pp",
    "min_dp",
    "replace_wait",
    "nonfinite",
    "log_dir",
)
