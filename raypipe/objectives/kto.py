"""Kahneman-Tversky optimisation (KTO) as TRL 1.16's `KTOTrainer` defines it: unpaired completions,
each marked desirable or not, pulled towards or away from the reference policy past a KL baseline.

A step's records are examples {"prompt_ids", "completion_ids", "label"} (TRL's tokenized columns;
`label` True for a desirable completion), or preference pairs {"prompt_ids", "chosen_ids",
"rejected_ids"}, unpaired as TRL unpairs them (every chosen completion, desirable, then every
rejected one). Each example is one row. The KL baseline is TRL's estimate over the step's batch:
the mean, over mismatched pairs (example i's prompt with example i - 1's completion, cycled), of the
policy's log-probability of the completion less the reference policy's, floored at zero and
taken without a gradient. The driver measures it before the step in three forward-only passes
(the rows and the mismatched rows under the reference, the mismatched rows under the policy),
so the loss on the last stage needs no more than each row's label, reference log-prob and the KL.

Loss types ("kto", "apo_zero_unpaired"), weights and metric names are TRL's.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from raypipe.core.errors import BatchError
from raypipe.objectives.base import LogProbPass, Objective, Rows, invalid_setting, means, register
from raypipe.objectives.dpo import row_logps
from raypipe.objectives.pairs import completion_rows

LOSS_TYPES = ("kto", "apo_zero_unpaired")
METRICS = ("rewards/chosen", "logps/chosen", "rewards/rejected", "logps/rejected")
EXAMPLE = ("prompt_ids", "completion_ids", "label")
PAIR = ("prompt_ids", "chosen_ids", "rejected_ids")


class KTOLoss:
    """`loss_fn` of a KTO run: the mean over the microbatch's rows of TRL's per-example loss
    (`target`: "labels", "desirable", "ref_logps" and the step's "kl", one per row)."""

    def __init__(self, beta: float, loss_type: str, desirable_weight: float, undesirable_weight: float) -> None:
        self.beta, self.loss_type = float(beta), loss_type
        self.weights = (float(desirable_weight), float(undesirable_weight))
        self.metrics: dict[str, float] | None = None

    def count(self, target: Mapping[str, torch.Tensor]) -> int:
        return int(target["labels"].shape[0])

    def reference(self, output: object, target: Mapping[str, torch.Tensor]) -> torch.Tensor:
        return row_logps(output, target["labels"])[0].detach().cpu()

    def __call__(self, output: object, target: Mapping[str, torch.Tensor]) -> torch.Tensor:
        logps, _ = row_logps(output, target["labels"])
        ratio = logps - target["ref_logps"].to(logps.device, torch.float32)
        kl = target["kl"].to(logps.device, torch.float32)
        desirable = target["desirable"].to(logps.device).bool()
        if self.loss_type == "kto":
            chosen, rejected = 1 - torch.sigmoid(self.beta * (ratio - kl)), 1 - torch.sigmoid(self.beta * (kl - ratio))
        else:  # "apo_zero_unpaired"
            chosen, rejected = 1 - torch.sigmoid(self.beta * ratio), torch.sigmoid(self.beta * ratio)
        losses = torch.where(desirable, self.weights[0] * chosen, self.weights[1] * rejected)
        rewards, logps = self.beta * ratio.detach(), logps.detach()
        self.metrics = {
            "examples": float(len(losses)),
            "chosen": float(desirable.sum()),
            "rejected": float((~desirable).sum()),
            "kl_sum": float(kl.sum()),
            "rewards/chosen": float(rewards[desirable].sum()),
            "logps/chosen": float(logps[desirable].sum()),
            "rewards/rejected": float(rewards[~desirable].sum()),
            "logps/rejected": float(logps[~desirable].sum()),
        }
        return losses.mean()

    def take_metrics(self) -> dict[str, float] | None:
        metrics, self.metrics = self.metrics, None
        return metrics


@register
class KTO(Objective):
    name = "kto"
    defaults = {"name": "kto", "beta": 0.1, "loss_type": "kto", "desirable_weight": 1.0, "undesirable_weight": 1.0}
    record = "example"
    data_source = "pairs"  # the job's pairs, unpaired; a Python caller may give examples

    @classmethod
    def check(cls, settings: dict[str, object], given: object) -> None:
        numbers = ("beta", "desirable_weight", "undesirable_weight")
        for key in numbers:
            value = settings[key]
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise invalid_setting(given, f"{key} must be a number > 0 (TRL's default is {cls.defaults[key]}).")
        if settings["loss_type"] not in LOSS_TYPES:
            raise invalid_setting(given, f"loss_type must be one of {', '.join(map(repr, LOSS_TYPES))}.")

    def loss(self) -> KTOLoss:
        s = self.settings
        return KTOLoss(s["beta"], s["loss_type"], s["desirable_weight"], s["undesirable_weight"])

    def rows(self, records: Sequence[Mapping[str, object]]) -> Rows:
        examples = unpaired(records)
        completions = [e["completion_ids"] for e in examples]
        mismatched = completions[-1:] + completions[:-1]  # TRL's KL pairs: each prompt with the completion before
        x, labels = completion_rows(
            [e["prompt_ids"] + c for e, c in zip(examples, completions)], list(map(len, completions))
        )
        kl_x, kl_labels = completion_rows(
            [e["prompt_ids"] + c for e, c in zip(examples, mismatched)], list(map(len, mismatched))
        )
        desirable = torch.tensor([bool(e["label"]) for e in examples])
        extra = {"mismatched": (kl_x, {"labels": kl_labels})} if self.settings["loss_type"] == "kto" else {}
        return Rows(x=x, y={"labels": labels, "desirable": desirable}, records=len(records), extra=extra)

    def passes(self) -> list[LogProbPass]:
        reference = [LogProbPass("rows", "reference", "ref_logps")]
        if self.settings["loss_type"] != "kto":  # TRL computes no KL for the unpaired APO loss
            return reference
        return reference + [
            LogProbPass("mismatched", "reference", "ref_kl_logps"),
            LogProbPass("mismatched", "policy", "kl_logps"),
        ]

    def finish(self, y: dict[str, torch.Tensor], answers: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        rows = y["labels"].shape[0]
        if "kl_logps" in answers:  # TRL's estimate over the batch, floored at zero, the same for every row
            kl = (answers["kl_logps"] - answers["ref_kl_logps"]).mean().clamp(min=0)
        else:
            kl = torch.zeros(())
        return {**y, "ref_logps": answers["ref_logps"], "kl": kl.expand(rows).clone()}

    def step_metrics(self, sums: Iterable[Mapping[str, float]]) -> dict[str, float]:
        sums = list(sums)
        if not sums:
            return {}
        metrics = {"kl": sum(s["kl_sum"] for s in sums) / max(sum(s["examples"] for s in sums), 1.0)}
        for side in ("chosen", "rejected"):
            metrics |= means(sums, side, [f"rewards/{side}", f"logps/{side}"])
        if "rewards/chosen" in metrics and "rewards/rejected" in metrics:
            metrics["rewards/margins"] = metrics["rewards/chosen"] - metrics["rewards/rejected"]
        return metrics

    def log_line(self, metrics: Mapping[str, object]) -> str:
        margin = f" | margin {metrics['rewards/margins']:.3f}" if "rewards/margins" in metrics else ""
        return f"{margin} | kl {metrics['kl']:.4f}" if "kl" in metrics else margin


def unpaired(records: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """KTO's examples from `records`: examples as they are, pairs unpaired as TRL unpairs them.

    Raises:
        BatchError: not a list of example or pair records of token ids.
    """
    if not isinstance(records, Sequence) or not records or not all(isinstance(r, Mapping) for r in records):
        raise BatchError(
            f"a KTO step takes a list of example records {{{', '.join(map(repr, EXAMPLE))}}} or pair records "
            f"{{{', '.join(map(repr, PAIR))}}} (token ids); got {type(records).__name__}"
        )
    if all(all(c in r for c in PAIR) for r in records):
        return [
            {"prompt_ids": list(r["prompt_ids"]), "completion_ids": list(r[column]), "label": column == "chosen_ids"}
            for column in ("chosen_ids", "rejected_ids")
            for r in records
        ]
    for i, record in enumerate(records):
        missing = [c for c in EXAMPLE if c not in record]
        if missing:
            raise BatchError(f"example {i} lacks {', '.join(missing)}: each record needs {', '.join(EXAMPLE)}")
        if not record["completion_ids"]:
            raise BatchError(f"example {i}'s completion_ids is empty: a completion needs at least one token")
    return [
        {"prompt_ids": list(r["prompt_ids"]), "completion_ids": list(r["completion_ids"]), "label": r["label"]}
        for r in records
    ]
