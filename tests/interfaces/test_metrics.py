"""Per-stage timing and TensorBoard event files, read back with TensorBoard's own reader."""

import re
from pathlib import Path

import pytest
import torch
from torch import nn

from raypipe import LayerSpec, TrainConfig, Trainer
from raypipe.core.devices import usable_cores

from helpers import MLP7, Sleep, batch, tensorboard_run

ROOT = Path(__file__).resolve().parents[2]


def test_tensorboard_scalars_match_the_step_metrics(ray_session, tmp_path):
    config = TrainConfig(pp=2, microbatches=4, log_dir=str(tmp_path), optimizer={"name": "sgd", "lr": 0.05})
    with Trainer(MLP7, nn.functional.mse_loss, config) as t:
        history = t.fit(batch, 4)
        info_after = t.stage_info()
    (folder,) = tmp_path.iterdir()
    assert re.fullmatch(r"\d{4}-\d\d-\d\d_\d\d-\d\d-\d\d_[0-9a-f]{8}", folder.name), folder.name  # start time, id
    events = tensorboard_run(str(tmp_path))
    tags = set(events.Tags()["scalars"])
    expected = {"train/loss", "train/lr", "train/grad_norm", "train/samples_per_s", "train/step_time"}
    expected |= {
        f"stage{s}/{k}" for s in range(2) for k in ("forward_s", "backward_s", "bubble_fraction", "peak_memory_bytes")
    }
    assert expected <= tags, expected - tags
    losses = events.Scalars("train/loss")
    assert [e.step for e in losses] == [1, 2, 3, 4]
    assert [e.value for e in losses] == pytest.approx([m["loss"] for m in history], rel=1e-6)
    assert [e.value for e in events.Scalars("train/lr")] == pytest.approx([0.05] * 4)
    memory = events.Scalars("stage1/peak_memory_bytes")
    assert all(e.value > 50e6 for e in memory)  # an actor process with torch loaded
    parts = ("parameters", "gradients", "optimizer_state", "activations", "other")
    assert {f"stage{s}/memory_{p}_bytes" for s in range(2) for p in parts} <= tags
    for stage, info in zip(history[-1]["stages"], info_after):
        split = stage["memory"]
        assert sum(split[p] for p in parts) == split["peak"] == stage["peak_memory_bytes"]
        assert split["parameters"] == info["parameter_bytes"] == split["gradients"] > 0  # SGD: no state
        assert split["optimizer_state"] == 0 and split["activations"] > 0 and split["other"] > 50e6
        assert info["memory"]["parameters"] == info["parameter_bytes"]  # stage_info() holds the last split
    assert [m["warmup"] for m in history] == [True, False, False, False]
    # a second run with the same log_dir is a run of its own in TensorBoard, the first's events kept;
    # its first step after a reconfigure is a warm-up step again
    with Trainer(MLP7, nn.functional.mse_loss, config.replace(pp=1)) as again:
        flags = [again.step(*batch(k))["warmup"] for k in range(2)]
        again.reconfigure(microbatches=2)
        flags.append(again.step(*batch(2))["warmup"])
        run_id = again.run_id
    assert flags == [True, False, True]
    first, second = sorted(tmp_path.iterdir(), key=lambda p: p.name.endswith(run_id[:8]))
    assert [e.step for e in tensorboard_run(first).Scalars("train/loss")] == [1, 2, 3, 4]
    assert [e.step for e in tensorboard_run(second).Scalars("train/loss")] == [1, 2, 3]


def test_bubble_and_busy_time_come_from_the_actors(ray_session):
    # stage 1 sleeps 50 ms per forward: it is busy, stage 0 mostly waits
    layers = [LayerSpec(nn.Linear, 6, 6), LayerSpec(Sleep, 0.05)]
    with Trainer(layers, nn.functional.mse_loss, TrainConfig(pp=2, microbatches=4)) as t:
        t.step(torch.randn(8, 6), torch.randn(8, 6))
        stages = t.step(torch.randn(8, 6), torch.randn(8, 6))["stages"]
    # 4 forwards of a 50 ms sleep: at least 0.2 s, and under 0.6 s on a machine 3x slower than CI's
    # (only the few ms around each sleep grow); counting one microbatch, or none, falls below 0.2
    assert 0.2 <= stages[1]["forward_s"] < 0.6, stages[1]
    assert stages[1]["bubble"] < 0.3 < 0.7 < stages[0]["bubble"] <= 1.0


def test_ray_metrics_reach_the_nodes_prometheus_endpoint(ray_session, metrics_port):
    """Step counter, step-time histogram, throughput and per-stage busy fraction, tagged by run,
    stage and rank, in the Prometheus text the Ray node serves."""
    import re
    import time
    import urllib.request

    config = TrainConfig(
        pp=2, microbatches=2, name="prom-test", optimizer={"name": "sgd", "lr": 0.05}, cpus_per_actor=0.5
    )
    with Trainer(MLP7, nn.functional.mse_loss, config) as t:
        history = t.fit(batch, 3)

        def series(text, name):
            pattern = rf'^ray_{name}\{{([^}}]*run="prom-test"[^}}]*)\}} (\S+)$'
            return {tags: float(v) for tags, v in re.findall(pattern, text, re.MULTILINE)}

        deadline, text = time.monotonic() + 60, ""
        while time.monotonic() < deadline:
            text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read().decode()
            if list(series(text, "raypipe_steps_total").values()) == [3.0] and series(
                text, "raypipe_stage_busy_fraction"
            ):
                break
            time.sleep(1)
    assert list(series(text, "raypipe_steps_total").values()) == [3.0], text[-2000:]
    assert list(series(text, "raypipe_step_seconds_count").values()) == [3.0]
    # Ray rebuilds a histogram's sum from bucket midpoints, so check the buckets themselves:
    # each cumulative count `le` must equal the number of step times at or below it
    buckets = {
        float(re.search(r'le="([^"]+)"', tags).group(1)): v
        for tags, v in series(text, "raypipe_step_seconds_bucket").items()
    }
    assert len(buckets) >= 5, buckets
    for le, count in buckets.items():
        assert count == sum(m["step_time"] <= le for m in history), (le, count, [m["step_time"] for m in history])
    assert list(series(text, "raypipe_loss").values()) == [pytest.approx(history[-1]["loss"], rel=1e-5)]
    busy = series(text, "raypipe_stage_busy_fraction")
    assert len(busy) == 2 and all(0.0 < v <= 1.0 for v in busy.values())
    assert any('stage="1"' in tags and 'rank="1"' in tags for tags in busy)
    # every series docs/watching.md names, and every one the Grafana dashboard reads, is exported so
    from raypipe.observe import grafana

    documented = set(re.findall(r"`(ray_raypipe_\w+?)`", (ROOT / "docs" / "watching.md").read_text()))
    exported = {n.split("{")[0] for n in text.splitlines() if n.startswith("ray_")}
    float_inputs = {"ray_raypipe_tokens_per_second"}  # MLP7 takes no token ids: set by a language model only
    assert documented and set(grafana.SERIES) - float_inputs <= exported
    for name in documented - float_inputs:
        assert re.search(rf"^{name}(_bucket|_sum|_count)?\{{", text, re.MULTILINE), name


def test_stashed_activations_gpipe_holds_all_1f1b_at_most_p_minus_s(ray_session):
    """Peak microbatches (and bytes autograd saved) each stage keeps for backward, p=4, m=8."""
    layers = [
        LayerSpec(nn.Linear, 6, 32),
        LayerSpec(nn.Tanh),
        LayerSpec(nn.Linear, 32, 32),
        LayerSpec(nn.Tanh),
        LayerSpec(nn.Linear, 32, 32),
        LayerSpec(nn.Tanh),
        LayerSpec(nn.Linear, 32, 3),
    ]
    config = TrainConfig(
        pp=4,
        microbatches=8,
        shard_plan=[[0, 2], [2, 4], [4, 6], [6, 7]],
        optimizer={"name": "sgd", "lr": 0.01},
        cpus_per_actor=0.25,
        measure_activations=True,
    )
    x, y = torch.randn(32, 6), torch.randn(32, 3)
    with Trainer(layers, nn.functional.mse_loss, config) as t:
        peaks = {}
        for schedule in ("gpipe", "1f1b"):
            t.reconfigure(schedule=schedule)
            peaks[schedule] = t.step(x, y)["stages"]
        t.reconfigure(measure_activations=False)  # then each chunk's first microbatch is measured once
        estimated = t.step(x, y)["stages"]
    # microbatches of one shape: counting each at the first one's size is exact
    assert [s["memory"]["activations"] for s in estimated] == [s["peak_stashed_bytes"] for s in peaks["1f1b"]]
    assert all("peak_stashed_bytes" not in s for s in estimated)
    assert [s["peak_stashed_microbatches"] for s in peaks["gpipe"]] == [8, 8, 8, 8]
    assert [s["peak_stashed_microbatches"] for s in peaks["1f1b"]] == [4, 3, 2, 1]
    for s in range(3):  # the same microbatches, so bytes scale with the count
        ratio = peaks["gpipe"][s]["peak_stashed_bytes"] / peaks["1f1b"][s]["peak_stashed_bytes"]
        assert ratio == pytest.approx(8 / (4 - s), rel=0.01)
        assert peaks["1f1b"][s]["peak_stashed_bytes"] >= (4 - s) * 4 * 32 * 4  # at least the tanh outputs


LR_SCHEDULES = {
    # base lr 0.1; expected by hand from the README's definition, not from raypipe.actors.optim.build
    "constant-warmup": ({"name": "constant", "warmup_steps": 4}, [0.025, 0.05, 0.075, 0.1, 0.1, 0.1, 0.1, 0.1]),
    "cosine-warmup": (
        {"name": "cosine", "warmup_steps": 2, "total_steps": 6, "min_lr": 0.02},
        [0.05, 0.1, 0.1, 0.02 + 0.04 * (1 + 0.5**0.5), 0.06, 0.02 + 0.04 * (1 - 0.5**0.5), 0.02, 0.02],
    ),
}


@pytest.mark.parametrize("name", LR_SCHEDULES)
def test_learning_rate_of_every_step_reaches_the_optimizer_and_tensorboard(ray_session, tmp_path, name):
    """Every step's lr (warm-up, decay, and past total_steps) in the metrics, in TensorBoard's reader,
    and in the update itself: plain SGD moves each weight by exactly -lr x its gradient."""
    schedule, expected = LR_SCHEDULES[name]
    config = TrainConfig(
        pp=1, optimizer={"name": "sgd", "lr": 0.1}, lr_schedule=schedule, log_dir=str(tmp_path), cpus_per_actor=0.5
    )
    lrs = []
    with Trainer(MLP7, nn.functional.mse_loss, config) as t:
        info = t.stage_info()[
            0
        ]  # alone on the 2-CPU node: both cores, whatever it reserved, never more than the OS gives
        assert info["cores"] == usable_cores() and info["threads"] == min(2, usable_cores())
        for k in range(len(expected)):
            before = t.state_dict()
            lrs.append(t.step(*batch(k))["lr"])
            grads, after = t.gradients(), t.state_dict()
            for key in grads:
                torch.testing.assert_close(after[key] - before[key], -lrs[-1] * grads[key], rtol=1e-4, atol=1e-7)
    assert lrs == pytest.approx(expected, rel=1e-9)
    events = tensorboard_run(str(tmp_path))
    assert [e.value for e in events.Scalars("train/lr")] == pytest.approx(expected, rel=1e-6)
