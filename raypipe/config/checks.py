"""Checks of single config values, each raising a ConfigError that names the field, the value
and the fix; `raypipe.config.TrainConfig` validates itself with them, and job sections reuse
`check_whole_number` and `nearest`."""

from __future__ import annotations

import inspect
import math
from collections.abc import Mapping
from typing import TypeGuard

from raypipe.core.errors import ConfigError, nearest

OPTIMIZER_NAMES = ("sgd", "adam", "adamw")
LR_SCHEDULE_NAMES = ("constant", "cosine")
LR_SCHEDULE_KEYS = ("name", "warmup_steps", "total_steps", "min_lr")


def invalid(label: str, value: object, fix: str) -> ConfigError:
    """The error for a bad value: `label=value is invalid: fix`."""
    return ConfigError(f"{label}={value!r} is invalid: {fix}")


def check_whole_number(label: str, value: object, minimum: int) -> None:
    """Raises ConfigError unless `value` is an int (not a bool) >= minimum."""
    if not is_int(value) or value < minimum:
        raise invalid(label, value, f"give a whole number >= {minimum}.")


def fail(name: str, value: object, fix: str) -> ConfigError:
    return invalid(f"TrainConfig.{name}", value, fix)


def is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: object) -> TypeGuard[int | float]:
    """A finite int or float (NaN and infinity pass every `<` test the wrong way)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def check_int(name: str, value: object, minimum: int) -> None:
    check_whole_number(f"TrainConfig.{name}", value, minimum)


def check_positive(name: str, value: object, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if not is_number(value) or value <= 0:
        raise fail(name, value, "give a finite number > 0" + (" or null." if allow_none else "."))


def check_choice(name: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        hint = nearest(value, choices) if isinstance(value, str) else ""
        raise fail(name, value, f"choose one of {', '.join(choices)}.{hint}")


def optimizer_class(name: str):
    import torch

    return {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}[name]


def check_optimizer(value: object) -> None:
    if not isinstance(value, Mapping) or "name" not in value:
        raise fail("optimizer", value, "give a mapping with a name, e.g. {'name': 'adamw', 'lr': 1e-3}.")
    check_choice("optimizer.name", value["name"], OPTIMIZER_NAMES)
    if "lr" not in value:
        raise fail("optimizer", value, "give a learning rate, e.g. 'lr': 1e-3.")
    check_positive("optimizer.lr", value["lr"])
    accepted = [p for p in inspect.signature(optimizer_class(value["name"])).parameters if p != "params"]
    for key in value:
        if key != "name" and key not in accepted:
            raise fail(
                f"optimizer.{key}",
                value[key],
                f"torch.optim {value['name']} takes {', '.join(accepted)}.{nearest(key, accepted)}",
            )


def check_lr_schedule(value: object) -> None:
    if not isinstance(value, Mapping) or "name" not in value:
        raise fail("lr_schedule", value, "give a mapping with a name, e.g. {'name': 'constant'}.")
    check_choice("lr_schedule.name", value["name"], LR_SCHEDULE_NAMES)
    for key in value:
        if key not in LR_SCHEDULE_KEYS:
            raise fail(
                f"lr_schedule.{key}",
                value[key],
                f"lr_schedule takes {', '.join(LR_SCHEDULE_KEYS)}.{nearest(key, LR_SCHEDULE_KEYS)}",
            )
    check_int("lr_schedule.warmup_steps", value.get("warmup_steps", 0), 0)
    if value["name"] == "cosine":
        if "total_steps" not in value:
            raise fail("lr_schedule", value, "cosine needs total_steps (the step it reaches min_lr).")
        check_int("lr_schedule.total_steps", value["total_steps"], 1)
    min_lr = value.get("min_lr", 0.0)
    if not is_number(min_lr) or min_lr < 0:
        raise fail("lr_schedule.min_lr", min_lr, "give a number >= 0.")


def check_shard_plan(value: object) -> None:
    """A shard plan's form, [start, end) pairs of whole numbers (its length: `check_plan_length`)."""
    if value is None:
        return
    if not isinstance(value, (list, tuple)) or not all(
        isinstance(r, (list, tuple)) and len(r) == 2 and all(is_int(i) for i in r) for r in value
    ):
        raise fail("shard_plan", value, "give one [start, end) pair of layer indices per stage, e.g. [[0, 3], [3, 5]].")


def check_plan_length(value: list[list[int]] | None, pp: int, chunks: int = 1) -> None:
    """A shard plan gives one range per stage (per virtual stage with model chunks)."""
    if value is not None and len(value) != pp * chunks:
        per = (
            f"pp={pp}: give one range per stage"
            if chunks == 1
            else f"pp={pp} x {chunks} chunks: give one range per virtual stage (chunk c of stage s is virtual stage c*pp+s)"  # noqa: E501
        )
        raise fail("shard_plan", value, f"it has {len(value)} ranges but {per}.")


DEVICE_KINDS = ("cpu", "cuda", "rocm", "mps")


def check_devices(value: object) -> None:
    """`devices`: one kind for every stage, or a list of kinds (their count: `check_devices_per_stage`)."""
    if isinstance(value, str):
        check_choice("devices", value, DEVICE_KINDS)
        return
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise fail("devices", value, f"give one kind of {', '.join(DEVICE_KINDS)}, or a list of them, one per stage.")
    for kind in value:
        check_choice("devices", kind, DEVICE_KINDS)


def check_devices_per_stage(value: str | list[str], pp: int) -> None:
    """A list of device kinds names one per stage."""
    if not isinstance(value, str) and len(value) != pp:
        raise fail(
            "devices", value, f"it names {len(value)} kinds but pp={pp}: give one kind per stage, or one for all."
        )


def plain(value: object) -> object:
    """`value` as JSON and YAML hold it, for a config's records (a checkpoint's manifest, trainer.json,
    a logger's parameters, `str(config)`): a function as its import path "module:name" (what a YAML
    config gives), an object that names where it was loaded from (a tokenizer) as that path, any other
    object as its repr. A record, not a recipe: a resume takes such values from its own config."""
    if isinstance(value, Mapping):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if callable(value):
        module, name = getattr(value, "__module__", None), getattr(value, "__qualname__", None)
        if module and name and module != "__main__" and "<" not in name:
            return f"{module}:{name}"
        return f"<{getattr(value, '__name__', type(value).__name__)}: a Python callable, not recorded>"
    path = getattr(value, "name_or_path", None)
    return path if isinstance(path, str) and path else repr(value)
