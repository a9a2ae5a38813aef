"""What a `TrainConfig` checks across its sections, once each section has checked its own fields
(`raypipe.config.sections`): each error names the field, the value and the fix
(`raypipe.config.checks`). And which fields a running trainer may change."""

from __future__ import annotations

from typing import Protocol

from raypipe.config.checks import check_devices_per_stage, check_plan_length, fail
from raypipe.config.engines import engine_kind, engines_that
from raypipe.config.objective import check_driver_steps
from raypipe.config.settings import LoraSettings, ObjectiveSettings
from raypipe.core.errors import ScheduleError
from raypipe.nn import lora
from raypipe.schedules import build_schedule


class Fields(Protocol):
    """The fields the checks across sections read, by their flat names (a `TrainConfig`)."""

    pp: int
    dp: int
    tp: int
    ep: int
    zero: int
    shard_plan: list[list[int]] | None
    microbatches: int
    schedule: str
    chunks: int | None
    extra_warmup: int | None
    sequence_chunks: int | str
    engine: str
    actor_steps: int | str
    objective: ObjectiveSettings | None
    compile: bool
    lora: LoraSettings | None
    quantize: str | list[str | None] | None
    min_pp: int
    min_dp: int
    devices: str | list[str]

    def num_chunks(self) -> int: ...

    def stage_kinds(self) -> list[str]: ...


def check_across(c: Fields) -> dict[str, object]:
    """Checks what spans the sections of `c` (each section checked its own fields as it was built);
    returns the fields whose checked form depends on others (`quantize`, one entry per stage).
    Raises ConfigError naming the field, the value and the fix."""
    if c.ep > 1 and not engine_kind(c.engine).whole_step_calls:
        raise fail(
            "engine",
            c.engine,
            f"ep > 1 runs on the {engines_that('whole_step_calls')} engines (a MoE layer's all-to-all needs every "
            "replica of its ep group inside one step call): use engine='p2p'.",
        )
    if c.zero == 3:
        check_zero3(c)
    check_sequence_chunks(c)
    check_schedule(c)
    check_plan_length(c.shard_plan, c.pp, c.num_chunks())
    check_driver_steps(c.objective, c.actor_steps)
    check_compile(c)
    if c.min_pp > c.pp:
        raise fail("min_pp", c.min_pp, f"the fewest stages an elastic run shrinks to: give at most pp={c.pp}.")
    if c.min_dp > c.dp:
        raise fail("min_dp", c.min_dp, f"the fewest replicas an elastic run shrinks to: give at most dp={c.dp}.")
    check_devices_per_stage(c.devices, c.pp)
    lora.check_tensor_parallel(c.lora, c.tp)
    quantize = lora.check_quantize(c.quantize, c.lora, c.stage_kinds())
    return {"quantize": quantize} if quantize != c.quantize else {}


def check_zero3(c: Fields) -> None:
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


def check_compile(c: Fields) -> None:
    """torch.compile'd layers fit the other fields: not where a layer's call runs collectives or
    gathers (tp, ep, zero=3) or bitsandbytes kernels (quantize), which are not tested compiled."""
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


def check_schedule(c: Fields) -> None:
    """The schedule fits pp, the microbatches and the split (its chunks and engine: `PipelineConfig`)."""
    if c.schedule == "auto":
        if c.shard_plan is not None:
            raise fail(
                "shard_plan",
                c.shard_plan,
                "schedule='auto' chooses the split and chunks itself: leave it unset, or name a schedule.",
            )
        return
    try:
        units = c.sequence_chunks if c.sequence_chunks != "auto" else 1  # "auto": chosen when the trainer starts
        build_schedule(c.schedule, c.pp, c.microbatches, c.chunks, c.extra_warmup, units)
    except ScheduleError as error:
        field = "extra_warmup" if "extra_warmup" in str(error) else "microbatches"
        raise fail(field, getattr(c, field), str(error)) from None


def check_sequence_chunks(c: Fields) -> None:
    """Sequence chunks fit the split, compiling and the objective (their schedule: `PipelineConfig`)."""
    if c.sequence_chunks == 1:
        return
    if c.sequence_chunks == "auto" and c.shard_plan is not None:
        raise fail(
            "sequence_chunks",
            c.sequence_chunks,
            "'auto' times the layers on each chunk count and splits them by those times: leave shard_plan unset, "
            "or give sequence_chunks a number.",
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
