"""A transformers decoder layer on sequence chunks (`raypipe.nn.sequence_chunks`): transformers'
own cache path, as chunked prefill uses it, with a cache whose layers keep each earlier chunk's
keys and values as gradient-collecting leaves of this step (`Position.extend`) instead of
tensors without history.

Its length is where the chunk starts, so transformers numbers the chunk's positions and makes
its masks (causal, padding, sliding window) over every token up to the chunk's end, exactly the
rows of the masks it makes for the whole sequence. Sliding-window layers keep every earlier key
(the mask leaves the out-of-window ones out), so their gradients are those of the whole run.

A packed row (documents one after another, `position_ids` starting again) gets its mask made
here (`packed_mask`): transformers keeps packed documents apart only when it has no cache.

Where the model attends with transformers' SDPA and `chunk_attention.supported` holds (the CPU),
the layer attends block by block (`block_attention`): the cache hands the attention the earlier
chunks' keys as blocks instead of one joined copy, and transformers' mask is sliced per block.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from transformers import AttentionInterface, DynamicCache
from transformers.cache_utils import DynamicLayer

from raypipe.models.hf import argument_memo, embedding_alone, rope, skeleton
from raypipe.nn import chunk_attention
from raypipe.nn.sequence_chunks import Position, current

if TYPE_CHECKING:
    from transformers import PretrainedConfig

#: the attention implementation a decoder layer runs a chunk with, in transformers' registry
BLOCKS = "raypipe_chunk_blocks"


class ChunkLayer(DynamicLayer):
    """One decoder layer's cache while a chunk runs: the chunk's keys and values after the earlier
    chunks' (`Position.extend`), and the chunk's start as its length."""

    def __init__(self, index: int, sliding: bool) -> None:
        super().__init__()
        self.index, self.is_sliding = index, sliding
        self.blocks: tuple[list, list] | None = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device, self.is_initialized = key_states.dtype, key_states.device, True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object, **kwargs: object) -> tuple:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        position = _position()
        if position.microbatch.shared.get("attention") == BLOCKS:  # `_block_attention` reads them here
            self.blocks = position.blocks(("hf", self.index), key_states, value_states)
            return key_states, value_states
        return position.extend(("hf", self.index), key_states, value_states)

    def get_seq_length(self) -> int:
        return _position().offset

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0


def layer_arguments(
    config: PretrainedConfig, index: int, hidden: torch.Tensor, inputs: dict[str, Any]
) -> tuple[tuple, dict]:
    """Decoder layer `index`'s arguments for the running chunk (`skeleton.layer_inputs` with the
    chunk cache): made once per chunk and attention type, the attention mask being the chunk's
    joined after every earlier chunk's."""
    position = _position()
    shared = position.microbatch.shared
    key, chunk_inputs = _chunk_inputs(config, index, hidden, inputs)
    if key not in shared:

        def made() -> tuple:
            with rope.whole_sequence(config, inputs.get("sequence_end")):
                return skeleton.layer_inputs(config, [index], hidden, chunk_inputs)[index]

        if _plain_so_far(position, inputs) and not rope.follows_length(config):  # kept from an earlier step
            found = argument_memo.key(config, key[-1], hidden, position.offset, position.end, chunked=True)
            arguments = argument_memo.kept(found, made)  # naming the cache of the step that made them
        else:
            arguments = made()
        _keep(config, index, key, argument_memo.with_cache(arguments, shared["cache"]), chunk_inputs)
    return shared[key]


def embedded(config: PretrainedConfig, modules: dict[str, torch.nn.Module], inputs: dict[str, Any]) -> torch.Tensor:
    """`skeleton.embed` of the running chunk, whose one pass of the base model's forward also makes
    decoder layer 0's arguments with the chunk cache (kept as `layer_arguments` keeps them, which
    then finds them made): the stage that embeds a chunk ran that pass twice, an embedding's and its
    first layer's (0.6 ms a chunk at 2,048 tokens, `benchmarks/chunk_cost.py`), and the second
    pass's cost is on the chunked step's critical path (the first stage's forwards, then its
    backwards). Two passes still where the embedding holds no floating weight to give the
    layer's hidden states their dtype (a packed row's eager mask takes it). No pass at all where
    layer 0's arguments are kept from an earlier step (`argument_memo`) and the family's prologue
    adds nothing to the embedding (`embedding_alone`)."""
    ids = inputs["input_ids"]
    dtype = next((p.dtype for m in modules.values() for p in m.parameters() if p.is_floating_point()), None)
    if dtype is None:
        return skeleton.embed(config, modules, inputs)
    like = torch.empty(*ids.shape, 0, dtype=dtype, device=ids.device)  # the hidden states' batch, dtype, device
    key, chunk_inputs = _chunk_inputs(config, 0, like, inputs)
    if not chunk_inputs:  # layer 0's arguments are made already
        return skeleton.embed(config, modules, inputs)
    position, embedding = _position(), embedding_alone.module(modules)
    remembered = None
    if _plain_so_far(position, inputs) and not rope.follows_length(config):  # kept, and the embedding alone
        remembered = argument_memo.key(config, key[-1], like, position.offset, position.end, chunked=True)
        arguments = argument_memo.get(remembered)
        if arguments is not None and embedding is not None and embedding_alone.known(config, embedding):
            cache = position.microbatch.shared["cache"]
            _keep(config, 0, key, argument_memo.with_cache(arguments, cache), chunk_inputs)
            return embedding(ids)

    def prologue() -> tuple:
        with rope.whole_sequence(config, inputs.get("sequence_end")):
            return skeleton.embed_with_arguments(config, modules, {"input_ids": ids, **chunk_inputs})

    asked = remembered is not None and embedding is not None
    hidden, *arguments = embedding_alone.alone(config, embedding, ids, prologue) if asked else prologue()
    if remembered is not None:
        argument_memo.put(remembered, tuple(arguments))
    _keep(config, 0, key, tuple(arguments), chunk_inputs)
    return hidden


def _chunk_inputs(
    config: PretrainedConfig, index: int, hidden: torch.Tensor, inputs: dict[str, Any]
) -> tuple[tuple, dict[str, Any]]:
    """(the key decoder layer `index`'s arguments for the running chunk are kept under, the inputs
    of the base model's forward that make them: the chunk cache, the attention mask joined after
    the earlier chunks' or a packed row's). `hidden`: like the layer's hidden states (their batch,
    dtype and device); no inputs where they are kept already."""
    position = _position()
    shared = position.microbatch.shared
    masks = shared.setdefault("attention_masks", {})
    masks[position.chunk] = inputs["attention_mask"]
    if "cache" not in shared:
        shared["cache"] = chunk_cache(config)
    types = getattr(config, "layer_types", None)
    key = ("arguments", position.chunk, types[index] if types else None)
    if key in shared:
        return key, {}
    mask = inputs["attention_mask"]
    sliding = shared["cache"].layers[index].is_sliding  # transformers' own answer for the layer
    if mask is not None:
        mask = torch.cat([masks[c] for c in range(position.chunk + 1)], dim=1)
    elif inputs["position_ids"] is not None and not _plain_so_far(position, inputs):
        # packed rows: each document sees only itself
        mask = packed_mask(config, sliding, hidden, inputs["position_ids"])
    chunk_inputs = {
        "attention_mask": mask,
        "position_ids": inputs["position_ids"],
        "past_key_values": shared["cache"],
        "use_cache": True,
    }
    return key, chunk_inputs


def _plain_so_far(position: Position, inputs: dict[str, Any]) -> bool:
    """Whether this chunk and every one before it in the microbatch had no attention mask and
    positions numbered from their start (`argument_memo.plain`): one document, causal, whose
    arguments positions alone decide (kept from step to step) and whose mask needs no documents."""
    plain = position.microbatch.shared.setdefault("plain", {})
    c = position.chunk
    if c not in plain:
        plain[c] = (c == 0 or plain.get(c - 1, False)) and argument_memo.plain(inputs, position.offset, position.end)
    return plain[c]


def _keep(config: PretrainedConfig, index: int, key: tuple, arguments: tuple, chunk_inputs: dict[str, Any]) -> None:
    """Keeps decoder layer `index`'s `arguments` for the running chunk under `key`; where
    transformers' mask is the causal triangle alone, with the block attention's plan for it."""
    position = _position()
    shared = position.microbatch.shared
    shared[key] = arguments
    kind = key[-1]  # the layer's attention type (`_chunk_inputs`' key)
    sliding = shared["cache"].layers[index].is_sliding
    window = getattr(config, "sliding_window", None) if sliding else None
    mask = chunk_inputs["attention_mask"]
    plain = mask is None or (mask.dim() == 2 and bool(mask.all()))
    if plain and kind in _CAUSAL_TYPES and (window is None or position.end < window):
        # transformers' mask is the causal triangle alone: the block attention's plan needs no
        # look at it (reducing it per block cost 3 % of a stage's forward at k = 8)
        plan = ("plan", position.chunk, id(arguments[1].get("attention_mask")))
        shared[plan] = chunk_attention.causal_plan(position.chunk + 1)


#: the layer types whose mask is causal and padding (and a window, for sliding ones) alone
_CAUSAL_TYPES = (None, "full_attention", "sliding_attention")


def packed_mask(config: PretrainedConfig, sliding: bool, hidden: torch.Tensor, positions: torch.Tensor) -> object:
    """The running chunk's (batch, 1, queries, keys) mask over every key up to its end where its
    rows pack several documents (`position_ids` starting again inside a row, no attention mask),
    else None: causal, within a query's document, and within the window of a `sliding` layer; as
    transformers masks a packed row without a cache (`find_packed_sequence_indices`), which it does
    not with one. Boolean for SDPA, additive for eager attention, as transformers gives each."""
    position = _position()
    documents = position.microbatch.shared.setdefault("documents", {})  # chunk -> (its documents, last position)
    c = position.chunk
    bounds = position.microbatch.starts
    for j in range(c):  # a chunk of one document numbered from its start made none (`_plain_so_far`)
        if j not in documents:
            length = bounds[j + 1] - bounds[j]
            ids = torch.zeros(hidden.shape[0], length, dtype=positions.dtype, device=positions.device)
            documents[j] = (ids, torch.full_like(ids[:, :1], bounds[j + 1] - 1))
    if c not in documents:
        positions = positions.expand(hidden.shape[0], -1)
        if c == 0:
            before, first = positions[:, :1] - 1, torch.zeros_like(positions[:, :1])
        else:
            before, first = documents[c - 1][1], documents[c - 1][0][:, -1:]
        # a document starts where a position does not follow the one before it
        starts = torch.diff(positions, prepend=before, dim=-1) != 1
        documents[c] = (first + starts.cumsum(-1), positions[:, -1:])
    keys = torch.cat([documents[i][0] for i in range(c + 1)], dim=1)
    if not bool(keys.any()):  # one document so far: transformers' causal mask from the cache
        return None
    queries = torch.arange(position.offset, position.end, device=hidden.device).unsqueeze(1)
    seen = torch.arange(position.end, device=hidden.device).unsqueeze(0)
    allowed = seen <= queries
    if sliding:
        allowed = allowed & (seen > queries - config.sliding_window)
    mask = (documents[c][0].unsqueeze(2) == keys.unsqueeze(1)) & allowed
    mask = mask.unsqueeze(1)
    if config._attn_implementation == "eager":
        return torch.zeros(mask.shape, dtype=hidden.dtype, device=hidden.device).masked_fill(
            ~mask, torch.finfo(hidden.dtype).min
        )
    return mask


def chunk_cache(config: PretrainedConfig) -> object:
    """transformers' cache for the whole model with a `ChunkLayer` in place of each of its layers
    (sliding where transformers' would be)."""
    cache = DynamicCache(config=config)
    cache.layers = [ChunkLayer(i, bool(getattr(layer, "is_sliding", False))) for i, layer in enumerate(cache.layers)]
    return cache


@contextlib.contextmanager
def block_attention(block: torch.nn.Module, hidden: torch.Tensor) -> Iterator[None]:
    """While decoder layer `block` runs a chunk: its SDPA attention runs block by block
    (`chunk_attention.attend`) where the kernel is there for `hidden`; otherwise as it is. Its
    modules' configs (the attention's may be a copy of the layer's) name `BLOCKS` meanwhile."""
    configs = _attention_configs(block)
    usable = bool(configs) and all(
        c._attn_implementation == "sdpa" and not float(getattr(c, "attention_dropout", 0.0) or 0.0) for c in configs
    )
    if not usable or not chunk_attention.supported(hidden):
        yield
        return
    shared = _position().microbatch.shared
    shared["attention"] = BLOCKS
    for config in configs:
        config._attn_implementation = BLOCKS
    try:
        yield
    finally:
        for config in configs:
            config._attn_implementation = "sdpa"
        shared["attention"] = None


_CONFIGS: weakref.WeakKeyDictionary[torch.nn.Module, list] = weakref.WeakKeyDictionary()


def _attention_configs(block: torch.nn.Module) -> list:
    """The distinct configs naming an attention implementation among `block`'s modules, found once
    per block (walking its modules for every chunk and layer cost 2 % of a small stage's forward)."""
    configs = _CONFIGS.get(block)
    if configs is None:
        found = (getattr(m, "config", None) for m in block.modules())
        configs = _CONFIGS[block] = list({id(c): c for c in found if hasattr(c, "_attn_implementation")}.values())
    return configs


def _block_attention(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """transformers' attention interface over the blocks the layer's `ChunkLayer` kept (its `key`
    and `value` are the chunk's own, the last block); `attention_mask` is over the joined keys."""
    position = _position()
    shared = position.microbatch.shared
    keys, values = shared["cache"].layers[module.layer_idx].blocks
    plan = ("plan", position.chunk, id(attention_mask))  # the layers' mask is one tensor (`layer_arguments`)
    if plan not in shared:
        shared[plan] = chunk_attention.block_plan(query, keys, attention_mask)
    out = chunk_attention.attend(query, keys, values, attention_mask, scaling, shared[plan])
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(BLOCKS, _block_attention)


def _position() -> Position:
    position = current()
    if position is None:
        raise RuntimeError("a sequence chunk's cache was used outside the chunk's forward")
    return position
