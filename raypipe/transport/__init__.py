"""Links between neighbouring stages, as the actors use them inside a step.

A stage sends each microbatch's activation (or input gradient), any pytree of tensors
(`tree`), through an outbox and
takes its neighbour's from an inbox; `outbox` and `inbox` pick the transport per link:
a process group of the stream's own, matched in order, where the driver made one (`ordered`:
NCCL between GPUs, device to device), else through host memory: shared memory between
neighbours on one node (`shm`), gloo point to point otherwise (`gloo`). Every transport speaks the stream
format of `stream` (a header, then flagged messages; poison when a stage failed). Also here: the step's closing
agreement (`agree`), the pipes both shm and agree use (`pipes`), the packing of the tensors the
driver sends (`wire`), and the trainer's torch.distributed world with its dp and tp groups
(`collective`). Everything here runs inside the actors; nothing here imports the driver.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from raypipe.transport import shm
from raypipe.transport.gloo import GlooInbox, GlooOutbox
from raypipe.transport.ordered import OrderedInbox, OrderedOutbox
from raypipe.transport.stream import PeerFailed

__all__ = ["PeerFailed", "inbox", "outbox"]


def outbox(dst: int, count: int, varying: bool = False, channel: int = 0, stream: Any = None) -> Any:
    """The sending end of this step's stream to world rank `dst`, which takes `count` messages:
    on the stream's own group when it has one (`stream`: (group, device)), else through shared
    memory when `dst` is linked on this node (`shm`), else over gloo.
    `varying`: the step's microbatches differ in shape, so each message describes itself.
    `channel`: which of this step's streams to `dst` it is, when there are several (model chunks)."""
    if stream is not None:
        return OrderedOutbox(dst, *stream, varying)
    link = shm.link_to(dst)
    if link is not None:
        return shm.ShmOutbox(link, count, varying, channel)
    return GlooOutbox(dst, varying, count, channel)


def inbox(src: int, tags: Sequence[int], stream: Any = None, channel: int | None = None) -> Any:
    """The receiving end of this step's stream from world rank `src`, its messages in `tags` order
    (the host transports pick messages out by tag, so several streams may share a pair of ranks;
    a stream with a group of its own, `stream`: (group, device), takes them in the order sent).
    `channel`: the sender's `outbox` channel, by which gloo recognises the stream from step to step."""
    if stream is not None:
        return OrderedInbox(src, *stream, tags)
    link = shm.link_to(src)
    return shm.ShmInbox(link, tags) if link is not None else GlooInbox(src, tags, channel)
