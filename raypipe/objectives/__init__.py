"""What a step minimises besides the next-token loss: preference pairs by DPO (`dpo.py`, their
batches in `pairs.py`), scored generations by GRPO (`grpo.py`, their batches in `rollouts.py`,
their scores in `rewards.py`), and the reference policy both are measured against (`reference.py`)."""

from collections.abc import Iterable, Mapping

from raypipe.objectives import dpo, grpo
from raypipe.objectives.dpo import LOSS_TYPES, METRICS, DPOLoss
from raypipe.objectives.grpo import GRPOLoss
from raypipe.objectives.pairs import pair_batch
from raypipe.objectives.rollouts import rollout_batch


def step_metrics(sums: Iterable[Mapping[str, float]]) -> dict[str, float]:
    """A step's objective metrics (TRL's names) from every microbatch's sums."""
    sums = list(sums)
    if not sums:
        return {}
    return (dpo if "pairs" in sums[0] else grpo).step_metrics(sums)


def objective_loss(objective: Mapping) -> DPOLoss | GRPOLoss:
    """The loss function of `TrainConfig.objective` (checked, its defaults filled in)."""
    if objective["name"] == "dpo":
        return DPOLoss(objective["beta"], objective["loss_type"])
    o = objective
    return GRPOLoss(
        o["beta"], o["loss_type"], o["epsilon"], o["epsilon_high"], o["max_completion_length"], o["temperature"]
    )


__all__ = [
    "DPOLoss",
    "GRPOLoss",
    "LOSS_TYPES",
    "METRICS",
    "objective_loss",
    "pair_batch",
    "rollout_batch",
    "step_metrics",
]
