"""Decoder layers' arguments kept from one step to the next (`skeleton.layer_inputs`' answers).

What transformers' base model passes a decoder layer (its rotary position embeddings, its mask,
its cache positions) depends on the tokens' positions and padding, not on their values. A run
whose samples have the same length and no padding asks for the same arguments every step; making
them runs the base model's forward up to the layer (`skeleton._prologue`): about a millisecond a
call at 64 wide, once per layer and step unchunked, once per chunk and stage with sequence chunks,
where it was 4-5 % of a small stage's step (`benchmarks/chunk_cost.py`).

Only arguments that positions alone decide are kept: no attention mask (no padding) and positions
numbered from the span's start (`plain`); a packed row or a padded batch makes them afresh, and
so does a model whose rotary frequencies follow the lengths it saw before (`rope.follows_length`). Kept
tensors hold no autograd history (made from zeros and buffers) and no layer changes them in place.
A chunk's arguments name its microbatch's cache, which `with_cache` swaps for the running one's.
The memo is per process and bounded in bytes (`BUDGET`), the least recently used dropped first.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from raypipe.models.hf import rope, skeleton

if TYPE_CHECKING:
    from transformers import PretrainedConfig

#: the bytes of tensors the memo keeps per process (a 2,048-token sample's chunk masks: ~2.3 MB)
BUDGET = 64 * 2**20

_memo: OrderedDict[tuple, tuple[tuple, dict[str, Any], int]] = OrderedDict()
_held = 0
_configs: dict[int, object] = {}  # id -> config: a config keyed by its id lives on, so no other takes the id


def config_id(config: object) -> int:
    """`id(config)`, which no later config of this process can take (`skeleton.skeleton` keeps its
    configs alike): a kept argument or verdict never answers for another model."""
    _configs.setdefault(id(config), config)
    return id(config)


def plain(inputs: dict[str, Any], start: int, end: int) -> bool:
    """Whether `inputs` (attention_mask, position_ids) make arguments that positions alone decide:
    no mask, and positions None or numbered start..end - 1 in every row. Positions on an
    accelerator are not looked at: reading them back would make every layer call wait for the
    device's queue; there a microbatch's arguments are made once per attention type (`_shared`)."""
    if inputs.get("attention_mask") is not None:
        return False
    positions = inputs.get("position_ids")
    if positions is None:
        return True
    if positions.device.type != "cpu":
        return False
    if positions.dim() != 2 or positions.shape[-1] != end - start or positions.is_floating_point():
        return False
    numbered = torch.arange(start, end, device=positions.device, dtype=positions.dtype)
    return bool((positions == numbered).all())


def key(config: object, kind: object, hidden: torch.Tensor, start: int, end: int, chunked: bool) -> tuple:
    """The memo's key for a layer `kind` (its index, or its attention type where layers of a type
    share arguments) on hidden states like `hidden` (their batch, dtype, device) over positions
    start..end - 1, under the attention implementation and autocast now in force; `chunked`: made
    with a chunk's cache."""
    device = hidden.device.type
    autocast = torch.is_autocast_enabled(device) if device in ("cpu", "cuda") else False
    implementation = getattr(config, "_attn_implementation", None)
    like = (hidden.shape[0], hidden.dtype, str(hidden.device))
    return (config_id(config), implementation, kind, chunked, *like, autocast, start, end)


def get(found: tuple) -> tuple[tuple, dict[str, Any]] | None:
    entry = _memo.get(found)
    if entry is None:
        return None
    _memo.move_to_end(found)
    return entry[0], entry[1]


def put(found: tuple, arguments: tuple[tuple, dict[str, Any]]) -> None:
    """Keeps `arguments` under `found` where they fit the budget, dropping the least recently used."""
    global _held
    args, kwargs = arguments
    tensors = _tensors([*args, *kwargs.values()])
    if any(t.requires_grad or t.is_inference() for t in tensors):  # history, or unusable in training
        return
    size = sum(t.numel() * t.element_size() for t in tensors)
    if size > BUDGET or found in _memo:
        return
    while _memo and _held + size > BUDGET:
        _, (_, _, dropped) = _memo.popitem(last=False)
        _held -= dropped
    _memo[found] = (args, kwargs, size)
    _held += size


def clear() -> None:
    global _held
    _memo.clear()
    _recent.clear()
    _held = 0


def with_cache(arguments: tuple[tuple, dict[str, Any]], cache: object) -> tuple[tuple, dict[str, Any]]:
    """`arguments` with the cache they name (transformers' `Cache`, as an argument) swapped for `cache`."""
    from transformers import Cache

    args, kwargs = arguments
    swap = lambda v: cache if isinstance(v, Cache) else v  # noqa: E731
    return tuple(swap(a) for a in args), {k: swap(v) for k, v in kwargs.items()}


def _tensors(values: list) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    for v in values:
        if torch.is_tensor(v):
            out.append(v)
        elif isinstance(v, (tuple, list)):
            out += _tensors(list(v))
    return out


def layer_inputs(config: PretrainedConfig, index: int, hidden: torch.Tensor, inputs: dict[str, Any]) -> tuple:
    """Decoder layer `index`'s arguments for a whole sequence (`skeleton.layer_inputs`, without a
    cache): kept for the next step where positions alone decide them; else shared with the layer of
    the same attention type that ran just before on the same mask and positions (`_recent`)."""
    if rope.follows_length(config):  # its frequencies follow the lengths seen before: made as each forward makes them
        return _made(config, index, hidden, inputs)
    if not plain(inputs, 0, hidden.shape[1]):
        return _shared(config, index, hidden, inputs)
    return kept(
        key(config, index, hidden, 0, hidden.shape[1], chunked=False), lambda: _made(config, index, hidden, inputs)
    )


def kept(found: tuple, make: Callable[[], tuple]) -> tuple:
    """The arguments kept under `found`, else `make()`'s, kept there for the next step (`put`)."""
    arguments = get(found)
    if arguments is None:
        arguments = make()
        put(found, arguments)
    return arguments


def _made(config: PretrainedConfig, index: int, hidden: torch.Tensor, inputs: dict[str, Any]) -> tuple:
    return skeleton.layer_inputs(config, [index], hidden, {**inputs, "use_cache": False})[index]


#: per config and attention type: the mask and positions objects its last layer ran on, that
#: layer's `key` (batch, dtype, device, span) and the arguments made for them; one each, so a run
#: of many shapes keeps no more than one microbatch's
_recent: dict[tuple, tuple[object, object, tuple, tuple]] = {}


def _shared(config: PretrainedConfig, index: int, hidden: torch.Tensor, inputs: dict[str, Any]) -> tuple:
    """The arguments of a padded or packed microbatch: made once per attention type as the whole
    model makes them once per forward (the masks per layer type, the rotary embeddings), not once
    per layer. A stage's layers pass one microbatch's mask and positions on as the same objects, so
    a layer whose type ran last on those very objects takes what it made (kept with them, so their
    ids cannot be reused meanwhile); a new microbatch brings new objects and makes its own."""
    types = getattr(config, "layer_types", None)
    kind = types[index] if types else None
    found = key(config, kind, hidden, 0, hidden.shape[1], chunked=False)
    mask, positions = inputs.get("attention_mask"), inputs.get("position_ids")
    recent = _recent.get(found[:3])  # the config, its attention implementation, the type
    if recent is not None and recent[0] is mask and recent[1] is positions and recent[2] == found:
        return recent[3]
    arguments = _made(config, index, hidden, inputs)
    _recent[found[:3]] = (mask, positions, found, arguments)
    return arguments
