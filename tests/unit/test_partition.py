"""Shard plans: uniform, parameter-balanced (exact), and checks of explicit plans."""

import itertools
import random
import re

import pytest
from torch import nn

from raypipe import ConfigError, LayerSpec
from raypipe.core.layers import parameter_counts
from raypipe.planning.partition import balanced_plan, check_plan, make_plan, speed_aware_plan, uniform_plan


def test_uniform_spreads_the_remainder_over_the_last_stages():
    assert uniform_plan(7, 3) == [(0, 2), (2, 4), (4, 7)]
    assert uniform_plan(8, 4) == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert uniform_plan(5, 5) == [(i, i + 1) for i in range(5)]


def _brute_force(times, fits=lambda s, a, b: True):
    """The slowest stage of the best split, trying every split; `times[s][i]`: layer i on stage s."""
    p, n = len(times), len(times[0])
    best = None
    for cuts in itertools.combinations(range(1, n), p - 1):
        bounds = (0, *cuts, n)
        if not all(fits(s, bounds[s], bounds[s + 1]) for s in range(p)):
            continue
        cost = max(sum(times[s][bounds[s] : bounds[s + 1]]) for s in range(p))
        best = cost if best is None else min(best, cost)
    return best


def test_balanced_plan_is_optimal():
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(1, 9)
        p = rng.randint(1, n)
        weights = [rng.randint(0, 20) for _ in range(n)]
        plan = balanced_plan(weights, p)
        check_plan(plan, n, p)
        cost = max(sum(weights[a:b]) for a, b in plan)
        assert cost == _brute_force([weights] * p), (weights, p, plan)


def test_parameter_partition_counts_without_allocating():
    specs = [
        LayerSpec(nn.Linear, 1000, 1000),
        LayerSpec(nn.ReLU),
        LayerSpec(nn.Linear, 1000, 10),
        LayerSpec(nn.Linear, 10, 10),
    ]
    counts = parameter_counts(specs)
    assert counts == [1_001_000, 0, 10_010, 110]
    assert make_plan(4, 2, "parameters", parameter_counts=counts) == [(0, 1), (1, 4)]


@pytest.mark.parametrize(
    "plan, problem",
    [
        ([[0, 2], [3, 5]], "gap before stage 1"),
        ([[0, 3], [2, 5]], "overlapping"),
        ([[0, 2], [2, 6]], "past the last layer"),
        ([[0, 0], [0, 5]], "empty"),
        ([[0, 2], [2, 4]], "layers 4..4 belong to no stage"),
        ([[0, 5]], "1 ranges for pp=2"),
    ],
)
def test_bad_plans_name_the_problem_and_the_fix(plan, problem):
    with pytest.raises(ConfigError) as info:
        check_plan(plan, 5, 2)
    message = str(info.value)
    assert "shard_plan" in message and problem in message
    assert "[[0, 2], [2, 5]]" in message  # a plan that would work


def test_more_stages_than_layers_is_a_config_error():
    with pytest.raises(ConfigError, match="only 2 layers"):
        make_plan(2, 3)


def test_speed_aware_plan_is_optimal_per_device_speed_and_within_memory():
    """Random layer times on stages of random speeds and random memory limits, against brute force."""
    rng = random.Random(1)
    for _ in range(300):
        n = rng.randint(1, 8)
        p = rng.randint(1, n)
        base = [rng.randint(1, 20) for _ in range(n)]
        speed = [rng.choice([1, 2, 3]) for _ in range(p)]
        times = [[t * k for t in base] for k in speed]
        size = [rng.randint(1, 5) for _ in range(n)]
        budget = [rng.randint(4, 20) for _ in range(p)]

        def fits(s, a, b):
            return sum(size[a:b]) <= budget[s]

        best = _brute_force(times, fits)
        if best is None:
            with pytest.raises(ConfigError, match="fits every stage's device memory"):
                speed_aware_plan(times, fits)
            continue
        plan = speed_aware_plan(times, fits)
        check_plan(plan, n, p)
        assert all(fits(s, a, b) for s, (a, b) in enumerate(plan))
        assert max(sum(times[s][a:b]) for s, (a, b) in enumerate(plan)) == best, (times, budget, plan)


def test_a_two_times_slower_second_stage_gets_a_third_of_equal_layers():
    assert speed_aware_plan([[1] * 6, [2] * 6]) == [(0, 4), (4, 6)]
    assert speed_aware_plan([[2] * 6, [1] * 6]) == [(0, 2), (2, 6)]


def test_profile_partition_needs_a_sample_batch():
    from raypipe import TrainConfig, Trainer

    with pytest.raises(ConfigError, match=r"partition='profile' needs a sample batch.*sample=\(x, y\)"):
        Trainer([LayerSpec(nn.Linear, 2, 2)] * 2, nn.functional.mse_loss, TrainConfig(pp=2, partition="profile"))


def test_the_profiler_times_one_of_alike_layers_and_gives_the_others_its_figures():
    """Layers that say what their cost depends on (`cost_key`) and cost the same are timed once: a
    GPT's three blocks run between them as one block does, and the second and third take the
    first's figures. transformers' decoder layers are alike where their attention type, per-layer
    settings and parameters are: Gemma 3's sliding layers are not its full one, nor DeepSeek-V3's
    dense first layer its expert layers."""
    import torch

    from raypipe.actors.profiler import LayerProfiler, cost_key
    from raypipe.core.layers import build_layer
    from raypipe.models import gpt, hf

    from hf_helpers import family_config

    class Counted(gpt.Block):
        calls = 0

        def forward(self, x):
            Counted.calls += 1
            return super().forward(x)

    cfg = gpt.GPTConfig(n_layer=3, n_head=2, n_embd=16, block_size=8, vocab_size=20)
    specs = gpt.layers(cfg)
    specs = [specs[0], *[LayerSpec(Counted, cfg)] * 3, specs[-1]]
    x, y = torch.randint(0, 20, (2, 8)), torch.randint(0, 20, (2, 8))
    got = LayerProfiler("cpu", False).profile(specs, 0, x, y, gpt.loss_fn, warmup=0, repeats=1)
    assert Counted.calls == 2  # one timed pass and one making the next layer's input: once, not thrice
    for figure in ("forward_s", "backward_s", "activation_bytes", "output_float_bytes", "parameter_bytes"):
        assert len(got[figure]) == 5 and got[figure][1] == got[figure][2] == got[figure][3], figure

    def keys(kind):
        model = hf.from_config(family_config(kind))
        return [cost_key(build_layer(spec, 0, i)) for i, spec in enumerate(model.layers)]

    gemma, deepseek = keys("gemma3"), keys("deepseek_v3")  # embedding, three decoder layers, head
    assert gemma[0] is None and gemma[1] == gemma[3] != gemma[2]  # sliding, full, sliding
    assert deepseek[1] != deepseek[2] == deepseek[3]  # dense, then experts


def test_profile_partition_balances_measured_layer_times(ray_session):
    """One kind of device, layers of 10 ms and 30 ms: the profile sees it, parameter counts do not.
    (Long enough that a loaded machine's per-call noise, ~1 ms, cannot move the split.)"""
    import torch

    from raypipe import TrainConfig, Trainer
    from raypipe.models.simulated import SimulatedCompute

    layers = [LayerSpec(SimulatedCompute, t, t) for t in (0.01, 0.01, 0.01, 0.01, 0.03, 0.03)]
    config = TrainConfig(
        pp=2, microbatches=4, partition="profile", optimizer={"name": "sgd", "lr": 0.01}, cpus_per_actor=0.5
    )
    x, y = torch.randn(16, 8), torch.randn(16, 8)
    lines = []
    with Trainer(layers, nn.functional.mse_loss, config, sample=(x, y), log=lines.append) as t:
        report = t.plan_report
        assert t.plan == [(0, 4), (4, 6)] == report.plan
        assert t.step(x, y)["loss"] > 0
    forward = report.profiles["cpu"]["forward_s"]
    assert report.profiles["cpu"]["threads"] == 1  # as each of the 2 stages on the 2-CPU node computes
    # each layer's output (4 rows x 8 float32), what would cross a link after it; the loss's none
    assert report.profiles["cpu"]["output_float_bytes"] == [4 * 8 * 4] * 5 + [0]
    assert report.profiles["cpu"]["output_float_elements"] == [4 * 8] * 5 + [0]
    # sleeps of 10 and 30 ms per forward: never measured shorter (a busy machine only lengthens
    # them, so no upper bound: the split above is what the measurement is for)
    assert forward[0] >= 0.0095 and forward[5] >= 0.0295 and forward[5] > forward[0], forward
    assert report.stage_seconds[1] >= 0.12, report.stage_seconds  # 2 layers x (30 + 30) ms
    assert report.step_seconds < report.uniform_step_seconds
    assert lines[0] == "raypipe: profiling the layers to choose the split ..."  # a job's log says what it waits for
    assert "stage 1: layers [4, 6) on cpu" in lines[1] and "ms per microbatch" in lines[1]
    assert re.fullmatch(r"raypipe: profiling the layers to choose the split: done in [\d.]+ s", lines[2]), lines[2]


def test_raypipe_plan_profiles_the_jobs_model_and_writes_json(ray_session, tmp_path, capsys):
    import json
    from pathlib import Path

    from raypipe.cli import main

    config = Path(__file__).parents[2] / "examples/configs/tiny.yaml"
    out = tmp_path / "plan.json"
    args = ["plan", str(config), "--set", "partition=profile", "--set", "compress_activations=int8"]
    assert main(args + ["--json", str(out)]) == 0
    printed = capsys.readouterr().out
    report = json.loads(out.read_text())
    # the line says which split the profiles chose: the uniform one, or one by the layers' cost
    uniform = [list(r) for r in report["plan"]] == [[0, 2], [2, 4]]
    how = "the uniform split, which the profiles find fastest" if uniform else "layers split by their cost"
    assert f"speed-aware plan from profiled layers ({how}): predicted step" in printed
    assert len(report["plan"]) == 2 and report["plan"][0][0] == 0 and report["plan"][-1][1] == 4
    assert len(report["profiles"]["cpu"]["forward_s"]) == 4 and all(
        t > 0 for t in report["profiles"]["cpu"]["forward_s"]
    )
    assert f"stage 1: layers [{report['plan'][1][0]}, 4)" in printed
    # the codec's time on each layer's output, the way compression is on (activations), not the other
    codec = report["profiles"]["cpu"]
    assert all(t > 0 for t in codec["codec_forward_s"][:3]) and codec["codec_forward_s"][3] == 0
    assert codec["codec_backward_s"] == [0.0] * 4
    # --links starts the stages where a run would: here on one node, so nothing to measure
    assert main(["plan", str(config), "--links", "--set", "partition=profile"]) == 0
    printed = capsys.readouterr().out
    assert "links between neighbouring stages:\n  stage 0 -> stage 1 over memory: one node, not measured" in printed


def _layers_profile(outputs: list[float], forward: float = 0.01) -> dict:
    """A profile of len(outputs) equal layers (backward twice the forward) whose outputs are
    `outputs` bytes of float32 (what crosses a link when a stage ends after that layer)."""
    n = len(outputs)
    return {
        "forward_s": [forward] * n,
        "backward_s": [2 * forward] * n,
        "parameter_bytes": [1000] * n,
        "activation_bytes": [100] * n,
        "memory_bytes": 2**34,
        "model": "test cpu",
        "cpu_fallback": False,
        "output_float_bytes": outputs,
        "output_float_elements": [b // 4 for b in outputs],
        "output_other_bytes": [0] * n,
    }


def test_a_measured_link_moves_the_split_to_a_narrow_boundary_and_auto_hides_it():
    """Six equal layers whose second one outputs 64 KiB and the others 4 MiB, over a 200 Mbit/s
    link: the link-blind split (3 + 3 layers) sends 4 MiB each way per microbatch, 1.2 s a step;
    planned for the link, the split moves to the narrow boundary (2 + 4) and the step to 0.55 s,
    as `schedules.timed` predicts with each message on the link. Under "auto" the link makes
    more forwards in flight (`extra_warmup`) and more microbatches win where every boundary is wide."""
    from raypipe import TrainConfig
    from raypipe.planning.autoschedule import plan_for_links, predicted_seconds, rank
    from raypipe.planning.links import Link, boundary_bytes
    from raypipe.planning.profiling import plan_from_profiles

    wide, narrow = 4 * 2**20, 64 * 2**10
    profiles = {"cpu": _layers_profile([wide, narrow, wide, wide, wide, 0])}
    rate = 200e6 / 8
    links = {(0, 1): Link(0, 1, "gloo", rate, 1e-3), (1, 0): Link(1, 0, "gloo", rate / 2, 1e-3)}
    config = TrainConfig(pp=2, microbatches=4, partition="profile")
    blind = plan_from_profiles(profiles, ["cpu", "cpu"], config)
    aware = plan_from_profiles(profiles, ["cpu", "cpu"], config, links)
    assert blind.plan == [(0, 3), (3, 6)] and aware.plan == [(0, 2), (2, 6)]
    on_link = predicted_seconds(config, blind, links)
    assert predicted_seconds(config, aware, links) < 0.5 * on_link
    assert on_link > 4 * wide / rate  # the activations alone, one way
    # each link's messages per step: 4 microbatches of 64 KiB and 1 ms, at its own rate each way
    wire = {(link.sender, link.receiver): seconds for link, seconds in aware.link_wire}
    assert wire == pytest.approx({(0, 1): 4 * (1e-3 + narrow / rate), (1, 0): 4 * (1e-3 + narrow / (rate / 2))})
    assert "stage 1 -> stage 0 over gloo: 100 Mbit/s, latency 1.00 ms:" in str(aware)
    assert boundary_bytes(profiles["cpu"], 3, config.replace(boundary_dtype="bf16")) == (wide / 2, wide / 2)
    assert boundary_bytes(profiles["cpu"], 3, config.replace(compress_gradients="int8")) == (wide, wide / 4)
    # plan_for_links: the same, from the link-blind report, and its account
    running, report, before, after, account = plan_for_links(config, config, blind, list(range(6)), links)
    assert report.plan == aware.plan and before == pytest.approx(on_link) and after < before
    assert "stage 0 -> stage 1 over gloo: 200 Mbit/s" in account

    # compressed boundaries cost the sending action the codec's profiled time, each way
    from raypipe.planning.profiling import scheduled_seconds
    from raypipe.schedules import build_schedule

    coded = {**profiles["cpu"], "codec_forward_s": [0.005] * 6, "codec_backward_s": [0.007] * 6}
    one = build_schedule("1f1b", 2, 1)  # F0 F1 B1 B0, one after another
    late = scheduled_seconds(one, [coded] * 2, [(0, 3), (3, 6)], early_gradients=False)
    assert late == pytest.approx(6 * 0.03 + 0.005 + 0.007)
    # as the p2p engine runs it, B1 hands its input gradient on before its weight gradients: B0
    # runs under B1's second half (half its backward, as profiled without the split)
    early = scheduled_seconds(one, [coded] * 2, [(0, 3), (3, 6)])
    assert early == pytest.approx(late - sum(coded["backward_s"][3:6]) / 2)

    # every boundary wide: auto runs more forwards ahead once it knows the link, and more microbatches
    auto = TrainConfig(pp=2, microbatches=8, schedule="auto")
    by_m = {m: {"cpu": _layers_profile([2 * 2**20 * 8 // m] * 5 + [0], 0.005 * 8 / m)} for m in (2, 4, 8, 16)}
    links = {(0, 1): Link(0, 1, "gloo", rate, 1e-3), (1, 0): Link(1, 0, "gloo", rate, 1e-3)}
    without, with_links = rank(by_m, list(range(6)), auto), rank(by_m, list(range(6)), auto, links)
    assert without.chosen.extra_warmup == 0 and all(c.extra_warmup == 0 for c in without.candidates)
    assert with_links.chosen.extra_warmup >= 1 and with_links.chosen.schedule in ("1f1b", "zb-h1")
    assert with_links.chosen.microbatches == 16
