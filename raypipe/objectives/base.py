"""What an objective is to the run: one subclass of `Objective` in a module of its own, registered
by name (`objectives.register`), which declares everything the run needs from it.

- its settings: TRL's names and defaults (`defaults`), checked once when `TrainConfig` is made
  (`check`), errors naming the setting and the fix;
- its data: what one record of a step is (`record`), the job's data source that reads such
  records (`data_source`), and the rows a step trains on (`rows`: checked token ids, labels);
- the passes the driver runs before its step, as data (`passes`: forward-only log-probabilities
  of some rows under the reference policy or the policy as it stands), and how their answers
  join the step's target (`finish`); or, when its rows are generated from the policy itself
  (`generates`: GRPO), the generation batches of `driver.inference.rollout`;
- its loss, which the last stage computes (`loss`), and its metrics under TRL's names
  (`step_metrics`, from the loss's per-microbatch sums).

The driver never asks which objective it runs: it asks the objective (`driver.inference.objective`
runs the passes, under the same timeout and recovery as the step), so a new one is one module.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch

from raypipe.core.errors import ConfigError

IGNORE = -100  # the label of a token no loss reads: a prompt's, padding


@dataclass(frozen=True)
class LogProbPass:
    """A forward-only pass through the pipeline before a step: the rows of batch part `rows`
    ("rows": the step's own; another name: a part `Rows.extra` holds) under `policy` ("reference":
    the run's reference policy; "policy": the weights as they stand, no gradient), each answered
    by the loss's `reference(output, target)`. The answers, joined in row order, land in the
    step's target under `into` (or in what `Objective.finish` makes of them)."""

    rows: str
    policy: Literal["reference", "policy"]
    into: str


@dataclass
class Rows:
    """A step's rows: the model's input `x`, the loss's target `y` (a dict of per-row tensors), and
    `extra` parts a pass reads ({name: (x, y)}: rows paired otherwise, say), which the step does not
    train on. `records`: how many records they came from (what must divide among the actors)."""

    x: object
    y: dict[str, torch.Tensor]
    records: int
    extra: dict[str, tuple[Any, dict[str, torch.Tensor]]]


class Objective:
    """The interface every objective implements (see the module's docstring). `settings`: its
    `TrainConfig.objective` dict, checked and with its defaults filled in."""

    name: ClassVar[str]
    defaults: ClassVar[Mapping[str, object]]
    record: ClassVar[str]  # what one record is, in errors and docs: "pair", "prompt", "example"
    data_source: ClassVar[str]  # the job's `data.source` whose records it reads
    generates: ClassVar[bool] = False  # its rows are generated from the policy (driver.inference.rollout)

    def __init__(self, settings: Mapping[str, Any]) -> None:
        self.settings = dict(settings)

    @classmethod
    def check(cls, settings: dict[str, object], given: object) -> None:
        """Raises ConfigError naming what is wrong in `settings` (`given`: what the user wrote)."""

    def loss(self) -> object:
        """The loss function the last stage computes: `loss(output, target)` with `count(target)`
        (what the step's loss is a mean over), `reference(output, target)` (a pass's answer) and
        `take_metrics()` (the microbatch's metric sums)."""
        raise NotImplementedError

    def rows(self, records: Sequence[Mapping[str, object]]) -> Rows:
        """The rows of one step made from its `records`.

        Raises:
            BatchError: the records are not this objective's, naming the record and the column.
        """
        raise NotImplementedError

    def passes(self) -> list[LogProbPass]:
        """The forward-only passes its step needs first, in order."""
        return []

    def finish(self, y: dict[str, torch.Tensor], answers: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The step's target from the rows' `y` and the passes' answers (by `into`)."""
        return {**y, **answers}

    def step_metrics(self, sums: Iterable[Mapping[str, float]]) -> dict[str, float]:
        """The step's metrics (TRL's names) from every microbatch's sums."""
        raise NotImplementedError

    def log_line(self, metrics: Mapping[str, object]) -> str:
        """What a job's step line adds for this objective (` | margin 0.123 ...`)."""
        return ""


OBJECTIVES: dict[str, type[Objective]] = {}  # by name: filled as each objective's module is imported


def register(kind: type[Objective]) -> type[Objective]:
    """Makes `kind` the objective named `kind.name` (a class decorator: the registry line)."""
    OBJECTIVES[kind.name] = kind
    return kind


def objective_for(settings: Mapping[str, Any]) -> Objective:
    """The objective of a checked `TrainConfig.objective`."""
    return OBJECTIVES[settings["name"]](settings)


def invalid_setting(value: object, fix: str) -> ConfigError:
    """The error for a bad `TrainConfig.objective`, worded as every config error is."""
    return ConfigError(f"TrainConfig.objective={value!r} is invalid: {fix}")


def means(sums: Iterable[Mapping[str, float]], count: str, names: Iterable[str]) -> dict[str, float]:
    """Each of `names` summed over every microbatch's sums and divided by the sum of `count` (the
    step's pairs, examples, ...): TRL's mean over the step's batch. Empty when nothing counted."""
    sums = list(sums)
    total = sum(s.get(count, 0.0) for s in sums)
    if not total:
        return {}
    return {name: sum(s[name] for s in sums) / total for name in names if all(name in s for s in sums)}
