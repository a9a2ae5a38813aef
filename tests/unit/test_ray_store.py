"""The world's rendezvous keys (`raypipe.transport.ray_store.StoreKeeper`), as torch's store calls
use them: a wait for a key another rank writes later, counters, compare-and-set, and a rank that
never comes ending the wait with an error that names the key. Ray-free: the keeper's methods are
awaited directly; `tests/parity/test_data_parallel.py` runs it inside real worlds."""

import asyncio

import pytest

from raypipe.transport.ray_store import RendezvousTimeout, StoreKeeper


def test_a_get_waits_for_the_key_another_rank_writes_then_counters_and_compare_set_agree_with_torch():
    async def run():
        keeper = StoreKeeper()
        waiting = asyncio.ensure_future(keeper.get("rank1/address", 5.0))
        await asyncio.sleep(0.05)
        assert not waiting.done()
        await keeper.set("rank1/address", b"10.0.0.2:4000")
        assert await waiting == b"10.0.0.2:4000"
        assert [await keeper.add("joined", 1) for _ in range(3)] == [1, 2, 3]
        assert await keeper.compare_set("leader", b"", b"0") == b"0"  # absent and expected empty: set
        assert await keeper.compare_set("leader", b"", b"1") == b"0"  # present and not as expected: kept
        assert await keeper.check(["leader", "joined"]) and not await keeper.check(["absent"])
        assert await keeper.num_keys() == 3 and await keeper.delete_key("leader") and await keeper.num_keys() == 2

    asyncio.run(run())


def test_a_rank_that_never_comes_ends_the_wait_naming_its_key():
    async def run():
        keeper = StoreKeeper()
        await keeper.set("rank0", b"here")
        with pytest.raises(RendezvousTimeout, match=r"waited 0 s .*\['rank1'\]: a rank did not join"):
            await keeper.wait(["rank0", "rank1"], 0.1)

    asyncio.run(run())


def test_a_call_whose_reply_was_lost_is_made_again_and_an_add_counts_once(monkeypatch):
    """After another node's loss a reply can be lost (Ray's ActorUnavailableError: the call may or
    may not have run): the store makes it again, and the keeper counts a retried `add` once."""
    import ray

    from raypipe.transport.ray_store import RayStore

    keeper, lost = StoreKeeper(), [2]

    class Method:
        def __init__(self, name):
            self.name = name

        def remote(self, *args):
            return (self.name, args)

    class Handle:
        def __getattr__(self, name):
            return Method(name)

    def get(call):
        name, args = call
        answer = asyncio.run(getattr(keeper, name)(*args))  # it ran; its reply may still be lost
        if lost[0]:
            lost[0] -= 1
            raise ray.exceptions.ActorUnavailableError("Connection reset by peer", None)
        return answer

    monkeypatch.setattr(ray, "get", get)
    store = RayStore(Handle(), timeout=5)
    assert store.add("joined", 1) == 1  # ran three times, counted once
    assert keeper.values["joined"] == b"1"
    lost[0] = 100  # never answers: the world's timeout ends it
    with pytest.raises(ray.exceptions.ActorUnavailableError):
        RayStore(Handle(), timeout=0.3).set("k", b"v")
