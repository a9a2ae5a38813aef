"""Data, tensor and ZeRO-1 parallelism under the engines the parity grid does not run them on:
"refs" (one call per action, its own path for reduce and norm) and "compiled" (the p2p step
through a Ray Compiled Graph). The p2p engine runs them in test_data_parallel.py and
test_tensor_parallel.py."""

import pytest
import torch
from torch import nn

from raypipe import TrainConfig, Trainer
from raypipe.models import gpt

from helpers import MLP7, batch, check_sgd_parity, lm_tokens, reference_run

SEED = 11
SGD = {"name": "sgd", "lr": 0.05, "momentum": 0.9}
GPT = gpt.GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16)


def sgd(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def tokens(k: int, size: int = 8):
    return lm_tokens(GPT, k, size, seed=900)


# engine, pp, dp, tp: dp cases on the MLP (ZeRO 0 and 1), tp cases on the GPT (its layers have plans)
CASES = [("refs", 2, 2, 1), ("compiled", 2, 2, 1), ("refs", 2, 1, 2), ("compiled", 2, 1, 2)]


@pytest.mark.slow
@pytest.mark.parametrize("engine, pp, dp, tp", CASES, ids=[f"{e}-pp{p}-dp{d}-tp{t}" for e, p, d, t in CASES])
def test_parity_under_every_engine(ray_session, engine, pp, dp, tp):
    layers, loss_fn, data = (MLP7, nn.functional.mse_loss, batch) if tp == 1 else (gpt.layers(GPT), gpt.loss_fn, tokens)
    config = TrainConfig(
        pp=pp, dp=dp, tp=tp, engine=engine, optimizer=SGD, seed=SEED, cpus_per_actor=0.25, threads_per_actor=1
    )
    reference = reference_run(layers, SEED, sgd, steps=3, microbatches=2 * dp, loss_fn=loss_fn, data=data)
    with Trainer(layers, loss_fn, config) as t:
        initial = t.state_dict()
        for zero in (0, 1) if dp > 1 else (0,):
            t.reconfigure(zero=zero)
            check_sgd_parity(t, initial, reference, "1f1b", 2, SGD, data=data)
