"""What a running trainer may change on its stage actors between steps (`Trainer.reconfigure`)."""

from __future__ import annotations

from dataclasses import dataclass, field


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
