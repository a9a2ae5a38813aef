"""A transformers decoder layer on sequence chunks (`raypipe.nn.sequence_chunks`): transformers'
own cache path, as chunked prefill uses it, with a cache whose layers keep each earlier chunk's
keys and values as gradient-collecting leaves of this step (`Position.extend`) instead of
tensors without history.

Its length is where the chunk starts, so transformers numbers the chunk's positions and makes
its masks (causal, padding, sliding window) over every token up to the chunk's end, exactly the
rows of the masks it makes for the whole sequence. Sliding-window layers keep every earlier key
(the mask leaves the out-of-window ones out), so their gradients are those of the whole run.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from raypipe.models.hf import skeleton
from raypipe.nn.sequence_chunks import Position, current


class ChunkLayer(DynamicLayer):
    """One decoder layer's cache while a chunk runs: the chunk's keys and values after the earlier
    chunks' (`Position.extend`), and the chunk's start as its length."""

    def __init__(self, index: int, sliding: bool) -> None:
        super().__init__()
        self.index, self.is_sliding = index, sliding

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device, self.is_initialized = key_states.dtype, key_states.device, True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any) -> tuple:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        return _position().extend(("hf", self.index), key_states, value_states)

    def get_seq_length(self) -> int:
        return _position().offset

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0


def layer_arguments(config: Any, index: int, hidden: torch.Tensor, inputs: dict[str, Any]) -> tuple[tuple, dict]:
    """Decoder layer `index`'s arguments for the running chunk (`skeleton.layer_inputs` with the
    chunk cache): made once per chunk and attention type, the attention mask being the chunk's
    joined after every earlier chunk's."""
    position = _position()
    shared = position.microbatch.shared
    masks = shared.setdefault("attention_masks", {})
    masks[position.chunk] = inputs["attention_mask"]
    if "cache" not in shared:
        shared["cache"] = chunk_cache(config)
    types = getattr(config, "layer_types", None)
    key = ("arguments", position.chunk, types[index] if types else None)
    if key not in shared:
        mask = inputs["attention_mask"]
        if mask is not None:
            mask = torch.cat([masks[c] for c in range(position.chunk + 1)], dim=1)
        chunk_inputs = {
            "attention_mask": mask,
            "position_ids": inputs["position_ids"],
            "past_key_values": shared["cache"],
            "use_cache": True,
        }
        shared[key] = skeleton.layer_inputs(config, [index], hidden, chunk_inputs)[index]
    return shared[key]


def chunk_cache(config: Any) -> Any:
    """transformers' cache for the whole model with a `ChunkLayer` in place of each of its layers
    (sliding where transformers' would be)."""
    cache = DynamicCache(config=config)
    cache.layers = [ChunkLayer(i, bool(getattr(layer, "is_sliding", False))) for i, layer in enumerate(cache.layers)]
    return cache


def _position() -> Position:
    position = current()
    if position is None:
        raise RuntimeError("a sequence chunk's cache was used outside the chunk's forward")
    return position
