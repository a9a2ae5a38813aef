"""The world's rendezvous through Ray: a torch.distributed store whose keys live in a Ray actor.

torch.distributed's usual rendezvous (`tcp://host:port`) opens a TCPStore server on rank 0: a
port on every interface, open while a trainer starts, that anyone on the network can reach and
write to. Here the keys live in a `StoreKeeper` actor instead and every access is a Ray call,
which Ray authenticates, so the world has no rendezvous port at all. gloo (and NCCL) only read
and write a few keys through it while the world and its groups are made (each rank's address);
their own connections then bind to the interface of the node's Ray address
(`collective.join_world`).

The keeper is an asyncio actor: a `get` or `wait` for a key another rank has not written yet
waits on an event, not by polling, and a rank that never comes ends it after the world's timeout
with an error that names the key.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

if TYPE_CHECKING:
    from ray.actor import ActorHandle


KEEPER_DIED = "the world's rendezvous keeper died"  # in the error a stage raises when it finds the keeper gone


class RendezvousTimeout(RuntimeError):
    """A rank waited longer than the world's timeout for a key another rank should have written."""


class StoreKeeper:
    """The world's keys and their values (bytes), in one Ray actor the driver starts."""

    def __init__(self) -> None:
        self.values: dict[str, bytes] = {}
        self.written: dict[str, asyncio.Event] = {}
        self.added: dict[str, int] = {}  # each `add` request's answer, for its retries

    def __repr__(self) -> str:  # Ray's dashboard and state API show this
        return "StoreKeeper(the world's rendezvous keys)"

    def _event(self, key: str) -> asyncio.Event:
        return self.written.setdefault(key, asyncio.Event())

    def _put(self, key: str, value: bytes) -> None:
        self.values[key] = value
        self._event(key).set()

    async def set(self, key: str, value: bytes) -> None:
        self._put(key, value)

    async def get(self, key: str, timeout: float) -> bytes:
        await self.wait([key], timeout)
        return self.values[key]

    async def add(self, key: str, amount: int, request: str = "") -> int:
        """Adds `amount` to the counter `key`; a `request` id seen before returns its first answer,
        so a call retried after a lost reply counts once."""
        if request and request in self.added:
            return self.added[request]
        total = int(self.values.get(key, b"0")) + amount
        self._put(key, str(total).encode())
        if request:
            self.added[request] = total
        return total

    async def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        current = self.values.get(key)
        if current == expected or (current is None and not expected):
            self._put(key, desired)
            return desired
        return expected if current is None else current

    async def wait(self, keys: Sequence[str], timeout: float) -> None:
        missing = [k for k in keys if k not in self.values]
        try:
            await asyncio.wait_for(asyncio.gather(*(self._event(k).wait() for k in missing)), timeout)
        except asyncio.TimeoutError:
            late = [k for k in missing if k not in self.values]
            raise RendezvousTimeout(
                f"the world's rendezvous waited {timeout:.0f} s (TrainConfig.step_timeout) for {late}: a rank did "
                "not join (it failed or was not started)"
            ) from None

    async def check(self, keys: Sequence[str]) -> bool:
        return all(k in self.values for k in keys)

    async def delete_key(self, key: str) -> bool:
        self.written.pop(key, None)
        return self.values.pop(key, None) is not None

    async def num_keys(self) -> int:
        return len(self.values)


class RayStore(dist.Store):
    """A torch.distributed store whose every call is a call on the world's `StoreKeeper` (`keeper`);
    `timeout` bounds each wait for a key, in seconds."""

    def __init__(self, keeper: ActorHandle, timeout: float) -> None:
        super().__init__()
        self.keeper, self.wait_seconds = keeper, timeout
        self.clones: list[RayStore] = []  # kept alive here: torch holds them only on its C++ side

    def _call(self, method: str, *args: object) -> Any:
        """The keeper's answer to `method(*args)`. A call whose reply was lost (Ray's
        ActorUnavailableError: a connection reset, as after another node's loss) is made again until
        the world's timeout; every method is idempotent (`add` by its request id). A keeper that
        died is named as such, not as the stage whose call found it."""
        import ray

        deadline, pause = time.monotonic() + self.wait_seconds, 0.05
        while True:
            try:
                return ray.get(getattr(self.keeper, method).remote(*args))
            except ray.exceptions.RayTaskError as e:
                if isinstance(e.cause, RendezvousTimeout):
                    raise RendezvousTimeout(str(e.cause)) from None
                raise
            except ray.exceptions.ActorUnavailableError:
                if time.monotonic() + pause > deadline:
                    raise
                time.sleep(pause)
                pause = min(2 * pause, 1.0)
            except ray.exceptions.ActorDiedError as e:
                raise RuntimeError(f"{KEEPER_DIED} while the actors joined: {e}") from None

    def clone(self) -> RayStore:
        """Another client of the same keys (gloo takes one for its point-to-point connections)."""
        self.clones.append(RayStore(self.keeper, self.wait_seconds))
        return self.clones[-1]

    def set(self, key: str, value: bytes | str) -> None:
        self._call("set", key, _bytes(value))

    def get(self, key: str) -> bytes:
        return self._call("get", key, self.wait_seconds)

    def add(self, key: str, amount: int) -> int:
        return self._call("add", key, amount, uuid.uuid4().hex)

    def compare_set(self, key: str, expected: bytes | str, desired: bytes | str) -> bytes:
        return self._call("compare_set", key, _bytes(expected), _bytes(desired))

    def wait(self, keys: Sequence[str], timeout: object = None) -> None:
        seconds = timeout.total_seconds() if hasattr(timeout, "total_seconds") else self.wait_seconds
        self._call("wait", list(keys), seconds or self.wait_seconds)

    def check(self, keys: Sequence[str]) -> bool:
        return self._call("check", list(keys))

    def delete_key(self, key: str) -> bool:
        return self._call("delete_key", key)

    def num_keys(self) -> int:
        return self._call("num_keys")


def _bytes(value: bytes | str | Sequence[int]) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)
