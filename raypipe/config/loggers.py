"""`TrainConfig.loggers`, checked: which experiment loggers exist, what each imports and which
options it takes (`raypipe.observe.loggers` builds them from the same table)."""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping
from typing import Any

from raypipe.config.checks import fail
from raypipe.core.errors import nearest

# name -> (module it imports, the raypipe-train extra that installs it, the options it takes)
LOGGERS: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "tensorboard": ("tensorboard", "tensorboard", ("log_dir",)),
    "mlflow": ("mlflow", "mlflow", ("tracking_uri", "experiment")),
    "wandb": ("wandb", "wandb", ("project", "entity", "mode", "dir", "tags")),
}


LoggerEntry = str | dict[str, dict[str, object]]  # a logger's name, or {name: {option: value}}


def check_loggers(value: object) -> list[LoggerEntry]:
    """`TrainConfig.loggers`, checked: a list of logger names or one-key mappings `{name: options}`.

    Raises ConfigError for an unknown name or option, a repeated logger, or a logger whose
    package is not installed (naming the extra that installs it).
    """
    if isinstance(value, str) or not isinstance(value, (list, tuple)):
        raise fail(
            "loggers",
            value,
            f"give a list of logger names, from {', '.join(LOGGERS)} (e.g. ['tensorboard', 'mlflow']), or [] for none.",
        )
    seen, result = set(), []
    for entry in value:
        name, options = entry_of(entry)
        if name not in LOGGERS:
            hint = nearest(name, tuple(LOGGERS)) if isinstance(name, str) else ""
            raise fail("loggers", value, f"{name!r} is not a logger: choose from {', '.join(LOGGERS)}.{hint}")
        if name in seen:
            raise fail("loggers", value, f"{name!r} is listed twice: list each logger once.")
        seen.add(name)
        module, extra, allowed = LOGGERS[name]
        unknown = sorted(set(options) - set(allowed))
        if unknown:
            raise fail("loggers", value, f"{name} takes the options {', '.join(allowed)}, not {', '.join(unknown)}.")
        if importlib.util.find_spec(module) is None:
            raise fail(
                "loggers",
                value,
                f"the {name} logger needs the {module} package, which is not installed: "
                f"pip install 'raypipe-train[{extra}]' (or leave {name} out).",
            )
        result.append({name: dict(options)} if options else name)
    return result


def entry_of(entry: Any) -> tuple[Any, dict[str, object]]:
    """A `loggers` entry as (name, options)."""
    if isinstance(entry, Mapping) and len(entry) == 1:
        ((name, options),) = entry.items()
        if options is None or isinstance(options, Mapping):
            return name, dict(options or {})
    if isinstance(entry, str):
        return entry, {}
    raise fail("loggers", entry, "give each logger as its name, or as {name: {option: value}}.")
