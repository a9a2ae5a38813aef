"""Links between neighbouring stages, as the actors use them inside a step.

A stage sends each microbatch's activation (or input gradient), any pytree of tensors
(`tree`), through an outbox and
takes its neighbour's from an inbox; `outbox` and `inbox` pick the transport per link:
shared memory between neighbours on one node (`shm`), gloo point to point otherwise
(`gloo`). Every transport speaks the stream format of `stream` (a header, then flagged
messages; poison when a stage failed). Also here: the step's closing agreement
(`agree`), the pipes both shm and agree use (`pipes`), and the wire format of the
batches and step calls the driver sends (`wire`).
"""

from __future__ import annotations

from typing import Any, Sequence

from raypipe.runtime.transport import shm
from raypipe.runtime.transport.gloo import GlooInbox, GlooOutbox
from raypipe.runtime.transport.stream import PeerFailed

__all__ = ["PeerFailed", "inbox", "outbox"]


def outbox(dst: int, count: int, varying: bool = False, channel: int = 0) -> Any:
    """The sending end of this step's stream to world rank `dst`, which takes `count` messages:
    through shared memory when `dst` is linked on this node (`shm`), else over gloo.
    `varying`: the step's microbatches differ in shape, so each message describes itself.
    `channel`: which of this step's streams to `dst` it is, when there are several (model chunks)."""
    link = shm.link_to(dst)
    return shm.ShmOutbox(link, count, varying, channel) if link is not None else GlooOutbox(dst, varying)


def inbox(src: int, tags: Sequence[int]) -> Any:
    """The receiving end of this step's stream from world rank `src`, its messages in `tags` order
    (each transport picks messages out by tag, so several streams may share a pair of ranks)."""
    link = shm.link_to(src)
    return shm.ShmInbox(link, tags) if link is not None else GlooInbox(src, tags)
