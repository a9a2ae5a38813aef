"""What ranks exchange outside the boundary streams (the join's facts, optimizer shares, the
checkpoint's gathers) travels as plain data (`raypipe.transport.plain`): JSON and tensor bytes,
nothing unpickled. Round trips of every kind they send, refusals of what a stranger might send
instead (a crafted pickle among them), and the collectives between two real gloo processes."""

import multiprocessing
import os
import pickle

import pytest
import torch

from raypipe.transport import plain
from raypipe.transport.plain import PeerDataError, decode, encode

TREE = {
    0: {"weight": {"exp_avg": torch.randn(3, 4), "step": torch.tensor(7.0)}},  # optimizer state by layer
    "ids": [1, 2, 3],
    ("node", 4): ("abc", 1234, True, None, 0.5, float("inf")),
    "dtypes": [torch.arange(6, dtype=d).reshape(2, 3) for d in (torch.int64, torch.int8, torch.uint8)]
    + [torch.randn(2, dtype=d) for d in (torch.float16, torch.bfloat16, torch.float64)]
    + [torch.tensor([True, False]), torch.empty(0, 5), torch.tensor(3)],
}


def same(a, b):
    if torch.is_tensor(a):
        return torch.is_tensor(b) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b and type(a) is type(b)


def test_every_kind_sent_comes_back_as_it_was():
    assert same(decode(encode(TREE)), TREE)
    assert decode(encode(False)) is False and decode(encode([])) == []


class Boom:
    def __reduce__(self):
        return (os.system, ("touch /tmp/raypipe-plain-pwned",))


@pytest.mark.parametrize(
    "payload, words",
    [
        (pickle.dumps(Boom()), "not a plain-data message"),  # a crafted pickle that would run a command
        (os.urandom(64), "not a plain-data message"),
        (b"\x03", "shorter than its header"),
        ((10**6).to_bytes(8, "little") + b"{}", "does not fit"),
        (len(b'{"t":"complex64","shape":[1]}').to_bytes(8, "little") + b'{"t":"complex64","shape":[1]}', "dtype"),
        (len(b'{"t":"float32","shape":[9]}').to_bytes(8, "little") + b'{"t":"float32","shape":[9]}', "past the end"),
        (len(b'{"t":"float32","shape":[-1]}').to_bytes(8, "little") + b'{"t":"float32","shape":[-1]}', "sizes"),
        (len(b'{"x":1}').to_bytes(8, "little") + b'{"x":1}', "none of the plain kinds"),
        (len(b"[1]").to_bytes(8, "little") + b"[1]" + b"junk", "follow the last tensor"),
        (len(b"[" * 50000).to_bytes(8, "little") + b"[" * 50000, "not JSON"),
    ],
)
def test_what_is_not_plain_data_is_refused_naming_the_rank(payload, words):
    with pytest.raises(PeerDataError, match=words) as refused:
        decode(torch.frombuffer(bytearray(payload), dtype=torch.uint8), peer=3)
    assert "rank 3 sent" in str(refused.value)
    assert not os.path.exists("/tmp/raypipe-plain-pwned")


def test_what_cannot_be_plain_data_is_refused_before_sending():
    with pytest.raises(TypeError, match="Boom cannot be sent as plain data"):
        encode({"x": Boom()})
    with pytest.raises(TypeError, match="complex64"):
        encode(torch.zeros(2, dtype=torch.complex64))


def _rank(rank: int, store: str, out) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        mine = {"rank": rank, "state": torch.full((rank + 1, 2), float(rank)), "node": ("n", rank)}
        everyone = plain.all_gather(mine)
        gathered = plain.gather(mine, dst=1)
        # as bytes: a queue shares a tensor's storage by a handle that dies with this process, which
        # may end before the test reads it (FileNotFoundError in the parent, seen in a full run)
        out.put((rank, pickle.dumps(everyone), pickle.dumps(gathered)))
    finally:
        dist.destroy_process_group()


def test_two_gloo_ranks_all_gather_and_gather_plain_data(tmp_path):
    context = multiprocessing.get_context("spawn")
    out = context.Queue()
    ranks = [context.Process(target=_rank, args=(r, str(tmp_path / "store"), out)) for r in range(2)]
    for p in ranks:
        p.start()
    try:
        results = {r: (pickle.loads(e), pickle.loads(g)) for r, e, g in (out.get(timeout=120) for _ in ranks)}
    finally:
        for p in ranks:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    expected = [{"rank": r, "state": torch.full((r + 1, 2), float(r)), "node": ("n", r)} for r in range(2)]
    for r in range(2):
        assert same(results[r][0], expected)  # sizes differ by rank: padded, then cut back
    assert results[0][1] is None and same(results[1][1], expected)
