"""Boundaries that are pytrees: a stage hands the next a dict with hidden states, a bool mask,
integer positions, a (loss, None) tuple, and gains each made from a stage's weights alone (whose
gradients torch's split backward drops: the engines' split must not). Exact parity with the same
layers in one process on every engine and both transports, and microbatches of different
shapes within one step (unpadded sequences) on every engine."""

import pytest
import torch
from torch import nn

from raypipe import TrainConfig, Trainer, build_layers

from helpers import DICT_MODEL, assert_close_dicts, check_sgd_parity, dict_batch, dict_loss, reference_run

SEED = 5
SGD = {"name": "sgd", "lr": 0.05, "momentum": 0.9}


def sgd(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


# engine, pp, schedule, same-node transport
CASES = [
    ("p2p", 2, "1f1b", "shm"),
    ("p2p", 3, "gpipe", "gloo"),
    ("refs", 3, "1f1b", "shm"),
    ("compiled", 2, "gpipe", "shm"),
    ("p2p", 1, "1f1b", "shm"),
    # split backwards and model chunks: the aux loss and the integer leaves through I, W and a V
    ("p2p", 2, "zb-v", "shm"),
    ("compiled", 3, "zb-h1", "shm"),
    ("p2p", 2, "interleaved-1f1b", "shm"),
]


@pytest.mark.slow
@pytest.mark.parametrize("engine, pp, schedule, transport", CASES, ids=["-".join(map(str, c)) for c in CASES])
def test_a_dict_boundary_trains_exactly_as_one_process(ray_session, engine, pp, schedule, transport):
    reference = reference_run(
        DICT_MODEL, SEED, sgd, steps=3, microbatches=2, loss_fn=dict_loss, data=dict_batch, reverse=schedule == "gpipe"
    )
    config = TrainConfig(
        pp=pp,
        engine=engine,
        schedule=schedule,
        microbatches=2,
        optimizer=SGD,
        seed=SEED,
        cpus_per_actor=0.25,
        threads_per_actor=1,
        same_node_transport=transport,
    )
    with Trainer(DICT_MODEL, dict_loss, config) as t:
        check_sgd_parity(t, t.state_dict(), reference, schedule, 2, SGD, data=dict_batch)


def varying_step(k: int):
    """Four microbatches of different sequence lengths, given as lists."""
    g = torch.Generator().manual_seed(300 + k)
    xs = [torch.randint(0, 11, (2, n), generator=g) for n in (3, 7, 5, 4)]
    return xs, [torch.randn(2, 2, generator=g) for _ in xs]


def varying_reference(steps: int):
    model = nn.Sequential(*build_layers(DICT_MODEL, SEED))
    opt = sgd(model.parameters())
    losses, grads = [], None
    for k in range(steps):
        opt.zero_grad()
        xs, ys = varying_step(k)
        total = 0.0
        for x, y in zip(xs, ys):
            loss = dict_loss(model(x), y)
            (loss / len(xs)).backward()
            total += loss.item()
        losses.append(total / len(xs))
        grads = grads or {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
    return losses, grads, model.state_dict()


@pytest.mark.slow
@pytest.mark.parametrize("engine, schedule", [("p2p", "1f1b"), ("refs", "1f1b"), ("compiled", "1f1b"), ("p2p", "zb-v")])
def test_microbatches_of_different_shapes_train_exactly(ray_session, engine, schedule):
    ref_losses, ref_grads, ref_final = varying_reference(3)
    config = TrainConfig(
        pp=2,
        microbatches=4,
        engine=engine,
        schedule=schedule,
        optimizer=SGD,
        seed=SEED,
        cpus_per_actor=0.25,
        threads_per_actor=1,
    )
    with Trainer(DICT_MODEL, dict_loss, config) as t:
        losses = []
        for k in range(3):
            losses.append(t.step(*varying_step(k))["loss"])
            if k == 0:
                assert_close_dicts(t.gradients(), ref_grads)
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=4e-5)
        assert_close_dicts(t.state_dict(), ref_final)
