"""Rotary embeddings whose frequencies follow the sequence's length.

transformers' `dynamic` (NTK) and `longrope` rotary embeddings pick their frequencies in each
forward from the longest position they are handed (`dynamic_rope_update`): `longrope` its long
factors past `original_max_position_embeddings`, `dynamic` grown to the longest length seen so far
and reset below the original one. So what a layer is handed depends on more than its own positions:

- on the sequence's whole length: a sequence chunk's forward sees only its own positions, so its
  rotary embedding is set first as the whole sequence's forward sets it (`whole_sequence`, from the
  end its unit carries: `data.sequence_units`), then computed on the chunk's positions without
  changing it again;
- for `dynamic`, on the lengths seen before: the arguments of a length cannot be kept from one step
  to the next (`argument_memo` makes them afresh, as transformers does each forward).
"""

from __future__ import annotations

import contextlib
import inspect
import types
from collections.abc import Iterator
from typing import Any

import torch


def rope_types(config: Any) -> list[str]:
    """The rotary embedding types `config` names (one per layer type where it has several)."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if not isinstance(params, dict):
        return []
    sets = [v for v in params.values() if isinstance(v, dict)] or [params]
    return [str(p.get("rope_type") or p.get("type") or "default") for p in sets]


#: per config (by id, the config held so no other takes it): the rotary type that follows the
#: length, or None, and the skeleton's rotary modules with their forwards unwrapped (`_of`)
_known: dict[int, tuple[Any, str | None, dict[Any, Any] | None]] = {}


def follows_length(config: Any) -> str | None:
    """The first of `config`'s rotary types whose frequencies follow the sequence's length, or None
    (found once per config: every decoder layer call asks)."""
    return _of(config)[1]


def _of(config: Any) -> tuple[Any, str | None, dict[Any, Any] | None]:
    found = _known.get(id(config))
    if found is None:
        follows = next((t for t in rope_types(config) if "dynamic" in t or t == "longrope"), None)
        found = _known[id(config)] = (config, follows, None)
    return found


def _rotaries(config: Any) -> dict[Any, Any]:
    """The skeleton's rotary modules (`skeleton.skeleton`, whose prologue makes every layer's
    arguments), each with its forward without transformers' update, found once per config."""
    held, follows, rotaries = _of(config)
    if rotaries is None:
        from raypipe.models.hf import skeleton

        base = getattr(skeleton.skeleton(config), skeleton.plan_of(config).base)
        found = [m for m in base.modules() if hasattr(m, "rope_type") and hasattr(m, "original_max_seq_len")]
        rotaries = {m: torch.no_grad()(inspect.unwrap(type(m).forward)) for m in found}
        _known[id(config)] = (held, follows, rotaries)
    return rotaries


@contextlib.contextmanager
def whole_sequence(config: Any, end: int | torch.Tensor | None) -> Iterator[None]:
    """Inside, the skeleton's rotary embeddings (`skeleton.skeleton`, whose prologue makes every
    layer's) are as a forward over positions up to `end` (the chunk's `sequence_end`) leaves them,
    and a forward on a chunk's positions computes with them without picking again: a chunk gets its
    slice of the whole sequence's rotary embedding. Nothing changes, and `end` is not read (on an
    accelerator, a wait), where `config`'s frequencies do not follow the length.

    Raises:
        ValueError: they follow it, and `end` is None (a chunk cut elsewhere than `sequence_units`).
    """
    follows = follows_length(config)
    if follows is None:
        yield
        return
    if end is None:
        raise ValueError(
            f"a sequence chunk of a model whose rotary embedding is {follows!r} needs its sequence's end "
            f"(`sequence_end`, which raypipe.data.sequence_units.cut_microbatch gives each unit)"
        )
    rotaries = _rotaries(config)
    last = torch.tensor([[int(end) - 1]])
    for rotary in rotaries:  # the update transformers' forward over the whole sequence makes
        kinds = list(rotary.rope_type) if isinstance(rotary.rope_type, dict) else [None]
        for kind in kinds:
            rotary(torch.zeros(1), last, **({"layer_type": kind} if kind is not None else {}))
    try:
        for rotary, forward in rotaries.items():  # the same forward, without its update
            rotary.forward = types.MethodType(forward, rotary)
        yield
    finally:
        for rotary in rotaries:
            rotary.__dict__.pop("forward", None)
