"""Boundary tensors over gloo point to point (torch.distributed, through host memory): the
transport between stages on different nodes, and between stages on one node when
shared memory is off or a stream is too large for it.

A message is one byte buffer, an 8-byte flag and then the tensor's bytes, so each hop
costs one gloo send and one receive (a separate flag message doubled both; posting a
gloo operation costs 0.1-0.25 ms on a loaded 2-core machine). The receiver posts the
following receives ahead (`GlooInbox`), so a message lands as soon as it is sent, with
no rendezvous: gloo moves a message only once its receive is posted. The receiver
reads the tensor as a view of the buffer, without a copy.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Sequence

import torch
import torch.distributed as dist

from raypipe.runtime.transport.stream import (
    DTYPES, FLAG_BYTES, HEADER, OK, POISON, PeerFailed, check_like, check_sendable, header,
)

LOOKAHEAD = 3  # receives posted per stream; refilled after each action, so two stay posted while it computes


class GlooOutbox:
    """The sending end of one gloo stream: a header before the first message, then flagged messages."""

    def __init__(self, dst: int) -> None:
        self.dst = dst
        self.like: torch.Tensor | None = None  # the first message's shape and dtype
        self.handles: list[tuple[Any, torch.Tensor]] = []  # (work, the buffer it sends), until waited

    def send(self, t: torch.Tensor | None, tag: int) -> None:
        """Starts sending `t` (a tensor on any device; None sends poison)."""
        if self.like is None:
            if t is None:
                self._post(header(None), tag)
                return
            check_sendable(t)
            self.like = torch.empty_like(t, device="cpu")
            self._post(header(t), tag)
        elif t is not None:
            check_like(self.like, t)
        message = _message(self.like)
        message[:FLAG_BYTES].view(torch.int64).fill_(OK if t is not None else POISON)
        if t is not None:
            _payload(message, self.like).copy_(t)
        self._post(message, tag)

    def wait(self) -> None:
        for work, _ in self.handles:
            work.wait()
        self.handles.clear()

    def _post(self, buffer: torch.Tensor, tag: int) -> None:
        self.handles.append((dist.isend(buffer, self.dst, tag=tag), buffer))


class GlooInbox:
    """The receiving end of one gloo stream, taking its messages in `tags` order."""

    def __init__(self, src: int, tags: Sequence[int]) -> None:
        self.src = src
        self.tags = deque(tags)
        self.like: torch.Tensor | None = None
        self.posted: deque[tuple[torch.Tensor, Any]] = deque()
        self.header = torch.empty(HEADER, dtype=torch.int64)
        self.header_work = dist.irecv(self.header, src, tag=self.tags[0]) if self.tags else None

    def take(self) -> torch.Tensor:
        """The next message's tensor (a view of the message buffer, which the caller owns).

        Raises:
            PeerFailed: the sender failed and sent poison.
        """
        if self.like is None:
            if self.header_work is None:  # the first header was poison: so are the following ones
                self.header_work = dist.irecv(self.header, self.src, tag=self.tags[0])
            self.header_work.wait()
            self.header_work = None
            code, ndim = int(self.header[0]), int(self.header[1])
            if code == POISON:
                self.tags.popleft()
                raise PeerFailed(f"world rank {self.src} failed earlier in this step")
            self.like = torch.empty([int(v) for v in self.header[2 : 2 + ndim]], dtype=DTYPES[code])
            self.refill()
        message, work = self.posted.popleft()
        work.wait()
        if int(message[:FLAG_BYTES].view(torch.int64)[0]) == POISON:
            raise PeerFailed(f"world rank {self.src} failed earlier in this step")
        return _payload(message, self.like)

    def refill(self) -> None:
        """Posts receives for the next messages, up to `LOOKAHEAD` ahead. The stage calls it
        after the action that took a message has sent its own result: posting a receive
        costs time, which would otherwise sit between a message's arrival and its compute."""
        if self.like is None:
            return
        while self.tags and len(self.posted) < LOOKAHEAD:
            message = _message(self.like)
            self.posted.append((message, dist.irecv(message, self.src, tag=self.tags.popleft())))


def _message(like: torch.Tensor) -> torch.Tensor:
    """An uninitialised message buffer for a tensor like `like`: the flag, then its bytes."""
    return torch.empty(FLAG_BYTES + like.numel() * like.element_size(), dtype=torch.uint8)


def _payload(message: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The tensor inside a message buffer, as a view (the flag's 8 bytes keep every dtype aligned)."""
    return message[FLAG_BYTES:].view(like.dtype).view(like.shape)
