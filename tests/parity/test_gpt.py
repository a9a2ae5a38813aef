"""The reference GPT: one-process equivalence of its layers, and it trains through the pipeline."""

import pytest
import torch
from torch import nn

from raypipe import ConfigError, TrainConfig, Trainer, build_layers
from raypipe.data import TokenDataset
from raypipe.models import gpt

TINY = gpt.GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=32)


def test_layers_split_at_block_boundaries_and_count_parameters():
    specs = gpt.layers(TINY)
    assert [s.factory for s in specs] == [gpt.Embedding, gpt.Block, gpt.Block, gpt.Head]
    model = nn.Sequential(*build_layers(specs))
    assert sum(p.numel() for p in model.parameters()) == TINY.parameters
    logits = model(torch.randint(0, 256, (2, 32)))
    assert logits.shape == (2, 32, 256)
    assert gpt.loss_fn(logits, torch.randint(0, 256, (2, 32))).item() == pytest.approx(5.55, abs=0.1)


def test_config_errors_name_the_model_field():
    with pytest.raises(ConfigError, match=r"model.n_embd=30 .* model.n_head=4"):
        gpt.GPTConfig(n_embd=30, n_head=4)
    with pytest.raises(ConfigError, match="model.n_layer"):
        gpt.GPTConfig(n_layer=0)


def test_gpt_learns_through_a_two_stage_pipeline(ray_session, corpus):
    data = TokenDataset.from_bin(corpus, TINY.block_size)
    config = TrainConfig(pp=2, microbatches=2, optimizer={"name": "adamw", "lr": 1e-2}, grad_clip=1.0)
    with Trainer(gpt.layers(TINY), gpt.loss_fn, config) as trainer:
        x, y = data.batch(10_000, 8)
        before = trainer.evaluate(x, y)
        losses = [trainer.step(*data.batch(k, 8))["loss"] for k in range(30)]
        after = trainer.evaluate(x, y)
        metrics = trainer.step(*data.batch(30, 8))
    assert losses[0] == pytest.approx(5.55, abs=0.15)  # ln(256): uniform over bytes
    assert sum(losses[-5:]) / 5 < losses[0] - 1.5
    assert after < before - 1.5
    assert metrics["tokens"] == 8 * 32 and metrics["tokens_per_s"] > 0
