"""Named pipes and shared-memory files between processes of one node: where they live, and
waiting on them while checking that the processes at the other end still live.

Used by `shm` (a record per message between neighbours) and `agree` (the step's
closing agreement among every rank)."""

from __future__ import annotations

import os
import select
import tempfile
import time

POLL_MS = 1000  # how often a waiting end checks that the processes it waits on are still alive


def wait_alive(poller: select.poll, peers: dict[int, int], timeout: float, what: str) -> None:
    """Waits until `poller` has an event, checking every POLL_MS that the processes awaited,
    `peers` (world rank -> pid, on this node), still live: one that exited fails the wait
    within a second instead of after `timeout` s."""
    deadline = time.monotonic() + timeout
    while not poller.poll(POLL_MS):
        for rank, pid in peers.items():
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                raise RuntimeError(f"world rank {rank} (pid {pid}, on this node) exited before it could {what}") from None
            except PermissionError:  # alive, another user's
                pass
        if time.monotonic() > deadline:
            ranks = ", ".join(str(r) for r in peers)
            raise RuntimeError(f"world rank{'s' if len(peers) > 1 else ''} {ranks} did not {what} within {timeout:.0f} s")


def poller(fd: int, event: int) -> select.poll:
    poller = select.poll()
    poller.register(fd, event)
    return poller


def directory() -> str:
    """/dev/shm where it exists (Linux); the temporary directory otherwise (macOS)."""
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
