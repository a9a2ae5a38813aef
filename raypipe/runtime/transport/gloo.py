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
from typing import Any, Sequence

import torch
import torch.distributed as dist

from raypipe.runtime.transport.stream import (
    FLAG_BYTES, HEADER_BYTES, OK, POISON, PeerFailed, check_like, header, read_header,
)
from raypipe.runtime.transport.tree import Layout, flatten, pack_into

LOOKAHEAD = 3  # receives posted per stream; refilled after each action, so two stay posted while it computes
PAYLOAD_TAG = 1 << 24  # added to a message's tag for a varying stream's payload


class GlooOutbox:
    """The sending end of one gloo stream: a header before the first message, then flagged messages."""

    def __init__(self, dst: int, varying: bool = False) -> None:
        self.dst, self.varying = dst, varying
        self.layout: Layout | None = None  # a fixed stream's layout, from its first message
        self.started = False  # the stream's header went out (poison before it goes as poison headers)
        self.handles: list[tuple[Any, torch.Tensor]] = []  # (work, the buffer it sends), until waited

    def send(self, value: Any, tag: int) -> None:
        """Starts sending `value` (a pytree of tensors on any device).

        Raises:
            ValueError: `value` cannot be sent in this stream (nothing went out).
        """
        layout, leaves = flatten(value)
        if not self.started:
            self._post(header(None, varying=True) if self.varying else header(layout), tag)
            self.layout, self.started = layout, True
        elif not self.varying:
            check_like(self.layout, layout)
        if self.varying:
            self._post(header(layout), tag)
            if layout.nbytes:
                payload = torch.empty(layout.nbytes, dtype=torch.uint8)
                pack_into(payload, layout, leaves)
                self._post(payload, tag + PAYLOAD_TAG)
            return
        on_gpu = next((t.device for t in leaves if t is not None and t.is_cuda), None)
        message = _message(layout, pinned=on_gpu is not None)
        message[:FLAG_BYTES].view(torch.int64).fill_(OK)
        pack_into(message[FLAG_BYTES:], layout, leaves, non_blocking=on_gpu is not None)
        if on_gpu is not None:  # gloo reads the buffer at once: the copies out of the GPU must be done
            torch.cuda.current_stream(on_gpu).synchronize()
        self._post(message, tag)

    def poison(self, tag: int) -> None:
        """Tells the receiver this stage failed, in place of the message on `tag`."""
        if not self.started or self.varying:
            self._post(header(None), tag)
            return
        message = _message(self.layout)
        message[:FLAG_BYTES].view(torch.int64).fill_(POISON)
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


def _message(layout: Layout, pinned: bool = False) -> torch.Tensor:
    """An uninitialised message buffer for a fixed stream: the flag, then the payload; in pinned
    memory for a value on a GPU, so its copy out runs at full speed and in one wait."""
    return torch.empty(FLAG_BYTES + layout.nbytes, dtype=torch.uint8, pin_memory=pinned)
