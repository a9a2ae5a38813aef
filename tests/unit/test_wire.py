"""Batches travel to the actors as numpy arrays (`raypipe.transport.wire`): exact round trips,
tensors the receiver owns, and everything else untouched."""

from collections import namedtuple

import numpy as np
import ray
import torch

from raypipe.transport.wire import Packed, pack, pack_microbatches, unpack

Pair = namedtuple("Pair", "x y")


def test_round_trip_is_exact_for_every_dtype_a_batch_uses():
    values = [
        torch.randn(3, 5),
        torch.randn(2, 3).to(torch.bfloat16),
        torch.randn(4).half(),
        torch.randint(0, 50_000, (2, 8)),
        torch.tensor([True, False]),
        torch.randn(6, 4)[:, 1],
    ]
    for value in values:
        packed = pack(value)
        assert isinstance(packed, Packed)
        back = unpack(packed)
        assert back.dtype == value.dtype and back.shape == value.shape
        assert torch.equal(back, value)


def test_nested_batches_keep_their_structure():
    batch = {
        "ids": torch.arange(6).view(2, 3),
        "parts": [torch.ones(2), (torch.zeros(1), "label")],
        "pair": Pair(torch.ones(1), 3),
    }
    packed = pack(batch)
    assert isinstance(packed["parts"][1], tuple) and isinstance(packed["pair"], Pair)
    back = unpack(packed)
    assert torch.equal(back["ids"], batch["ids"]) and back["parts"][1][1] == "label"
    assert isinstance(back["pair"], Pair) and back["pair"].y == 3


def test_tensors_needing_grad_and_non_tensors_pass_through():
    w = torch.ones(2, requires_grad=True)
    assert pack(w) is w
    assert pack("text") == "text" and pack(None) is None and pack(3.5) == 3.5


def test_through_ray_the_receiver_gets_a_writable_tensor_of_its_own(ray_session):
    @ray.remote
    def double_in_place(packed):
        t = unpack(packed)
        t.mul_(2)  # a layer may modify its input in place
        return pack(t)

    x = torch.arange(8, dtype=torch.float32)
    packed = pack(x)
    assert isinstance(packed.array, np.ndarray)
    assert torch.equal(unpack(ray.get(double_in_place.remote(packed))), 2 * x)
    assert torch.equal(unpack(ray.get(double_in_place.remote(ray.put(packed)))), 2 * x)
    assert torch.equal(x, torch.arange(8, dtype=torch.float32))  # the sender's tensor is untouched


def test_microbatches_travel_stacked_and_come_back_as_disjoint_owned_rows():
    items = [torch.randn(2, 3) for _ in range(4)]
    sent = [t.clone() for t in items]
    packed = pack_microbatches(items)
    assert isinstance(packed, Packed) and packed.array.shape == (4, 2, 3)  # one array for the call
    back = unpack(packed)
    for i, item in enumerate(items):
        assert torch.equal(back[i], item)
    back[1].mul_(0)  # a layer writing into its input touches only its own microbatch
    assert torch.equal(back[0], sent[0]) and torch.equal(back[2], sent[2])
    assert torch.equal(items[1], sent[1])  # and never the sender's


def test_microbatches_that_cannot_stack_travel_one_by_one():
    ragged = [torch.ones(2, 3), torch.ones(1, 3)]
    mixed = [torch.ones(2), torch.ones(2, dtype=torch.int64)]
    for items in (ragged, mixed, [None, None], ["a", "b"], []):
        packed = pack_microbatches(items)
        assert isinstance(packed, list) and len(packed) == len(items)
        back = unpack(packed)
        for got, want in zip(back, items):
            assert torch.equal(got, want) if torch.is_tensor(want) else got == want
