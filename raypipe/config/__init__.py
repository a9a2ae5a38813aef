"""The training configuration: `TrainConfig` (`train_config`) made of nine typed sections
(`sections`, each checking its own fields when built), the typed settings its mappings hold
(`settings`), the checks across sections (`validation`, the loggers' in `loggers`), and the
configuration guide's table generated from the sections (`guide`)."""

from raypipe.config.sections import (
    SECTION_OF,
    SECTIONS,
    AdaptersConfig,
    CheckpointConfig,
    ClusterConfig,
    NumericsConfig,
    ObserveConfig,
    OptimConfig,
    ParallelConfig,
    PipelineConfig,
    RecoveryConfig,
)
from raypipe.config.train_config import JOB_SECTIONS, TrainConfig, apply_overrides, check_reconfigurable, load_yaml
from raypipe.config.validation import RECONFIGURABLE

__all__ = [
    "AdaptersConfig",
    "CheckpointConfig",
    "ClusterConfig",
    "NumericsConfig",
    "ObserveConfig",
    "OptimConfig",
    "ParallelConfig",
    "PipelineConfig",
    "RecoveryConfig",
    "JOB_SECTIONS",
    "RECONFIGURABLE",
    "SECTIONS",
    "SECTION_OF",
    "TrainConfig",
    "apply_overrides",
    "check_reconfigurable",
    "load_yaml",
]
