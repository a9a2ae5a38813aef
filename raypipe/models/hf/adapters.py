"""LoRA adapters of a split transformers model in peft's own format: `adapter_model.safetensors`
(keys as `PeftModel` saves them: `base_model.model.<checkpoint key>` without the adapter's
name) and `adapter_config.json`, so `peft.PeftModel.from_pretrained(base, dir)` loads what
raypipe trained, and raypipe loads what peft saved."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch

from raypipe.driver.results import gather
from raypipe.errors import ConfigError
from raypipe.layers import LayerSpec
from raypipe.lora import ADAPTER, peft_config
from raypipe.models.hf.layers import checkpoint_key

WEIGHTS, CONFIG = "adapter_model.safetensors", "adapter_config.json"
PREFIX = "base_model.model."


def peft_names(keys: Sequence[str], prefixes: list[list[tuple[str, str]]]) -> dict[str, str]:
    """raypipe adapter key (`"<layer>.<local>"`) -> the key peft saves it under."""
    names = {}
    for key in keys:
        index, _, local = key.partition(".")
        names[key] = PREFIX + checkpoint_key(prefixes[int(index)], local).replace(f".{ADAPTER}.", ".")
    return names


def save(
    stages: Sequence[Sequence[Any]], specs: Sequence[LayerSpec], model: Any, lora: dict | None, directory: str
) -> None:
    """Writes replica 0's adapters (every stage's, through the driver: they are small) with the
    config peft reads, naming the base model's directory when it came from one."""
    from safetensors.torch import save_file

    if lora is None:
        raise ConfigError(
            "save_adapter needs a LoRA run: set TrainConfig.lora (e.g. {'r': 8, 'target_modules': "
            "['q_proj', 'v_proj']}); save_pretrained writes a whole model."
        )
    state: dict[str, torch.Tensor] = {}
    for part in gather([stage[0].adapters.remote() for stage in stages], "save_adapter"):
        state.update(part)
    names = peft_names(list(state), _exporter(model).prefixes(specs))
    os.makedirs(directory, exist_ok=True)
    save_file(
        {names[k]: v.contiguous() for k, v in state.items()},
        os.path.join(directory, WEIGHTS),
        metadata={"format": "pt"},
    )
    config = peft_config(lora)
    config.base_model_name_or_path = getattr(model, "source", None)
    config.save_pretrained(directory)


def load(
    actors: Sequence[Any],
    stages: Sequence[Sequence[Any]],
    specs: Sequence[LayerSpec],
    model: Any,
    plan: Sequence[Sequence[tuple[int, int]]],
    directory: str,
) -> None:
    """Loads peft-format adapters into every actor (each stage its own), replacing the adapters.

    Raises:
        ConfigError: no adapter file, or adapters that do not fit this model's (names the keys).
    """
    from safetensors.torch import load_file

    path = os.path.join(directory, WEIGHTS)
    if not os.path.exists(path):
        raise ConfigError(
            f"{directory} holds no {WEIGHTS}: give a directory save_adapter (or peft's save_pretrained) wrote."
        )
    saved = load_file(path)
    mine: list[str] = []
    for part in gather([stage[0].adapters.remote() for stage in stages], "load_adapter"):
        mine += list(part)
    names = peft_names(mine, _exporter(model).prefixes(specs))
    missing = sorted(n for n in names.values() if n not in saved)
    stray = sorted(set(saved) - set(names.values()))
    if missing or stray:
        raise ConfigError(
            f"the adapters in {directory} do not fit this model's: missing {missing[:3]}, "
            f"unexpected {stray[:3]} (another rank, target_modules or model?)"
        )
    state = {key: saved[name] for key, name in names.items()}
    parts = [
        {k: v for k, v in state.items() if any(a <= int(k.partition(".")[0]) < b for a, b in ranges)} for ranges in plan
    ]  # per stage, the layer ranges it holds
    # LoRA runs have tp = 1: world rank d * pp + s holds stage s of replica d
    gather([a.load_adapters.remote(parts[rank % len(plan)]) for rank, a in enumerate(actors)], "load_adapter")


def load_group(group: Any, directory: str) -> None:
    """`load` into every actor of `group` (an `ActorGroup`): `Trainer.load_adapter`, and a recovery
    loading them again."""
    with group.whole_weights():
        load(group.actors, group.replica0()[0], group.specs, group.model, group.actor_plan(), directory)


def _exporter(model: Any) -> Any:
    """The transformers key mapping of `model` (peft's format names tensors by it)."""
    exporter = getattr(model, "exporter", None)
    if not hasattr(exporter, "prefixes"):
        raise ConfigError(
            "adapters in peft's format need a transformers model (raypipe.models.hf): peft names "
            "each adapter by the transformers module it adapts."
        )
    return exporter
