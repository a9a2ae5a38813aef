"""What a step minimises besides a model's own next-token loss, one module per objective, each
registering its `Objective` (`base.py`: the interface, the registry): preference pairs by DPO
(`dpo.py`, their rows in `pairs.py`), unpaired desirable and undesirable completions by KTO
(`kto.py`), scored generations by GRPO (`grpo.py`, their rows in `rollouts.py`, their scores in
`rewards.py`); the reference policy they are measured against (`reference.py`)."""

from raypipe.objectives import dpo, grpo, kto  # noqa: F401 - each registers its objective: the registry lines
from raypipe.objectives.base import OBJECTIVES, LogProbPass, Objective, Rows, objective_for, register
from raypipe.objectives.dpo import LOSS_TYPES, METRICS, DPOLoss
from raypipe.objectives.grpo import GRPOLoss
from raypipe.objectives.kto import KTOLoss
from raypipe.objectives.pairs import pair_batch
from raypipe.objectives.rollouts import rollout_batch

__all__ = [
    "DPOLoss",
    "GRPOLoss",
    "KTOLoss",
    "LOSS_TYPES",
    "LogProbPass",
    "METRICS",
    "OBJECTIVES",
    "Objective",
    "Rows",
    "objective_for",
    "pair_batch",
    "register",
    "rollout_batch",
]
