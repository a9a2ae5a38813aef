"""The training configuration: `TrainConfig` (`train_config`), its fields in sections
(`sections`), the checks every field passes when a config is built (`validation`, the loggers'
in `loggers`), and the configuration guide's table generated from the class (`guide`)."""

from raypipe.config.sections import SECTION_OF, SECTIONS
from raypipe.config.train_config import JOB_SECTIONS, TrainConfig, apply_overrides, check_reconfigurable, load_yaml
from raypipe.config.validation import RECONFIGURABLE

__all__ = [
    "JOB_SECTIONS",
    "RECONFIGURABLE",
    "SECTIONS",
    "SECTION_OF",
    "TrainConfig",
    "apply_overrides",
    "check_reconfigurable",
    "load_yaml",
]
