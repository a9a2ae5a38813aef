"""Boundary tensors between neighbouring stage actors on one node, through shared memory.

Under the p2p engine, gloo sends every boundary tensor over loopback TCP, and each hop
costs the receiver's "ready" notice, the send, and wake-ups of gloo's I/O threads at both
ends: posting one gloo operation took 0.1-0.25 ms on the loaded 2-core machine. Stages
on one node (every GPU box, every Mac, every CPU test) skip all that here: the sender
copies the value's tensors into a slot of a file in shared memory (/dev/shm) and writes a 32-byte
record (tag, flag, file generation, slot) to a named pipe; the receiver, blocked reading
that pipe, wakes and takes the value as views of the slot. One copy and two system
calls per hop, no threads in between.

Files. Each direction of a link has one data file at a time per channel (one channel without
model chunks; with chunks, one per pair of neighbouring virtual stages the two actors hold,
whose messages the receiver picks out by tag): a header (the values' `tree.Layout`) and
slots for twice the stream's messages of one step. Steps alternate
between the two halves, so a step's sends never overwrite a slot the previous step's
receiver may still hold a view of (a step ends with an all-reduce every actor joins, so
a receiver is at most one step behind). The file is kept while the shape stays, and
replaced (the next generation) when the layout or count changes; the receiver
unlinks each file as soon as it has mapped it, and the pipes are unlinked once both ends
have opened them. Every name carries its maker's pid: a sender unlinks at `close` the files
no receiver mapped, and each new world sweeps away what dead processes of its node left
(`pipes.sweep_stale`: a killed actor runs no clean-up), so nothing outlives its trainer for long.

Varying streams (shapes that differ between the step's microbatches: microbatches of any
sizes, a sequence cut into unequal chunks) have a file of their own per channel: each message
is its own header and payload, one after another in the step's half, at the offset its
record names (`shm_files`). A half too small for the step's next message is replaced by a
file twice as large (the next generation) from that message on. Over gloo such a stream sent
a header and then the payload, posting the payload's receive only once its header had
arrived: 2.8 ms a hop on the loaded 2-core machine, where shared memory takes a few tenths.

Fallback. A stream whose slots would not fit (`MAX_STREAM_BYTES`, or /dev/shm full, as
in a container with a 64 MB /dev/shm) goes over gloo for the rest of that step: the record
of its first message not in shared memory says so and the receiver switches to a gloo
Inbox. Neighbours on different nodes always use gloo. Poison (a failed stage's message)
is a record with the POISON flag.
"""

from __future__ import annotations

import os
import select
import struct
import uuid
from collections import deque
from collections.abc import Sequence

import torch
import torch.distributed as dist

from raypipe.transport import plain, shm_files
from raypipe.transport.gloo import GlooInbox, GlooOutbox
from raypipe.transport.pipes import owned, poller, sweep_stale, wait_alive
from raypipe.transport.pipes import prefix as link_prefix
from raypipe.transport.shm_files import FILE_HEADER
from raypipe.transport.stream import POISON, PeerFailed, check_like, header
from raypipe.transport.tree import Boundary, Layout, flatten

# record flags besides POISON: a tensor in a slot; this stream goes over gloo from here on this step;
# a varying stream's message at an offset of its file
OK, GLOO, PLACED = 0, 1, 2
RECORD = struct.Struct("<4q")  # tag, flag, generation, slot (or offset): written atomically (< PIPE_BUF)
MAX_STREAM_BYTES = 1 << 30  # one direction's file; larger streams go over gloo
MAPPED_FILES = 16  # the receiver keeps this many newest files mapped: a file per channel in use

_links: dict[int, Link] = {}  # neighbour's world rank -> this process's link to it


def connect(rank: int, neighbours: Sequence[int], timeout: float, enabled: bool = True) -> list[int]:
    """Opens a shared-memory link to every neighbour on this node; a collective of the world.

    Every rank of the world calls it once after joining (with its pipeline neighbours'
    world ranks); a link is used only when both ends opened it, otherwise that pair
    keeps gloo. Returns the neighbours linked.

    Args:
        timeout: seconds a receive may wait for its message (the world's collective timeout).
        enabled: False keeps gloo for every neighbour (TrainConfig.same_node_transport="gloo").
    """
    import ray

    disconnect()
    node = ray.get_runtime_context().get_node_id()
    everyone = plain.all_gather((node, os.getpid(), uuid.uuid4().hex[:16], sorted(neighbours) if enabled else []))
    sweep_stale(node)  # what dead actors of earlier trainers left on this node
    prefix = link_prefix("shm", node, everyone[0][2])
    local = [n for n in neighbours if enabled and everyone[n][0] == node and rank in everyone[n][3]]
    made = []
    for n in local:  # each end makes the pipe it writes to
        try:
            os.mkfifo(_pipe(prefix, rank, n, os.getpid()), 0o600)
            made.append(n)
        except OSError:
            pass
    dist.barrier()
    opened: dict[int, tuple[int, int]] = {}
    for n in made:
        fds = []
        try:  # O_RDWR: opening never waits for the other end, and a write never fails for lack of a reader
            fds.append(os.open(_pipe(prefix, n, rank, everyone[n][1]), os.O_RDWR | os.O_NONBLOCK))
            fds.append(os.open(_pipe(prefix, rank, n, os.getpid()), os.O_RDWR | os.O_NONBLOCK))
            opened[n] = (fds[0], fds[1])
        except OSError:
            for fd in fds:
                os.close(fd)
    agreed = plain.all_gather(sorted(opened))  # also: every end has opened its pipes by now
    for n in made:
        os.unlink(_pipe(prefix, rank, n, os.getpid()))
    for n, (reader, writer) in opened.items():
        if rank in agreed[n]:
            _links[n] = Link(rank, n, everyone[n][1], reader, writer, prefix, timeout)
        else:
            os.close(reader)
            os.close(writer)
    return sorted(_links)


def disconnect() -> None:
    """Closes every link of this process (a new world connects afresh)."""
    for link in _links.values():
        link.close()
    _links.clear()


def link_to(rank: int | None) -> Link | None:
    return _links.get(rank) if rank is not None else None


class Link:
    """This process's two pipes and its outgoing data file to one neighbour on the node."""

    def __init__(
        self, rank: int, peer: int, peer_pid: int, reader: int, writer: int, prefix: str, timeout: float
    ) -> None:
        self.rank, self.peer, self.peer_pid = rank, peer, peer_pid
        self.reader, self.writer, self.prefix, self.timeout = reader, writer, prefix, timeout
        self.records: deque[tuple[int, int, int, int]] = deque()
        self.early: dict[int, tuple[int, int, int, int]] = {}  # records read while waiting for another tag
        self.partial = b""
        self.poller = select.poll()
        self.poller.register(reader, select.POLLIN)
        # sending side: per channel (a stream kind: one without model chunks), its file and what it holds
        self.generation = 0  # the newest file's number, over all channels
        self.channels: dict[int, Channel] = {}
        # receiving side: the newest files mapped (one per channel the sender uses), their slots as views
        self.mapped: dict[int, tuple[Layout, list]] = {}
        self.made: set[str] = set()  # the data files this end made

    # ----- sending --------------------------------------------------------------

    def begin_stream(self, channel: int = 0) -> Channel:
        """A new step's stream on `channel` starts: it writes the other half of that channel's slots.
        A link carries one channel per direction without model chunks; with chunks, one per pair of
        neighbouring virtual stages the two actors hold (its streams' messages have their own tags)."""
        state = self.channels.setdefault(channel, Channel())
        state.parity ^= 1
        state.used = 0
        return state

    def prepare(self, layout: Layout, count: int, state: Channel) -> bool:
        """Makes the channel's outgoing file hold `count` messages of `layout` per half; False when it cannot."""
        like = (layout, count)
        if like == state.out_like:
            return True
        out = self._new_file(FILE_HEADER + 2 * count * shm_files.slot_bytes(layout.nbytes))
        if out is None:
            return False
        out[:FILE_HEADER].copy_(header(layout))
        state.out_like, state.parity, state.generation = like, 0, self.generation
        state.out_slots = shm_files.slot_views(out, layout)  # they keep the mapping alive
        return True

    def place(self, layout: Layout, leaves: list[torch.Tensor | None], tag: int, left: int, state: Channel) -> bool:
        """Writes a varying stream's message (`layout`'s `leaves`) after the step's earlier ones in its
        channel's varying file and announces it; a half too small for it is replaced by a file whose
        halves hold twice as much, and at least `left` messages of its size (this one and those still
        to come this step). False when no such file can be made (nothing was written).

        Raises:
            ValueError: `layout` is too large to describe (nothing was written)."""
        described = header(layout, varying=True)
        need = shm_files.message_bytes(layout)
        if state.varying is None or state.used + need > state.half:
            half = max(2 * state.half, left * need)
            data = self._new_file(FILE_HEADER + 2 * half)
            if data is None:
                return False
            data[:FILE_HEADER].copy_(header(None, varying=True))  # no layout: each message brings its own
            state.varying, state.half, state.used, state.varying_generation = data, half, 0, self.generation
        offset = FILE_HEADER + state.parity * state.half + state.used
        shm_files.write_message(state.varying, offset, layout, described, leaves)
        state.used += need
        self.write(tag, PLACED, offset, state.varying_generation)
        return True

    def _new_file(self, size: int) -> torch.Tensor | None:
        """The next generation's outgoing file of `size` bytes, mapped; None when it cannot be made."""
        if size > MAX_STREAM_BYTES:
            return None
        path = _data(self.prefix, self.rank, self.peer, self.generation + 1, os.getpid())
        data = shm_files.create(path, size)
        if data is not None:
            self.made.add(path)  # unlinked by the receiver when it maps it; by `close` if it never does
            self.generation += 1
        return data

    def put(self, leaves: list[torch.Tensor | None], tag: int, index: int, state: Channel) -> None:
        """Copies the stream's message `index` (a value's leaves) into its channel's slot and announces it."""
        slot = state.parity * state.out_like[1] + index
        for view, leaf in zip(state.out_slots[slot], leaves):
            if view is not None:
                view.copy_(leaf)
        self.write(tag, OK, slot, state.generation)

    def write(self, tag: int, flag: int, slot: int = 0, generation: int = 0) -> None:
        record = RECORD.pack(tag, flag, generation, slot)
        while True:
            try:
                os.write(self.writer, record)
                return
            except BlockingIOError:  # the pipe is full: the receiver is far behind
                self._wait(self.writer, select.POLLOUT, "make room for a message")

    # ----- receiving ------------------------------------------------------------

    def read_tag(self, tag: int) -> tuple[int, int, int, int]:
        """The record of message `tag` (tag, flag, generation, slot), waiting for it; records of
        other channels' messages that arrive first are kept for their own takers."""
        if tag in self.early:
            return self.early.pop(tag)
        while True:
            record = self.read()
            if record[0] == tag:
                return record
            self.early[record[0]] = record

    def read(self) -> tuple[int, int, int, int]:
        """The next record from the neighbour (tag, flag, generation, slot), waiting for it."""
        while not self.records:
            try:
                data = os.read(self.reader, 1 << 16)
            except BlockingIOError:
                self._wait(self.reader, select.POLLIN, "send a message")
                continue
            data = self.partial + data
            whole = len(data) - len(data) % RECORD.size
            self.records.extend(RECORD.iter_unpack(data[:whole]))
            self.partial = data[whole:]
        return self.records.popleft()

    def view(self, generation: int, slot: int, flag: int = OK) -> Boundary:
        """The value in `slot` of the neighbour's file `generation` (at offset `slot` where `flag` is
        PLACED, a varying stream's), as views (no copy)."""
        if generation not in self.mapped:
            layout, data = shm_files.open_mapped(_data(self.prefix, self.peer, self.rank, generation, self.peer_pid))
            self.mapped[generation] = (layout, data if layout is None else shm_files.slot_views(data, layout))
            while len(self.mapped) > MAPPED_FILES:  # the least recently read: replaced by a newer file
                del self.mapped[next(iter(self.mapped))]
        layout, held = self.mapped[generation] = self.mapped.pop(generation)  # now the most recent
        if flag == PLACED:
            layout, views = shm_files.read_message(held, slot)
        else:
            views = held[slot]
        # new tensor objects on the file's memory for every message: the stage marks what it
        # receives requires_grad, and autograd would otherwise keep a .grad on the cached views
        return layout.tree([None if v is None else v.detach() for v in views])

    # ----- both -----------------------------------------------------------------

    def _wait(self, fd: int, event: int, what: str) -> None:
        waiting = self.poller if fd == self.reader else poller(fd, event)
        wait_alive(waiting, {self.peer: self.peer_pid}, self.timeout, what)

    def close(self) -> None:
        for fd in (self.reader, self.writer):
            try:
                os.close(fd)
            except OSError:
                pass
        for path in self.made:  # files a receiver never mapped (it died first, or the stream changed)
            try:
                os.unlink(path)
            except OSError:
                pass
        self.channels, self.mapped, self.made = {}, {}, set()


class Channel:
    """One stream kind's sending state on a link: its file's layout and slots, the half in use."""

    def __init__(self) -> None:
        self.out_like: tuple[Layout, int] | None = None  # the values' layout, messages per step
        self.out_slots: list = []
        self.parity = 0
        self.generation = 0
        # a varying stream's file (its bytes), the bytes of each half, those this step used, its number
        self.varying: torch.Tensor | None = None
        self.half = self.used = self.varying_generation = 0


class ShmOutbox:
    """The sending end of one stream to a neighbour on this node (`transport.outbox` picks it)."""

    def __init__(self, link: Link, count: int, varying: bool = False, channel: int = 0) -> None:
        self.link, self.count, self.varying = link, count, varying
        self.layout: Layout | None = None
        self.sent = 0
        self.gloo: GlooOutbox | None = None  # set when this step's stream does not fit, or varies
        self.state = link.begin_stream(channel)

    def send(self, value: Boundary, tag: int) -> None:
        """Sends `value` (a pytree of tensors on any device).

        Raises:
            ValueError: `value` cannot be sent in this stream (nothing went out).
        """
        if self.gloo is not None:
            self.gloo.send(value, tag)
            return
        layout, leaves = flatten(value)
        if self.varying:
            self._count()
            if not self.link.place(layout, leaves, tag, self.count - self.sent, self.state):
                self._over_gloo(value, tag)
                return
        else:
            if self.layout is None:
                if not self.link.prepare(layout, self.count, self.state):
                    header(layout)  # a layout too large to describe is refused before the switch
                    self._over_gloo(value, tag)
                    return
                self.layout = layout
            else:
                check_like(self.layout, layout)
            self._count()
            self.link.put(leaves, tag, self.sent, self.state)
        self.sent += 1

    def _count(self) -> None:
        if self.sent >= self.count:
            raise ValueError(f"stream to world rank {self.link.peer} got more than its {self.count} messages")

    def _over_gloo(self, value: Boundary, tag: int) -> None:
        """This message and the step's others over gloo: shared memory cannot hold them."""
        self.link.write(tag, GLOO)
        self.gloo = GlooOutbox(self.link.peer, self.varying)
        self.gloo.send(value, tag)

    def poison(self, tag: int) -> None:
        """Tells the receiver this stage failed, in place of the message on `tag`."""
        if self.gloo is not None:
            self.gloo.poison(tag)
            return
        self.link.write(tag, POISON)
        self.sent += 1

    def wait(self) -> None:
        if self.gloo is not None:
            self.gloo.wait()


class ShmInbox:
    """The receiving end of one stream from a neighbour on this node, taking messages in `tags` order."""

    def __init__(self, link: Link, tags: Sequence[int]) -> None:
        self.link = link
        self.tags = deque(tags)
        self.gloo: GlooInbox | None = None

    def take(self) -> Boundary:
        """The next message's value (views into shared memory, valid for this step and the next).

        Raises:
            PeerFailed: the sender failed and sent poison.
        """
        if self.gloo is not None:
            return self.gloo.take()
        tag, flag, generation, slot = self.link.read_tag(self.tags[0])
        if flag == GLOO:
            self.gloo = GlooInbox(self.link.peer, list(self.tags))
            return self.gloo.take()
        self.tags.popleft()
        if flag == POISON:
            raise PeerFailed(f"world rank {self.link.peer} failed earlier in this step")
        return self.link.view(generation, slot, flag)

    def refill(self) -> None:
        if self.gloo is not None:
            self.gloo.refill()


def _pipe(prefix: str, src: int, dst: int, pid: int) -> str:
    return owned(f"{prefix}-{src}-{dst}.pipe", pid)


def _data(prefix: str, src: int, dst: int, generation: int, pid: int) -> str:
    return owned(f"{prefix}-{src}-{dst}-{generation}.data", pid)
