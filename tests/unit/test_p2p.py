"""The p2p engine's wire protocol between two real processes, over every transport that
`raypipe.transport` picks from: shared memory between neighbours on one node (`shm`),
gloo, and a stream on a group of its own matched in order (`ordered`: NCCL's device path,
here over gloo on the CPU). Every boundary dtype arrives exactly, poison arrives where it was sent, a shape
change within a step is refused before anything goes out, a stream too large for shared
memory goes over gloo, nothing is left in /dev/shm, and a receiver whose neighbour exited
fails instead of waiting."""

import os
import time

import pytest
import ray
import torch

from raypipe.transport.ray_store import StoreKeeper

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32, torch.bool]

POISON = "poison"


@ray.remote(num_cpus=0)
class Peer:
    """One end of a two-rank world: rank 0 sends a stream, rank 1 takes it."""

    def join(self, keeper, rank, transport):
        from raypipe.transport import ordered, shm
        from raypipe.transport.collective import join_world

        self.stream = None  # (group, device) of the ordered stream
        if transport == "ordered":
            group = join_world(keeper, 2, rank, [[0, 1]], timeout=30)[0]
            ordered.warm_up([(0, group, [0, 1])], rank, torch.device("cpu"))
            self.stream = (group, torch.device("cpu"))
            return []
        join_world(keeper, 2, rank, [], timeout=30)
        return shm.connect(rank, [1 - rank], timeout=30, enabled=transport == "shm")

    def send(self, tensors, tags, limit=None, varying=False):
        """Sends each value (None: poison) as the stage does; returns the refusals.
        `limit`: the largest stream (bytes) shared memory may carry this time; `varying`:
        the step's microbatches differ in shape."""
        from raypipe import transport as p2p
        from raypipe.transport import shm

        default, shm.MAX_STREAM_BYTES = shm.MAX_STREAM_BYTES, limit or shm.MAX_STREAM_BYTES
        try:
            box, refused = p2p.outbox(1, len(tensors), varying, stream=self.stream), []
            for t, tag in zip(tensors, tags):
                if t is None:
                    box.poison(tag)
                    continue
                try:
                    box.send(t, tag)
                except ValueError as error:
                    refused.append(str(error))
                    box.poison(tag)  # what the stage does: poison keeps the pattern
            box.wait()
            return refused, type(box).__name__, getattr(box, "gloo", None) is not None
        finally:
            shm.MAX_STREAM_BYTES = default

    def take(self, tags):
        """Takes every message; writes into each taken tensor (a layer may) and keeps a copy,
        and the taken tensors themselves (`kept`)."""
        from raypipe.transport import PeerFailed, inbox
        from raypipe.transport.tree import map_tensors, tensors

        box, got, self.kept = inbox(0, tags, stream=self.stream), [], []
        for _ in tags:
            try:
                value = box.take()
                got.append(map_tensors(torch.clone, value))
                for t in tensors(value):
                    if t.dtype != torch.bool:
                        t.add_(1)  # must not change a message still to be taken
                    self.kept.append((t, t.clone()))
            except PeerFailed:
                got.append(POISON)
            box.refill()
        return got

    def hold(self):
        """Keeps the tensors the last `take` returned, as a stage's stash does."""
        self.held = self.kept

    def held_unchanged(self):
        """Whether the held tensors still hold what they did when taken."""
        return all(torch.equal(t, copy) for t, copy in self.held)

    def pid(self):
        return os.getpid()

    def shm_files(self):
        """Files of this process's links still in the shared-memory directory."""
        from raypipe.transport import pipes, shm

        names = {os.path.basename(link.prefix) for link in shm._links.values()}
        return [f for f in os.listdir(pipes.directory()) if any(f.startswith(n) for n in names)]


def connect(transport):
    sender, receiver = Peer.remote(), Peer.remote()
    keeper = ray.remote(StoreKeeper).remote()
    linked = ray.get([sender.join.remote(keeper, 0, transport), receiver.join.remote(keeper, 1, transport)], timeout=60)
    return sender, receiver, linked


@pytest.fixture(scope="module", params=["shm", "gloo", "ordered"])
def peers(ray_session, request):
    sender, receiver, linked = connect(request.param)
    assert linked == ([[1], [0]] if request.param == "shm" else [[], []])
    yield sender, receiver
    for actor in (sender, receiver):
        ray.kill(actor)


def test_a_message_whose_receiver_died_leaves_no_file_past_the_next_world_on_the_node(ray_session):
    """A killed actor runs no clean-up: the file a sender made for a receiver that died before
    mapping it outlives both. Every name carries its maker's pid, and the next world that
    connects on the node sweeps what dead processes left (a live process's files stay)."""
    from raypipe.transport.pipes import directory

    sender, receiver, _ = connect("shm")
    pid = ray.get(sender.pid.remote(), timeout=30)
    ray.get(sender.send.remote([torch.ones(4)], [0]), timeout=30)  # announced, never taken
    ray.kill(receiver)
    ray.kill(sender)
    left = [f for f in os.listdir(directory()) if f".pid{pid}." in f]
    assert len(left) == 1 and left[0].endswith(".data"), left
    sender, receiver, _ = connect("shm")
    assert not [f for f in os.listdir(directory()) if f".pid{pid}." in f]
    assert ray.get(sender.shm_files.remote(), timeout=30) == []  # the new pipes: opened, unlinked
    for actor in (sender, receiver):
        ray.kill(actor)


def exchange(peers, tensors, tags=None, limit=None):
    sender, receiver = peers
    tags = tags or [2 * i for i in range(len(tensors))]
    (refused, _, _), got = ray.get([sender.send.remote(tensors, tags, limit), receiver.take.remote(tags)], timeout=60)
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


def same(a, b):
    """Two boundary values are equal: the same tree, None where None, equal tensors."""
    import torch.utils._pytree as pytree

    (la, sa), (lb, sb) = pytree.tree_flatten(a), pytree.tree_flatten(b)
    return sa == sb and all(
        (x is None and y is None)
        or (torch.is_tensor(x) and torch.is_tensor(y) and x.dtype == y.dtype and torch.equal(x, y))
        for x, y in zip(la, lb)
    )


def test_a_pytree_with_a_mask_ids_and_none_arrives_exactly(peers):
    values = [
        {
            "hidden": torch.randn(2, 5, 4),
            "mask": torch.rand(2, 5) > 0.3,
            "positions": torch.arange(10).view(2, 5) + i,
            "aux": (torch.tensor(float(i)), None),
        }
        for i in range(3)
    ]
    refused, got = exchange(peers, values)
    assert refused == [] and all(same(a, b) for a, b in zip(values, got))


def test_a_gradient_tree_of_only_none_leaves_is_a_message_not_poison(peers):
    refused, got = exchange(peers, [{"ids": None}, {"ids": None}])
    assert refused == [] and got == [{"ids": None}, {"ids": None}]


def test_varying_shapes_arrive_when_the_step_says_they_vary(peers):
    sender, receiver = peers
    values = [{"h": torch.randn(1, n, 4), "ids": torch.arange(n)} for n in (5, 3, 8)] + [
        None,
        {"h": None, "ids": None},  # no payload at all
        {"h": torch.ones(1, 2, 4), "ids": torch.arange(2)},
    ]
    tags = [2 * i for i in range(len(values))]
    (refused, _, over_gloo), got = ray.get(
        [sender.send.remote(values, tags, None, True), receiver.take.remote(tags)], timeout=60
    )
    assert refused == [] and not over_gloo  # between neighbours on one node: through shared memory
    assert all(same(a, b) for a, b in zip(values[:3], got[:3]))
    assert got[3] == POISON and same(values[4], got[4]) and same(values[5], got[5])


def test_a_varying_stream_that_outgrows_its_file_arrives_and_what_was_taken_outlives_the_next_step(peers):
    """A varying stream's messages lie one after another in a half of its file; one that does not
    fit moves the stream to a file twice as large mid-step. What the receiver took (views of those
    files) stays as it was while the next step's messages are written, and no file is left."""
    sender, receiver = peers

    def step(base: float) -> list:
        sizes = [8, 16384, 8, 32768, 4]  # the second and fourth outgrow the half the first made
        values = [{"h": torch.arange(float(n)) + base, "n": torch.tensor([n])} for n in sizes]
        tags = [2 * i for i in range(len(values))]
        (refused, _, over_gloo), got = ray.get(
            [sender.send.remote(values, tags, None, True), receiver.take.remote(tags)], timeout=60
        )
        assert refused == [] and not over_gloo and all(same(a, b) for a, b in zip(values, got))
        return got

    step(0.0)
    ray.get(receiver.hold.remote(), timeout=30)
    step(1000.0)  # in the other half of the file the first step grew into
    assert ray.get(receiver.held_unchanged.remote(), timeout=30)
    step(2000.0)  # the first step's half again (its taker is done with it: a step's views live one step more)
    assert ray.get([sender.shm_files.remote(), receiver.shm_files.remote()], timeout=30) == [[], []]


def test_a_varying_stream_too_large_for_shared_memory_goes_over_gloo_from_that_message_on(peers):
    sender, receiver = peers
    values = [torch.randn(16), torch.randn(262144), torch.randn(3)]  # 1 MiB in the middle
    tags = [1, 3, 5]
    (refused, kind, over_gloo), got = ray.get(
        [sender.send.remote(values, tags, 1 << 19, True), receiver.take.remote(tags)], timeout=60
    )
    assert refused == [] and all(torch.equal(a, b) for a, b in zip(values, got))
    assert over_gloo == (kind == "ShmOutbox")


def test_poison_first_then_a_varying_stream(peers):
    sender, receiver = peers
    values = [None, torch.ones(2, 3), torch.zeros(4)]
    tags = [0, 2, 4]
    (refused, _, _), got = ray.get(
        [sender.send.remote(values, tags, None, True), receiver.take.remote(tags)], timeout=60
    )
    assert refused == [] and got[0] == POISON and same(got[1], values[1]) and same(got[2], values[2])


def test_a_non_tensor_leaf_is_refused_before_it_goes_out(peers):
    refused, got = exchange(peers, [{"h": torch.ones(2), "n": 3}, {"h": torch.ones(2), "n": 3}])
    assert len(refused) == 2 and "int" in refused[0] and "only tensors and None" in refused[0]
    assert got == [POISON, POISON]


def test_taken_tensors_outlive_the_next_step(peers):
    # a stage's stash holds taken tensors until its step ends, which may be after its
    # neighbour has started the next step's sends
    sender, receiver = peers
    exchange(peers, [torch.full((2, 3), float(i)) for i in range(4)])
    ray.get(receiver.hold.remote(), timeout=30)
    exchange(peers, [torch.full((2, 3), 100.0 + i) for i in range(4)])
    assert ray.get(receiver.held_unchanged.remote(), timeout=30)


def test_a_stream_too_large_for_shared_memory_goes_over_gloo(peers):
    sender, receiver = peers
    tensors = [torch.randn(16, 16) for _ in range(3)]
    tags = [1, 3, 5]
    (refused, kind, over_gloo), got = ray.get(
        [sender.send.remote(tensors, tags, 512), receiver.take.remote(tags)], timeout=60
    )
    assert refused == [] and all(torch.equal(a, b) for a, b in zip(tensors, got))
    assert over_gloo == (kind == "ShmOutbox")  # only a shared-memory stream has anything to fall back from
    # the next step fits again and goes through shared memory
    (refused, kind, over_gloo), got = ray.get(
        [sender.send.remote(tensors, tags), receiver.take.remote(tags)], timeout=60
    )
    assert not over_gloo and all(torch.equal(a, b) for a, b in zip(tensors, got))


def test_nothing_is_left_in_shared_memory(peers):
    exchange(peers, [torch.randn(3, 5) for _ in range(3)])
    exchange(peers, [torch.randn(7) for _ in range(2)])  # a new shape: a new file
    sender, receiver = peers
    assert ray.get([sender.shm_files.remote(), receiver.shm_files.remote()], timeout=30) == [[], []]


def test_a_receiver_whose_neighbour_exited_fails_instead_of_waiting(ray_session):
    sender, receiver, _ = connect("shm")
    try:
        taking = receiver.take.remote([0, 2])
        time.sleep(1.0)  # the receiver is waiting for the first message
        ray.kill(sender)
        with pytest.raises(ray.exceptions.RayTaskError, match="exited before it could send"):  # not GetTimeoutError
            ray.get(taking, timeout=30)
    finally:
        for actor in (sender, receiver):
            ray.kill(actor)
