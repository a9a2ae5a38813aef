"""bf16 and fp16 exactly as one process with `torch.autocast` (and, for fp16, torch's own
GradScaler) computes them, and fp16's dynamic loss scaling: an overflowing step skipped on
every stage, the scale halved, training going on.

The pipeline's losses and gradients equal the one-process autocast run's bit for bit, and
its weights differ by a few fp32 ulps (gradients summed in another order), so the tolerance
is 1e-7 absolute. It separates autocast on from off: the fp32 reference lies 1e-5 to 3e-4
away (fp16 rounds 8x finer than bf16, so its distance is the smaller); the test prints both."""

import math

import pytest
import torch
from torch import nn

from raypipe import LayerSpec, TrainConfig, Trainer
from raypipe.actors.optim.build import LossScaler

from helpers import reference_run

SEED = 5
SGD = {"name": "sgd", "lr": 0.1, "momentum": 0.9}
LAYERS = [
    LayerSpec(nn.Linear, 8, 32),
    LayerSpec(nn.Tanh),
    LayerSpec(nn.Linear, 32, 32),
    LayerSpec(nn.GELU),
    LayerSpec(nn.Linear, 32, 4),
]
TARGET = torch.randn(8, 4, generator=torch.Generator().manual_seed(7))


def data(k: int):
    """A learnable map (not noise), so the loss and weights really move in 3 steps."""
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(300 + k))
    return x, torch.sin(x @ TARGET)


def sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


TOLERANCE = 1e-7  # absolute; autocast off lies 30x or more beyond it


def distance(actual: dict, expected: dict) -> float:
    """The largest absolute difference of any element."""
    return max(
        float((torch.as_tensor(actual[key]).double() - torch.as_tensor(e).double()).abs().max())
        for key, e in expected.items()
    )


def as_dicts(losses, grads, weights):
    return {"losses": {"loss": torch.tensor(losses)}, "grads": grads, "weights": weights}


@pytest.fixture(scope="module")
def trainer(ray_session):
    config = TrainConfig(pp=2, microbatches=2, optimizer=SGD, seed=SEED, cpus_per_actor=0.5, threads_per_actor=1)
    with Trainer(LAYERS, nn.functional.mse_loss, config) as t:
        yield t


@pytest.fixture(scope="module")
def initial(trainer):
    return trainer.state_dict()


def run_three_steps(trainer, initial, precision):
    trainer.reconfigure(precision=precision)
    trainer.reset_optimizer()  # also a fresh loss scaler
    trainer.load_state_dict(initial)
    losses, grads = [], None
    for k in range(3):
        metrics = trainer.step(*data(k))
        losses.append(metrics["loss"])
        grads = grads or trainer.gradients()
    return as_dicts(losses, grads, trainer.state_dict()), metrics


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_autocast_matches_one_process_autocast_and_not_fp32(trainer, initial, precision):
    ours, last = run_three_steps(trainer, initial, precision)
    on = as_dicts(*reference_run(LAYERS, SEED, sgd, 3, microbatches=2, data=data, precision=precision))
    off = as_dicts(*reference_run(LAYERS, SEED, sgd, 3, microbatches=2, data=data, precision="fp32"))
    distance_on = {part: distance(ours[part], on[part]) for part in ours}
    distance_off = {part: distance(ours[part], off[part]) for part in ours}
    print(f"{precision}: distance to autocast reference {distance_on}, to fp32 reference {distance_off}")
    assert all(d <= TOLERANCE for d in distance_on.values()), distance_on
    assert all(d >= 30 * TOLERANCE for d in distance_off.values()), distance_off  # it tells on from off
    if precision == "fp16":
        assert last["loss_scale"] == 2.0**16 and not last["skipped"]


def test_loss_scaler_halves_on_overflow_and_grows_after_its_interval():
    scaler = LossScaler(scale=1024.0, growth_interval=3)
    scaler.update(found_inf=False)
    scaler.update(found_inf=False)
    assert (scaler.scale, scaler.good_steps) == (1024.0, 2)
    scaler.update(found_inf=True)  # an overflow also restarts the count of good steps
    assert (scaler.scale, scaler.good_steps) == (512.0, 0)
    for _ in range(3):
        scaler.update(found_inf=False)
    assert (scaler.scale, scaler.good_steps) == (1024.0, 0)
    assert LossScaler().scale == 2.0**16 and LossScaler().growth_interval == 2000  # GradScaler's defaults


class Amplify(nn.Module):
    """Identity forward; backward multiplies the gradient by `factor` in fp16, the way a layer with
    large weights does under autocast: the scaled gradient overflows while the loss stays finite."""

    def __init__(self, factor: float) -> None:
        super().__init__()
        self.factor = factor

    def forward(self, x):
        return _Amplify.apply(x, self.factor)


class _Amplify(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, factor):
        ctx.factor = factor
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return (grad.half() * ctx.factor).to(grad.dtype), None


def test_overflowing_steps_are_skipped_on_every_stage_and_the_scale_halves(ray_session):
    """fp16 from the default scale 2^16: gradients times 2^16 times 2^6 overflow fp16 until the
    scale has fallen far enough; each such step leaves every stage's weights bit-identical and halves
    the scale, then training goes on, as torch's GradScaler does it."""
    layers = [LayerSpec(nn.Linear, 8, 32), LayerSpec(Amplify, 64.0), LayerSpec(nn.Tanh), LayerSpec(nn.Linear, 32, 4)]
    config = TrainConfig(
        pp=3,
        microbatches=2,
        precision="fp16",
        optimizer=SGD,
        seed=SEED,
        cpus_per_actor=0.3,
        shard_plan=[[0, 1], [1, 2], [2, 4]],
        threads_per_actor=1,
    )
    ref_losses, _, ref_final = reference_run(layers, SEED, sgd, 12, microbatches=2, data=data, precision="fp16")
    with Trainer(layers, nn.functional.mse_loss, config) as t:
        before = t.state_dict()
        history, losses = [], []
        for k in range(12):
            metrics = t.step(*data(k))
            losses.append(metrics["loss"])
            history.append((metrics["skipped"], metrics["loss_scale"], math.isfinite(metrics["loss"])))
            after = t.state_dict()
            same = all(torch.equal(before[key], after[key]) for key in before)
            assert same == metrics["skipped"], (k, metrics)  # skipped: bit-identical; else trained
            before = after
        final = t.state_dict()
    skipped = [s for s, _, _ in history]
    assert all(finite for _, _, finite in history)
    first_good = skipped.index(False)
    assert first_good >= 2 and not any(skipped[first_good:]), history  # skipped while overflowing, then trains
    assert [scale for _, scale, _ in history[:first_good]] == [2.0 ** (15 - k) for k in range(first_good)]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=4e-5)
    for key in ref_final:
        torch.testing.assert_close(final[key], ref_final[key], rtol=1e-5, atol=4e-5)
