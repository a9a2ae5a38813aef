"""`TrainConfig.observe`: the run's name and where its scalars go."""

from __future__ import annotations

from dataclasses import field

from raypipe.config.checks import fail
from raypipe.config.loggers import LoggerEntry, check_loggers
from raypipe.config.sections.base import Section, section


def _tensorboard() -> list[LoggerEntry]:
    return ["tensorboard"]


@section("observe")
class ObserveConfig(Section):
    """The run's name and where each step's scalars go.

    Attributes:
        name: run name, used in actor names and logs; None picks a unique one.
        log_dir: TensorBoard scalars (per step and stage) go here, a folder per run (docs/watching.md); None: off.
        loggers: where each step's scalars go (`raypipe.observe.loggers`): "tensorboard" (to `log_dir`),
            "mlflow", "wandb", each a name or `{name: {option: value}}`, e.g.
            `[tensorboard, {mlflow: {tracking_uri: "sqlite:///runs.db"}}]`.
    """

    name: str | None = None
    log_dir: str | None = None
    loggers: list[LoggerEntry] = field(default_factory=_tensorboard)

    def __post_init__(self) -> None:
        if self.name is not None and (not isinstance(self.name, str) or not self.name):
            raise fail("name", self.name, "give a non-empty string or null.")
        if self.log_dir is not None and (not isinstance(self.log_dir, str) or not self.log_dir):
            raise fail("log_dir", self.log_dir, "give a directory path or null.")
        self.normalise("loggers", check_loggers(self.loggers))
