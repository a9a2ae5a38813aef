"""A HuggingFace causal LM as raypipe layers: the embeddings, each decoder layer, and the final
norm with the head, each a module holding transformers' own modules under transformers' own
attribute names (copied from the model's skeleton, `skeleton.py`), so their weights map one to
one onto the checkpoint's keys, wherever the model's plan says they are (`skeleton.Plan`).

What one layer hands the next is a dict: `hidden_states`, the 2-D `attention_mask` (or None)
and `position_ids` (integers, so they get no gradient); in a mixture-of-experts model trained
with `output_router_logits`, also `router_stats`, the routing sums its loss balances (`moe.py`).
Each layer runs what transformers' forward does around it from transformers' own code: the
embedding its scale, a decoder layer its masks and rotary embedding for its layer type, the head
its logits' soft-cap or scale (`skeleton.embed`, `layer_inputs`, `head_logits`).

Layers are built on the actor that runs them (`build`): from a checkpoint, each is made on
the meta device and takes the tensors read for it as its parameters (`tensor_files.read`: its own
tensors only, in its dtype, on its stage's device); from a config, it is initialised by
transformers' own `_init_weights`.
"""

from __future__ import annotations

import contextlib
import copy
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from raypipe.core import layers
from raypipe.models.hf import argument_memo, conversions, embedding_alone, skeleton, tensor_files
from raypipe.models.hf.sparse_moe import SparseMoeBlock, add_stats, is_moe, router_stats, routing_stats
from raypipe.nn import sequence_chunks

if TYPE_CHECKING:
    from transformers import PretrainedConfig


class HFEmbedding(nn.Module):
    """The base model's modules before its decoder layers (token embedding; GPT-2's positions and
    dropout): input ids, or a dict with `input_ids` and optionally `attention_mask` and
    `position_ids`, in; the boundary dict out."""

    runs_sequence_chunks = True  # a chunk's positions start where it starts (`raypipe.nn.sequence_chunks`)

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        plan = skeleton.plan_of(config)
        self.config, self.names = config, plan.embeddings
        base = getattr(skeleton.skeleton(config), plan.base)
        for name in plan.embeddings:
            setattr(self, name, copy.deepcopy(base._modules[name]))
        self.prefixes = [("", f"{plan.base}.")]
        self.cache: dict[str, Any] | None = None  # while generating: what the stage's layers share

    def compile_targets(self) -> list[nn.Module]:
        return [getattr(self, name) for name in self.names]

    def begin_cache(self, shared: dict[str, Any]) -> None:
        """Starts generation: where the stage's decoder layers keep their cache (`HFDecoderLayer`),
        whose arguments for each forward this embedding makes in its own pass (`StageCache.embedded`)."""
        self.cache = shared

    def end_cache(self) -> None:
        self.cache = None

    def forward(self, x: Any) -> dict[str, Any]:
        inputs = {"input_ids": x} if torch.is_tensor(x) else x
        ids = inputs["input_ids"]
        mask, positions = inputs.get("attention_mask"), inputs.get("position_ids")
        if positions is None:  # as the whole model numbers them without a cache (a chunk: from its start)
            chunk = sequence_chunks.current()
            start = chunk.offset if chunk is not None else 0
            positions = torch.arange(start, start + ids.shape[1], device=ids.device).unsqueeze(0)
        if mask is not None:
            mask = mask.view(ids.shape[0], -1)
        held = {name: getattr(self, name) for name in self.names}
        end = {"sequence_end": x["sequence_end"]} if isinstance(x, dict) and "sequence_end" in x else {}
        inputs = {"input_ids": ids, "attention_mask": mask, "position_ids": positions}
        kv = self.cache.get("kv") if self.cache is not None else None
        if kv is not None and 0 in kv.held:  # generating, with the first decoder layers: one pass
            hidden = kv.embedded(held, inputs)
        elif sequence_chunks.current() is not None:  # a chunk: one pass, layer 0's arguments with it
            from raypipe.models.hf.chunk_cache import embedded

            hidden = embedded(self.config, held, {**inputs, **end})
        else:
            hidden = embedding_alone.embed(self.config, held, inputs, lambda: skeleton.embed(self.config, held, inputs))
        return {"hidden_states": hidden, "attention_mask": mask, "position_ids": positions, **end}


class HFDecoderLayer(nn.Module):
    """One of the model's decoder layers (`index` among them), run with the keyword arguments the
    whole model would pass it; during generation it reads and extends the stage's KV cache."""

    def __init__(self, config: PretrainedConfig, index: int) -> None:
        super().__init__()
        plan = skeleton.plan_of(config)
        self.config, self.index = config, index
        base = getattr(skeleton.skeleton(config), plan.base)
        self.block = copy.deepcopy(getattr(base, plan.layers)[index])
        prefix = plan.checkpoint_prefix(f"{plan.layers}.{index}")
        self.prefixes = [("block.", prefix)]
        moe = SparseMoeBlock(config) if is_moe(config) else None
        object.__setattr__(self, "moe", moe)  # a second name for block.mlp, not a second submodule
        if moe is not None:  # Mixtral's experts one by one, under the checkpoint's names (`moe.py`)
            self.block.mlp = moe
            moe_prefix = f"{prefix}block_sparse_moe."
            self.prefixes = [("block.mlp.router.", moe_prefix + "gate."), ("block.mlp.", moe_prefix)] + self.prefixes
        self.routers = router_stats(self.block, config)  # another MoE's router logits, as its forward makes them
        self.cache: Any = None

    @property
    def runs_sequence_chunks(self) -> bool:
        """Through transformers' cache path (`chunk_cache`), but not with a routing loss over the
        whole sequence (`output_router_logits`)."""
        return self.why_not_sequence_chunks is None

    @property
    def why_not_sequence_chunks(self) -> str | None:
        if getattr(self.config, "output_router_logits", False):
            return "its routing loss (output_router_logits) is over the whole sequence's routing"
        return None

    @property
    def cost_key(self) -> tuple:
        """What its cost depends on besides its parameters (`actors.profiler.cost_key`): the config's
        per-layer settings at its index (`layer_types`, `no_rope_layers`, ...: every list as long as
        the layers) and every plain setting of its modules (an attention window, its type), its
        index aside. Layers with one key cost the same: the profiler times the first."""
        count = getattr(self.config, "num_hidden_layers", None)
        per_layer = tuple(
            (name, repr(value[self.index]))
            for name, value in sorted(self.config.to_dict().items())
            if isinstance(value, (list, tuple)) and len(value) == count
        )
        settings = tuple(
            (path, name, repr(value))
            for path, module in self.block.named_modules()
            for name, value in sorted(vars(module).items())
            if not name.startswith("_")
            and name not in ("layer_idx", "training")
            and isinstance(value, (bool, int, float, str, type(None)))
        )
        return per_layer, settings

    def tp_plan(self, tp_size: int) -> dict[str, object]:
        """transformers' own `base_model_tp_plan` for this layer: colwise and rowwise linears, the
        rest replicated."""
        from raypipe.core.errors import ConfigError
        from raypipe.nn import ColumnParallel, RowParallel

        styles = {"colwise": ColumnParallel(), "rowwise": RowParallel(), "replicated_with_grad_allreduce": None}
        plan, self.tp_summed = {}, []
        prefix = f"{skeleton.plan_of(self.config).layers}.*."
        for pattern, style in (getattr(self.config, "base_model_tp_plan", None) or {}).items():
            if not pattern.startswith(prefix) or (self.moe is not None and ".mlp." in pattern):
                continue
            if style not in styles:
                raise ConfigError(
                    f"{self.config.model_type}'s tp plan splits {pattern} as {style!r}; raypipe "
                    f"supports {sorted(styles)}: use tp=1 for this model."
                )
            if styles[style] is not None:
                plan["block." + pattern[len(prefix) :]] = styles[style]
            else:  # replicated, its gradient summed over the tp ranks (`StageModel.tp_summed`)
                self.tp_summed.append("block." + pattern[len(prefix) :])
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

    def compile_targets(self) -> list[nn.Module]:
        """What `TrainConfig.compile` compiles: transformers' decoder layer (its inputs are made eagerly)."""
        return [self.block]

    def begin_cache(self, shared: dict[str, Any]) -> None:
        """Starts generation: every decoder layer of the stage shares one transformers cache, whose
        layers held elsewhere mirror one held here (`skeleton.stage_cache`)."""
        shared.setdefault("held", []).append(self.index)
        self.cache = shared.setdefault("kv", skeleton.StageCache(self.config, shared["held"]))

    def end_cache(self) -> None:
        self.cache = None

    def forward(self, x: dict[str, Any]) -> dict[str, Any]:
        hidden = x["hidden_states"]
        inputs = {"attention_mask": x["attention_mask"], "position_ids": x["position_ids"]}
        attending: Any = contextlib.nullcontext()
        if self.cache is not None:
            args, kwargs = self.cache.inputs(self.index, hidden, inputs)
        elif sequence_chunks.current() is not None:  # a sequence chunk, after the chunks before it
            from raypipe.models.hf.chunk_cache import block_attention, layer_arguments

            whole = {**inputs, "sequence_end": x.get("sequence_end")}  # the sequence's end (`rope`)
            args, kwargs = layer_arguments(self.config, self.index, hidden, whole)
            attending = block_attention(self.block, hidden)
        else:
            args, kwargs = argument_memo.layer_inputs(self.config, self.index, hidden, inputs)
        with attending:
            out = self.block(hidden, *args, **kwargs)
        hidden = out[0] if isinstance(out, tuple) else out
        if self.training and getattr(self.config, "output_router_logits", False):
            logits = self.moe.router_logits if self.moe is not None else self.routers.take()
            if logits is not None:
                stats = routing_stats(logits, self.config, x["attention_mask"])
                return {**x, "hidden_states": hidden, "router_stats": add_stats(x.get("router_stats"), stats)}
        return {**x, "hidden_states": hidden}


class HFHead(nn.Module):
    """The final norm and the language-model head: the boundary dict in, logits out (as the causal
    LM's forward makes them: soft-capped, scaled)."""

    runs_sequence_chunks = True  # token by token

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        plan = skeleton.plan_of(config)
        self.config, self.norm_name, self.head_name = config, plan.norm, plan.head
        model = skeleton.skeleton(config)
        setattr(self, plan.norm, copy.deepcopy(getattr(model, plan.base)._modules[plan.norm]))
        setattr(self, plan.head, copy.deepcopy(model._modules[plan.head]))
        self.prefixes = [(f"{plan.head}.", f"{plan.head}."), ("", f"{plan.base}.")]

    def compile_targets(self) -> list[nn.Module]:
        return [getattr(self, self.norm_name), getattr(self, self.head_name)]

    def forward(self, x: Any) -> Any:
        hidden = x["hidden_states"] if isinstance(x, dict) else x
        logits = skeleton.head_logits(self.config, getattr(self, self.norm_name), getattr(self, self.head_name), hidden)
        if isinstance(x, dict) and "router_stats" in x:  # training a MoE: the loss balances the routing
            return logits, x["router_stats"]
        return logits


def checkpoint_keys(module: nn.Module, tied: bool = False) -> dict[str, str]:
    """The module's state-dict keys -> the checkpoint's keys (a tied head reads the embedding)."""
    keys = {local: layers.checkpoint_key(module.prefixes, local) for local in module.state_dict()}
    if tied:
        for head, embedding in skeleton.plan_of(module.config).tied.items():
            for local, key in keys.items():
                if key == head:
                    keys[local] = embedding
    return keys


KINDS = {"embedding": HFEmbedding, "decoder": HFDecoderLayer, "head": HFHead}


class ConfigRef:
    """A transformers config inside a `LayerSpec`, printed in one line (a config's own repr is its
    whole JSON, which would fill every error message that names the layer)."""

    def __init__(self, config: PretrainedConfig) -> None:
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
    with torch.device("meta"):
        module = KINDS[kind](*args)
    if torch.get_default_device().type == "meta":  # only counting parameters (the driver's partitioner)
        return module
    loading = layers.loading()
    device = loading.device or torch.device("cpu")
    buffers = {n: b for n, b in module.named_buffers() if not b.is_meta}  # computed (rotary frequencies)
    if source is None:
        module.to_empty(device=device)
        skeleton.initialise(module, config)
        _put_buffers(module, buffers, device)
        return module.to(tensor_files.DTYPES[dtype])
    keys = checkpoint_keys(module, tied=bool(getattr(config, "tie_word_embeddings", False)))
    tensors = conversions.read(source, config, keys.values(), tensor_files.DTYPES[dtype], device, loading.map_files)
    # the tensors read become the parameters: nothing allocated twice, nothing initialised in vain
    module.load_state_dict({local: tensors[key] for local, key in keys.items()}, strict=True, assign=True)
    del tensors
    state = module.state_dict(keep_vars=True)
    loading.keep({key: state[local] for local, key in keys.items()})
    _put_buffers(module, {n: b for n, b in buffers.items() if n not in state}, device)
    module.read_keys = dict(tensor_files.last_read)  # what this layer read, for `StageActor.info`
    return module


def _put_buffers(module: nn.Module, buffers: dict[str, torch.Tensor], device: torch.device) -> None:
    """Gives `module` the buffers the files do not hold (computed when transformers built the
    skeleton, such as rotary frequencies), on `device`; zeros where none was computed."""
    for name, buffer in list(module.named_buffers()):
        if name in buffers or buffer.is_meta:
            owner, _, attr = name.rpartition(".")
            sub = module.get_submodule(owner) if owner else module
            value = buffers[name] if name in buffers else torch.zeros_like(buffer, device=device)
            persistent = attr not in sub._non_persistent_buffers_set
            sub.register_buffer(attr, value.to(device), persistent=persistent)
