"""The typed settings a `TrainConfig` field holds as a mapping: the optimizer, its learning-rate
schedule, the objective and LoRA. Each is a `TypedDict`, so `{"name": "adamw", "lr": 1e-3}` in
Python, YAML or `--set optimizer.lr=...` is the value itself, and an editor or type checker knows
its keys. A section checks and converts its value once, when it is built (a peft `LoraConfig`
becomes its fields); what the actors and the driver read after that is this form."""

from __future__ import annotations

from typing import Literal, Required, TypedDict

OptimizerName = Literal["sgd", "adam", "adamw"]
LrScheduleName = Literal["constant", "cosine"]


class OptimizerSettings(TypedDict, total=False):
    """`TrainConfig.optimizer`: a torch.optim optimizer by name with its keywords (any keyword its
    class takes is accepted; the common ones are typed here)."""

    name: Required[OptimizerName]
    lr: Required[float]
    weight_decay: float
    momentum: float
    dampening: float
    nesterov: bool
    betas: tuple[float, float] | list[float]
    eps: float
    amsgrad: bool
    maximize: bool
    foreach: bool | None
    fused: bool | None


class LrScheduleSettings(TypedDict, total=False):
    """`TrainConfig.lr_schedule`: a constant rate, or a linear warm-up then a cosine to `min_lr`."""

    name: Required[LrScheduleName]
    warmup_steps: int
    total_steps: int
    min_lr: float


class ObjectiveSettings(TypedDict, total=False):
    """`TrainConfig.objective`: a registered objective by name (`raypipe.objectives.OBJECTIVES`) with
    its settings, TRL's names and defaults filled in. The keys beyond the name are the objective's
    own, declared and checked by it (docs/preference.md lists them), so they are not typed here."""

    name: Required[str]
    beta: float
    loss_type: str


class LoraSettings(TypedDict, total=False):
    """`TrainConfig.lora`: peft's `LoraConfig` fields as plain values (the common ones typed here;
    every field peft takes is accepted and checked by peft itself)."""

    r: int
    lora_alpha: float
    lora_dropout: float
    target_modules: str | list[str]
    exclude_modules: str | list[str] | None
    use_rslora: bool
    use_dora: bool
    bias: Literal["none", "all", "lora_only"]
    modules_to_save: list[str] | None
    rank_pattern: dict[str, int]
    alpha_pattern: dict[str, float]
    init_lora_weights: bool | str
