"""LoRA adapters written and read in peft's format (`models.hf.adapters`: its file names and keys)
across the actors: every stage's adapters gathered and saved by the driver (they are small), and
a saved set handed to every actor, each taking its own (`Trainer.save_adapter`, `load_adapter`,
and a recovery loading them again)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from raypipe.core.errors import ConfigError
from raypipe.driver.results import gather
from raypipe.models.hf.adapters import PREFIX, WEIGHTS
from raypipe.nn.lora import peft_config

if TYPE_CHECKING:
    from ray.actor import ActorHandle

    from raypipe.driver.actor_group import ActorGroup


def save(stages: Sequence[Sequence[Any]], model: Any, lora: dict | None, directory: str) -> None:
    """Writes replica 0's adapters as peft saves them (every stage's, through the driver: they are
    small; each stage names them with peft's own `get_peft_model_state_dict`) with peft's own
    serialisation of the run's LoraConfig, naming the base model's directory when it came from one."""
    from safetensors.torch import save_file

    if lora is None:
        raise ConfigError(
            "save_adapter needs a LoRA run: set TrainConfig.lora (e.g. {'r': 8, 'target_modules': "
            "['q_proj', 'v_proj']}); save_pretrained writes a whole model."
        )
    state: dict[str, torch.Tensor] = {}
    for part in gather([stage[0].peft_adapters.remote() for stage in stages], "save_adapter"):
        state.update(part)
    os.makedirs(directory, exist_ok=True)
    save_file(
        {PREFIX + k: v.contiguous() for k, v in state.items()}, os.path.join(directory, WEIGHTS), {"format": "pt"}
    )
    config = peft_config(lora)
    config.base_model_name_or_path = getattr(model, "source", None)
    config.save_pretrained(directory)


def load(actors: Sequence[ActorHandle], directory: str) -> None:
    """Loads peft-format adapters into every actor (each stage takes its own), replacing the adapters.

    Raises:
        ConfigError: no adapter file, or adapters that do not fit this model's (names the keys).
    """
    from safetensors.torch import load_file

    path = os.path.join(directory, WEIGHTS)
    if not os.path.exists(path):
        raise ConfigError(
            f"{directory} holds no {WEIGHTS}: give a directory save_adapter (or peft's save_pretrained) wrote."
        )
    saved = {k.removeprefix(PREFIX): v for k, v in load_file(path).items()}
    try:
        parts = gather([a.load_peft_adapters.remote(saved) for a in actors], "load_adapter")
    except Exception as error:  # noqa: BLE001 - a stage's refusal names the keys it lacks
        raise ConfigError(f"the adapters in {directory} do not fit this model's: {error}") from None
    stray = sorted(set(saved) - {k for part in parts for k in part})
    if stray:
        raise ConfigError(
            f"the adapters in {directory} do not fit this model's: unexpected {stray[:3]} "
            f"(another rank, target_modules or model?)"
        )


def load_group(group: ActorGroup, directory: str) -> None:
    """`load` into every actor of `group` (an `ActorGroup`): `Trainer.load_adapter`, and a recovery
    loading them again."""
    with group.whole_weights():
        load(group.actors, directory)
