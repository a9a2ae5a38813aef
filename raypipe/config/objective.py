"""`TrainConfig.objective`: what a step minimises besides a model's own loss, DPO on preference pairs
or GRPO on scored generations, with TRL 1.16's names and defaults."""

from __future__ import annotations

from typing import Any

from raypipe.config.checks import fail, is_int, is_number

DPO = {"name": "dpo", "beta": 0.1, "loss_type": "sigmoid"}
GRPO = {
    "name": "grpo",
    "beta": 0.0,
    "loss_type": "dapo",
    "num_generations": 8,
    "epsilon": 0.2,
    "epsilon_high": None,
    "scale_rewards": "group",
    "max_completion_length": 512,
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": None,
    "num_iterations": 1,
    "reward_funcs": [],
    "reward_weights": None,
    "tokenizer": None,
    "eos_token_id": None,
}
DEFAULTS = {"dpo": DPO, "grpo": GRPO}


def check_objective(value: Any, actor_steps: Any = "auto") -> dict[str, Any] | None:
    """`TrainConfig.objective`, with its defaults filled in (None: the loss function's own). Its
    reference policy (DPO's, GRPO's with beta > 0) is the starting adapters under `lora`, else a
    frozen copy of each stage's starting weights beside them (`objectives.reference`)."""
    if value is None:
        return None
    if not isinstance(value, dict) or value.get("name") not in DEFAULTS:
        raise fail(
            "objective",
            value,
            'give None, {"name": "dpo", "beta": 0.1, "loss_type": "sigmoid"} or {"name": "grpo", "num_generations": 8, '
            '"loss_type": "dapo", "reward_funcs": [...]}.',
        )
    name = value["name"]
    unknown = sorted(set(value) - set(DEFAULTS[name]))
    if unknown:
        raise fail(
            "objective",
            value,
            f"{', '.join(unknown)} are not {name.upper()} settings: {', '.join(DEFAULTS[name])} are.",
        )
    objective = {**DEFAULTS[name], **value}
    (_check_dpo if name == "dpo" else _check_grpo)(objective, value)
    if actor_steps not in (0, "auto"):
        raise fail(
            "actor_steps",
            actor_steps,
            f"each {name.upper()} step's batch goes through a pass on the driver first (the reference, or generation): "
            'give 0 or "auto".',
        )
    return objective


def _check_dpo(objective: dict[str, Any], value: Any) -> None:
    from raypipe.objectives.dpo import LOSS_TYPES

    if not is_number(objective["beta"]) or objective["beta"] <= 0:
        raise fail("objective", value, "beta must be a number > 0 (TRL's default is 0.1).")
    if objective["loss_type"] not in LOSS_TYPES:
        raise fail("objective", value, f"loss_type must be one of {', '.join(map(repr, LOSS_TYPES))}.")


def _check_grpo(objective: dict[str, Any], value: Any) -> None:
    from raypipe.objectives.grpo import LOSS_TYPES
    from raypipe.objectives.rollouts import SCALINGS

    o = objective
    checks = [
        (is_number(o["beta"]) and o["beta"] >= 0, "beta must be a number >= 0 (TRL's default is 0.0: no KL term)."),
        (o["loss_type"] in LOSS_TYPES, f"loss_type must be one of {', '.join(map(repr, LOSS_TYPES))}."),
        (is_int(o["num_generations"]) and o["num_generations"] >= 2, "num_generations must be an int >= 2 (a group)."),
        (is_number(o["epsilon"]) and o["epsilon"] > 0, "epsilon must be a number > 0 (TRL's default is 0.2)."),
        (
            o["epsilon_high"] is None or (is_number(o["epsilon_high"]) and o["epsilon_high"] > 0),
            "epsilon_high: None or > 0.",
        ),
        (o["scale_rewards"] in SCALINGS, f"scale_rewards must be one of {', '.join(map(repr, SCALINGS))}."),
        (is_int(o["max_completion_length"]) and o["max_completion_length"] >= 1, "max_completion_length: an int >= 1."),
        (is_number(o["temperature"]) and o["temperature"] > 0, "temperature must be > 0 (GRPO samples)."),
        (is_number(o["top_p"]) and 0 < o["top_p"] <= 1, "top_p must be in (0, 1]."),
        (o["top_k"] is None or (is_int(o["top_k"]) and o["top_k"] >= 1), "top_k: None or an int >= 1."),
        (is_int(o["num_iterations"]) and o["num_iterations"] >= 1, "num_iterations must be an int >= 1."),
        (isinstance(o["reward_funcs"], (list, tuple)), "reward_funcs: a list of callables or 'module:function' paths."),
        (
            o["tokenizer"] is None or isinstance(o["tokenizer"], str) or hasattr(o["tokenizer"], "batch_decode"),
            "tokenizer: None (completions as token ids), a model directory's path, or a tokenizer.",
        ),
        (o["eos_token_id"] is None or is_int(o["eos_token_id"]), "eos_token_id: None or a token id."),
    ]
    for ok, fix in checks:
        if not ok:
            raise fail("objective", value, fix)
    o["reward_funcs"] = list(o["reward_funcs"])
    for f in o["reward_funcs"]:
        if not callable(f) and not (isinstance(f, str) and ":" in f):
            raise fail(
                "objective", value, f"reward function {f!r}: give a callable or an import path 'module:function'."
            )
    weights = o["reward_weights"]
    if weights is not None and (
        not isinstance(weights, (list, tuple))
        or len(weights) != len(o["reward_funcs"])
        or not all(is_number(w) for w in weights)
    ):
        raise fail("objective", value, "reward_weights: None (all 1) or one number per reward function.")
