"""What a running trainer may change between steps (`Trainer.reconfigure`): the fields, and
the settings its stage actors get."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class StageSettings:
    """What a running trainer may change between steps without rebuilding actors."""

    microbatches: int
    optimizer: dict
    lr_schedule: dict = field(default_factory=lambda: {"name": "constant"})
    grad_clip: float | None = None
    precision: str = "fp32"
    boundary_dtype: str = "fp32"
    activation_checkpointing: bool = False
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
            activation_checkpointing=c.activation_checkpointing,
            measure_activations=c.measure_activations,
            zero=c.zero,
            dp_bucket_bytes=max(1, int(c.dp_bucket_mb * 2**20)),
            stop_on_nonfinite=stops_on_nonfinite(c),
        )


def stops_on_nonfinite(config: Any) -> bool:
    """Whether a non-finite step ends training: nonfinite="error", except under fp16, whose
    loss scaling skips such steps by design."""
    return config.nonfinite == "error" and config.precision != "fp16"


# TrainConfig fields a running trainer can change between steps (`Trainer.reconfigure`);
# the others shape the actors.
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


def check_reconfigurable(changes: dict[str, Any]) -> None:
    """Raises ConfigError for a field that needs a new Trainer, or one TrainConfig lacks."""
    from raypipe.checks import nearest
    from raypipe.config import TrainConfig
    from raypipe.errors import ConfigError

    fixed = [k for k in changes if k not in RECONFIGURABLE]
    if fixed:
        names = TrainConfig.field_names()
        if fixed[0] in names:
            raise ConfigError(
                f"TrainConfig.{fixed[0]} cannot change on a running trainer (it decides the "
                f"actors); shut this one down and build a new Trainer. Changeable: {', '.join(RECONFIGURABLE)}."
            )
        raise ConfigError(f"unknown field {fixed[0]!r}.{nearest(fixed[0], names)}")
