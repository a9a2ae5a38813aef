"""raypipe: train PyTorch models split across Ray actors (pipeline, data and tensor parallel).

Import everything from here (tensor-parallel layers from `raypipe.nn`); other
submodules may change.
"""

import raypipe.core.notices  # noqa: F401 - first: hides third-party notices that ask nothing of the user
from raypipe import nn
from raypipe.checkpoint.layout import CheckpointError
from raypipe.config import (
    AdaptersConfig,
    CheckpointConfig,
    ClusterConfig,
    NumericsConfig,
    ObserveConfig,
    OptimConfig,
    ParallelConfig,
    PipelineConfig,
    RecoveryConfig,
    TrainConfig,
)
from raypipe.core.errors import (
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
from raypipe.core.layers import LayerSpec, build_layers
from raypipe.observe.step_breakdown import StepBreakdown
from raypipe.observe.timeline import Timeline
from raypipe.planning.links import Link
from raypipe.planning.profiling import PlanReport
from raypipe.schedules import Action, bubble, build_schedule, format_schedule, peak_in_flight
from raypipe.trainer import Trainer

__version__ = "0.1.0"

__all__ = [
    "Action",
    "ActorDiedError",
    "AdaptersConfig",
    "BatchError",
    "CheckpointConfig",
    "CheckpointError",
    "ClusterConfig",
    "ConfigError",
    "LayerSpec",
    "Link",
    "NonFiniteError",
    "NumericsConfig",
    "ObserveConfig",
    "OptimConfig",
    "ParallelConfig",
    "PipelineConfig",
    "PlacementError",
    "PlanReport",
    "RaypipeError",
    "RecoveryConfig",
    "ScheduleError",
    "StageError",
    "StepBreakdown",
    "StepTimeoutError",
    "Timeline",
    "TrainConfig",
    "Trainer",
    "bubble",
    "build_layers",
    "build_schedule",
    "format_schedule",
    "nn",
    "peak_in_flight",
]
