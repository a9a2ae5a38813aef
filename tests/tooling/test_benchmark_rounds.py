"""The benchmarks' side-by-side timing (`support/rounds.py`): every runner gets its
steps in turn, the order rotates every turn, and ratios pair neighbours in time."""

import pytest

from rounds import interleaved, match_actor_threads, paired_ratio, plain_twin, ratio_with_spread


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


def test_a_ratio_comes_with_its_spread_and_a_baseline_with_an_actors_threads():
    import torch

    seconds = {"peft": [[1.0, 2.0], [4.0]], "raypipe_pp1": [[2.0, 2.0], [2.0]]}
    assert ratio_with_spread(seconds, "peft", "raypipe_pp1") == {"median": 1.0, "spread": [0.5, 2.0], "pairs": 3}
    threads = torch.get_num_threads()
    try:
        match_actor_threads("cuda", 1)  # the device computes: the process keeps its threads
        assert torch.get_num_threads() == threads
        match_actor_threads("cpu", 1)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(threads)


def test_the_gpu_check_flags_a_ratio_outside_its_band():
    from gpu_report import EXPECTED, bands, sanity

    low, high = EXPECTED["cpu"]["llm_lora"]["raypipe_pp1_over_peft"]
    result = {
        "ratios": {
            "raypipe_pp1_over_peft": {"median": (low + high) / 2, "spread": [low, high], "pairs": 4},
            "raypipe_pp2_over_peft": {"median": 40.0, "spread": [22.7, 60.0], "pairs": 4},  # a broken baseline
        }
    }
    checked = sanity("llm_lora", "cpu", result)
    assert [name for name, r in checked.items() if r["within"]] == ["raypipe_pp1_over_peft"]
    assert "raypipe_pp2_over_peft 40.00 [22.70-60.00] OUT OF BAND" in bands(checked)
    assert sanity("llm_lora", "cpu", None) == {} and sanity("hop", "cuda", {"ratios": {}}) == {}
