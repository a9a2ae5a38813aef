"""Per-stage timing and TensorBoard event files, read back with TensorBoard's own reader."""

import pytest
import torch
from torch import nn

from helpers import MLP7, Sleep, batch
from raypipe import LayerSpec, TrainConfig, Trainer


def test_tensorboard_scalars_match_the_step_metrics(ray_session, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    config = TrainConfig(pp=2, microbatches=4, log_dir=str(tmp_path), optimizer={"name": "sgd", "lr": 0.05})
    with Trainer(MLP7, nn.functional.mse_loss, config) as t:
        history = t.fit(batch, 4)
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    expected = {"train/loss", "train/lr", "train/grad_norm", "train/samples_per_s", "train/step_time"}
    expected |= {f"stage{s}/{k}" for s in range(2) for k in ("forward_s", "backward_s", "bubble_fraction", "peak_memory_bytes")}
    assert expected <= tags, expected - tags
    losses = events.Scalars("train/loss")
    assert [e.step for e in losses] == [1, 2, 3, 4]
    assert [e.value for e in losses] == pytest.approx([m["loss"] for m in history], rel=1e-6)
    assert [e.value for e in events.Scalars("train/lr")] == pytest.approx([0.05] * 4)
    memory = events.Scalars("stage1/peak_memory_bytes")
    assert all(e.value > 50e6 for e in memory)  # an actor process with torch loaded


def test_bubble_and_busy_time_come_from_the_actors(ray_session):
    # stage 1 sleeps 50 ms per forward: it is busy, stage 0 mostly waits
    layers = [LayerSpec(nn.Linear, 6, 6), LayerSpec(Sleep, 0.05)]
    with Trainer(layers, nn.functional.mse_loss, TrainConfig(pp=2, microbatches=4)) as t:
        t.step(torch.randn(8, 6), torch.randn(8, 6))
        stages = t.step(torch.randn(8, 6), torch.randn(8, 6))["stages"]
    assert stages[1]["forward_s"] == pytest.approx(0.2, abs=0.05)
    assert stages[1]["bubble"] < 0.3 < 0.7 < stages[0]["bubble"] <= 1.0
