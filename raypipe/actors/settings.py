"""The settings a stage actor trains by, which a running trainer may change between steps
(`Trainer.reconfigure`; which `TrainConfig` fields may change: `raypipe.config.validation.RECONFIGURABLE`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from raypipe.env import gradient_hand_on


@dataclass
class StageSettings:
    """What a running trainer may change between steps without rebuilding actors."""

    microbatches: int
    optimizer: dict
    lr_schedule: dict = field(default_factory=lambda: {"name": "constant"})
    grad_clip: float | None = None
    precision: str = "fp32"
    boundary_dtype: str = "fp32"
    compress_activations: str = "none"
    compress_gradients: str = "none"
    activation_checkpointing: bool = False
    compile: bool = False
    # when a whole backward hands its input gradient on: "measured", "early" or "late" (`env.gradient_hand_on`)
    gradient_hand_on: str = "measured"
    # the step's schedule as (name, pp, microbatches, chunks, extra_warmup): what `hand_on` times both ways
    schedule_spec: tuple | None = None
    measure_activations: bool = False
    zero: int = 0
    dp_bucket_bytes: int = 25 * 2**20
    # a non-finite step ends training (TrainConfig.nonfinite="error", not fp16's loss scaling):
    # steps queued behind it must not run
    stop_on_nonfinite: bool = True

    @classmethod
    def from_config(cls, c: Any) -> StageSettings:
        """The settings of a `TrainConfig`."""
        return cls(
            microbatches=c.microbatches,
            optimizer=dict(c.optimizer),
            lr_schedule=dict(c.lr_schedule),
            grad_clip=c.grad_clip,
            precision=c.precision,
            boundary_dtype=c.boundary_dtype,
            compress_activations=c.compress_activations,
            compress_gradients=c.compress_gradients,
            activation_checkpointing=c.activation_checkpointing,
            compile=c.compile,
            gradient_hand_on=gradient_hand_on(),
            schedule_spec=(c.schedule, c.pp, c.microbatches, c.chunks, c.extra_warmup),
            measure_activations=c.measure_activations,
            zero=c.zero,
            dp_bucket_bytes=max(1, int(c.dp_bucket_mb * 2**20)),
            stop_on_nonfinite=stops_on_nonfinite(c),
        )


def stops_on_nonfinite(config: Any) -> bool:
    """Whether a non-finite step ends training: nonfinite="error", except under fp16, whose
    loss scaling skips such steps by design."""
    return config.nonfinite == "error" and config.precision != "fp16"
