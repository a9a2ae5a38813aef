"""`TrainConfig.optim`: what a step minimises and how the weights follow."""

from __future__ import annotations

from dataclasses import field as dataclasses_field

from raypipe.config.checks import check_choice, check_int, check_lr_schedule, check_optimizer, check_positive
from raypipe.config.choices import NONFINITE_POLICIES, NonfinitePolicy
from raypipe.config.objective import check_objective
from raypipe.config.sections.base import Section, section
from raypipe.config.settings import LrScheduleSettings, ObjectiveSettings, OptimizerSettings


def _adamw() -> OptimizerSettings:
    return {"name": "adamw", "lr": 1e-3}


def _constant() -> LrScheduleSettings:
    return {"name": "constant"}


@section("optim")
class OptimConfig(Section):
    """What a step minimises and how the weights follow: the optimizer, its schedule, the objective.

    Attributes:
        optimizer: {"name": "sgd" | "adam" | "adamw", "lr": ..., other torch.optim keywords}.
            Stages on the CPU use torch's fused kernels unless `fused` or `foreach` is given
            (AdamW steps ~2.8x faster there; "fused": False keeps torch's default).
        lr_schedule: {"name": "constant" | "cosine", "warmup_steps", "total_steps", "min_lr"}.
        grad_clip: clip gradients to this global L2 norm (across all stages); None disables.
        objective: what a step minimises. None: the loss function (a model's next-token loss).
            {"name": "dpo", "beta": 0.1, "loss_type": "sigmoid" | "hinge" | "ipo"}: direct
            preference optimisation as TRL defines it; `Trainer.step` then takes a list of pair
            records {"prompt_ids", "chosen_ids", "rejected_ids"} and measures each pair against the
            policy as the run began (its adapters, or a frozen copy of the weights; docs/preference.md).
            {"name": "grpo", "num_generations": G, "loss_type": "dapo" | "grpo" | "dr_grpo", "beta":
            0.0, "reward_funcs": [...], ...}: group
            relative policy optimisation as TRL's GRPOTrainer defines it; `Trainer.step` takes one
            generation batch {"prompt_ids", "completion_ids", "rewards"} and `fit` generates and scores
            each batch of prompts itself (docs/preference.md: every registered objective's settings).
        nonfinite: what a NaN or infinite loss or gradient does: "error" stops with an
            error naming the step, "skip" skips that update and goes on. Weights are
            never updated from non-finite gradients.
        seed: seeds layer initialisation (per layer, so the same for any split) and data order.
    """

    optimizer: OptimizerSettings = dataclasses_field(default_factory=_adamw)
    lr_schedule: LrScheduleSettings = dataclasses_field(default_factory=_constant)
    grad_clip: float | None = None
    objective: ObjectiveSettings | None = None
    nonfinite: NonfinitePolicy = "error"
    seed: int = 0

    def __post_init__(self) -> None:
        check_optimizer(self.optimizer)
        self.normalise("optimizer", dict(self.optimizer))
        check_lr_schedule(self.lr_schedule)
        self.normalise("lr_schedule", dict(self.lr_schedule))
        check_positive("grad_clip", self.grad_clip, allow_none=True)
        self.normalise("objective", check_objective(self.objective))
        check_choice("nonfinite", self.nonfinite, NONFINITE_POLICIES)
        check_int("seed", self.seed, 0)
