"""Which live run may write a checkpoint root: one at a time.

Two runs saving into one directory would delete each other's saves (each sweeps the debris of
its own killed saves, each prunes), so a trainer holds its `checkpoint_dir` for as long as it
lives, and a save to another root holds that one while it writes. The hold dies with its
holder, never needing a clean-up:

- a local directory: an exclusive `flock` on `<root>/.raypipe-lock`, which the kernel releases
  when the process ends however it ends (the file says who holds it, for the refusal's message;
  it is removed on release, and an acquirer checks it locked the file still at that path);
- an object store (no locks there): a lease object `<root>/.raypipe-lock` naming its holder and
  when it expires, renewed by a daemon thread every `LEASE_S / 4` seconds; a holder that died
  stops renewing, and its lease lapses within `LEASE_S`. Object stores have no compare-and-swap
  through pyarrow, so two runs starting within the same second could both take it: the
  acquirer reads its lease back after writing it, which narrows that window to the store's
  latency.

A second holder is refused with a `CheckpointError` naming the holder (run, process, host) and
the fixes. Plain Python: the driver holds these, never an actor.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

from raypipe.checkpoint.files import PRIVATE_FILE, CheckpointError, make_private_dir
from raypipe.checkpoint.storage import StoragePath, location, redact, scrub

LOCK = ".raypipe-lock"
LEASE_S = 60.0  # an object-store lease lapses this long after its holder's last renewal

# every root this process holds, so that a second trainer of the same process is refused too (a
# flock taken twice by one process on two descriptors conflicts; this also covers object stores)
_held: dict[str, RootLock] = {}
_held_guard = threading.Lock()


class RootLock:
    """This process's hold on one checkpoint root (`acquire` takes it, `release` gives it up).

    Args:
        root: the checkpoint root (a directory or a URI).
        holder: who holds it, for a refused run's message: the run's name.
    """

    def __init__(self, root: str, holder: str) -> None:
        self.root, self.holder = str(root), holder
        self.token = uuid.uuid4().hex
        self._fd: int | None = None
        self._renewing: threading.Event | None = None

    def describe(self) -> dict[str, object]:
        return {"run": self.holder, "pid": os.getpid(), "host": socket.gethostname(), "token": self.token}

    def acquire(self) -> RootLock:
        """Takes the root, or raises.

        Raises:
            CheckpointError: another live run (of this or another process) holds it.
        """
        key = self._key()
        with _held_guard:
            other = _held.get(key)
            if other is not None:
                raise self._refusal(other.describe())
            path = location(self.root)
            try:
                self._take_lease(path) if isinstance(path, StoragePath) else self._take_flock(path)
            except CheckpointError:
                raise
            except Exception as error:  # noqa: BLE001 - a bucket it cannot reach: named, its secret unshown
                raise CheckpointError(
                    f"checkpoint_dir {redact(self.root)} cannot be listed or written: {type(error).__name__}: "
                    f"{scrub(str(error), self.root)}"
                ) from None
            _held[key] = self
        return self

    def release(self) -> None:
        """Gives the root up (nothing if not held). Safe to call twice."""
        with _held_guard:
            if _held.get(self._key()) is not self:
                return
            del _held[self._key()]
            path = location(self.root)
            if isinstance(path, StoragePath):
                self._drop_lease(path)
            elif self._fd is not None:
                try:
                    (path / LOCK).unlink(missing_ok=True)  # while still locked: an acquirer re-checks the path
                finally:
                    os.close(self._fd)  # releases the flock
                    self._fd = None

    # ----- a local directory: flock -------------------------------------------------

    def _take_flock(self, root: Any) -> None:
        import fcntl

        make_private_dir(root)
        file = root / LOCK
        while True:
            fd = os.open(file, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, PRIVATE_FILE)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as error:
                holder = _read_json(lambda: os.pread(fd, 4096, 0))
                os.close(fd)
                if error.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise CheckpointError(f"cannot lock checkpoint_dir {root}: {error}") from None
                raise self._refusal(holder) from None
            try:  # the file we locked must still be the one at the path (a releaser unlinks it)
                same = os.fstat(fd).st_ino == os.lstat(file).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(self.describe()).encode(), 0)
        self._fd = fd

    # ----- an object store: a renewed lease -----------------------------------------

    def _take_lease(self, root: StoragePath) -> None:
        lease = root / LOCK
        holder = _read_json(lease.read_bytes)
        if holder is not None and holder.get("expires", 0) > time.time() and holder.get("token") != self.token:
            raise self._refusal(holder)
        self._write_lease(lease)
        time.sleep(0.2)  # a run that wrote at the same moment: the store keeps one of the two
        holder = _read_json(lease.read_bytes)
        if holder is None or holder.get("token") != self.token:
            raise self._refusal(holder or {})
        self._renewing = threading.Event()
        threading.Thread(target=self._renew, args=(lease, self._renewing), daemon=True, name="raypipe-lease").start()

    def _write_lease(self, lease: StoragePath) -> None:
        lease.write_bytes(json.dumps({**self.describe(), "expires": time.time() + LEASE_S}).encode())

    def _renew(self, lease: StoragePath, stop: threading.Event) -> None:
        while not stop.wait(LEASE_S / 4):
            try:
                self._write_lease(lease)
            except Exception:  # noqa: BLE001 - a store that blinked: the next renewal tries again
                pass

    def _drop_lease(self, root: StoragePath) -> None:
        if self._renewing is not None:
            self._renewing.set()
        lease = root / LOCK
        holder = _read_json(lease.read_bytes)
        if holder is not None and holder.get("token") == self.token:
            try:
                lease.delete()
            except Exception:  # noqa: BLE001 - it lapses on its own
                pass

    # ----- messages ------------------------------------------------------------------

    def _key(self) -> str:
        path = location(self.root)
        return path.uri if isinstance(path, StoragePath) else os.path.realpath(path)

    def _refusal(self, holder: dict[str, object] | None) -> CheckpointError:
        holder = holder or {}
        who = f"run {holder.get('run', '?')} (pid {holder.get('pid', '?')} on {holder.get('host', '?')})"
        here = holder.get("pid") == os.getpid() and holder.get("host") == socket.gethostname()
        fix = "call that trainer's shutdown() first" if here else "wait for it to end"
        return CheckpointError(
            f"checkpoint_dir {redact(self.root)} is in use by {who}{', in this process' if here else ''}: two live "
            f"runs saving there would delete each other's saves. Give this run a checkpoint_dir of its own, or "
            f"{fix}. Nothing was started."
        )


def hold(root: str | None, holder: str) -> RootLock | None:
    """This process's hold on `root` for run `holder` (None for no root).

    Raises:
        CheckpointError: another live run holds it (`RootLock.acquire`).
    """
    return RootLock(root, holder).acquire() if root is not None else None


def release(held: RootLock | None) -> None:
    """Gives up `held` (nothing for None)."""
    if held is not None:
        held.release()


@contextlib.contextmanager
def held_by(root: str, holder: str) -> Iterator[None]:
    """Within the block `root` is held for run `holder`: by the hold it has already (its own
    checkpoint_dir), else by one taken for the block (a save to another root).

    Raises:
        CheckpointError: another live run holds it.
    """
    with _held_guard:
        mine = _held.get(RootLock(root, holder)._key())
    if mine is not None and mine.holder == holder:
        yield
        return
    taken = RootLock(root, holder).acquire()
    try:
        yield
    finally:
        taken.release()


@contextlib.contextmanager
def moving(held: RootLock | None, root: str | None, holder: str) -> Iterator[RootLock | None]:
    """Moves run `holder` from the root it holds (`held`) to `root`: the block runs holding both,
    and the old one is given up after it (the new one, if the block raises). Yields the hold on
    `root` (`held` itself when the root is the same).

    Raises:
        CheckpointError: another live run holds `root`.
    """
    if held is not None and root is not None and held._key() == RootLock(root, holder)._key():
        yield held
        return
    new = hold(root, holder)
    try:
        yield new
    except BaseException:
        if new is not None:
            new.release()
        raise
    if held is not None:
        held.release()


def _read_json(read: Any) -> dict[str, Any] | None:
    try:
        value = json.loads(read() or b"null")
    except Exception:  # noqa: BLE001 - absent, empty, partly written: no holder known
        return None
    return value if isinstance(value, dict) else None
