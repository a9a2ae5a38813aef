"""The p2p engine's wire protocol (`raypipe.p2p`) between two real processes over gloo:
every boundary dtype arrives exactly, poison arrives where it was sent, and a shape
change within a step is refused before anything goes out."""

import pytest
import ray
import torch

from raypipe.p2p import DTYPES

POISON = "poison"


@ray.remote(num_cpus=0)
class Peer:
    """One end of a two-rank gloo world: rank 0 sends a stream, rank 1 takes it."""

    def address(self):
        from raypipe.collective import rendezvous_address

        return rendezvous_address()

    def join(self, address, port, rank):
        from raypipe.collective import join_world

        join_world(address, port, 2, rank, [], timeout=30)

    def send(self, tensors, tags):
        """Sends each tensor (None: poison) as the stage does; returns the refusals."""
        from raypipe.p2p import Outbox

        box, refused = Outbox(1), []
        for t, tag in zip(tensors, tags):
            try:
                box.send(t, tag)
            except ValueError as error:
                refused.append(str(error))
                box.send(None, tag)  # what the stage does: poison keeps the pattern
        box.wait()
        return refused

    def take(self, tags):
        """Takes every message; writes into each taken tensor (a layer may) and keeps a copy."""
        from raypipe.p2p import Inbox, PeerFailed

        inbox, got = Inbox(0, tags), []
        for _ in tags:
            try:
                t = inbox.take()
                got.append(t.clone())
                if t.dtype != torch.bool:
                    t.add_(1)  # must not change a message still to be taken
            except PeerFailed:
                got.append(POISON)
            inbox.refill()
        return got


@pytest.fixture(scope="module")
def peers(ray_session):
    sender, receiver = Peer.remote(), Peer.remote()
    address, port = ray.get(sender.address.remote(), timeout=30)
    ray.get([sender.join.remote(address, port, 0), receiver.join.remote(address, port, 1)], timeout=60)
    yield sender, receiver
    for actor in (sender, receiver):
        ray.kill(actor)


def exchange(peers, tensors, tags=None):
    sender, receiver = peers
    tags = tags or [2 * i for i in range(len(tensors))]
    refused, got = ray.get([sender.send.remote(tensors, tags), receiver.take.remote(tags)], timeout=60)
    return refused, got


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_boundary_dtype_arrives_exactly(peers, dtype):
    base = torch.randn(5, 3, 4) * 100
    tensors = [base[i].to(dtype) if dtype != torch.bool else base[i] > 0 for i in range(5)]
    refused, got = exchange(peers, tensors)
    assert refused == []
    for sent, taken in zip(tensors, got):
        assert taken.dtype == dtype and taken.shape == (3, 4)
        assert torch.equal(taken, sent)


def test_poison_arrives_where_it_was_sent_first_or_later(peers):
    t = torch.arange(6.0).view(2, 3)
    refused, got = exchange(peers, [None, t, None, t + 1, t + 2])
    assert refused == []
    assert got[0] == POISON and got[2] == POISON
    assert torch.equal(got[1], t) and torch.equal(got[3], t + 1) and torch.equal(got[4], t + 2)


def test_a_shape_change_within_a_step_is_refused_by_the_sender_and_seen_as_poison(peers):
    a, b = torch.ones(2, 3), torch.ones(4, 3)
    refused, got = exchange(peers, [a, b, a])
    assert len(refused) == 1 and "(4, 3)" in refused[0] and "engine='refs'" in refused[0]
    assert torch.equal(got[0], a) and got[1] == POISON and torch.equal(got[2], a)
