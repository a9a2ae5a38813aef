"""Named pipes and shared-memory files between processes of one node: where they live, and
waiting on them while checking that the processes at the other end still live.

Used by `shm` (a record per message between neighbours) and `agree` (the step's
closing agreement among every rank)."""

from __future__ import annotations

import os
import re
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
                raise RuntimeError(
                    f"world rank {rank} (pid {pid}, on this node) exited before it could {what}"
                ) from None
            except PermissionError:  # alive, another user's
                pass
        if time.monotonic() > deadline:
            ranks = ", ".join(str(r) for r in peers)
            raise RuntimeError(
                f"world rank{'s' if len(peers) > 1 else ''} {ranks} did not {what} within {timeout:.0f} s"
            )


def poller(fd: int, event: int) -> select.poll:
    poller = select.poll()
    poller.register(fd, event)
    return poller


def directory() -> str:
    """/dev/shm where it exists (Linux); the temporary directory otherwise (macOS)."""
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def owned(path: str, pid: int) -> str:
    """`path` (`<prefix>-....pipe` or `.data`) marked with the pid of the process that makes it,
    so that a later sweep can tell whose it was."""
    stem, dot, suffix = path.rpartition(".")
    return f"{stem}.pid{pid}.{suffix}"


def prefix(kind: str, node_id: str, world: str) -> str:
    """The start of every file name of one world's links on this node: `raypipe-<kind>-<node>-<world>`.
    The node's Ray id keeps a sweep to files of this node's processes (one pid namespace)."""
    return os.path.join(directory(), f"raypipe-{kind}-{node_id[:12]}-{world}")


_OWNED = re.compile(r"^raypipe-\w+-([0-9a-f]{12})-\w+-.*\.pid(\d+)\.(?:pipe|data)$")


def sweep_stale(node_id: str) -> list[str]:
    """Deletes the pipes and shared-memory files this node's raypipe processes made and left when
    they died (a SIGKILLed or Ray-killed actor runs no clean-up; a receiver that died before it
    mapped a file never unlinked it). A live process's files stay. Returns the names deleted."""
    removed = []
    for name in os.listdir(directory()):
        match = _OWNED.match(name)
        if match and match.group(1) == node_id[:12] and not alive(int(match.group(2))):
            try:
                os.unlink(os.path.join(directory(), name))
                removed.append(name)
            except OSError:  # another sweep was first
                pass
    return removed


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        return True
    return True
