"""LoRA settings (`TrainConfig.lora`) and what each stage does with them, through `peft`.

Each stage actor injects peft's LoRA layers into the layers it builds (`apply`), right after
building them, under a seed of its own per layer, so the adapters start the same however the
model is split. The base weights are frozen: only the adapters get gradients, optimizer
state, the dp all-reduce and ZeRO shares. Adapters leave and enter in peft's own format
(`Trainer.save_adapter`, `load_adapter`); `merged_state` folds them into the base weights
for `save_pretrained(merge_adapters=True)`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from raypipe.errors import ConfigError

FIELDS = {"r": 8, "alpha": 16, "dropout": 0.0, "target_modules": None}
ADAPTER = "default"  # peft's adapter name; its state-dict keys carry it, its files do not


def check(value: Any, tp: int) -> dict[str, Any] | None:
    """`TrainConfig.lora` as a plain dict (from a dict or a `peft.LoraConfig`), checked.

    Raises:
        ConfigError: naming the field, the value and what to give instead.
    """
    if value is None:
        return None
    if type(value).__name__ == "LoraConfig":  # a peft.LoraConfig
        value = {"r": value.r, "alpha": value.lora_alpha, "dropout": value.lora_dropout,
                 "target_modules": sorted(value.target_modules) if value.target_modules else None}
    if not isinstance(value, dict):
        raise ConfigError(f"lora={value!r} is invalid: give a mapping such as {{'r': 8, 'alpha': 16, "
                          f"'target_modules': ['q_proj', 'v_proj']}}, a peft.LoraConfig, or null.")
    unknown = sorted(set(value) - set(FIELDS))
    if unknown:
        raise ConfigError(f"lora has unknown fields {unknown}: it takes {sorted(FIELDS)}.")
    out = {**FIELDS, **value}
    if not isinstance(out["r"], int) or isinstance(out["r"], bool) or out["r"] < 1:
        raise ConfigError(f"lora.r={out['r']!r} is invalid: give the adapters' rank, a whole number >= 1.")
    if not isinstance(out["alpha"], (int, float)) or out["alpha"] <= 0:
        raise ConfigError(f"lora.alpha={out['alpha']!r} is invalid: give a positive number (the scale is alpha / r).")
    if not isinstance(out["dropout"], (int, float)) or not 0 <= out["dropout"] < 1:
        raise ConfigError(f"lora.dropout={out['dropout']!r} is invalid: give a number in [0, 1).")
    targets = out["target_modules"]
    if not targets or not isinstance(targets, (list, tuple)) or not all(isinstance(t, str) for t in targets):
        raise ConfigError(f"lora.target_modules={targets!r} is invalid: name the linear layers to adapt, "
                          f"e.g. ['q_proj', 'v_proj'] (Llama) or ['c_attn'] (GPT-2).")
    out["target_modules"] = list(targets)
    if tp > 1:
        raise ConfigError(f"lora with tp={tp} is not supported: peft cannot wrap raypipe's tensor-parallel "
                          f"linears. Use tp=1 (pp and dp work with LoRA).")
    return out


def peft_config(lora: dict[str, Any]) -> Any:
    from peft import LoraConfig

    return LoraConfig(r=lora["r"], lora_alpha=lora["alpha"], lora_dropout=lora["dropout"],
                      target_modules=list(lora["target_modules"]), task_type="CAUSAL_LM")


def apply(module: nn.Sequential, lora: dict[str, Any], seeds: list[int]) -> None:
    """Injects LoRA adapters into every layer of `module` holding a target (layer j's under
    `seeds[j]`), then freezes everything but the adapters."""
    from peft import inject_adapter_in_model

    config = peft_config(lora)
    targets = set(lora["target_modules"])
    for layer, seed in zip(module, seeds):
        if not any(name.rpartition(".")[2] in targets for name, _ in layer.named_modules()):
            continue
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            inject_adapter_in_model(config, layer)
    for name, p in module.named_parameters():
        p.requires_grad_(is_adapter(name))


def is_adapter(key: str) -> bool:
    return ".lora_A." in key or ".lora_B." in key


def base_key(key: str) -> str:
    """A state-dict key without peft's wrapping (`q_proj.base_layer.weight` -> `q_proj.weight`)."""
    return key.replace(".base_layer.", ".")


def merged_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """The layers' weights with every adapter folded into its base weight, under the base keys."""
    from peft.tuners.lora import LoraLayer

    merged = {}
    for name, sub in module.named_modules():
        if isinstance(sub, LoraLayer):
            base = sub.get_base_layer()
            merged[f"{name}.weight"] = (base.weight + sub.get_delta_weight(ADAPTER)).detach().clone()
    state = {}
    for key, value in module.state_dict().items():
        if is_adapter(key):
            continue
        key = base_key(key)
        state[key] = merged.get(key, value.detach().clone())
    return state
