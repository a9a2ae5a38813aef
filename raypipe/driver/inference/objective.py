"""An objective step's batch (`TrainConfig.objective`), which `Trainer.step` makes here: DPO's from
pair records (`inference.reference`), GRPO's from a generation batch (`inference.rollout`)."""

from __future__ import annotations

from typing import Any

import torch


def objective_batch(group: Any, batch: Any) -> tuple[dict[str, torch.Tensor], dict]:
    """`(x, y)` of one step of `group`'s objective on `batch`: pair records (DPO) or a generation
    batch (GRPO)."""
    if group.config.objective["name"] == "dpo":
        from raypipe.driver.inference.reference import preference_batch

        return preference_batch(group, batch)
    from raypipe.driver.inference.rollout import grpo_batch

    return grpo_batch(group, batch)
