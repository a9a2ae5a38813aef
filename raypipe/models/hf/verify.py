"""Exact or refused: before any actor starts, a small model of the same type is split into
raypipe's layers and run against transformers' own forward.

The small model keeps every flag of the user's config (its attention kinds per layer, tied head,
scales, soft-caps, activation, rotary variant) with two decoder layers and small widths
(`small`). Its weights are transformers' own initialisation; raypipe's layers take them under
their checkpoint keys. A batch with left padding and ignored labels goes through both, in
training mode with dropout off: every decoder layer's output, the logits and the loss (with a
mixture of experts' auxiliary loss where the model adds one) must agree. A type that does not
is refused, naming the first output that differs.

The verdict is kept per (model type, transformers version, how raypipe composes the layers, the
config's flags) in `<RAYPIPE_CACHE_DIR>/hf-verdicts.json`, so it is made once per machine; a check
costs about a second on the CPU. The verdict also says whether the model adds a load-balancing loss.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import warnings
from typing import TYPE_CHECKING, Any

import torch

from raypipe.core import env
from raypipe.core.errors import ConfigError

if TYPE_CHECKING:
    from transformers import PretrainedConfig

# widths small enough for a driver to build in a second, by the config attribute that holds them
SMALL = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "num_attention_heads": 4,
    "head_dim": 16,
    "vocab_size": 128,
    "num_experts": 4,
    "num_local_experts": 4,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "kv_lora_rank": 16,
    "q_lora_rank": 16,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "v_head_dim": 16,
    "first_k_dense_replace": 1,
    "n_group": 1,
    "topk_group": 1,
    "sliding_window": 4,
    "max_position_embeddings": 64,
    "n_positions": 64,
}
_verdicts: dict[str, dict[str, object]] = {}  # this process's, beside the file's

#: how raypipe composes a model's layers, in the verdict's key: a change that could make a type
#: differ from transformers asks every type again (2: a padded microbatch's decoder arguments made
#: once per attention type, `argument_memo`; 3: longrope's factors fitted to the small model, which
#: could not be built before)
COMPOSITION = 3
_lock = threading.Lock()


def verdict(config: PretrainedConfig) -> dict[str, object]:
    """{"exact": bool, "why": str, "aux_loss": bool} for `config`'s model type and flags.

    Raises:
        ConfigError: the type's split differs from transformers' forward (naming where).
    """
    import transformers

    key = f"{config.model_type}|{transformers.__version__}|{COMPOSITION}|{_flags(config)}"
    with _lock:
        found = _verdicts.get(key) or _stored().get(key)
        if found is None:
            found = _compare(config)
            _store(key, found)
        _verdicts[key] = found
    if not found["exact"]:
        raise ConfigError(
            f"raypipe's split of {config.model_type} ({type(config).__name__}) does not give transformers' own "
            f"forward on a small model of the same flags: {found['why']}. It is refused rather than trained "
            f"wrong; write it as LayerSpecs, or pass verify=False to train it unchecked."
        )
    return found


def small(config: PretrainedConfig) -> object:
    """`config` with two decoder layers and small widths, every other setting kept."""
    values, name = config.to_dict(), lambda key: config.attribute_map.get(key, key)
    change = {name(k): v for k, v in SMALL.items() if values.get(name(k)) is not None}
    change[name("num_hidden_layers")] = 2
    if values.get("qk_rope_head_dim") is not None and "head_dim" in change:  # MLA: rotary dims are the head's
        change["head_dim"] = SMALL["qk_rope_head_dim"]
    kv, heads = values.get(name("num_key_value_heads")), values.get(name("num_attention_heads"))
    if kv is not None and heads is not None:  # grouped when the model groups, else one per head
        change[name("num_key_value_heads")] = 4 if kv == heads else 2
    layers = values.get(name("num_hidden_layers"))
    types = values.get("layer_types") or []
    # two layers of different kinds where the model has several: every per-layer list keeps those two
    keep = [0, next((i for i, t in enumerate(types) if t != types[0]), 1 if (layers or 0) > 1 else 0)]
    for key, value in values.items():
        if isinstance(value, list) and layers and len(value) == layers:
            change[key] = [value[i] for i in keep]
    vocab = change.get(name("vocab_size"), values.get(name("vocab_size")))
    for key in ("pad_token_id", "bos_token_id", "eos_token_id"):  # token ids the small vocabulary lacks
        if isinstance(values.get(key), int) and vocab is not None and values[key] >= vocab:
            change[key] = None if key != "pad_token_id" else 0
    for name, value in values.items():  # dropout off: a training-mode forward must be deterministic
        if isinstance(value, float) and ("dropout" in name or "pdrop" in name):
            change[name] = 0.0
    tiny = type(config).from_dict({**values, **change})
    rotary = _rotary_factors_for(tiny, values)
    return type(config).from_dict({**values, **change, **rotary}) if rotary else tiny


def _rotary_factors_for(tiny: PretrainedConfig, values: dict[str, Any]) -> dict[str, Any]:
    """The rotary parameters of `values` with longrope's per-frequency factors (one per pair of
    the rotary dims) cut to the small model's rotary dims, the first kept; none where nothing is cut."""
    key = next((k for k in ("rope_parameters", "rope_scaling") if isinstance(values.get(k), dict)), None)
    if key is None:
        return {}
    head_dim = getattr(tiny, "head_dim", None) or tiny.hidden_size // tiny.num_attention_heads

    def fitted(params: dict[str, Any]) -> dict[str, Any]:
        pairs = int(head_dim * params.get("partial_rotary_factor", 1.0)) // 2
        cut = {}
        for name in ("short_factor", "long_factor"):
            factors = params.get(name)
            if isinstance(factors, list) and factors and len(factors) != pairs:
                cut[name] = (factors * (pairs // len(factors) + 1))[:pairs]
        return {**params, **cut}

    params = values[key]
    nested = any(isinstance(v, dict) for v in params.values())
    changed = {k: fitted(v) if isinstance(v, dict) else v for k, v in params.items()} if nested else fitted(params)
    return {key: changed} if changed != params else {}


def _compare(config: PretrainedConfig) -> dict[str, object]:
    from transformers import AutoModelForCausalLM

    try:
        tiny = small(config)
        if hasattr(tiny, "output_router_logits"):
            tiny.output_router_logits = True
        torch.manual_seed(0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            reference = AutoModelForCausalLM.from_config(tiny).train()
    except Exception as error:  # noqa: BLE001 - any failure to build the small model is the verdict
        return {"exact": False, "why": f"a small {config.model_type} could not be built ({error})", "aux_loss": False}
    try:
        return _run(tiny, reference)
    except Exception as error:  # noqa: BLE001 - a split that cannot even run is not exact
        return {"exact": False, "why": f"{type(error).__name__}: {error}", "aux_loss": False}


def _run(tiny: Any, reference: Any) -> dict[str, object]:
    """Both forwards on one batch, compared output by output."""
    from raypipe.models.hf.causal_lm_layers import HFDecoderLayer, HFEmbedding, HFHead, checkpoint_keys
    from raypipe.models.hf.conversions import to_checkpoint
    from raypipe.models.hf.loss import CausalLMLoss

    state = reference.state_dict()
    state = {**to_checkpoint(tiny, state), **state}  # by the model's names, and as its files name them
    n = tiny.num_hidden_layers
    tied = bool(getattr(tiny, "tie_word_embeddings", False))
    layers = [HFEmbedding(tiny)] + [HFDecoderLayer(tiny, i) for i in range(n)] + [HFHead(tiny)]
    for layer in layers:
        keys = checkpoint_keys(layer, tied)
        layer.load_state_dict({local: state[key] for local, key in keys.items()}, strict=True, assign=True)
        layer.train()
    ids = torch.randint(1, tiny.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    labels = ids.masked_fill(mask == 0, -100)
    labels[1, 5:7] = -100
    outputs: list[torch.Tensor] = []
    hooks = [
        layer.register_forward_hook(lambda _m, _i, out: outputs.append(out[0] if isinstance(out, tuple) else out))
        for layer in getattr(getattr(reference, reference.base_model_prefix), skeleton_layers(tiny))
    ]
    with torch.no_grad():
        expected = reference(input_ids=ids, attention_mask=mask, labels=labels)
    for hook in hooks:
        hook.remove()
    aux = getattr(expected, "aux_loss", None) is not None
    experts = getattr(tiny, "num_experts", None) or getattr(tiny, "num_local_experts", None) or 0
    loss_fn = CausalLMLoss(tiny.vocab_size, experts if aux else 0, getattr(tiny, "router_aux_loss_coef", 0.0) or 0.0)
    with torch.no_grad():
        x: Any = {"input_ids": ids, "attention_mask": mask}
        for i, layer in enumerate(layers):
            x = layer(x)
            if 0 < i <= n and not _close(x["hidden_states"], outputs[i - 1]):
                return {"exact": False, "why": f"decoder layer {i - 1}'s output differs", "aux_loss": aux}
        logits = x[0] if isinstance(x, tuple) else x
        if not _close(logits, expected.logits):
            return {"exact": False, "why": "the logits differ", "aux_loss": aux}
        if not _close(loss_fn(x, labels), expected.loss):
            return {"exact": False, "why": "the loss differs", "aux_loss": aux}
    return {"exact": True, "why": "", "aux_loss": aux}


def skeleton_layers(config: PretrainedConfig) -> str:
    from raypipe.models.hf.skeleton import plan_of

    return plan_of(config).layers


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.allclose(a.float(), b.float(), rtol=1e-5, atol=1e-5)


def _flags(config: PretrainedConfig) -> str:
    """A digest of the config's settings that are no size: what may change how the model computes."""
    values = config.to_dict()
    flags = {k: v for k, v in values.items() if isinstance(v, (bool, str)) or k == "layer_types"}
    flags["rope"] = sorted((values.get("rope_scaling") or values.get("rope_parameters") or {}).items(), key=str)
    return hashlib.sha256(json.dumps(flags, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _path() -> str:
    return os.path.join(env.cache_dir(), "hf-verdicts.json")


def _stored() -> dict[str, dict[str, object]]:
    try:
        with open(_path()) as f:
            stored = json.load(f)
        return stored if isinstance(stored, dict) else {}
    except (OSError, ValueError):
        return {}


def _store(key: str, found: dict[str, object]) -> None:
    try:
        os.makedirs(env.cache_dir(), exist_ok=True)
        stored = {**_stored(), key: found}
        tmp = f"{_path()}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(stored, f, indent=1, sort_keys=True)
        os.replace(tmp, _path())
    except OSError:  # a read-only home: the verdict is made again next time
        pass
