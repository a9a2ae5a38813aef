"""Training features beyond the parity grid: precision, layer forms, partitions."""

import pytest
import torch
from torch import nn

from raypipe import LayerSpec, TrainConfig, Trainer

from helpers import assert_close_dicts, reference_run

SGD = {"name": "sgd", "lr": 0.05, "momentum": 0.9}


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_reduced_precision_tracks_fp32(ray_session, precision):
    from raypipe.data import TokenDataset
    from raypipe.models import gpt

    cfg = gpt.GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16)
    data = TokenDataset(torch.randint(0, 256, (4096,), generator=torch.Generator().manual_seed(0)).numpy(), 16)
    results = {}
    for p in ("fp32", precision):
        config = TrainConfig(pp=2, microbatches=2, precision=p, optimizer={"name": "adamw", "lr": 3e-3}, seed=1)
        with Trainer(gpt.layers(cfg), gpt.loss_fn, config) as t:
            results[p] = [t.step(*data.batch(k, 8)) for k in range(6)]
    fp32 = [m["loss"] for m in results["fp32"]]
    low = [m["loss"] for m in results[precision]]
    torch.testing.assert_close(torch.tensor(low), torch.tensor(fp32), rtol=3e-2, atol=0)
    if precision == "fp16":
        assert results["fp16"][-1]["loss_scale"] == 2.0**16 and not results["fp16"][-1]["skipped"]


def test_layers_as_zero_argument_callables_and_explicit_plans(ray_session):
    layers = [lambda: nn.Linear(4, 8), nn.ReLU, lambda: nn.Linear(8, 2)]
    config = TrainConfig(pp=2, shard_plan=[[0, 1], [1, 3]], optimizer=SGD, microbatches=2)
    with Trainer(layers, nn.functional.mse_loss, config) as t:
        info = t.stage_info()
        assert [i["layers"] for i in info] == [(0, 1), (1, 3)]
        assert [i["parameters"] for i in info] == [40, 18]
        assert len({i["pid"] for i in info}) == 2  # one process per stage
        x, y = torch.randn(4, 4), torch.randn(4, 2)
        losses = [t.step(x, y)["loss"] for _ in range(5)]
        assert losses[-1] < losses[0]


def test_parameter_partition_places_big_layers_alone(ray_session):
    layers = [
        LayerSpec(nn.Linear, 64, 64),
        LayerSpec(nn.Linear, 64, 2),
        LayerSpec(nn.Linear, 2, 2),
        LayerSpec(nn.Linear, 2, 2),
    ]
    with Trainer(layers, nn.functional.mse_loss, TrainConfig(pp=2, partition="parameters")) as t:
        assert t.plan == [(0, 1), (1, 4)]


def test_a_stage_without_parameters_trains_in_step(ray_session):
    layers = [LayerSpec(nn.Linear, 3, 5), LayerSpec(nn.Tanh), LayerSpec(nn.Linear, 5, 2)]
    config = TrainConfig(pp=3, microbatches=2, optimizer=SGD, seed=4)

    def data(k):
        g = torch.Generator().manual_seed(k)
        return torch.randn(6, 3, generator=g), torch.randn(6, 2, generator=g)

    with Trainer(layers, nn.functional.mse_loss, config) as t:
        assert [i["parameters"] for i in t.stage_info()] == [20, 0, 12]
        losses = [t.step(*data(k))["loss"] for k in range(3)]
        ref_losses, _, ref_final = reference_run(
            layers, 4, lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9), steps=3, data=data
        )
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses))
        assert_close_dicts(t.state_dict(), ref_final)


def test_the_parity_example_passes(ray_session, monkeypatch, capsys):
    """examples/parity_check.py, in this process (its own model, pp=3, both schedules). Not in
    test_parity: that module keeps a trainer holding the CPUs the example's actors ask for."""
    import runpy
    import sys
    from pathlib import Path

    monkeypatch.setattr(sys, "argv", ["parity_check.py"])
    script = runpy.run_path(str(Path(__file__).resolve().parents[2] / "examples" / "parity_check.py"))
    assert script["main"]() == 0
    out = capsys.readouterr().out
    assert out.count("max |weight difference|") == 2 and "parity holds" in out
