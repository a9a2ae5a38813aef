"""`TrainConfig`'s sections, as torchtitan's JobConfig nests its own: each a frozen dataclass of
related fields that checks them when it is built (`base.section`), in the order the guide's table
and a config's printout list them. A section is never named as a field is (`config.pipeline.schedule`,
`config.numerics.precision`), so the flat names stay the config's own too: `TrainConfig(pp=2)`,
`--set pp=2` and a YAML file's `pp: 2`, at the top or under any section (`parallel: {pp: 2}`)."""

from __future__ import annotations

from raypipe.config.sections.adapters import AdaptersConfig
from raypipe.config.sections.base import Alias, Section
from raypipe.config.sections.checkpoint import CheckpointConfig
from raypipe.config.sections.cluster import ClusterConfig
from raypipe.config.sections.numerics import NumericsConfig
from raypipe.config.sections.observe import ObserveConfig
from raypipe.config.sections.optim import OptimConfig
from raypipe.config.sections.parallel import ParallelConfig
from raypipe.config.sections.pipeline import PipelineConfig
from raypipe.config.sections.recovery import RecoveryConfig

SECTION_TYPES: dict[str, type[Section]] = {
    kind.NAME: kind
    for kind in (
        ParallelConfig,
        PipelineConfig,
        OptimConfig,
        NumericsConfig,
        AdaptersConfig,
        CheckpointConfig,
        RecoveryConfig,
        ClusterConfig,
        ObserveConfig,
    )
}
SECTIONS: dict[str, tuple[str, ...]] = {name: kind.names() for name, kind in SECTION_TYPES.items()}
SECTION_OF: dict[str, str] = {name: section for section, names in SECTIONS.items() for name in names}

__all__ = [
    "SECTIONS",
    "SECTION_OF",
    "SECTION_TYPES",
    "AdaptersConfig",
    "Alias",
    "CheckpointConfig",
    "ClusterConfig",
    "NumericsConfig",
    "ObserveConfig",
    "OptimConfig",
    "ParallelConfig",
    "PipelineConfig",
    "RecoveryConfig",
    "Section",
]
