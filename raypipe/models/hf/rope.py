"""Rotary embeddings whose frequencies follow the sequence's length.

transformers' `dynamic` (NTK) and `longrope` rotary embeddings pick their frequencies in each
forward from the longest position they are handed (`dynamic_rope_update`): `longrope` its long
factors past `original_max_position_embeddings`, `dynamic` grown to the longest length seen so far
and reset below the original one. So what a layer is handed depends on more than its own positions:

- on the sequence's whole length: a sequence chunk asks with its own end and would get the
  frequencies of a shorter sequence (`sequence_chunks` is refused for these, `HFDecoderLayer`);
- for `dynamic`, on the lengths seen before: the arguments of a length cannot be kept from one step
  to the next (`argument_memo` makes them afresh, as transformers does each forward).
"""

from __future__ import annotations

from typing import Any


def rope_types(config: Any) -> list[str]:
    """The rotary embedding types `config` names (one per layer type where it has several)."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if not isinstance(params, dict):
        return []
    sets = [v for v in params.values() if isinstance(v, dict)] or [params]
    return [str(p.get("rope_type") or p.get("type") or "default") for p in sets]


def follows_length(config: Any) -> str | None:
    """The first of `config`'s rotary types whose frequencies follow the sequence's length, or None."""
    return next((t for t in rope_types(config) if "dynamic" in t or t == "longrope"), None)
