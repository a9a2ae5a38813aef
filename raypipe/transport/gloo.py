"""Boundary values over gloo point to point (torch.distributed, through host memory): the
transport between stages on different nodes, and between stages on one node when
shared memory is off or a stream is too large for it.

A message is one byte buffer, an 8-byte flag and then the value's payload (`tree`), so
each hop costs one gloo send and one receive (a separate flag message doubled both;
posting a gloo operation costs 0.1-0.25 ms on a loaded 2-core machine). The receiver
posts the following receives ahead (`GlooInbox`), so a message lands as soon as it is
sent, with no rendezvous: gloo moves a message only once its receive is posted. The
receiver reads the leaves as views of the buffer, without a copy.

A varying stream (shapes differ between the step's microbatches) sends each message as
its own header and then its payload on a tag of its own (`PAYLOAD_TAG`); the receiver
posts the headers ahead and each payload's receive once its header has arrived.

A value on a GPU (a CUDA stage whose neighbour is on another kind of device, or shares its GPU)
is copied into pinned memory, all leaves without waiting, then waited for once.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from raypipe.transport.stream import FLAG_BYTES, HEADER_BYTES, POISON, Outbox, PeerFailed, read_header
from raypipe.transport.tree import Layout

LOOKAHEAD = 3  # receives posted per stream; refilled after each action, so two stay posted while it computes
PAYLOAD_TAG = 1 << 24  # added to a message's tag for a varying stream's payload


class GlooOutbox(Outbox):
    """The sending end of one gloo stream (`stream.Outbox`): messages in host memory, each on its tag."""

    def __init__(self, dst: int, varying: bool = False) -> None:
        super().__init__(varying)
        self.dst = dst

    def _buffer(self, nbytes: int, leaves: list[torch.Tensor | None]) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=_on_gpu(leaves))

    def _post(self, buffer: torch.Tensor, tag: int, payload: bool = False) -> None:
        self.handles.append((dist.isend(buffer, self.dst, tag=tag + PAYLOAD_TAG * payload), buffer))


class GlooInbox:
    """The receiving end of one gloo stream, taking its messages in `tags` order."""

    def __init__(self, src: int, tags: Sequence[int]) -> None:
        self.src = src
        self.tags = deque(tags)
        self.layout: Layout | None = None
        self.started = self.varying = False
        self.posted: deque[tuple[torch.Tensor, Any, int]] = deque()  # (buffer, work, tag)
        self.header = torch.empty(HEADER_BYTES, dtype=torch.uint8)
        self.header_work = dist.irecv(self.header, src, tag=self.tags[0]) if self.tags else None

    def take(self) -> Any:
        """The next message's value (views of the message buffer, which the caller owns).

        Raises:
            PeerFailed: the sender failed and sent poison.
        """
        if not self.started:
            if self.header_work is None:  # the last header was poison: read the next message's
                self.header_work = dist.irecv(self.header, self.src, tag=self.tags[0])
            self.header_work.wait()
            self.header_work = None
            flag, self.varying, self.layout = read_header(self.header)
            if flag == POISON:
                self.tags.popleft()
                raise PeerFailed(f"world rank {self.src} failed earlier in this step")
            self.started = True
            self.refill()
        buffer, work, tag = self.posted.popleft()
        work.wait()
        if self.varying:
            flag, _, layout = read_header(buffer)
            if flag == POISON:
                raise PeerFailed(f"world rank {self.src} failed earlier in this step")
            payload = torch.empty(layout.nbytes, dtype=torch.uint8)
            if layout.nbytes:
                dist.irecv(payload, self.src, tag=tag + PAYLOAD_TAG).wait()
            return layout.tree(layout.views(payload))
        if int(buffer[:FLAG_BYTES].view(torch.int64)[0]) == POISON:
            raise PeerFailed(f"world rank {self.src} failed earlier in this step")
        return self.layout.tree(self.layout.views(buffer[FLAG_BYTES:]))

    def refill(self) -> None:
        """Posts receives for the next messages, up to `LOOKAHEAD` ahead. The stage calls it
        after the action that took a message has sent its own result: posting a receive
        costs time, which would otherwise sit between a message's arrival and its compute."""
        if not self.started:
            return
        while self.tags and len(self.posted) < LOOKAHEAD:
            tag = self.tags.popleft()
            buffer = torch.empty(HEADER_BYTES, dtype=torch.uint8) if self.varying else _message(self.layout)
            self.posted.append((buffer, dist.irecv(buffer, self.src, tag=tag), tag))


def _message(layout: Layout) -> torch.Tensor:
    """An uninitialised message buffer for a fixed stream: the flag, then the payload."""
    return torch.empty(FLAG_BYTES + layout.nbytes, dtype=torch.uint8)


def _on_gpu(leaves: list[torch.Tensor | None]) -> bool:
    """Whether a value has leaves on a GPU: its message then goes through pinned memory, so the
    copies out run at full speed and are waited for once (`stream.Outbox`)."""
    return any(t is not None and t.is_cuda for t in leaves)
