"""A HuggingFace causal LM as raypipe layers: the embeddings, each decoder layer, and the final
norm with the head, each a module holding transformers' own classes under transformers' own
attribute names, so their weights map one to one onto the checkpoint's keys.

What one layer hands the next is a dict: `hidden_states`, the 2-D `attention_mask` (or None)
and `position_ids` (integers, so they get no gradient); in a Mixtral-shaped model trained with
`output_router_logits`, also `router_stats`, the routing sums its loss balances (`moe.py`).
Every decoder layer makes its mask and rotary embedding from them with transformers' own functions,
exactly as the whole model does once for all of its layers.

Layers are built on the actor that runs them (`build`): from a checkpoint, each is made on
the meta device and takes the tensors read for it as its parameters (`weights.read`: its own
tensors only, in its dtype, on its stage's device); from a config, it is initialised as
transformers initialises the whole model.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from raypipe import layers
from raypipe.models.hf import weights
from raypipe.models.hf.families import family_of
from raypipe.models.hf.moe import SparseMoeBlock, add_stats, is_moe, routing_stats


class HFEmbedding(nn.Module):
    """Token (and, for GPT-2, position) embeddings: input ids, or a dict with `input_ids` and
    optionally `attention_mask` and `position_ids`, in; the boundary dict out."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config, family = config, family_of(config)
        self.prefixes = [("", family.base)]
        hidden = config.hidden_size
        if family.base == "transformer.":  # GPT-2: learned positions, dropout
            self.wte = nn.Embedding(config.vocab_size, hidden)
            self.wpe = nn.Embedding(config.max_position_embeddings, hidden)
            self.drop = nn.Dropout(config.embd_pdrop)
        else:
            self.embed_tokens = nn.Embedding(config.vocab_size, hidden, config.pad_token_id)

    def forward(self, x: Any) -> dict[str, Any]:
        inputs = {"input_ids": x} if torch.is_tensor(x) else x
        ids = inputs["input_ids"]
        mask, positions = inputs.get("attention_mask"), inputs.get("position_ids")
        if positions is None:  # as the whole model numbers them without a cache
            positions = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0)
        if hasattr(self, "wte"):
            hidden = self.drop(self.wte(ids) + self.wpe(positions))
        else:
            hidden = self.embed_tokens(ids)
        if mask is not None:
            mask = mask.view(ids.shape[0], -1)
        return {"hidden_states": hidden, "attention_mask": mask, "position_ids": positions}


class HFDecoderLayer(nn.Module):
    """One of the model's decoder layers (`index` among them), with its mask and rotary embedding
    made from the boundary dict; during generation it reads and extends the stage's KV cache."""

    def __init__(self, config: Any, index: int) -> None:
        super().__init__()
        self.config, self.index, family = config, index, family_of(config)
        classes = family.classes()
        self.block = getattr(classes, family.decoder)(config, layer_idx=index)
        self.prefixes = [("block.", family.decoder_prefix(index))]
        moe = SparseMoeBlock(config) if is_moe(config) else None
        object.__setattr__(self, "moe", moe)  # a second name for block.mlp, not a second submodule
        if moe is not None:  # experts one by one, under the checkpoint's names (`moe.py`)
            self.block.mlp = moe
            moe_prefix = f"{family.decoder_prefix(index)}block_sparse_moe."
            self.prefixes = [("block.mlp.router.", moe_prefix + "gate."), ("block.mlp.", moe_prefix)] + self.prefixes
        # not a submodule: its buffers are computed, never stored, so they stay out of the state
        # dict and survive materialisation from the meta device
        with torch.device("cpu"):
            rotary = getattr(classes, family.rotary)(config) if family.rotary else None
        object.__setattr__(self, "rotary", rotary)
        self.cache: Any = None
        self.sliding = _is_sliding(config, index)

    def tp_plan(self, tp_size: int) -> dict[str, Any]:
        """transformers' own `base_model_tp_plan` for this layer: colwise and rowwise linears."""
        from raypipe.errors import ConfigError
        from raypipe.nn import ColumnParallel, RowParallel

        styles = {"colwise": ColumnParallel(), "rowwise": RowParallel()}
        plan = {}
        for pattern, style in (getattr(self.config, "base_model_tp_plan", None) or {}).items():
            prefix = f"{family_of(self.config).layers}.*."
            if not pattern.startswith(prefix) or (self.moe is not None and ".mlp." in pattern):
                continue
            if style not in styles:
                raise ConfigError(
                    f"{self.config.model_type}'s tp plan splits {pattern} as {style!r}; raypipe "
                    f"supports {sorted(styles)}: use tp=1 for this model."
                )
            plan["block." + pattern[len(prefix) :]] = styles[style]
        for e in range(self.moe.num_experts if self.moe is not None else 0):  # each expert as a SwiGLU MLP
            plan.update(
                {
                    f"block.mlp.experts.{e}.w1": ColumnParallel(),
                    f"block.mlp.experts.{e}.w3": ColumnParallel(),
                    f"block.mlp.experts.{e}.w2": RowParallel(),
                }
            )
        if not plan:
            raise ConfigError(f"{self.config.model_type} declares no base_model_tp_plan for its layers: use tp=1.")
        return plan

    def begin_cache(self, shared: dict[str, Any]) -> None:
        """Starts generation: every decoder layer of the stage shares one transformers cache."""
        from transformers import DynamicCache

        self.cache = shared.setdefault("kv", DynamicCache(config=self.config))

    def end_cache(self) -> None:
        self.cache = None

    def forward(self, x: dict[str, Any]) -> dict[str, Any]:
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

        hidden, positions = x["hidden_states"], x["position_ids"]
        make_mask = create_sliding_window_causal_mask if self.sliding else create_causal_mask
        mask = make_mask(
            config=self.config,
            inputs_embeds=hidden,
            attention_mask=x["attention_mask"],
            past_key_values=self.cache,
            position_ids=positions,
            **({"layer_idx": self.index} if self.cache is not None and not self.sliding else {}),
        )
        extra = {"position_embeddings": self.rotary(hidden, position_ids=positions)} if self.rotary else {}
        hidden = self.block(
            hidden,
            attention_mask=mask,
            position_ids=positions,
            past_key_values=self.cache,
            use_cache=self.cache is not None,
            **extra,
        )
        if self.moe is not None and self.training and getattr(self.config, "output_router_logits", False):
            stats = add_stats(x.get("router_stats"), routing_stats(self.moe, x["attention_mask"]))
            return {**x, "hidden_states": hidden, "router_stats": stats}
        return {**x, "hidden_states": hidden}


class HFHead(nn.Module):
    """The final norm and the language-model head: the boundary dict in, logits out."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config, family = config, family_of(config)
        eps = getattr(config, "layer_norm_epsilon", None) or config.rms_norm_eps
        norm_class = nn.LayerNorm if family.norm_class == "LayerNorm" else getattr(family.classes(), family.norm_class)
        setattr(self, family.norm, norm_class(config.hidden_size, eps=eps))
        self.norm_name = family.norm
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.prefixes = [("lm_head.", "lm_head."), ("", family.base)]

    def forward(self, x: Any) -> Any:
        hidden = x["hidden_states"] if isinstance(x, dict) else x
        logits = self.lm_head(getattr(self, self.norm_name)(hidden))
        if isinstance(x, dict) and "router_stats" in x:  # training a Mixtral: the loss balances the routing
            return logits, x["router_stats"]
        return logits


def checkpoint_key(prefixes: list[tuple[str, str]], local: str) -> str:
    """A layer's state-dict key under the checkpoint's name, by the layer's (local prefix,
    checkpoint prefix) pairs (`prefixes`, the first that matches)."""
    prefix, hf = next((p, h) for p, h in prefixes if local.startswith(p))
    return hf + local[len(prefix) :]


def checkpoint_keys(module: nn.Module, tied: bool = False) -> dict[str, str]:
    """The module's state-dict keys -> the checkpoint's keys (a tied head reads the embedding)."""
    keys = {local: checkpoint_key(module.prefixes, local) for local in module.state_dict()}
    if tied and "lm_head.weight" in keys:
        keys["lm_head.weight"] = family_of(module.config).tied_key()
    return keys


KINDS = {"embedding": HFEmbedding, "decoder": HFDecoderLayer, "head": HFHead}


class ConfigRef:
    """A transformers config inside a `LayerSpec`, printed in one line (a config's own repr is its
    whole JSON, which would fill every error message that names the layer)."""

    def __init__(self, config: Any) -> None:
        self.config = config

    def __repr__(self) -> str:
        c = self.config
        return f"{c.model_type}(hidden_size={c.hidden_size}, layers={c.num_hidden_layers}, vocab={c.vocab_size})"


def build(kind: str, ref: ConfigRef, index: int | None, source: str | None, dtype: str) -> nn.Module:
    """Builds one layer where it runs (the `LayerSpec` factory of every HF layer).

    Args:
        kind: "embedding", "decoder" or "head"; ref: the model's config; index: the decoder layer's index.
        source: a model directory to read this layer's tensors from, or None to initialise it
            as transformers does.
        dtype: "fp32" or "bf16", the dtype its weights are kept in.
    """
    config = ref.config
    args = (config, index) if kind == "decoder" else (config,)
    if source is None:
        module = KINDS[kind](*args)
        _init_like_transformers(module, config)
        return module.to(weights.DTYPES[dtype])
    with torch.device("meta"):
        module = KINDS[kind](*args)
    if torch.get_default_device().type == "meta":  # only counting parameters (the driver's partitioner)
        return module
    keys = checkpoint_keys(module, tied=bool(getattr(config, "tie_word_embeddings", False)))
    loading = layers.loading()
    device = loading.device
    tensors = weights.read(source, keys.values(), weights.DTYPES[dtype], device)
    # the tensors read become the parameters: nothing allocated twice, nothing initialised in vain
    module.load_state_dict({local: tensors[key] for local, key in keys.items()}, strict=True, assign=True)
    del tensors
    state = module.state_dict(keep_vars=True)
    loading.keep({key: state[local] for local, key in keys.items()})
    for sub in module.modules():  # a buffer outside the state dict has no value in the files
        for name, buffer in list(sub.named_buffers(recurse=False)):
            if buffer.is_meta:
                sub.register_buffer(name, torch.zeros_like(buffer, device=device or "cpu"), persistent=False)
    module.read_keys = dict(weights.last_read)  # what this layer read, for `StageActor.info`
    return module


def _init_like_transformers(module: nn.Module, config: Any) -> None:
    """transformers' initialisation: normal(0, initializer_range) weights and zero biases for
    linears and embeddings, unit norms; GPT-2 scales its residual projections by 1/sqrt(2 n_layer)."""
    std = config.initializer_range
    for name, sub in module.named_modules():
        weight = getattr(sub, "weight", None)
        if not isinstance(weight, torch.Tensor) or not isinstance(weight, nn.Parameter):
            continue
        with torch.no_grad():
            if weight.dim() >= 2:
                scaled = name.endswith("c_proj") and config.model_type == "gpt2"
                weight.normal_(0.0, std / math.sqrt(2 * config.num_hidden_layers) if scaled else std)
            else:
                weight.fill_(1.0)
            bias = getattr(sub, "bias", None)
            if isinstance(bias, nn.Parameter):
                bias.zero_()
            if isinstance(sub, nn.Embedding) and sub.padding_idx is not None:
                weight[sub.padding_idx].zero_()


def _is_sliding(config: Any, index: int) -> bool:
    """Whether decoder layer `index` attends within a sliding window (Mistral, some Qwen2 layers)."""
    types = getattr(config, "layer_types", None)
    if types:
        return types[index] == "sliding_attention"
    return config.model_type in ("mistral", "mixtral") and getattr(config, "sliding_window", None) is not None
