"""The end-of-step agreement of every actor of a world, through pipes when all share a node.

A p2p step ends with every actor of the trainer's world summing a few numbers (the
squared gradient norm, non-finite and failure votes, the step's call id and its square), so all
clip, skip or raise alike, and all learn whether they ran the same call.
Through gloo that is a ring all-reduce: 2 (n - 1) sequential loopback-TCP exchanges,
2.7 ms after the last of 4 actors arrived on the project's 2-core machine, on the
critical path of every step. When the whole world is on one node, each rank instead
writes its numbers as one 64-byte record into every other rank's named pipe and reads
the others' from its own: one wake-up per rank. Every rank adds the records up in rank
order, so all get the same bits. Worlds that span nodes keep gloo.

Like gloo's all-reduce it is a barrier: no rank leaves before every rank has arrived,
which `shm`'s alternating slots rely on. A rank whose peer's process exited
fails within a second, naming it, instead of waiting for the timeout.
"""

from __future__ import annotations

import os
import select
import struct
import uuid

import torch
import torch.distributed as dist

from raypipe.transport import plain
from raypipe.transport.pipes import owned, poller, sweep_stale, wait_alive
from raypipe.transport.pipes import prefix as link_prefix

VALUES = 6  # numbers each rank contributes (`Stage.finish_step`'s votes)
RECORD = struct.Struct(f"<2q{VALUES}d")  # rank, round, values: written atomically (< PIPE_BUF)

# this actor's pipes to every other rank of its world (`connect`): module state because an actor
# process is in exactly one trainer world, which `all_sum` reaches from the step's last call
_board: Board | None = None


def connect(rank: int, timeout: float, enabled: bool = True) -> bool:
    """Sets up the pipes when every rank of the world is on this node; a collective of the world.

    Returns whether the world agrees through pipes (False: through gloo).
    """
    import ray

    global _board
    disconnect()
    size = dist.get_world_size()
    node = ray.get_runtime_context().get_node_id()
    everyone = plain.all_gather((node, os.getpid(), uuid.uuid4().hex[:16], enabled))
    if not all(e[3] and e[0] == node for e in everyone):
        return False
    sweep_stale(node)
    prefix = link_prefix("agree", node, everyone[0][2])
    own = owned(f"{prefix}-{rank}.pipe", os.getpid())
    fds: dict[int, int] = {}
    try:
        os.mkfifo(own, 0o600)
        made = True
    except OSError:
        made = False
    dist.barrier()
    ok = made
    if ok:
        try:  # O_RDWR: opening never waits for the other end, and a write never fails for lack of a reader
            for r in range(size):
                fds[r] = os.open(
                    own if r == rank else owned(f"{prefix}-{r}.pipe", everyone[r][1]), os.O_RDWR | os.O_NONBLOCK
                )
        except OSError:
            ok = False
    votes = plain.all_gather(ok)  # also: every rank has opened every pipe by now
    if made:
        os.unlink(own)
    if not all(votes):
        for fd in fds.values():
            os.close(fd)
        return False
    _board = Board(rank, fds, [e[1] for e in everyone], timeout)
    return True


def disconnect() -> None:
    """Closes this process's pipes (a new world connects afresh)."""
    global _board
    if _board is not None:
        _board.close()
    _board = None


def all_sum(values: torch.Tensor) -> torch.Tensor:
    """`values` (float64, at most VALUES long) summed over every rank of the world, on every rank."""
    if _board is not None:
        return _board.sum(values)
    dist.all_reduce(values)
    return values


class Board:
    """This rank's pipe (read) and every other rank's (write)."""

    def __init__(self, rank: int, fds: dict[int, int], pids: list[int], timeout: float) -> None:
        self.rank, self.fds, self.pids, self.timeout = rank, fds, pids, timeout
        self.round = 0
        self.pending: dict[tuple[int, int], tuple[float, ...]] = {}  # (round, rank) -> values, read early
        self.partial = b""
        self.poller = select.poll()
        self.poller.register(fds[rank], select.POLLIN)

    def sum(self, values: torch.Tensor) -> torch.Tensor:
        self.round += 1
        given = values.tolist()  # at most VALUES numbers, the rest sent as zeros
        mine = tuple(float(v) for v in given) + (0.0,) * (VALUES - len(given))
        record = RECORD.pack(self.rank, self.round, *mine)
        for r, fd in self.fds.items():
            if r != self.rank:
                self._write(fd, record, r)
        rows = {self.rank: mine}
        while len(rows) < len(self.pids):
            for rnd, r in [key for key in self.pending if key[0] == self.round]:
                rows[r] = self.pending.pop((rnd, r))
            if len(rows) < len(self.pids):
                self._read([r for r in range(len(self.pids)) if r not in rows])
        total = [0.0] * VALUES
        for r in range(len(self.pids)):  # rank order: every rank adds the same numbers the same way
            total = [a + b for a, b in zip(total, rows[r])]
        return torch.tensor(total[: len(given)], dtype=values.dtype)

    def _write(self, fd: int, record: bytes, peer: int) -> None:
        while True:
            try:
                os.write(fd, record)
                return
            except BlockingIOError:  # never in practice: a pipe holds 64 KiB, a round writes 40 bytes
                self._wait(poller(fd, select.POLLOUT), [peer], "make room in its pipe")

    def _read(self, missing: list[int]) -> None:
        try:
            data = os.read(self.fds[self.rank], 1 << 16)
        except BlockingIOError:
            self._wait(self.poller, missing, "reach the end of the step")
            return
        data = self.partial + data
        whole = len(data) - len(data) % RECORD.size
        for rank, rnd, *values in RECORD.iter_unpack(data[:whole]):
            self.pending[(rnd, rank)] = tuple(values)
        self.partial = data[whole:]

    def _wait(self, waiting: select.poll, peers: list[int], what: str) -> None:
        wait_alive(waiting, {r: self.pids[r] for r in peers}, self.timeout, what)

    def close(self) -> None:
        for fd in self.fds.values():
            try:
                os.close(fd)
            except OSError:
                pass
        self.fds = {}
