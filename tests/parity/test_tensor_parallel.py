"""Tensor parallelism (with pipeline and data parallelism): exact parity with one process,
shards that really hold a share of the weights, and state_dict / checkpoints that do not
depend on tp."""

import pytest
import ray
import torch
from torch import nn

from raypipe import ConfigError, LayerSpec, TrainConfig, Trainer
from raypipe.checkpoint import layout as ckpt
from raypipe.models import gpt

from helpers import check_sgd_parity, lm_tokens, reference_run

SEED = 3
SGD = {"name": "sgd", "lr": 0.1, "momentum": 0.9}
GPT = gpt.GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16)
LAYERS = gpt.layers(GPT)


def tokens(k: int, size: int = 8):
    return lm_tokens(GPT, k, size, seed=500)


def sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


@pytest.fixture(scope="module")
def reference():
    """Losses, first-step gradients and weights after 3 steps of the dense GPT in one process."""
    return {
        m: reference_run(LAYERS, SEED, sgd, steps=3, microbatches=m, loss_fn=gpt.loss_fn, data=tokens) for m in (2, 4)
    }


TOPOLOGIES = [(1, 1, 2), (2, 1, 2), (1, 2, 2), (2, 2, 2)]  # pp x dp x tp; zero 0 and 1 by reconfigure


@pytest.fixture(scope="module", params=TOPOLOGIES, ids=lambda p: f"pp{p[0]}-dp{p[1]}-tp{p[2]}")
def trainer(request, ray_session):
    pp, dp, tp = request.param
    t = Trainer(
        LAYERS,
        gpt.loss_fn,
        TrainConfig(
            pp=pp, dp=dp, tp=tp, zero=int(dp > 1), optimizer=SGD, seed=SEED, cpus_per_actor=0.2, threads_per_actor=1
        ),
    )
    yield t
    t.shutdown()


@pytest.fixture(scope="module")
def initial(trainer):
    return trainer.state_dict()


def test_state_dict_is_the_dense_models(trainer, initial):
    """Merged shards give exactly the one-process model's initial weights, under its keys."""
    dense = torch.nn.Sequential(*gpt_dense()).state_dict()
    assert set(initial) == set(dense)
    assert all(torch.equal(initial[k], dense[k]) for k in dense)


def gpt_dense():
    from raypipe import build_layers

    return build_layers(LAYERS, SEED)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_sgd_parity_and_identical_replicas(trainer, initial, reference, schedule):
    m = 2
    ref = reference[m * trainer.config.dp]  # dp replicas x m microbatches = the reference's chunks
    # split tensors count each shard once in the gradient norm, replicated ones once (not per tp rank)
    # ZeRO-1 under 1F1B only: what it changes (the optimizer step) does not depend on the schedule
    for zero in (0, 1) if trainer.config.dp > 1 and schedule == "1f1b" else (0,):
        trainer.reconfigure(zero=zero)
        check_sgd_parity(trainer, initial, ref, schedule, m, SGD, data=tokens)
        shards = ray.get([a.state_dict.remote() for a in trainer.group.actors])
        per_replica = len(shards) // trainer.config.dp
        for rank in range(per_replica, len(shards)):  # every replica's shard equals replica 0's, bit for bit
            twin = shards[rank % per_replica]
            assert all(torch.equal(shards[rank][k], twin[k]) for k in twin), f"{trainer.names[rank]} diverged"


def test_actors_are_named_by_place_and_hold_half_of_each_split_layer(trainer):
    pp, dp, tp = trainer.config.pp, trainer.config.dp, trainer.config.tp
    info = trainer.stage_info()
    assert [i["name"] for i in info] == [
        f"stage{s}-dp{d}-tp{t}" for d in range(dp) for s in range(pp) for t in range(tp)
    ]
    dense = gpt_dense()
    for i in info:
        start, end = i["layers"]
        split = replicated = 0
        for layer in dense[start:end]:
            for name, p in layer.named_parameters():
                if name in SPLIT or name.endswith(SPLIT_SUFFIXES):
                    split += p.numel()
                else:
                    replicated += p.numel()
        assert split > replicated  # the split tensors are most of the model
        assert i["parameters"] == split // tp + replicated, i


SPLIT = {"wte.weight", "lm_head.weight"}
SPLIT_SUFFIXES = ("c_attn.weight", "c_attn.bias", "c_fc.weight", "c_fc.bias", "c_proj.weight")


def test_evaluate_and_predict_match_the_dense_model(trainer, initial):
    trainer.load_state_dict(initial)
    x, y = tokens(9)
    model = torch.nn.Sequential(*gpt_dense()).eval()
    with torch.no_grad():
        expected = model(x)
    torch.testing.assert_close(trainer.predict(x), expected, rtol=1e-5, atol=1e-5)
    assert trainer.evaluate(x, y) == pytest.approx(float(gpt.loss_fn(expected, y)), rel=1e-5)


def test_checkpoint_holds_whole_tensors_and_restores_under_another_tp(trainer, initial, tmp_path, ray_session):
    """Adam state saved at tp=2 restores into tp=1 (and back): both continue identically."""
    adam = {"name": "adamw", "lr": 1e-2}
    trainer.reconfigure(optimizer=adam, microbatches=2)
    trainer.reset_optimizer()
    trainer.load_state_dict(initial)
    for k in range(2):
        trainer.step(*tokens(k))
    where = trainer.save(str(tmp_path))
    block = ckpt.load_tensors(where / ckpt.layer_file("model", 1))
    assert block["attn.c_attn.weight"].shape == (3 * GPT.n_embd, GPT.n_embd)
    moments = ckpt.load_tensors(where / ckpt.layer_file("optim", 1))["attn.c_attn.weight"]
    assert moments["exp_avg"].shape == (3 * GPT.n_embd, GPT.n_embd)
    expected = trainer.step(*tokens(2))["loss"]
    trainer.load(str(where))  # whole tensors re-sharded into this topology, Adam state included
    assert trainer.step(*tokens(2))["loss"] == pytest.approx(expected, rel=1e-6, abs=1e-7)
    cfg = TrainConfig(pp=1, optimizer=adam, microbatches=2 * trainer.config.dp, seed=SEED, cpus_per_actor=0.01)
    with Trainer(LAYERS, gpt.loss_fn, cfg) as dense:
        dense.load(str(where))
        assert dense.step(*tokens(2))["loss"] == pytest.approx(expected, rel=1e-5, abs=1e-6)


def test_tp_that_does_not_divide_the_heads_fails_before_any_actor_starts(ray_session):
    with pytest.raises(ConfigError, match=r"n_head=2 does not divide by TrainConfig.tp=4"):
        Trainer(LAYERS, gpt.loss_fn, TrainConfig(tp=4))


def test_tp_on_a_stage_whose_layers_have_no_plan_is_refused_before_any_actor_starts():
    plain = [LayerSpec(nn.Linear, 8, 8), LayerSpec(nn.ReLU), LayerSpec(nn.Linear, 8, 2)]
    with pytest.raises(
        ConfigError,
        match=r"tp=3, but no layer of stage 0 \(layers \[0, 3\)\) declares a tp_plan.*"
        r"ColumnParallel.*or set tp=1",
    ):
        Trainer(plain, nn.functional.mse_loss, TrainConfig(tp=3))
    # the GPT's layers have plans; a trailing stage of plain layers alone does not
    with pytest.raises(ConfigError, match=r"no layer of stage 1 \(layers \[4, 5\)\)"):
        Trainer(LAYERS + [LayerSpec(nn.Identity)], gpt.loss_fn, TrainConfig(pp=2, tp=2, shard_plan=[[0, 4], [4, 5]]))


def test_each_group_takes_the_backend_of_its_members_tensors():
    from raypipe.core.protocol import ActorInfo
    from raypipe.driver.links.ways import group_backend

    def infos(*devices):  # each on a GPU of its own where on cuda
        return [
            ActorInfo(name=f"a{i}", device=d, node_id="n", gpu=f"GPU-{i}" if d.startswith("cuda") else None)
            for i, d in enumerate(devices)
        ]

    assert group_backend(infos("cpu", "cpu"), [0, 1]) == "gloo"
    assert group_backend(infos("cuda:0", "cuda:0"), [0, 1]) == "nccl"  # ROCm's torch uses the cuda device type too
    assert group_backend(infos("cuda:0", "mps"), [0, 1]) == "gloo"
    assert group_backend(infos("mps", "mps"), [0, 1]) == "gloo"
