"""Sequence chunks (`TrainConfig.sequence_chunks`): each sample cut along the sequence into k
chunks that flow through the pipeline one after another (TeraPipe, Seq1F1B), so that one long
sample fills the pipeline.

Exact because attention is causal: chunk c's queries see the keys and values of chunks 0..c
only. Each attention layer keeps its earlier chunks' keys and values for the step as leaves of
their own (`KVChunks`); chunk c's forward attends to them and to its own, and its backward
(chunks run backward in reverse order) adds their gradients to those leaves, which chunk c'
< c's backward then back-propagates with its output's gradient (`Sequence.roots`).

A stage's executor opens a chunk's `Position` around the chunk's forward (`Sequence.forward`);
layers ask `current()` for it: None when the step is not chunked, so they run as always. Under
activation checkpointing a chunk's forward runs again in its backward (`Position.replayed`):
it attends to the same earlier leaves and keeps nothing, so the chunk's keys are added once.
A backward split in two (ZB-H1's I and W, or one handed on early) gives the earlier leaves
their gradients in its first half (`Sequence.split_backward`).
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from raypipe.core.layers import Boundary, LossFunction

_CURRENT: contextvars.ContextVar[Position | None] = contextvars.ContextVar("sequence_chunk", default=None)


def current() -> Position | None:
    """The chunk whose forward is running on this thread, or None (not chunked, or no forward).
    None inside a compiled layer, without a graph break: compile is refused with chunks."""
    if torch.compiler.is_compiling():
        return None
    return _CURRENT.get()


class KVChunks:
    """One attention layer's keys and values of one microbatch, chunk by chunk: what each chunk
    made (`made`, in its graph, the roots of its backward) and its leaf copy (`leaves`, which later
    chunks attend to and collect gradients on)."""

    def __init__(self) -> None:
        self.made: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.leaves: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def earlier(self, chunk: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The leaves of every chunk before `chunk` still kept (their backwards come after its)."""
        return [self.leaves[c] for c in sorted(self.leaves) if c < chunk]

    def keep(self, chunk: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Keeps what chunk `chunk` made, and a leaf copy of it for the chunks after it."""
        self.made[chunk] = (keys, values)
        self.leaves[chunk] = (keys.detach().requires_grad_(), values.detach().requires_grad_())

    def roots(self, chunk: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(what chunk `chunk` made, the gradient later chunks gave its leaf) for its backward;
        frees both."""
        made, leaves = self.made.pop(chunk, None), self.leaves.pop(chunk, None)
        if made is None or leaves is None:
            return []
        return [(m, leaf.grad) for m, leaf in zip(made, leaves) if leaf.grad is not None]


class Microbatch:
    """One microbatch's chunks on one stage: where each starts in the sequence, each attention
    layer's `KVChunks`, and what its layers share across chunks (`shared`: transformers' cache,
    the attention masks seen so far)."""

    def __init__(self) -> None:
        self.starts: dict[int, int] = {0: 0}
        self.layers: dict[object, KVChunks] = {}
        self.shared: dict[str, Any] = {}

    def kv(self, layer: object) -> KVChunks:
        return self.layers.setdefault(layer, KVChunks())


class Position:
    """The chunk a forward runs: its microbatch's state, its index, how many there are, and where
    in the sequence it starts (`offset`) and ends."""

    def __init__(self, microbatch: Microbatch, chunk: int, chunks: int, length: int) -> None:
        self.microbatch, self.chunk, self.chunks = microbatch, chunk, chunks
        self.offset = microbatch.starts[chunk]
        self.end = self.offset + length
        microbatch.starts[chunk + 1] = self.end
        self.replay = False  # a recomputation of the chunk's forward (`replayed`)
        self.seen: dict[object, list] = {}  # per layer, the earlier leaves its forward attended to

    def extend(
        self, layer: object, keys: torch.Tensor, values: torch.Tensor, dim: int = -2
    ) -> tuple[torch.Tensor, ...]:
        """`layer`'s keys and values for this chunk's attention: its own joined after every earlier
        chunk's along `dim` (the sequence's); kept for the chunks after it (`blocks`)."""
        all_keys, all_values = self.blocks(layer, keys, values)
        if len(all_keys) == 1:
            return keys, values
        return torch.cat(all_keys, dim=dim), torch.cat(all_values, dim=dim)

    def blocks(self, layer: object, keys: torch.Tensor, values: torch.Tensor) -> tuple[list, list]:
        """`layer`'s keys and values for this chunk's attention as blocks for
        `chunk_attention.attend` (no joined copy): every earlier chunk's leaves, then its own. The
        forward notes the leaves it sees (`seen`) and keeps what it made; a replay attends to those
        same leaves and keeps nothing (what it made is kept already, and under a split backward the
        chunk before it may have run its input half since, freeing its leaves)."""
        kv = self.microbatch.kv(layer)
        if not self.replay:
            self.seen[layer] = kv.earlier(self.chunk)
            kv.keep(self.chunk, keys, values)
        earlier = self.seen[layer]
        return [*(k for k, _ in earlier), keys], [*(v for _, v in earlier), values]

    def replayed(self) -> Replay:
        """This chunk's forward again, as activation checkpointing recomputes it in the chunk's
        backward (torch's `checkpoint(context_fn=...)`, on whatever thread autograd runs it): it
        attends to the earlier leaves its forward saw (`seen`), and the keys and values the chunk
        made are not kept a second time."""
        again = copy.copy(self)
        again.replay = True
        return Replay(again)


class Replay:
    """A context that makes `position` the running chunk, as often as it is entered: torch's
    checkpoint enters its recomputation context at each recomputation, and a split backward
    recomputes in each of its halves."""

    def __init__(self, position: Position) -> None:
        self.position = position
        self.tokens: list[contextvars.Token] = []

    def __enter__(self) -> Position:
        self.tokens.append(_CURRENT.set(self.position))
        return self.position

    def __exit__(self, *exc: object) -> None:
        _CURRENT.reset(self.tokens.pop())

    def causal_mask(self, device: torch.device) -> torch.Tensor:
        """Which keys (every token up to this chunk's end) each of this chunk's queries sees: a
        (queries, keys) boolean mask, True where attention is allowed."""
        queries = torch.arange(self.offset, self.end, device=device).unsqueeze(1)
        return torch.arange(self.end, device=device).unsqueeze(0) <= queries


class Sequence:
    """A stage's chunked microbatches during a step: the executor's unit u is chunk u % k of
    microbatch u // k."""

    def __init__(self, chunks: int) -> None:
        self.chunks = chunks
        self.open: dict[tuple[object, int], Microbatch] = {}

    @classmethod
    def of(cls, chunks: int, layers: object, actor: str, indices: list[int]) -> Sequence:
        """A stage's step state for `chunks` per microbatch (1: not chunked, nothing kept), its
        `layers` checked first where chunked (`check_chunkable`)."""
        if chunks > 1:
            check_chunkable(layers, actor, indices)
        return cls(chunks)

    def split(self, unit: int) -> tuple[int, int]:
        """(microbatch, chunk) of a unit."""
        return divmod(unit, self.chunks)

    def forward(self, unit: int, module: Any, x: Any, part: Any = None, recompute: bool = False) -> Any:
        """`module(x)` as unit `unit`'s sequence chunk (of model chunk `part`). `recompute`: under
        activation checkpointing (torch's, non-reentrant), the chunk's forward runs again in its
        backward as a replay (`Position.replayed`)."""
        m, c = self.split(unit)
        microbatch = self.open.setdefault((part, m), Microbatch())
        position = Position(microbatch, c, self.chunks, sequence_length(x))
        token = _CURRENT.set(position)
        try:
            if not recompute:
                return module(x)
            replay = (contextlib.nullcontext(), position.replayed())
            return checkpoint(module, x, use_reentrant=False, context_fn=lambda: replay)
        finally:
            _CURRENT.reset(token)

    def made(self, unit: int, part: object = None) -> list[torch.Tensor]:
        """The keys and values unit `unit` made, kept until its backward: under activation
        checkpointing the part of its attention autograd's saved-tensor hooks do not see."""
        m, c = self.split(unit)
        microbatch = self.open.get((part, m))
        return [t for kv in microbatch.layers.values() for t in kv.made.get(c, ())] if microbatch else []

    def roots(self, unit: int, part: object = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(keys or values unit `unit` made, the gradient later chunks gave them): added to its
        backward's outputs. Its microbatch is done after its first chunk; none unchunked."""
        m, c = self.split(unit)
        microbatch = self.open.get((part, m))
        if microbatch is None:
            return []
        pairs = [pair for kv in microbatch.layers.values() for pair in kv.roots(c)]
        if c == 0:
            del self.open[(part, m)]
        return pairs

    def split_backward(self, unit: int, part: object, outputs: list, grads: list | None, inputs: list) -> tuple:
        """(outputs, their gradients, inputs) of unit `unit`'s backward split in two
        (`split_backward.input_gradients`): its keys and values with the gradients later chunks gave
        them (`roots`) as one more output, a scalar (torch's split detaches its outputs in place,
        which views refuse), and the leaves of its microbatch's earlier chunks as more inputs, so
        that the first half gives them their gradients before those chunks' backwards run. Unchanged
        when the step is not chunked."""
        if self.chunks == 1:
            return outputs, grads, inputs
        roots = self.roots(unit, part)
        if roots:
            outputs = [*outputs, sum((made * g).sum() for made, g in roots)]
            grads = None if grads is None else [*grads, torch.ones_like(outputs[-1])]
        m, c = self.split(unit)
        microbatch = self.open.get((part, m))
        layers = microbatch.layers.values() if microbatch is not None else ()
        return outputs, grads, [*inputs, *(t for kv in layers for pair in kv.earlier(c) for t in pair)]

    def clear(self) -> None:
        self.open.clear()


def unit_loss(
    loss_fn: LossFunction, out: Boundary, target: Boundary, device: torch.device, weight: float, chunked: bool
) -> torch.Tensor:
    """`loss_fn(out, target)` with the target on `device`, but zero (with a graph) for a `chunked`
    unit of weight 0: a sequence chunk whose targets are all ignored (a mean over none is NaN)."""
    from raypipe.transport.tree import map_tensors, tensors

    if chunked and weight == 0.0:
        return sum(t.float().sum() for t in tensors(out) if t.is_floating_point()) * 0.0
    return loss_fn(out, map_tensors(lambda t: t.to(device), target))


def sequence_length(x: Boundary) -> int:
    """The sequence length of a boundary value: dim 1 of its first tensor of two or more dimensions
    (token ids (batch, sequence), hidden states (batch, sequence, width))."""
    from raypipe.transport.tree import tensors

    for t in tensors(x):
        if t.dim() >= 2:
            return int(t.shape[1])
    raise ValueError("a sequence chunk holds no tensor with a sequence dimension (dim 1)")


# torch's modules that work token by token: a chunk of the sequence is all they need
_TOKEN_BY_TOKEN = (
    torch.nn.Linear,
    torch.nn.Embedding,
    torch.nn.LayerNorm,
    torch.nn.RMSNorm,
    torch.nn.Dropout,
    torch.nn.Identity,
    torch.nn.GELU,
    torch.nn.ReLU,
    torch.nn.SiLU,
    torch.nn.Tanh,
    torch.nn.Sigmoid,
    torch.nn.Softmax,
)


def check_chunkable(layers: Any, actor: str, indices: list[int]) -> None:
    """Refuses layers that cannot run on sequence chunks: only those declaring
    `runs_sequence_chunks` (their attention keeps earlier chunks' keys and values, or they work
    token by token) and torch's own token-by-token modules can. A layer that declares it cannot
    may say why (`why_not_sequence_chunks`).

    Raises:
        ConfigError: naming the first such layer, its index and the actor holding it.
    """
    from raypipe.core.errors import ConfigError

    for index, layer in zip(indices, layers):
        declared = getattr(layer, "runs_sequence_chunks", None)
        if declared is True or (declared is None and isinstance(layer, _TOKEN_BY_TOKEN)):
            continue
        reason = getattr(layer, "why_not_sequence_chunks", None) or "its result depends on the whole sequence at once"
        why = (
            f"says it cannot ({reason})"
            if declared is False
            else "does not say it can: attention over the whole sequence would see only the chunk"
        )
        fix = (
            ""
            if declared is False
            else ", or give the layer's class `runs_sequence_chunks = True` where it works token by token or "
            "attends through raypipe.nn.sequence_chunks.current() (as raypipe's GPT and transformers' causal LMs do)"
        )
        raise ConfigError(
            f"TrainConfig.sequence_chunks: layer {index} ({type(layer).__name__}, on {actor}) cannot run on "
            f"sequence chunks: it {why}. Use sequence_chunks=1{fix}."
        )
