"""A layer's tensors where transformers' checkpoints keep them under other names or shapes.

transformers 5 declares per model type how a checkpoint's tensors become the model's
(`conversion_mapping`): renamings (GPT-NeoX's `embed_out` is its `lm_head`) and conversions (a
mixture of experts stores each expert's `gate_proj`, `up_proj`, `down_proj`; the model holds them
stacked and fused in `experts.gate_up_proj` and `experts.down_proj`). A stage reads its layers
through the same transforms, applied by transformers' own objects to the tensors it read, and an
export reverts them as transformers' `save_pretrained` does, so a checkpoint transformers wrote
loads and one raypipe writes loads back into transformers.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch

from raypipe.models.hf import skeleton, tensor_files

if TYPE_CHECKING:
    from transformers import PretrainedConfig

_sources: dict[tuple[str, int], dict[str, list[tuple[str, str | None]]]] = {}  # (directory, config) -> targets
_lock = threading.Lock()


def transforms(config: PretrainedConfig) -> tuple[list, list]:
    """The model type's (renamings, converters) as transformers loads a checkpoint with them."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming

    found = get_model_conversion_mapping(skeleton.skeleton(config)) or []
    return (
        [t for t in found if isinstance(t, WeightRenaming)],
        [t for t in found if isinstance(t, WeightConverter)],
    )


def sources(directory: str, config: PretrainedConfig) -> dict[str, list[tuple[str, str | None]]]:
    """Model key -> the checkpoint keys it is made from, each with the converter pattern that
    matched it (None: a tensor renamed, or kept as it is). Made once per directory and process."""
    with _lock:
        key = (directory, id(config))
        if key not in _sources:
            from transformers.core_model_loading import rename_source_key

            renamings, converters = transforms(config)
            targets: dict[str, list[tuple[str, str | None]]] = {}
            for name in tensor_files.files_by_key(directory):
                target, pattern = rename_source_key(name, renamings, converters)
                targets.setdefault(target, []).append((name, pattern))
            _sources[key] = targets
        return _sources[key]


def read(
    directory: str,
    config: PretrainedConfig,
    wanted: Iterable[str],
    dtype: torch.dtype,
    device: Any,
    mapped: bool = False,
) -> dict[str, torch.Tensor]:
    """The model's tensors under `wanted` keys, read from `directory` (`tensor_files.read`: only the
    checkpoint tensors they are made from, mapped from their files with `mapped`) and converted as
    transformers converts them.

    Raises:
        KeyError: a key nothing in the checkpoint makes.
    """
    wanted = list(wanted)
    where = tensor_files.files_by_key(directory)
    if all(k in where for k in wanted):  # the common case: the checkpoint names the model's tensors
        return tensor_files.read(directory, wanted, dtype, device, mapped)
    made = sources(directory, config)
    missing = [k for k in wanted if k not in made]
    if missing:
        raise KeyError(f"{directory} has no tensor that makes {missing[0]!r} (it has e.g. {sorted(where)[:3]})")
    read_now = tensor_files.read(directory, [s for k in wanted for s, _ in made[k]], dtype, device, mapped)
    _, converters = transforms(config)
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    out = {}
    for key in wanted:
        parts = made[key]
        if parts[0][1] is None:  # renamed only
            out[key] = read_now[parts[0][0]]
            continue
        converter = copy.deepcopy(by_pattern[parts[0][1]])
        for source, pattern in parts:
            converter.add_tensor(key, source, pattern, read_now[source])
        converted = converter.convert(key, model=skeleton.skeleton(config), config=config)
        value = converted[key]
        out[key] = value[0] if isinstance(value, list) else value
    return out


def to_checkpoint(config: PretrainedConfig, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A state dict under the model's keys as transformers' `save_pretrained` writes it (renamings
    and conversions reverted)."""
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # a transformers without conversions: its files name tensors as its modules do
        return state
    return revert_weight_conversion(skeleton.skeleton(config), state)


def needed(config: PretrainedConfig) -> bool:
    """Whether the model type's checkpoints name any tensor otherwise than its modules do."""
    renamings, converters = transforms(config)
    return bool(renamings or converters)
