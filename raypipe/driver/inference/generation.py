"""Generating tokens through the pipeline: the driver runs one forward per new token through
every stage (each actor's output going straight to the next as an object reference); the last
stage picks the next token (`raypipe.nn.sampling.pick`) and the driver feeds it back.

With a model whose layers keep a KV cache (`raypipe.model.Model.kv_cache`: transformers
layers), each stage keeps the keys and values of its own layers, so after the prompt only
the new token runs through the pipeline; other models run the whole sequence each time.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from raypipe.driver.results import gather, wait_for_progress
from raypipe.transport.wire import pack, unpack


def generate(
    stages: Sequence[Sequence[Any]],
    names: Sequence[Sequence[str]],
    chunks: Sequence[int] | None,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    temperature: float,
    top_k: int | None,
    cached: bool,
    timeout: float,
    attention_mask: torch.Tensor | None = None,
    eos_token_id: int | None = None,
    seed: int | None = None,
    top_p: float = 1.0,
) -> torch.Tensor:
    """The prompt `input_ids` followed by up to `max_new_tokens` generated tokens per row; rows
    that produced `eos_token_id` continue with it (as transformers pads finished rows).

    `stages` holds each stage's tp ranks, in virtual-stage order with model chunks (`chunks`: the
    chunk each runs); every rank runs, rank 0's output goes on.
    """
    flat = [a for ranks in stages for a in ranks]
    flat_names = [n for ranks in names for n in ranks]
    sequence, mask = input_ids, attention_mask
    done = torch.zeros(input_ids.shape[0], dtype=torch.bool)
    try:
        for i in range(max_new_tokens):
            x = _step_input(sequence, mask, i, cached)
            sampling = (temperature, top_k, top_p, seed)
            token = _run(stages, names, chunks, x, start=i == 0, cached=cached, timeout=timeout, sampling=sampling)
            if eos_token_id is not None:
                token = token.masked_fill(done, eos_token_id)
                done |= token == eos_token_id
            sequence = torch.cat([sequence, token[:, None]], dim=1)
            if mask is not None:
                mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)
            if eos_token_id is not None and bool(done.all()):
                break
    finally:
        gather([a.end_generation.remote() for a in flat], "generate", flat, flat_names)
    return sequence


def _step_input(sequence: torch.Tensor, mask: torch.Tensor | None, i: int, cached: bool) -> Any:
    """What stage 0 takes for new token i: with a cache the prompt, then only the last token with
    its position; without, the whole sequence so far."""
    if not cached:
        return sequence if mask is None else {"input_ids": sequence, "attention_mask": mask}
    if mask is None:
        positions = torch.arange(sequence.shape[1]).unsqueeze(0)
    else:  # left padding: positions count the real tokens, as transformers' generate numbers them
        positions = (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 1)
    ids = sequence if i == 0 else sequence[:, -1:]
    x = {"input_ids": ids, "position_ids": positions if i == 0 else positions[:, -1:]}
    if mask is not None:
        x["attention_mask"] = mask
    return x


def _run(
    stages: Sequence[Sequence[Any]],
    names: Sequence[Sequence[str]],
    chunks: Sequence[int] | None,
    x: Any,
    start: bool,
    cached: bool,
    timeout: float,
    sampling: tuple,
) -> torch.Tensor:
    """One forward through every stage; each row's next token, picked on the last stage
    (`StageActor.generate_forward`) by `sampling` = (temperature, top_k, top_p, seed)."""
    ref, pending = pack(x), {}
    for s, ranks in enumerate(stages):
        chunk = None if chunks is None else chunks[s]
        last = sampling if s == len(stages) - 1 else None
        refs = [actor.generate_forward.remote(ref, start, cached, chunk, last) for actor in ranks]
        for t, r in enumerate(refs):
            pending[r] = (names[s][t], "generate")
        ref = refs[0]
    wait_for_progress(pending, timeout, "generate")
    flat = [a for ranks in stages for a in ranks]
    return unpack(gather([ref], "generate", flat, [n for ranks in names for n in ranks])[0])
