"""Boundary values on a process group of their own per stream, matched in order: the device
path between CUDA (and ROCm) stages, over NCCL (RCCL), with no copy through host memory.

NCCL ignores tags: two ranks' sends and receives match in the order they are posted, and run
one after another on their communicator's stream. Over one communicator per pair of stages a
1F1B step deadlocks: stage 0 sends activation 1 before it takes gradient 0, stage 1 sends
gradient 0 before it takes activation 1, and neither stream gets past its first operation.
So each stream (one direction between two virtual stages: activations forward, or gradients
back) has a 2-rank group of its own, made when the world is joined (`warm_up` connects them
in one global order, so no two actors wait on each other's first use). A stream's messages are
taken in the order they are sent (`schedules.validate` checks every schedule for it), and the
two directions never wait on each other.

Messages follow `stream`'s format: a header (the layout) before the stream's first message,
then flagged messages; a varying stream sends each message's header and then its payload.
Sends return at once: NCCL runs each on its own stream after the compute that made the value,
the stage goes on to its next action, and the step waits for its sends only at its end. The
receiver posts up to `LOOKAHEAD` receives ahead (a varying stream one header: its payload's
size comes in it); a message's flag is copied to host memory on
a side stream, so taking it waits for that message to arrive, never for this stage's queued
compute, and the compute that reads it is ordered after its arrival on the device.

A rule this path needs: no device-wide synchronisation (`torch.cuda.synchronize`,
`empty_cache`) inside a step's action list. It would wait for receives posted ahead, whose
senders may be waiting for this stage's next send. Stream syncs (`.item()`) are safe.

On CPU stages (`TrainConfig.device_links="nccl"`) the same code runs over gloo groups: that is
how the tests check the protocol without a GPU.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from raypipe.transport.stream import FLAG_BYTES, HEADER_BYTES, POISON, Outbox, PeerFailed, read_header
from raypipe.transport.tree import Boundary, Layout

LOOKAHEAD = 3  # receives posted ahead per stream (each holds a message's buffer until taken)

_side: dict[torch.device, Any] = {}  # per CUDA device, the stream that copies arrived flags to the host


class OrderedOutbox(Outbox):
    """The sending end of one stream on its own group (`stream.Outbox`); `device`: where its
    messages are built (the stage's GPU under NCCL, the CPU under gloo). Order is the match:
    tags are not sent."""

    def __init__(self, dst: int, group: Any, device: torch.device, varying: bool = False) -> None:
        super().__init__(varying)
        self.dst, self.group, self.device = dst, group, device

    def _buffer(self, nbytes: int, leaves: list[torch.Tensor | None]) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def _header(self, data: torch.Tensor) -> torch.Tensor:
        return data.to(self.device)

    def _post(self, buffer: torch.Tensor, tag: int, payload: int = 0) -> None:
        self.handles.append((dist.isend(buffer, self.dst, group=self.group), buffer))


class OrderedInbox:
    """The receiving end of one stream on its own group, taking one message per entry of `tags`."""

    def __init__(self, src: int, group: Any, device: torch.device, tags: Sequence[int]) -> None:
        self.src, self.group, self.device = src, group, device
        self.remaining = len(tags)  # messages still to post a receive for
        self.layout: Layout | None = None
        self.started = self.varying = False
        self.posted: deque[_Arrival] = deque()
        self.header = self._receive(HEADER_BYTES, HEADER_BYTES) if self.remaining else None

    def take(self) -> Boundary:
        """The next message's value (views of its buffer, which the caller owns).

        Raises:
            PeerFailed: the sender failed and sent poison.
        """
        if not self.started:
            if self.header is None:  # the last header was poison: the next message's comes next
                self.header = self._receive(HEADER_BYTES, HEADER_BYTES)
            flag, self.varying, self.layout = read_header(self.header.arrive())
            self.header = None
            if flag == POISON:  # in place of the first message: the stream has not started
                self.remaining -= 1
                raise PeerFailed(f"world rank {self.src} failed earlier in this step")
            self.started = True
            self.refill()
        if not self.posted:
            self.refill()
        arrival = self.posted.popleft()
        if self.varying:
            flag, _, layout = read_header(arrival.arrive())
            if flag == POISON:
                raise PeerFailed(f"world rank {self.src} failed earlier in this step")
            payload = torch.empty(0, dtype=torch.uint8, device=self.device)
            if layout.nbytes:
                arrival = self._receive(layout.nbytes, 0)
                arrival.arrive()
                payload = arrival.buffer
            return layout.tree(layout.views(payload))
        if int(arrival.arrive().view(torch.int64)[0]) == POISON:
            raise PeerFailed(f"world rank {self.src} failed earlier in this step")
        return self.layout.tree(self.layout.views(arrival.buffer[FLAG_BYTES:]))

    def refill(self) -> None:
        """Posts receives for the next messages, up to `LOOKAHEAD` ahead."""
        if not self.started:
            return
        # a varying stream's next header follows the last message's payload, whose size only its
        # own header told: one header at a time, posted after that payload's receive
        ahead = 1 if self.varying else LOOKAHEAD
        while self.remaining and len(self.posted) < ahead:
            self.remaining -= 1
            if self.varying:
                self.posted.append(self._receive(HEADER_BYTES, HEADER_BYTES))
            else:
                self.posted.append(self._receive(FLAG_BYTES + self.layout.nbytes, FLAG_BYTES))

    def _receive(self, nbytes: int, peek: int) -> _Arrival:
        buffer = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        return _Arrival(buffer, dist.irecv(buffer, self.src, group=self.group), peek)


class _Arrival:
    """A posted receive. On a GPU its first `peek` bytes (flag or header) are copied to pinned
    host memory on a side stream as soon as it lands, so `arrive` waits for the message alone;
    with nothing to peek at, `arrive` only orders the compute stream after it."""

    def __init__(self, buffer: torch.Tensor, work: Any, peek: int) -> None:
        self.buffer, self.work, self.peek = buffer, work, peek
        self.host, self.event = None, None
        if buffer.is_cuda and peek:
            side = _side.get(buffer.device)
            if side is None:
                side = _side[buffer.device] = torch.cuda.Stream(buffer.device)
            with torch.cuda.stream(side):
                work.wait()  # the side stream waits for the receive, the compute stream does not
                self.host = torch.empty(peek, dtype=torch.uint8, pin_memory=True)
                self.host.copy_(buffer[:peek], non_blocking=True)
                self.event = torch.cuda.Event()
                self.event.record(side)

    def arrive(self) -> torch.Tensor:
        """Waits for the message; returns its first `peek` bytes on the host. Work queued on the
        current stream after this call sees the whole message."""
        if self.event is None:
            self.work.wait()
            return self.buffer[: self.peek]
        self.event.synchronize()
        torch.cuda.current_stream(self.buffer.device).wait_event(self.event)
        return self.host


def warm_up(streams: Sequence[tuple[int, Any, list[int]]], rank: int, device: torch.device) -> None:
    """Connects every stream group this rank is in, one after another in the world's group order
    (`streams`: (group index, group, its two ranks, sender first)), so NCCL's communicators are
    made now, not at a first use that two actors might reach in different orders; a link that
    cannot connect fails here, at start, within the world's timeout."""
    for _, group, (sender, receiver) in sorted(streams, key=lambda s: s[0]):
        probe = torch.ones(1, device=device)
        if rank == sender:
            dist.send(probe, receiver, group=group)
        else:
            dist.recv(probe, sender, group=group)
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()
