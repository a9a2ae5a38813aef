"""Generating tokens through the pipeline without the driver in the loop: each new token is one
forward through every stage (each actor's output going straight to the next as an object
reference), the last stage picks the token (`raypipe.nn.decoding.Picker`) and the first stage
turns it into its next input (`Feed`), so the driver queues calls ahead and only reads tokens
back a few steps behind (to free what it no longer needs and to stop once every row has ended).

With two or more stages the rows split into one microbatch per actor, each with its own KV
caches, so every stage works on some microbatch's token at once; a single actor decodes
`TOKENS_PER_CALL` tokens per call. With a model whose layers keep a KV cache
(`raypipe.models.model.Model.kv_cache`: transformers layers) only the new token runs after the prompt;
other models run the whole sequence each time.

Sampling is seeded per microbatch (`seed` for the first, one derived from it for each other),
so a seed gives the same tokens for the same pipeline; a different number of stages splits
the rows differently and so draws differently.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from raypipe.driver.results import gather, wait_for_progress
from raypipe.observe.phases import Phase
from raypipe.transport.wire import pack, unpack

if TYPE_CHECKING:
    from ray import ObjectRef
    from ray.actor import ActorHandle

    from raypipe.driver.actor_group import ActorGroup

TOKENS_PER_CALL = 16  # a single actor's tokens per call: Ray's per-call cost spread over them
BEHIND = 4  # the calls the driver queues ahead of the tokens it has read back


def generate(
    stages: Sequence[Sequence[ActorHandle]],
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
    progress: Callable[[int], None] = lambda made: None,
) -> torch.Tensor:
    """The prompt `input_ids` followed by up to `max_new_tokens` generated tokens per row; rows
    that produced `eos_token_id` continue with it (as transformers pads finished rows), and
    generation ends once every row has.

    `stages` holds each stage's tp ranks, in virtual-stage order with model chunks (`chunks`: the
    chunk each runs); every rank runs, rank 0's output goes on. `progress` hears how many tokens
    per row have come back, as they do.
    """
    if max_new_tokens < 1:
        return input_ids
    flat = [a for ranks in stages for a in ranks]
    flat_names = [n for ranks in names for n in ranks]
    alone = len(flat) == 1
    per_call = TOKENS_PER_CALL if alone else 1
    slots = _microbatches(input_ids.shape[0], len({id(ranks[0]) for ranks in stages}))
    sampling = [(len(rows), temperature, top_k, top_p, _seed(seed, m), eos_token_id) for m, rows in enumerate(slots)]
    prompts = [
        pack(
            {
                "input_ids": input_ids[rows],
                **({} if attention_mask is None else {"attention_mask": attention_mask[rows]}),
            }
        )
        for rows in slots
    ]
    queued: list[tuple[list[object], dict]] = []  # per call round: each microbatch's tokens, and every call's label
    tokens: list[list[torch.Tensor]] = [[] for _ in slots]
    try:
        for i in range(-(-max_new_tokens // per_call)):
            count = min(per_call, max_new_tokens - i * per_call)
            last = [prompts[m] if i == 0 else queued[-1][0][m] for m in range(len(slots))]
            queued.append(_queue(stages, names, chunks, last, i == 0, cached, sampling, count))
            if len(queued) > BEHIND:
                ended = _read(queued.pop(0), tokens, timeout, flat, flat_names, eos_token_id)
                progress(_made(tokens))
                if ended:
                    queued.clear()
                    break
        while queued and not _read(queued.pop(0), tokens, timeout, flat, flat_names, eos_token_id):
            progress(_made(tokens))
        made = _made(tokens)
    finally:
        gather([a.end_generation.remote() for a in flat], "generate", flat, flat_names)
    new = torch.cat([torch.cat(rows, dim=1)[:, :made] for rows in tokens], dim=0)
    if eos_token_id is not None:
        ended = (new == eos_token_id).all(dim=0).nonzero()
        new = new[:, : int(ended[0]) + 1] if len(ended) else new
    return torch.cat([input_ids, new.to(input_ids.dtype)], dim=1)


def generate_on(
    group: ActorGroup,
    label: str,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    temperature: float,
    top_k: int | None,
    cached: bool,
    attention_mask: torch.Tensor | None = None,
    eos_token_id: int | None = None,
    seed: int | None = None,
    top_p: float = 1.0,
) -> torch.Tensor:
    """`generate` through `group`'s inference path (an `ActorGroup`, its weights whole), within its
    step timeout, reported as the phase `label` (`observe.phases`: a bar on a terminal, a line
    every 30 s in a log): `Trainer.generate` and a GRPO generation batch."""
    with Phase(label, group.log, max_new_tokens, "tokens", announce=False) as phase:
        with group.whole_weights():
            path = group.inference_path()
            how = (max_new_tokens, temperature, top_k, cached, group.config.step_timeout)
            return generate(*path, input_ids, *how, attention_mask, eos_token_id, seed, top_p, phase.at)


def _made(tokens: list[list[torch.Tensor]]) -> int:
    """Tokens per row read back so far (every microbatch has at least this many)."""
    return min(sum(t.shape[1] for t in rows) for rows in tokens)


def _microbatches(rows: int, actors: int) -> list[torch.Tensor]:
    """The rows of each microbatch: one per actor on the path (as many as there are rows at
    most), so that each has a token to work on while the others' go through the rest."""
    return list(torch.arange(rows).tensor_split(min(rows, actors)))


def _seed(seed: int | None, m: int) -> int | None:
    """Microbatch `m`'s sampling seed: `seed` for the first, a distant one for each other."""
    return seed if seed is None or m == 0 else (seed * 6364136223846793005 + m * 1442695040888963407) % 2**63


def _queue(
    stages: Sequence[Sequence[ActorHandle]],
    names: Sequence[Sequence[str]],
    chunks: Sequence[int] | None,
    inputs: Sequence[object],
    start: bool,
    cached: bool,
    sampling: Sequence[tuple],
    count: int,
) -> tuple[list[object], dict]:
    """One round of calls: each microbatch's `inputs` (its prompt at `start`, else the tokens its
    last call picked) through every stage. Returns each microbatch's picked tokens (references)
    and every call's (actor, label)."""
    picked: list[object] = []
    pending: dict[ObjectRef, tuple[str, str]] = {}
    for m, ref in enumerate(inputs):
        for s, ranks in enumerate(stages):
            chunk = None if chunks is None else chunks[s]
            chosen = sampling[m] if s == len(stages) - 1 else None
            refs: list[ObjectRef] = [
                actor.decode.remote(ref, m, start, cached, chunk, s == 0, chosen, count) for actor in ranks
            ]
            for t, r in enumerate(refs):
                pending[r] = (names[s][t], f"generate microbatch {m}")
            ref = refs[0]
        picked.append(ref)
    return picked, pending


def _read(
    round_: tuple[list[Any], dict],
    tokens: list[list[torch.Tensor]],
    timeout: float,
    actors: Sequence[ActorHandle],
    names: Sequence[str],
    eos_token_id: int | None,
) -> bool:
    """Waits for a round of calls and keeps its tokens; whether every row has now ended."""
    picked, pending = round_
    wait_for_progress(pending, timeout, "generate")
    for m, got in enumerate(unpack(gather(picked, "generate", actors, names))):
        tokens[m].append(got)
    return eos_token_id is not None and all(bool((rows[-1][:, -1] == eos_token_id).all()) for rows in tokens)
