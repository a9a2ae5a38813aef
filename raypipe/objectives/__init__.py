"""What a step minimises besides the next-token loss: preference pairs by DPO (`dpo.py`), their
batches (`pairs.py`) and the reference policy they are measured against (`reference.py`)."""

from raypipe.objectives.dpo import LOSS_TYPES, METRICS, DPOLoss, step_metrics
from raypipe.objectives.pairs import pair_batch

__all__ = ["DPOLoss", "LOSS_TYPES", "METRICS", "pair_batch", "step_metrics"]
