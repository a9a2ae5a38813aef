"""`TrainConfig.objective`: what a step minimises besides a model's own loss, one of the objectives
registered in `raypipe.objectives` (DPO, GRPO, ...), with TRL 1.16's names and defaults. Each
objective checks its own settings; this checks what they share."""

from __future__ import annotations

from typing import Any

from raypipe.config.checks import fail


def check_objective(value: object) -> dict[str, object] | None:
    """`TrainConfig.objective`, with its defaults filled in (None: the loss function's own). Its
    reference policy (every objective's that measures against one) is the starting adapters under `lora`,
    else a frozen copy of each stage's starting weights beside them (`objectives.reference`)."""
    if value is None:
        return None
    from raypipe.objectives import OBJECTIVES

    if not isinstance(value, dict) or value.get("name") not in OBJECTIVES:
        examples = ", ".join(f"{{'name': {name!r}, ...}}" for name in sorted(OBJECTIVES))
        raise fail("objective", value, f"give None or one of {examples} (their settings: docs/preference.md).")
    kind = OBJECTIVES[value["name"]]
    unknown = sorted(set(value) - set(kind.defaults))
    if unknown:
        raise fail(
            "objective",
            value,
            f"{', '.join(unknown)} are not {kind.name.upper()} settings: {', '.join(kind.defaults)} are.",
        )
    objective = {**kind.defaults, **value}
    kind.check(objective, value)
    return objective


def check_driver_steps(objective: dict[str, Any] | None, actor_steps: int | str) -> None:
    """An objective's batches pass through the driver before each step, so the driver steps."""
    if objective is not None and actor_steps not in (0, "auto"):
        raise fail(
            "actor_steps",
            actor_steps,
            f"each {objective['name'].upper()} step's batch goes through a pass on the driver first (the reference, or "
            'generation): give 0 or "auto".',
        )
