"""LoRA settings (`TrainConfig.lora`) and what each stage does with them, through `peft`.

`TrainConfig.lora` takes a `peft.LoraConfig` or its fields as a dict, and means what peft means
by every field it honours: `target_modules` as a list, a string or regex, or "all-linear";
`exclude_modules`, `layers_to_transform` with `layers_pattern`, `rank_pattern`, `alpha_pattern`,
`use_rslora`, `bias`, `modules_to_save`, `init_lora_weights` (True, False, "gaussian"). Fields
raypipe cannot honour (DoRA, initialisations that rewrite the base, ...) are refused by name.

Each stage actor injects peft's LoRA layers into the layers it builds (`apply`), right after
building them, under a seed of its own per layer, so the adapters start the same however the
model is split. peft sees each layer under the names it has in the whole model (`named_view`:
a transformers layer's `model.layers.3.self_attn.q_proj`), so its matching, layer filters,
patterns and saved names are the whole model's. What peft leaves trainable (the adapters, the
biases `bias` trains, `modules_to_save`'s copies) trains; the rest is frozen. Adapters leave and
enter in peft's own format (`peft_state`, `load_peft_state`; `Trainer.save_adapter`,
`load_adapter`); `dense_state` folds them into the base weights for
`save_pretrained(merge_adapters=True)`.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from raypipe.core.errors import ConfigError
from raypipe.core.layers import checkpoint_key

ADAPTER = "default"  # peft's adapter name; its state-dict keys carry it, its files do not
ALIASES = {"alpha": "lora_alpha", "dropout": "lora_dropout"}  # raypipe's short names, still taken
# fields of a LoraConfig that describe the saved file, not the training: kept as peft writes them
IGNORED = ("task_type", "peft_type", "auto_mapping", "peft_version", "base_model_name_or_path", "revision")
# fields raypipe cannot honour where they differ from peft's default, and why
REFUSED = {
    "use_dora": "DoRA's magnitude vectors are not split across stages yet",
    "use_qalora": "QA-LoRA needs GPTQ-quantized layers",
    "lora_bias": "a LoRA bias on the B matrix is not carried to the exported adapters yet",
    "layer_replication": "replicated layers would be built on several stages",
    "trainable_token_indices": "token-level training of the embedding is not supported",
    "target_parameters": "parameters as targets (not modules) are not supported",
    "megatron_config": "Megatron's parallel layers are not raypipe's",
    "alora_invocation_tokens": "activated LoRA is not supported",
    "use_bdlora": "block-diagonal LoRA is not supported",
}
INITS = (True, False, "gaussian")  # initialisations that leave the base as it is


def check(value: Any) -> dict[str, Any] | None:
    """`TrainConfig.lora` as a plain dict of `peft.LoraConfig`'s fields (from a LoraConfig or a
    dict of its fields; "alpha" and "dropout" stand for lora_alpha and lora_dropout), checked by
    peft itself and for what raypipe honours.

    Raises:
        ConfigError: naming the field, the value and what to give instead.
    """
    if value is None:
        return None
    if type(value).__name__ == "LoraConfig":  # a peft.LoraConfig
        value = value.to_dict()
    if not isinstance(value, dict):
        raise ConfigError(
            f"lora={value!r} is invalid: give a mapping such as {{'r': 8, 'lora_alpha': 16, "
            f"'target_modules': ['q_proj', 'v_proj']}}, a peft.LoraConfig, or null."
        )
    fields = {ALIASES.get(k, k): v for k, v in value.items() if k not in IGNORED}
    r, targets = fields.get("r", 8), fields.get("target_modules")
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise ConfigError(f"lora.r={r!r} is invalid: give the adapters' rank, a whole number >= 1.")
    if not targets or not (isinstance(targets, str) or all(isinstance(t, str) for t in targets)):
        raise ConfigError(
            f"lora.target_modules={targets!r} is invalid: name the linear layers to adapt, e.g. ['q_proj', "
            f"'v_proj'] (Llama) or ['c_attn'] (GPT-2), a regex matched against their full names, or 'all-linear'."
        )
    config = _peft(fields)
    for name, why in REFUSED.items():
        if getattr(config, name, None) not in (None, False, [], {}):
            raise ConfigError(f"lora.{name}={getattr(config, name)!r} is refused: {why}. Leave it at peft's default.")
    if config.init_lora_weights not in INITS:
        raise ConfigError(
            f"lora.init_lora_weights={config.init_lora_weights!r} is refused: it rewrites the base weights, which "
            f"each stage reads from the model directory. Use one of {list(INITS)}."
        )
    return _plain({k: v for k, v in config.to_dict().items() if k not in IGNORED})


def check_tensor_parallel(settings: dict[str, Any] | None, tp: int) -> None:
    """Refuses LoRA across tensor-parallel ranks, which peft cannot wrap."""
    if settings is not None and tp > 1:
        raise ConfigError(
            f"lora with tp={tp} is not supported: peft cannot wrap raypipe's tensor-parallel "
            f"linears. Use tp=1 (pp and dp work with LoRA)."
        )


def _peft(fields: dict[str, Any]) -> Any:
    """peft's LoraConfig of `fields`, its own checks turned into errors naming the field."""
    import inspect

    from peft import LoraConfig

    known = set(inspect.signature(LoraConfig).parameters)
    unknown = sorted(set(fields) - known)
    if unknown:
        raise ConfigError(
            f"lora has unknown fields {unknown}: it takes peft.LoraConfig's fields, e.g. r, lora_alpha, "
            f"lora_dropout, target_modules, exclude_modules, use_rslora, bias, modules_to_save, rank_pattern."
        )
    try:
        return LoraConfig(**fields)
    except (ValueError, TypeError) as error:
        raise ConfigError(f"lora is invalid, as peft says: {error}") from None


def _plain(value: Any) -> Any:
    """`value` with sets as sorted lists and enums as their values: what YAML and JSON hold."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (set, frozenset)):
        return sorted(value)
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return getattr(value, "value", value) if type(value).__module__.startswith("peft") else value


def peft_config(lora: dict[str, Any]) -> Any:
    """peft's own LoraConfig of `TrainConfig.lora` (its short names taken too)."""
    from peft import LoraConfig

    fields = {ALIASES.get(k, k): v for k, v in lora.items() if k not in IGNORED}
    return LoraConfig(**{**fields, "task_type": "CAUSAL_LM"})


QUANTIZE = ("nf4", "int8")
QUANTIZE_KINDS = {"cpu", "cuda", "rocm"}  # where bitsandbytes has kernels (its CPU backend since 0.45)


def check_quantize(value: object, lora_config: dict | None, kinds: list[str]) -> list[str | None] | None:
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


def resolve(lora: dict[str, object], layers: list[nn.Module], whole: nn.Module | None) -> dict[str, object]:
    """The run's LoRA settings with "all-linear" made the list of names peft makes of it (on the
    whole transformers model `whole`, whose output layer it leaves out; else every linear), checked
    against the model's layers (built on the meta device): targets that match nothing are refused,
    as peft refuses them.

    Raises:
        ConfigError: no module of the model matches the targets (peft's words, and its fields).
    """
    from peft.tuners.tuners_utils import _maybe_include_all_linear_layers, check_target_module_exists

    config = peft_config(lora)
    if config.target_modules == "all-linear":
        if whole is not None:
            config = _maybe_include_all_linear_layers(config, whole)
        else:
            linear = {n.rpartition(".")[2] for layer in layers for n, m in layer.named_modules() if _linear(m)}
            config.target_modules = linear
    names = [name for layer in layers for name, _ in named_view(layer).named_modules() if name]
    if not any(check_target_module_exists(config, name) for name in names):
        raise ConfigError(
            f"lora.target_modules={lora['target_modules']!r} (exclude_modules={config.exclude_modules!r}, "
            f"layers_to_transform={config.layers_to_transform!r}): Target modules not found in the base model, "
            f"as peft says. Its modules are named like {names[-4:]}."
        )
    return {**lora, "target_modules": _plain(config.target_modules)}


def _linear(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) or type(module).__name__ == "Conv1D"


def apply(module: nn.Sequential, lora: dict[str, object], seeds: list[int], quantized: str | None = None) -> None:
    """Injects LoRA adapters into every layer of `module` holding a target (layer j's under
    `seeds[j]`; in fp32 over a bf16 base, as peft keeps them), after storing the layers' linears
    in `quantized` bits ("nf4", "int8") when given. peft sees each layer under its whole-model
    names (`named_view`) and leaves trainable what it trains; every other weight is frozen."""
    from peft import inject_adapter_in_model
    from peft.tuners.tuners_utils import cast_adapter_dtype, check_target_module_exists

    config = peft_config(lora)
    for layer in module if quantized else []:
        if not hasattr(layer, "lm_head"):  # QLoRA keeps the head in full precision
            quantize(layer, quantized)
    for p in module.parameters():
        p.requires_grad_(False)
    for layer, seed in zip(module, seeds):
        view = named_view(layer)
        names = [name for name, _ in view.named_modules() if name]
        if any(check_target_module_exists(config, name) for name in names):
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                inject_adapter_in_model(copy.deepcopy(config), view)
        elif any(name.rpartition(".")[2] in (config.modules_to_save or ()) for name in names):
            # a layer with modules to save but no target: peft's own wrapper, as get_peft_model wraps them
            from peft.utils.other import _set_trainable

            _set_trainable(view, ADAPTER, module_names=config.modules_to_save, inference_mode=False)
            view.peft_config = {ADAPTER: copy.deepcopy(config)}
        else:
            continue
        _take_back(layer, view)
        object.__setattr__(layer, "lora_view", view)  # peft's config is on it: what saving and loading ask
        # adapters over a bf16 (or fp16) base are kept in fp32, as get_peft_model keeps them
        cast_adapter_dtype(view, ADAPTER, autocast_adapter_dtype=True)


def named_view(layer: nn.Module) -> nn.Module:
    """`layer`'s submodules under the names the whole model gives them: a transformers layer's by
    its `prefixes` (its decoder block as `model.layers.3`), so peft matches, ranks and saves them as
    in the whole model; any other layer is its own view."""
    prefixes = getattr(layer, "prefixes", None)
    if not prefixes:
        return layer
    root = nn.Module()
    for name, child in layer.named_children():
        *path, leaf = checkpoint_key(prefixes, name + ".").rstrip(".").split(".")
        parent = root
        for part in path:
            if part not in parent._modules:
                parent.add_module(part, nn.Module())
            parent = parent._modules[part]
        parent.add_module(leaf, child)
    return root


def _take_back(layer: nn.Module, view: nn.Module) -> None:
    """Puts back into `layer` the children peft replaced in its view (a target or a module to save
    that is one of the layer's own children, such as a head)."""
    if view is layer:
        return
    for name, child in list(layer.named_children()):
        now = view.get_submodule(checkpoint_key(layer.prefixes, name + ".").rstrip("."))
        if now is not child:
            setattr(layer, name, now)


def trained_keys(layer: nn.Module) -> set[str]:
    """The state keys of `layer` a LoRA run trains (and so saves): what peft left trainable."""
    return {name for name, p in layer.named_parameters() if p.requires_grad}


def peft_state(layer: nn.Module) -> dict[str, torch.Tensor]:
    """What peft saves of `layer`'s adapters, under the names it saves them by (`named_view`'s,
    without the adapter's name): its `get_peft_model_state_dict`."""
    from peft import get_peft_model_state_dict

    view = getattr(layer, "lora_view", None)
    if view is None:
        return {}
    return {k: v.detach().cpu().clone() for k, v in get_peft_model_state_dict(view, adapter_name=ADAPTER).items()}


def load_peft_state(layer: nn.Module, state: dict[str, torch.Tensor]) -> set[str]:
    """Loads the adapters of `state` (peft's saved names) that belong to `layer`; returns the keys
    it took. A layer that trains something must find all of it in `state`.

    Raises:
        ValueError: naming the adapter keys of the layer missing from `state`.
    """
    from peft import set_peft_model_state_dict

    view = getattr(layer, "lora_view", None)
    if view is None:
        return set()
    mine = set(peft_state(layer))
    missing = sorted(mine - set(state))
    if missing:
        raise ValueError(f"the adapters lack {missing[:3]} (another rank, target_modules or model?)")
    set_peft_model_state_dict(view, {k: state[k] for k in mine}, adapter_name=ADAPTER)
    return mine


def is_adapter(key: str) -> bool:
    return ".lora_A." in key or ".lora_B." in key


def base_key(key: str) -> str:
    """A state-dict key without peft's wrapping (`q_proj.base_layer.weight` -> `q_proj.weight`)."""
    return key.replace(".base_layer.", ".")


def dense_state(module: nn.Module, merge: bool) -> dict[str, torch.Tensor]:
    """The layers' base weights under the base keys, quantized ones dequantized (their statistics
    left out), with every adapter folded in when `merge`: what a transformers directory holds. The
    base's own tensors are returned as they are (not copied): call it per layer to bound memory."""
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
        if ".original_module." in key or f".modules_to_save.{ADAPTER}." in key:  # peft's modules_to_save
            if (".original_module." in key) == merge:  # merged: the trained copy; else the base
                continue
            key = key.replace(".original_module.", ".").replace(f".modules_to_save.{ADAPTER}.", ".")
        key = base_key(key)
        owner = next((m for m in dense if key.startswith(m + ".")), None)
        if owner is None:
            state[key] = value.detach()
        elif key == f"{owner}.weight":
            state[key] = dense[owner].detach()
        elif key == f"{owner}.bias":
            state[key] = value.detach()
    return state
