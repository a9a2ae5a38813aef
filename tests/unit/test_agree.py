"""The end-of-step agreement (`raypipe.transport.agree`) between real processes sharing a node:
through pipes, the same sums, to the bit, on every rank, round after round; nothing left
in shared memory; and a rank whose peer exited fails instead of waiting. (Worlds told to
use gloo agree through gloo's all-reduce: `tests/parity/test_parity.py` runs them.)"""

import os
import time

import pytest
import ray
import torch

from raypipe.transport import agree
from raypipe.transport.ray_store import StoreKeeper

SIZE = 3


@ray.remote(num_cpus=0)
class Rank:
    def join(self, keeper, rank, enabled):
        from raypipe.transport import agree
        from raypipe.transport.collective import join_world

        join_world(keeper, SIZE, rank, [], timeout=30)
        self.rank = rank
        return agree.connect(rank, timeout=30, enabled=enabled)

    def sums(self, rows, delays=None):
        """all_sum of `rows[round][rank]` for each round; `delays[round]` s of sleep first (this rank)."""
        from raypipe.transport import agree

        out = []
        for i, row in enumerate(rows):
            if delays:
                time.sleep(delays[i][self.rank])
            out.append(agree.all_sum(torch.tensor(row[self.rank], dtype=torch.float64)).tolist())
        return out

    def leftovers(self):
        """Files of the agreement left in the shared-memory directory."""
        from raypipe.transport.pipes import directory as _directory

        return [f for f in os.listdir(_directory()) if f.startswith("raypipe-agree-")]


def world(enabled):
    ranks = [Rank.remote() for _ in range(SIZE)]
    keeper = ray.remote(StoreKeeper).remote()
    through_pipes = ray.get([r.join.remote(keeper, i, enabled) for i, r in enumerate(ranks)], timeout=60)
    return ranks, through_pipes


@pytest.fixture(scope="module")
def ranks(ray_session):
    ranks, through_pipes = world(True)
    assert through_pipes == [True] * SIZE
    yield ranks
    for r in ranks:
        ray.kill(r)


def test_every_rank_gets_the_same_sums_round_after_round(ranks):
    g = torch.Generator().manual_seed(0)
    rows = (torch.randn(6, SIZE, agree.VALUES, generator=g, dtype=torch.float64) * 1e3).tolist()
    rows[2][1] = [float("nan"), 1.0, 0.0, 1.0] + [0.0] * (agree.VALUES - 4)  # a non-finite vote travels too
    # ranks arrive in different orders; a fast rank's next round may come before a slow one read this round's
    delays = [[0.0, 0.2, 0.0], [0.2, 0.0, 0.0], [0.0, 0.0, 0.2], [0.0, 0.0, 0.0], [0.1, 0.0, 0.3], [0.0, 0.0, 0.0]]
    results = ray.get([r.sums.remote(rows, delays) for r in ranks], timeout=60)
    for rnd, row in enumerate(rows):
        expected = torch.tensor(row, dtype=torch.float64).sum(0)
        got = [torch.tensor(res[rnd], dtype=torch.float64) for res in results]
        torch.testing.assert_close(got[0], expected, equal_nan=True)
        for other in got[1:]:  # the same bits everywhere, so every rank clips and skips alike
            assert torch.equal(other.nan_to_num(7.0), got[0].nan_to_num(7.0))


def test_rounds_back_to_back_keep_each_rounds_numbers_apart(ranks):
    # with no pause between rounds a rank often reads the next round's record from a
    # faster peer together with this round's; it must keep it for the next round
    rows = [[[float(rnd), float(r), 1.0, 0.0] for r in range(SIZE)] for rnd in range(300)]
    results = ray.get([r.sums.remote(rows) for r in ranks], timeout=60)
    expected = [[SIZE * float(rnd), float(sum(range(SIZE))), float(SIZE), 0.0] for rnd in range(300)]
    assert results == [expected] * SIZE


def test_nothing_is_left_in_shared_memory(ranks):
    assert ray.get(ranks[0].leftovers.remote(), timeout=30) == []


def test_a_rank_whose_peer_exited_fails_instead_of_waiting(ranks):  # last: it ends the world
    waiting = [r.sums.remote([[[1.0, 0.0, 0.0, 0.0]] * SIZE]) for r in ranks[1:]]
    time.sleep(1.0)  # ranks 1 and 2 are waiting for rank 0
    ray.kill(ranks[0])
    for ref in waiting:  # a rank left waiting would end in GetTimeoutError, not this
        with pytest.raises(ray.exceptions.RayTaskError, match="world rank 0 .* exited before it could"):
            ray.get(ref, timeout=30)
