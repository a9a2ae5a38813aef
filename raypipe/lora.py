"""LoRA settings (`TrainConfig.lora`) and what each stage does with them, through `peft`.

Each stage actor injects peft's LoRA layers into the layers it builds (`apply`), right after
building them, under a seed of its own per layer, so the adapters start the same however the
model is split. The base weights are frozen: only the adapters get gradients, optimizer
state, the dp all-reduce and ZeRO shares. Adapters leave and enter in peft's own format
(`Trainer.save_adapter`, `load_adapter`); `dense_state` folds them into the base weights
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
        value = {
            "r": value.r,
            "alpha": value.lora_alpha,
            "dropout": value.lora_dropout,
            "target_modules": sorted(value.target_modules) if value.target_modules else None,
        }
    if not isinstance(value, dict):
        raise ConfigError(
            f"lora={value!r} is invalid: give a mapping such as {{'r': 8, 'alpha': 16, "
            f"'target_modules': ['q_proj', 'v_proj']}}, a peft.LoraConfig, or null."
        )
    unknown = sorted(set(value) - set(FIELDS))
    if unknown:
        raise ConfigError(f"lora has unknown fields {unknown}: it takes {sorted(FIELDS)}.")
    out = {**FIELDS, **value}
    if not isinstance(out["r"], int) or isinstance(out["r"], bool) or out["r"] < 1:
        raise ConfigError(f"lora.r={out['r']!r} is invalid: give the adapters' rank, a whole number >= 1.")
    if not isinstance(out["alpha"], (int, float)) or isinstance(out["alpha"], bool) or out["alpha"] <= 0:
        raise ConfigError(f"lora.alpha={out['alpha']!r} is invalid: give a positive number (the scale is alpha / r).")
    if not isinstance(out["dropout"], (int, float)) or isinstance(out["dropout"], bool) or not 0 <= out["dropout"] < 1:
        raise ConfigError(f"lora.dropout={out['dropout']!r} is invalid: give a number in [0, 1).")
    targets = out["target_modules"]
    if not targets or not isinstance(targets, (list, tuple)) or not all(isinstance(t, str) for t in targets):
        raise ConfigError(
            f"lora.target_modules={targets!r} is invalid: name the linear layers to adapt, "
            f"e.g. ['q_proj', 'v_proj'] (Llama) or ['c_attn'] (GPT-2)."
        )
    out["target_modules"] = list(targets)
    if tp > 1:
        raise ConfigError(
            f"lora with tp={tp} is not supported: peft cannot wrap raypipe's tensor-parallel "
            f"linears. Use tp=1 (pp and dp work with LoRA)."
        )
    return out


def peft_config(lora: dict[str, Any]) -> Any:
    from peft import LoraConfig

    return LoraConfig(
        r=lora["r"],
        lora_alpha=lora["alpha"],
        lora_dropout=lora["dropout"],
        target_modules=list(lora["target_modules"]),
        task_type="CAUSAL_LM",
    )


QUANTIZE = ("nf4", "int8")
QUANTIZE_KINDS = {"cpu", "cuda", "rocm"}  # where bitsandbytes has kernels (its CPU backend since 0.45)


def check_quantize(value: Any, lora_config: dict | None, kinds: list[str]) -> list[str | None] | None:
    """`TrainConfig.quantize` as one entry per stage (None: that stage keeps its dtype), checked
    against LoRA and each stage's device kind.

    Raises:
        ConfigError: naming the stage, its device kind and the options that work there.
    """
    if value is None:
        return None
    if not isinstance(value, (str, list, tuple)):
        raise ConfigError(
            f"quantize={value!r} is invalid: give 'nf4', 'int8', one of them (or null) per stage, or null."
        )
    per_stage = [value] * len(kinds) if isinstance(value, str) else list(value)
    if len(per_stage) != len(kinds):
        raise ConfigError(f"quantize={value!r} has {len(per_stage)} entries but pp={len(kinds)}: give one per stage.")
    if lora_config is None:
        raise ConfigError(
            f"quantize={value!r} stores a frozen base in fewer bits, which only LoRA leaves frozen: "
            f"set TrainConfig.lora too (QLoRA), or use hf.from_pretrained(..., dtype='bf16')."
        )
    for stage, (q, kind) in enumerate(zip(per_stage, kinds)):
        if q is not None and q not in QUANTIZE:
            raise ConfigError(f"quantize[{stage}]={q!r} is invalid: give one of {list(QUANTIZE)} or null.")
        if q is not None and kind not in QUANTIZE_KINDS:
            raise ConfigError(
                f"stage {stage} runs on {kind}, where bitsandbytes has no {q} kernels: give that stage null "
                f"(e.g. quantize: [nf4, null]) and load the base in bf16 (hf.from_pretrained(dtype='bf16')); "
                f"{q} works on {sorted(QUANTIZE_KINDS)} stages."
            )
    return per_stage


def quantize(layer: nn.Module, kind: str) -> None:
    """Replaces every linear of `layer` with bitsandbytes' 4-bit (NF4) or 8-bit twin holding the same
    weights, frozen (QLoRA's base). Computation stays in the weights' original dtype."""
    import bitsandbytes as bnb

    for name, child in list(layer.named_modules()):
        if type(child) is not nn.Linear:
            continue
        dtype = child.weight.dtype
        # the twin is made on the meta device and takes the linear's own tensors (quantized when
        # moved to its device): no full-size weight of its own, no copy of the linear's
        with torch.device("meta"):
            if kind == "nf4":
                new = bnb.nn.Linear4bit(
                    child.in_features,
                    child.out_features,
                    bias=child.bias is not None,
                    compute_dtype=dtype,
                    quant_type="nf4",
                )
            else:
                new = bnb.nn.Linear8bitLt(
                    child.in_features, child.out_features, bias=child.bias is not None, has_fp16_weights=False
                )
        if kind == "nf4":
            new.weight = bnb.nn.Params4bit(child.weight.data, requires_grad=False, quant_type="nf4")
            # on a CPU with AVX-512 bf16, bitsandbytes repacks the weight on the first forward in eval
            # mode, for good, and computes differently from then on (0.01 apart here): keep one path
            new.support_avx512bf16_for_cpu = False
        else:
            new.weight = bnb.nn.Int8Params(child.weight.data, requires_grad=False, has_fp16_weights=False)
        if child.bias is not None:
            new.bias = nn.Parameter(child.bias.data, requires_grad=False)
        parent, _, attr = name.rpartition(".")
        setattr(layer.get_submodule(parent) if parent else layer, attr, new.to(child.weight.device))


def dense_weight(module: nn.Module) -> torch.Tensor:
    """A linear's weight as a dense tensor: bitsandbytes' quantized ones dequantized."""
    weight = module.weight
    if type(weight).__name__ == "Params4bit":
        import bitsandbytes.functional as bnbf

        return bnbf.dequantize_4bit(weight.data, weight.quant_state).to(
            getattr(module, "compute_dtype", None) or torch.float32
        )
    if type(weight).__name__ == "Int8Params":  # row scales: on the weight until a forward moves them to the state
        scales = weight.SCB if weight.SCB is not None else module.state.SCB
        return weight.data.float() * scales.float().unsqueeze(1) / 127.0
    return weight


def apply(module: nn.Sequential, lora: dict[str, Any], seeds: list[int], quantized: str | None = None) -> None:
    """Injects LoRA adapters into every layer of `module` holding a target (layer j's under
    `seeds[j]`; in fp32 over a bf16 base, as peft keeps them), after storing the layers' linears
    in `quantized` bits ("nf4", "int8") when given, then freezes everything but the adapters."""
    from peft import inject_adapter_in_model
    from peft.tuners.tuners_utils import cast_adapter_dtype

    config = peft_config(lora)
    targets = set(lora["target_modules"])
    for layer in module if quantized else []:
        if not hasattr(layer, "lm_head"):  # QLoRA keeps the head in full precision
            quantize(layer, quantized)
    for layer, seed in zip(module, seeds):
        if not any(name.rpartition(".")[2] in targets for name, _ in layer.named_modules()):
            continue
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            inject_adapter_in_model(config, layer)
        # adapters over a bf16 (or fp16) base are kept in fp32, as get_peft_model keeps them
        cast_adapter_dtype(layer, ADAPTER, autocast_adapter_dtype=True)
    for name, p in module.named_parameters():
        p.requires_grad_(is_adapter(name))


def is_adapter(key: str) -> bool:
    return ".lora_A." in key or ".lora_B." in key


def base_key(key: str) -> str:
    """A state-dict key without peft's wrapping (`q_proj.base_layer.weight` -> `q_proj.weight`)."""
    return key.replace(".base_layer.", ".")


def dense_state(module: nn.Module, merge: bool) -> dict[str, torch.Tensor]:
    """The layers' base weights under the base keys, quantized ones dequantized (their statistics
    left out), with every adapter folded in when `merge`: what a transformers directory holds."""
    from peft.tuners.lora import LoraLayer

    dense: dict[str, torch.Tensor] = {}  # module path -> its dense weight
    for name, sub in module.named_modules():
        if isinstance(sub, LoraLayer):
            weight = dense_weight(sub.get_base_layer())
            dense[name] = weight + sub.get_delta_weight(ADAPTER).to(weight.dtype) if merge else weight
        elif type(getattr(sub, "weight", None)).__name__ in ("Params4bit", "Int8Params"):
            dense.setdefault(base_key(name + ".").rstrip("."), dense_weight(sub))
    state = {}
    for key, value in module.state_dict().items():
        if is_adapter(key):
            continue
        key = base_key(key)
        owner = next((m for m in dense if key.startswith(m + ".")), None)
        if owner is None:
            state[key] = value.detach().clone()
        elif key == f"{owner}.weight":
            state[key] = dense[owner].detach().clone()
        elif key == f"{owner}.bias":
            state[key] = value.detach().clone()
    return state
