"""The benchmarks' side-by-side timing (`benchmarks/rounds.py`): every runner gets its
steps in turn, the order rotates every turn, and ratios pair neighbours in time."""

import pytest
from rounds import interleaved, paired_ratio, plain_twin


def test_turns_rotate_so_no_runner_always_follows_the_same_one():
    calls = []
    runners = {name: (lambda step, name=name: calls.append((name, step))) for name in "abc"}
    seconds = interleaved(runners, rounds=2, steps=3, warmup=1)

    assert calls[:3] == [("a", 0), ("b", 0), ("c", 0)]  # warm-up, one step each
    turns = [calls[3 + 3 * t : 6 + 3 * t] for t in range(6)]
    assert [[name for name, _ in turn] for turn in turns] == [
        list("abc"),
        list("bca"),
        list("cab"),
        list("abc"),
        list("bca"),
        list("cab"),
    ]
    # every runner takes the same step index in a turn: round r, step i is 1000 r + i
    assert [{step for _, step in turn} for turn in turns] == [{0}, {1}, {2}, {1000}, {1001}, {1002}]
    assert {name: [len(r) for r in rounds] for name, rounds in seconds.items()} == {
        "a": [3, 3],
        "b": [3, 3],
        "c": [3, 3],
    }


def test_paired_ratio_compares_the_same_step_of_each_runner():
    seconds = {"plain_torch_m4": [[1.0, 2.0, 4.0]], "raypipe_pp1_m4": [[2.0, 2.0, 2.0]]}
    # pairs 0.5, 1.0, 2.0: the median pair, not the ratio of the medians or of the bests
    assert paired_ratio(seconds, "plain_torch_m4", "raypipe_pp1_m4") == pytest.approx(1.0)
    assert plain_twin("raypipe_fit_pp1_m4") == "plain_torch_m4"
    assert plain_twin("raypipe_pp2_m4", "fused") == "plain_fused_m4"
