"""The dp all-reduce when gradients span many buckets and change dtype (a module of its own: the
trainers of test_data_parallel.py hold every CPU of the shared local Ray while they live)."""

import torch
from torch import nn

from raypipe import LayerSpec, TrainConfig, Trainer, build_layers

from helpers import check_sgd_parity, reference_run

SEED = 7
SGD = {"name": "sgd", "lr": 0.05, "momentum": 0.9}


def sgd(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


class Float64Linear(nn.Module):
    """A float64 layer between float32 ones: its gradients make the dp all-reduce change dtype."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.linear = nn.Linear(n, n, dtype=torch.float64)

    def forward(self, x):
        return self.linear(x.double()).float()


def test_gradients_spanning_many_buckets_of_two_dtypes_average_exactly(ray_session):
    """dp_bucket_mb far below the gradients' size: each bucket is flattened, reduced and copied back
    on its own, and a dtype change closes a bucket; the result is still the full batch's gradient."""
    from raypipe.transport.collective import bucket_plan

    layers = [
        LayerSpec(nn.Linear, 6, 16),
        LayerSpec(nn.Tanh),
        LayerSpec(Float64Linear, 16),
        LayerSpec(nn.Linear, 16, 3),
    ]
    bucket_mb = 512 / 2**20
    grads = [p for p in nn.Sequential(*build_layers(layers, SEED)).parameters()]
    plan = bucket_plan(grads, int(bucket_mb * 2**20))
    assert len(plan) >= 4 and len({grads[i].dtype for bucket in plan for i in bucket}) == 2, plan
    config = TrainConfig(
        pp=1, dp=2, microbatches=2, optimizer=SGD, seed=SEED, dp_bucket_mb=bucket_mb, cpus_per_actor=0.5
    )
    with Trainer(layers, nn.functional.mse_loss, config) as t:
        assert [i["threads"] for i in t.stage_info()] == [1, 1]  # two actors share the 2-CPU node
        check_sgd_parity(t, t.state_dict(), reference_run(layers, SEED, sgd, steps=3, microbatches=4), "1f1b", 2, SGD)
