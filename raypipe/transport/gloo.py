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
its own header and then its payload on a tag of its own (`PAYLOAD_TAG`). Its stream header
says a bound (`stream.read_bound`): its first payload's size, or its last step's largest where
that is larger (`_largest`: the sender's to remember). The receiver posts each later message's
payload receive that large together with its header's, ahead: gloo takes a smaller message
into a larger receive, and a payload larger than the bound sends the rest on a third tag,
received once its header has told its size. A payload's receive posted only once its
header had arrived left the sender's gloo thread to send it while its stage computed.

A value on a GPU (a CUDA stage whose neighbour is on another kind of device, or shares its GPU)
is copied into pinned memory, all leaves without waiting, then waited for once.

Receives posted before the step's traffic (issue 36). gloo sends a message only once the
receiver's "ready" notice for it has crossed the link, and that notice travels on the same TCP
connection as the bulk data going the other way. A receiver that posts its first receives only
when the stream's header has arrived sends that notice mid-step, where it queues behind the
activations (or gradients) already in flight the other way: on a 200 Mbit/s link the first
gradient of a 1F1B step waited 130-215 ms for it, and the step behind it. So a stream whose
previous step was fixed (both ends remember its payload size, `_remember`) has its first
`LOOKAHEAD` receives posted when the step's links are made, each as large as that payload;
the sender keeps its messages within them (a larger value switches the stream to varying,
whose headers fit), and a stream that fails before it starts sends a filler into the
receive posted for its message, so no posted receive is left for a later step to match.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from raypipe.transport.stream import (
    FLAG_BYTES,
    HEADER_BYTES,
    POISON,
    Outbox,
    PeerFailed,
    header,
    read_bound,
    read_header,
)
from raypipe.transport.tree import Boundary, Layout

LOOKAHEAD = 3  # receives posted per stream; refilled after each action, so two stay posted while it computes
PAYLOAD_TAG = 1 << 24  # added to a message's tag for a varying stream's payload

# Per stream, (peer, channel): the payload bytes of its last step's fixed messages, which both ends
# know, so the receiver may post this step's first receives before anything arrives. One table
# per end: an actor may send and receive on channels of one number with one peer.
_sent: dict[tuple[int, int], int] = {}
_received: dict[tuple[int, int], int] = {}
# Per varying stream the sender keeps, (peer, channel): its last step's largest payload, which
# this step's bound is at least, so a stream whose first payload is not its largest (gradients
# of chunks cut unevenly run backwards: the short last chunk's first) sends no overflow.
_largest: dict[tuple[int, int], int] = {}


def forget_streams() -> None:
    """Drops what both ends remember of past steps (on joining or leaving a world: a new peer
    process remembers nothing)."""
    _sent.clear()
    _received.clear()
    _largest.clear()


def _remember(table: dict[tuple[int, int], int], key: tuple[int, int] | None, fixed_bytes: int | None) -> None:
    """Records a finished stream: its fixed payload size, or nothing (varying, or never started;
    a payload whose receive could not also hold a header is not worth posting ahead)."""
    if key is not None and fixed_bytes is not None and FLAG_BYTES + fixed_bytes >= HEADER_BYTES:
        table[key] = fixed_bytes


class GlooOutbox(Outbox):
    """The sending end of one gloo stream (`stream.Outbox`): messages in host memory, each on its tag.
    `count` messages on `channel` (None: nothing posted ahead for it, as for shared memory's fallback)."""

    def __init__(self, dst: int, varying: bool = False, count: int = 0, channel: int | None = None) -> None:
        super().__init__(varying)
        self.dst = dst
        self.key = None if channel is None else (dst, channel)
        self.capacity = _sent.pop(self.key, 0) if self.key else 0  # of the receives posted ahead
        self.preposted = min(LOOKAHEAD, count) if self.capacity else 0
        self.sent = 0
        self.bound = 0  # a varying stream's payload bytes the receiver posts ahead per message
        self.largest = 0  # a varying stream's largest payload this step

    def _stream_header(self, layout: Layout) -> torch.Tensor:
        bound = max(layout.nbytes, _largest.get(self.key, 0))  # (no key: none remembered)
        if self.varying and not self.preposted and bound:  # none of its receives posted yet
            self.bound = bound
            return header(None, varying=True, bound=self.bound)
        return super()._stream_header(layout)

    def _payload(self, layout: Layout, leaves: list[torch.Tensor | None], tag: int) -> None:
        self.largest = max(self.largest, layout.nbytes)
        if not self.bound:
            super()._payload(layout, leaves, tag)
        elif not layout.nbytes:  # the receive posted for its payload takes a byte
            self._post(torch.zeros(1, dtype=torch.uint8), tag, payload=1)
        else:
            message = self._packed(layout, leaves, None)
            self._post(message[: self.bound], tag, payload=1)
            if layout.nbytes > self.bound:
                self._post(message[self.bound :], tag, payload=2)

    def send(self, value: Boundary, tag: int = 0) -> None:
        super().send(value, tag)
        self.sent += 1

    def _fits(self, layout: Layout) -> bool:
        return not self.capacity or layout.nbytes <= self.capacity  # within the receives posted ahead

    def poison(self, tag: int = 0) -> None:
        filler = not self.started and self.sent < self.preposted  # the receive posted for this message
        super().poison(tag)
        if filler:
            message = torch.empty(FLAG_BYTES, dtype=torch.uint8)
            message.view(torch.int64).fill_(POISON)
            self._post(message, tag)
        if self.bound:  # and the receive posted for its payload
            self._post(torch.zeros(1, dtype=torch.uint8), tag, payload=1)
        self.sent += 1

    def wait(self) -> None:
        super().wait()
        _remember(_sent, self.key, self.layout.nbytes if self.started and not self.varying else None)
        if self.key is not None and self.started:  # a varying step's largest payload, or none after a fixed one
            if self.varying:
                _largest[self.key] = self.largest
            else:
                _largest.pop(self.key, None)

    def _buffer(self, nbytes: int, leaves: list[torch.Tensor | None]) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=_on_gpu(leaves))

    def _post(self, buffer: torch.Tensor, tag: int, payload: int = 0) -> None:
        self.handles.append((dist.isend(buffer, self.dst, tag=tag + PAYLOAD_TAG * payload), buffer))


class GlooInbox:
    """The receiving end of one gloo stream, taking its messages in `tags` order; on `channel`,
    its first receives posted now when the stream's last step was fixed (see the module's note)."""

    def __init__(self, src: int, tags: Sequence[int], channel: int | None = None) -> None:
        self.src = src
        self.tags = deque(tags)  # those whose message has no receive posted yet
        self.count, self.taken = len(tags), 0
        self.key = None if channel is None else (src, channel)
        self.layout: Layout | None = None
        self.started = self.varying = False
        self.bound = 0  # a varying stream's payload bytes posted ahead per message
        self.posted: deque[tuple[torch.Tensor, Any, int]] = deque()  # (buffer, work, tag)
        self.payloads: dict[int, tuple[torch.Tensor, Any]] = {}  # tag -> its payload's receive posted ahead
        self.header = torch.empty(HEADER_BYTES, dtype=torch.uint8)
        self.header_work = dist.irecv(self.header, src, tag=self.tags[0]) if self.tags else None
        capacity = _received.pop(self.key, 0) if self.key else 0
        self.preposted = min(LOOKAHEAD, len(self.tags)) if capacity else 0
        for _ in range(self.preposted):
            tag = self.tags.popleft()
            buffer = torch.empty(FLAG_BYTES + capacity, dtype=torch.uint8)
            self.posted.append((buffer, dist.irecv(buffer, src, tag=tag), tag))

    def take(self) -> Boundary:
        """The next message's value (views of the message buffer, which the caller owns).

        Raises:
            PeerFailed: the sender failed and sent poison.
        """
        index = self.taken
        self.taken += 1
        try:
            if not self.started:
                self._start(index)
            return self._message()
        finally:
            if self.taken == self.count:
                _remember(_received, self.key, self.layout.nbytes if self.started and not self.varying else None)

    def _start(self, index: int) -> None:
        """Reads the stream's header, which comes before message `index` on its tag.

        Raises:
            PeerFailed: the header is poison: the sender failed before its stream started.
        """
        ahead = index < self.preposted  # this message's tag has a receive posted ahead, which took the header
        if index == 0:
            self.header_work.wait()
            head = self.header
        elif ahead:
            buffer, work, tag = self.posted.popleft()
            work.wait()
            head = buffer[:HEADER_BYTES]
        else:  # the last header was poison: this message's header comes on its own tag
            dist.irecv(self.header, self.src, tag=self.tags[0]).wait()
            head = self.header
        flag, self.varying, self.layout = read_header(head)
        self.bound = read_bound(head) if self.varying else 0
        if flag == POISON:
            if ahead and index == 0:  # the filler for the receive posted ahead for message 0
                self.posted.popleft()[1].wait()
            elif ahead:
                dist.irecv(torch.empty(FLAG_BYTES, dtype=torch.uint8), self.src, tag=tag).wait()
            else:
                self.tags.popleft()
            raise PeerFailed(f"world rank {self.src} failed earlier in this step")
        self.started = True
        if ahead and index > 0:  # the message itself follows its header on that tag
            self.posted.appendleft(self._receive(tag))
        self.refill()

    def _message(self) -> Boundary:
        buffer, work, tag = self.posted.popleft()
        work.wait()
        if self.varying:
            flag, _, layout = read_header(buffer)
            ahead = self.payloads.pop(tag, None)
            if ahead is not None:
                ahead[1].wait()  # its payload, or the byte a poisoned message sends in its place
            if flag == POISON:
                raise PeerFailed(f"world rank {self.src} failed earlier in this step")
            return layout.tree(layout.views(self._payload(layout, tag, ahead)))
        if int(buffer[:FLAG_BYTES].view(torch.int64)[0]) == POISON:
            raise PeerFailed(f"world rank {self.src} failed earlier in this step")
        return self.layout.tree(self.layout.views(buffer[FLAG_BYTES : FLAG_BYTES + self.layout.nbytes]))

    def refill(self) -> None:
        """Posts receives for the next messages, up to `LOOKAHEAD` ahead. The stage calls it
        after the action that took a message has sent its own result: posting a receive
        costs time, which would otherwise sit between a message's arrival and its compute."""
        if not self.started:
            return
        while self.tags and len(self.posted) < LOOKAHEAD:
            self.posted.append(self._receive(self.tags.popleft()))

    def _payload(self, layout: Layout, tag: int, ahead: tuple[torch.Tensor, Any] | None) -> torch.Tensor:
        """A varying message's payload: in the receive posted ahead for it, and beyond its bound on
        a tag of its own; or, none posted ahead, received now."""
        if ahead is not None and layout.nbytes <= len(ahead[0]):
            return ahead[0][: layout.nbytes]
        payload = torch.empty(layout.nbytes, dtype=torch.uint8)
        start = 0 if ahead is None else len(ahead[0])
        if start:
            payload[:start].copy_(ahead[0])
        if layout.nbytes > start:
            dist.irecv(payload[start:], self.src, tag=tag + PAYLOAD_TAG * (1 if ahead is None else 2)).wait()
        return payload

    def _receive(self, tag: int) -> tuple[torch.Tensor, object, int]:
        """A receive posted for the message on `tag` of the started stream: its header when varying
        (and its payload's, as large as the stream's bound)."""
        if self.varying and self.bound:
            payload = torch.empty(self.bound, dtype=torch.uint8)
            self.payloads[tag] = (payload, dist.irecv(payload, self.src, tag=tag + PAYLOAD_TAG))
        buffer = torch.empty(HEADER_BYTES, dtype=torch.uint8) if self.varying else _message(self.layout)
        return buffer, dist.irecv(buffer, self.src, tag=tag), tag


def _message(layout: Layout) -> torch.Tensor:
    """An uninitialised message buffer for a fixed stream: the flag, then the payload."""
    return torch.empty(FLAG_BYTES + layout.nbytes, dtype=torch.uint8)


def _on_gpu(leaves: list[torch.Tensor | None]) -> bool:
    """Whether a value has leaves on a GPU: its message then goes through pinned memory, so the
    copies out run at full speed and are waited for once (`stream.Outbox`)."""
    return any(t is not None and t.is_cuda for t in leaves)
