"""raypipe: train PyTorch models split across Ray actors (pipeline parallel).

Import everything from here; the submodules may change.
"""

from raypipe.checkpoint import CheckpointError
from raypipe.config import TrainConfig
from raypipe.errors import (
    ActorDiedError,
    BatchError,
    ConfigError,
    NonFiniteError,
    PlacementError,
    RaypipeError,
    ScheduleError,
    StageError,
    StepTimeoutError,
)
from raypipe.layers import LayerSpec, build_layers
from raypipe.schedules import Action, build_schedule, format_schedule
from raypipe.trainer import Trainer

__version__ = "0.1.0"

__all__ = [
    "Action",
    "ActorDiedError",
    "BatchError",
    "CheckpointError",
    "ConfigError",
    "NonFiniteError",
    "LayerSpec",
    "PlacementError",
    "RaypipeError",
    "ScheduleError",
    "StageError",
    "StepTimeoutError",
    "TrainConfig",
    "Trainer",
    "build_layers",
    "build_schedule",
    "format_schedule",
]
