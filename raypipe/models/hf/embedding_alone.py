"""The embedding stage without transformers' prologue, where the prologue adds nothing.

An embedding stage makes the first decoder layer's input by running the base model's forward up
to that layer (`skeleton.embed`): an embedding's scale, positions added, dropout, whatever the
family does, with no code of raypipe's. For Llama, Mistral or Qwen2 that input is the token
embedding's output unchanged, and the pass around it (the rotary embeddings, the masks, the
forward's wrappers) is about a millisecond of Python per call at 64 wide: per chunk, on the
pipeline's critical path (the first stage's forwards, then the last chunk through the others).

Whether a family's prologue adds nothing is asked of it, not listed: the first call in a process
runs both and compares them bit for bit (`alone`), per config, training mode and autocast. Only
one embedding module, no attention mask and positions numbered from the span's start
(`argument_memo.plain`) take the short way; anything else runs the prologue as before. A chunk
takes it where its first layer's arguments are kept from an earlier step too
(`chunk_cache.embedded`): that pass made them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from raypipe.models.hf import argument_memo

if TYPE_CHECKING:
    from transformers import PretrainedConfig

_verdicts: dict[tuple, bool] = {}  # (config, training, autocast) -> whether the prologue adds nothing


def module(modules: dict[str, nn.Module]) -> nn.Module | None:
    """The one embedding module a stage holds, or None (GPT-2's token and position embeddings)."""
    return next(iter(modules.values())) if len(modules) == 1 else None


def embed(
    config: PretrainedConfig, modules: dict[str, nn.Module], inputs: dict[str, Any], prologue: Callable[[], Any]
) -> torch.Tensor:
    """The first decoder layer's input for a whole sequence: the embedding module's own output
    where this process found the prologue adds nothing, else `prologue()` (asking the first time)."""
    embedding, ids = module(modules), inputs["input_ids"]
    if embedding is None or not argument_memo.plain(inputs, 0, ids.shape[1]):
        return prologue()
    if known(config, embedding):
        return embedding(ids)
    return alone(config, embedding, ids, prologue)


def known(config: PretrainedConfig, embedding: nn.Module) -> bool:
    """Whether this process found that `config`'s prologue hands the first layer `embedding`'s
    output unchanged, in the mode and autocast now in force."""
    return _verdicts.get(_key(config, embedding), False)


def alone(config: PretrainedConfig, embedding: nn.Module, ids: torch.Tensor, prologue: Callable[[], Any]) -> Any:
    """`prologue()`'s answer (whose first element, or itself, is the first layer's input); the first
    time per config, mode and autocast, also the embedding's own output on `ids`, compared with it."""
    made = prologue()
    key = _key(config, embedding)
    if key not in _verdicts:
        hidden = made[0] if isinstance(made, tuple) else made
        with torch.no_grad():
            own = embedding(ids)
        same = torch.is_tensor(own) and own.shape == hidden.shape and own.dtype == hidden.dtype
        _verdicts[key] = bool(same and torch.equal(own, hidden.detach()))
    return made


def _key(config: PretrainedConfig, embedding: nn.Module) -> tuple:
    autocast = torch.is_autocast_enabled("cpu") or (torch.cuda.is_available() and torch.is_autocast_enabled("cuda"))
    return (argument_memo.config_id(config), embedding.training, autocast)
