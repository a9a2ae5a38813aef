"""Direct preference optimisation (DPO) as TRL's `DPOTrainer` defines it, computed on the last stage.

A pair's chosen and rejected completions are two rows of one microbatch, side by side (rows
2i and 2i + 1: `pairs.pair_batch`), so each microbatch holds whole pairs and the step's loss is the
mean over its pairs whatever the split (`DPOLoss.count`). The target carries the labels (the
completion's tokens; the prompt and padding -100) and the reference policy's log-probabilities
of each row, measured in a forward-only pass before the step (`raypipe.objectives.reference`).

Loss types ("sigmoid", "hinge", "ipo") and metric names are TRL 1.16's.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.nn.functional as F

from raypipe.objectives.base import IGNORE, LogProbPass, Objective, Rows, invalid_setting, means, register

LOSS_TYPES = ("sigmoid", "hinge", "ipo")
METRICS = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
)


def row_logps(output: Any, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, the sum of the log-probabilities of its labelled tokens (each predicted from the
    position before it, as a causal LM's loss shifts them) in float32, and how many there are."""
    logits = output[0] if isinstance(output, tuple) else output
    labels = labels.to(logits.device)
    shifted = labels[:, 1:]
    mask = shifted != IGNORE
    logps = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    picked = torch.gather(logps, 2, shifted.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return (picked * mask).sum(dim=1), mask.sum(dim=1)


class DPOLoss:
    """`loss_fn` of a DPO run: `DPOLoss(beta, loss_type)(output, {"labels", "ref_logps"})`, the mean
    of TRL's per-pair loss over the microbatch's pairs. It keeps the microbatch's metric sums for
    the step's report (`take_metrics`), and `reference(output, target)` gives the rows' log-probs
    in the reference pass."""

    def __init__(self, beta: float = 0.1, loss_type: str = "sigmoid") -> None:
        self.beta, self.loss_type = float(beta), loss_type
        self.metrics: dict[str, float] | None = None

    def count(self, target: Mapping[str, torch.Tensor]) -> int:
        """Pairs in the microbatch: what the step's loss is a mean over."""
        return int(target["labels"].shape[0]) // 2

    def reference(self, output: object, target: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The rows' log-probabilities (the reference pass's answer from the last stage)."""
        return row_logps(output, target["labels"])[0].detach().cpu()

    def __call__(self, output: object, target: Mapping[str, torch.Tensor]) -> torch.Tensor:
        logps, tokens = row_logps(output, target["labels"])
        ref = target["ref_logps"].to(logps.device, torch.float32)
        chosen_ratio, rejected_ratio = logps[0::2] - ref[0::2], logps[1::2] - ref[1::2]
        delta = chosen_ratio - rejected_ratio
        if self.loss_type == "sigmoid":
            per_pair = -F.logsigmoid(self.beta * delta)
        elif self.loss_type == "hinge":
            per_pair = torch.relu(1 - self.beta * delta)
        else:  # "ipo": per completion token, as TRL normalises it
            ipo = chosen_ratio / tokens[0::2].clamp(min=1) - rejected_ratio / tokens[1::2].clamp(min=1)
            per_pair = (ipo - 1 / (2 * self.beta)) ** 2
        chosen, rejected = self.beta * chosen_ratio.detach(), self.beta * rejected_ratio.detach()
        self.metrics = {
            "pairs": float(delta.numel()),
            "rewards/chosen": float(chosen.sum()),
            "rewards/rejected": float(rejected.sum()),
            "rewards/accuracies": float((chosen > rejected).float().sum()),
            "rewards/margins": float((chosen - rejected).sum()),
            "logps/chosen": float(logps[0::2].detach().sum()),
            "logps/rejected": float(logps[1::2].detach().sum()),
        }
        return per_pair.mean()

    def take_metrics(self) -> dict[str, float] | None:
        """The last microbatch's metric sums (then forgotten)."""
        metrics, self.metrics = self.metrics, None
        return metrics


def step_metrics(sums: Iterable[Mapping[str, float]]) -> dict[str, float]:
    """TRL's metrics of a step: the means over every pair of every microbatch and replica."""
    return means(sums, "pairs", METRICS)


@register
class DPO(Objective):
    """Preference pairs, each a chosen and a rejected completion of one prompt, against the run's
    reference policy (measured in one forward-only pass before the step)."""

    name = "dpo"
    defaults = {"name": "dpo", "beta": 0.1, "loss_type": "sigmoid"}
    record = "pair"
    data_source = "pairs"

    @classmethod
    def check(cls, settings: dict[str, object], given: object) -> None:
        beta = settings["beta"]
        if isinstance(beta, bool) or not isinstance(beta, (int, float)) or beta <= 0:
            raise invalid_setting(given, "beta must be a number > 0 (TRL's default is 0.1).")
        if settings["loss_type"] not in LOSS_TYPES:
            raise invalid_setting(given, f"loss_type must be one of {', '.join(map(repr, LOSS_TYPES))}.")

    def loss(self) -> DPOLoss:
        return DPOLoss(self.settings["beta"], self.settings["loss_type"])

    def rows(self, records: Any) -> Rows:
        from raypipe.objectives.pairs import pair_batch

        x, labels = pair_batch(records)
        return Rows(x=x, y={"labels": labels}, records=len(records), extra={})

    def passes(self) -> list[LogProbPass]:
        return [LogProbPass("rows", "reference", "ref_logps")]

    def step_metrics(self, sums: Iterable[Mapping[str, float]]) -> dict[str, float]:
        return step_metrics(sums)

    def log_line(self, metrics: Mapping[str, object]) -> str:
        if "rewards/margins" not in metrics:
            return ""
        return f" | margin {metrics['rewards/margins']:.3f} | accuracy {metrics['rewards/accuracies']:.2f}"
