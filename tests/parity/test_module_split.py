"""A user's own nn.Module split at named points (`raypipe.models.module.split`): its forward is
checked to chain submodules, each submodule reaches only its stage's actor with its weights, and
training matches the same module trained in one process. A forward that is not a chain gets an
error naming what it computes in between."""

import copy

import pytest
import torch

from raypipe import ConfigError, TrainConfig, Trainer
from raypipe.models import module

from helpers import ChainModel, assert_close_dicts, chain_loss

SGD = {"name": "sgd", "lr": 0.1, "momentum": 0.9}


def data(k):
    g = torch.Generator().manual_seed(40 + k)
    ids = torch.randint(0, 20, (8, 6), generator=g)
    return ids, torch.randint(0, 20, (8, 6), generator=g)


def test_the_chain_is_found_in_call_order():
    assert module.chain(ChainModel(depth=3)) == ["embed", "blocks.0", "blocks.1", "blocks.2", "norm", "head"]


@pytest.mark.slow
def test_a_module_split_at_named_points_trains_exactly_as_in_one_process(ray_session):
    torch.manual_seed(0)
    model = ChainModel()
    reference = copy.deepcopy(model)
    opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    split = module.split(model, split_points=["blocks.2", "norm"], loss_fn=chain_loss)
    assert split.shard_plan == [[0, 3], [3, 6], [6, 8]]
    with Trainer(
        split, config=TrainConfig(pp=3, microbatches=2, optimizer=SGD, cpus_per_actor=0.25, threads_per_actor=1)
    ) as t:
        assert [info["layers"] for info in t.stage_info()] == [(0, 3), (3, 6), (6, 8)]
        for k in range(3):
            x, y = data(k)
            opt.zero_grad()
            expected = 0.0
            for xc, yc in zip(x.chunk(2), y.chunk(2)):
                loss = chain_loss(reference(xc), yc)
                (loss / 2).backward()
                expected += loss.item() / 2
            opt.step()
            assert abs(t.step(x, y)["loss"] - expected) < 1e-5
        assert_close_dicts(split.to_module_keys(t.state_dict()), reference.state_dict())


class NotAChain(ChainModel):
    def forward(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            x = x + block(x)  # a residual the split would lose
        return self.head(self.norm(x))


class TwoInputs(ChainModel):
    def forward(self, ids, mask):
        return self.head(self.norm(self.embed(ids) * mask))


def test_a_forward_that_is_not_a_chain_is_refused_with_what_to_do():
    with pytest.raises(
        ConfigError, match=r"computes call_function <built-in function add> after 'blocks.0'.*LayerSpecs"
    ):
        module.split(NotAChain(), ["blocks.2"])
    with pytest.raises(ConfigError, match="more than one input"):
        module.split(TwoInputs(), ["norm"])
    with pytest.raises(ConfigError, match=r"split point 'blocks.9' is not one of ChainModel's chained submodules"):
        module.split(ChainModel(), ["blocks.9"])


def test_split_points_must_match_pp(ray_session):
    split = module.split(ChainModel(), ["norm"], loss_fn=chain_loss)
    with pytest.raises(ConfigError, match=r"split into 2 stages \(its split points\) but TrainConfig.pp=3"):
        Trainer(split, config=TrainConfig(pp=3))
