"""LoRA adapters of a split transformers model in peft's own format: `adapter_model.safetensors`
(keys as `PeftModel` saves them: `base_model.model.<checkpoint key>` without the adapter's
name) and `adapter_config.json`, so `peft.PeftModel.from_pretrained(base, dir)` loads what
raypipe trained, and raypipe loads what peft saved."""

from __future__ import annotations

from collections.abc import Sequence

from raypipe.core.layers import checkpoint_key
from raypipe.nn.lora import ADAPTER

WEIGHTS, CONFIG = "adapter_model.safetensors", "adapter_config.json"
PREFIX = "base_model.model."


def peft_names(keys: Sequence[str], prefixes: list[list[tuple[str, str]]]) -> dict[str, str]:
    """raypipe adapter key (`"<layer>.<local>"`) -> the key peft saves it under."""
    names = {}
    for key in keys:
        index, _, local = key.partition(".")
        names[key] = PREFIX + checkpoint_key(prefixes[int(index)], local).replace(f".{ADAPTER}.", ".")
    return names
