"""Data parallelism: parity with one process, bit-identical replicas, batch checks."""

import pytest
import ray
import torch
from torch import nn

from raypipe import BatchError, TrainConfig, Trainer

from helpers import MLP7, assert_close_dicts, batch, check_sgd_parity, reference_run

SEED = 7
SGD = {"name": "sgd", "lr": 0.05, "momentum": 0.9}


def sgd(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


@pytest.fixture(scope="module", params=[(1, 2), (2, 2)], ids=lambda p: f"pp{p[0]}-dp{p[1]}")
def trainer(request, ray_session):
    pp, dp = request.param
    t = Trainer(MLP7, nn.functional.mse_loss, TrainConfig(pp=pp, dp=dp, optimizer=SGD, seed=SEED))
    yield t
    t.shutdown()


@pytest.fixture(scope="module")
def initial(trainer):
    return trainer.state_dict()


def replica_state(trainer, d):
    state = {}
    for part in ray.get(
        [a.state_dict.remote() for stage in trainer.topology.grid(trainer.group.actors)[d] for a in stage]
    ):
        state.update(part)
    return state


def test_actors_are_named_by_their_place(trainer):
    pp, dp = trainer.config.pp, trainer.config.dp
    assert [i["name"] for i in trainer.stage_info()] == [f"stage{s}-dp{d}-tp0" for d in range(dp) for s in range(pp)]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("microbatches, zero", [(1, 0), (4, 0), (4, 1)])  # ZeRO-1: both schedules, m=4
def test_sgd_parity_and_identical_replicas(trainer, initial, schedule, microbatches, zero):
    trainer.reconfigure(zero=zero)
    check_sgd_parity(trainer, initial, reference_run(MLP7, SEED, sgd, steps=3), schedule, microbatches, SGD)
    first = replica_state(trainer, 0)
    for d in range(1, trainer.config.dp):
        other = replica_state(trainer, d)
        assert all(torch.equal(first[k], other[k]) for k in first), "replicas diverged"


def test_adamw_with_clipping_parity_while_zero_switches_on_and_off(trainer, initial):
    """Adam's moments survive re-sharding: ZeRO-1 on for the second step only, same result."""
    adamw = {"name": "adamw", "lr": 1e-2, "weight_decay": 0.1}
    trainer.reconfigure(schedule="1f1b", microbatches=2, optimizer=adamw, grad_clip=0.5, zero=0)
    trainer.reset_optimizer()
    trainer.load_state_dict(initial)
    losses = []
    for k, zero in enumerate([0, 1, 0]):
        trainer.reconfigure(zero=zero)
        losses.append(trainer.step(*batch(k))["loss"])
    trainer.reconfigure(grad_clip=None)
    ref_losses, _, ref_final = reference_run(
        MLP7,
        SEED,
        lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1),
        steps=3,
        grad_clip=0.5,
        microbatches=2 * trainer.config.dp,
    )
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=4e-5)
    assert_close_dicts(trainer.state_dict(), ref_final)


def test_batch_must_split_over_replicas_and_microbatches(trainer):
    trainer.reconfigure(microbatches=4)
    x, y = batch(0, size=12)
    with pytest.raises(BatchError, match=r"dp=2 x microbatches=4 = 8 equal parts.*e\.g\. 8"):
        trainer.step(x, y)


@pytest.mark.parametrize("zero", [0, 1])
def test_optimizer_state_bytes_per_actor(trainer, initial, zero):
    trainer.reconfigure(optimizer={"name": "adamw", "lr": 1e-3}, zero=zero)
    trainer.reset_optimizer()
    trainer.load_state_dict(initial)
    trainer.step(*batch(0))
    info = trainer.stage_info()
    pp, dp = trainer.config.pp, trainer.config.dp
    for s in range(pp):
        actors = [info[d * pp + s] for d in range(dp)]
        params = actors[0]["parameter_bytes"]
        held = [a["optimizer_state_bytes"] for a in actors]
        if trainer.config.zero:
            # the replicas split Adam's two moments (2 x parameter bytes) between them
            assert abs(sum(held) - 2 * params) <= 64, (held, params)
            assert max(held) < 0.8 * 2 * params, held
        else:
            assert all(abs(h - 2 * params) <= 64 for h in held), (held, params)


class _Marker:
    """A pickle that creates a file when loaded: what a stranger would send to run code."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_the_world_has_no_rendezvous_port_and_strangers_on_its_ports_change_nothing(trainer, initial, tmp_path):
    """The world meets through Ray (`transport.ray_store`): an actor listens on Ray's own port and
    gloo's, the latter on its node's address only (torch's TCPStore listened on every interface of
    rank 0, and gloo on whatever the host name resolved to). Strangers
    that connect to each port and send a crafted pickle, random bytes or nothing, and stay
    connected while the world steps and saves a checkpoint, leave training exact and run nothing."""
    import os
    import pickle
    import socket

    import psutil

    info = trainer.stage_info()
    node_ip = ray.util.get_node_ip_address()
    for actor, handle in zip(info, trainer.group.actors):
        assert actor["listening"] and all(a.rsplit(":", 1)[0] == node_ip for a in actor["listening"]), actor
        rays = ray._private.state.actors(handle._actor_id.hex())["Address"]["Port"]  # its core worker's
        listens = {
            f"{c.laddr.ip}:{c.laddr.port}"
            for c in psutil.Process(actor["pid"]).net_connections("tcp")
            if c.status == psutil.CONN_LISTEN and c.laddr.port != rays
        }
        assert listens == set(actor["listening"]), (actor["name"], listens)
    marker = tmp_path / "ran"
    payloads = [pickle.dumps(_Marker(marker)), os.urandom(4096), b""]
    strangers = []
    try:
        for k, address in enumerate(a for actor in info for a in actor["listening"]):
            host, port = address.rsplit(":", 1)
            strangers.append(socket.create_connection((host, int(port)), timeout=10))
            strangers[-1].sendall(payloads[k % 3])
        check_sgd_parity(trainer, initial, reference_run(MLP7, SEED, sgd, steps=3), "1f1b", 4, SGD)
        trainer.reconfigure(zero=1)  # the save gathers each stage's optimizer shards over the world
        before = trainer.state_dict()
        trainer.load(str(trainer.save(str(tmp_path / "ck"))))
        assert_close_dicts(trainer.state_dict(), before, rtol=0, atol=0)
    finally:
        trainer.reconfigure(zero=0)
        for s in strangers:
            s.close()
    assert not marker.exists()
