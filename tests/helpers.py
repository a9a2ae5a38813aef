"""Layers and references shared by tests. This module is not installed, so the
trainer must ship it to the actors by value: using it tests that too. What the benchmarks use as
well lives in support/ (the toy model and its one-process reference, saves that break, the
namespace cluster), which this module puts on the path of whatever process imports it."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))

from raypipe import LayerSpec  # noqa: E402

from toy_models import AUTOCAST, MLP7, batch, reference_run  # noqa: E402, F401 - the tests import them from here


def lm_tokens(config, k: int, size: int, seed: int):
    """Batch k of random token sequences for a GPT `config`: inputs and next-token targets."""
    g = torch.Generator().manual_seed(seed + k)
    seq = torch.randint(0, config.vocab_size, (size, config.block_size + 1), generator=g)
    return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()


def tensorboard_run(log_dir):
    """TensorBoard's own reader on the events of one run: `log_dir` itself when it holds event
    files, else the one run folder a trainer made in it (`observe.loggers.run_folder`)."""
    from pathlib import Path

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log_dir = Path(log_dir)
    if not list(log_dir.glob("events.out.tfevents.*")):
        (log_dir,) = [p for p in log_dir.iterdir() if p.is_dir()]
    events = EventAccumulator(str(log_dir))
    events.Reload()
    return events


def check_sgd_parity(trainer, initial, reference, schedule, microbatches, optimizer, data=batch, actors=False):
    """Restarts `trainer` from `initial` and checks 3 steps of `data(k)` against `reference_run`'s
    output: every step's loss, the first step's gradients and global gradient norm, the final weights.
    `actors`: the 3 steps are one run the actors drive (`actor_steps`): its losses and final weights."""
    ref_losses, ref_grads, ref_final = reference
    trainer.reconfigure(schedule=schedule, microbatches=microbatches, optimizer=optimizer)
    trainer.reset_optimizer()
    trainer.load_state_dict(initial)
    losses = []
    if actors:
        trainer.step_count = 0
        trainer.reconfigure(actor_steps=3)
        try:
            losses = [m["loss"] for m in trainer.fit(data, 3)]
        finally:
            trainer.reconfigure(actor_steps=0)
    for k in range(0 if actors else 3):
        metrics = trainer.step(*data(k))
        losses.append(metrics["loss"])
        if k == 0:
            assert_close_dicts(trainer.gradients(), ref_grads)
            norm = float(torch.sqrt(sum(g.pow(2).sum() for g in ref_grads.values())))
            assert abs(metrics["grad_norm"] - norm) <= 1e-5 * norm, (metrics["grad_norm"], norm)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=4e-5)
    assert_close_dicts(trainer.state_dict(), ref_final)


def assert_close_dicts(actual, expected, rtol=1e-5, atol=4e-5):
    assert set(actual) == set(expected), (sorted(actual), sorted(expected))
    for key in expected:
        torch.testing.assert_close(actual[key], expected[key], rtol=rtol, atol=atol, msg=lambda m: f"{key}: {m}")


class Exploding(nn.Module):
    """A layer whose constructor fails, as a user's buggy layer would."""

    def __init__(self) -> None:
        super().__init__()
        raise ValueError("this layer cannot be built")


class Sleep(nn.Module):
    """Identity that sleeps in forward: a stuck or very slow stage."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.seconds)
        return x


class KillOnce(nn.Module):
    """Identity that SIGKILLs its own process the first time `flag` exists (then removes it).

    A flag that says "pause" instead makes it create `flag + ".paused"` and sleep 30 s,
    so a test can kill the actor from outside while it is surely inside a step.
    """

    def __init__(self, flag: str) -> None:
        super().__init__()
        self.flag = flag

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import os
        import signal

        if os.path.exists(self.flag):
            try:
                with open(self.flag) as f:
                    pause = f.read().strip() == "pause"
                os.remove(self.flag)
            except FileNotFoundError:  # another replica's copy of this layer took it first
                return x
            if pause:
                open(self.flag + ".paused", "w").close()
                time.sleep(30)
            else:
                os.kill(os.getpid(), signal.SIGKILL)
        return x


class DictEmbed(nn.Module):
    """Token ids -> a dict boundary: hidden states, a bool mask, integer positions, an auxiliary
    loss that needs a gradient, and a None leaf: every kind of leaf a stage may hand on."""

    def __init__(self, vocab: int, dim: int) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)

    def forward(self, ids: torch.Tensor) -> dict:
        h = self.emb(ids)
        positions = torch.arange(ids.shape[1]).expand_as(ids)
        return {"h": h, "mask": ids % 3 != 0, "pos": positions, "aux": (h.pow(2).mean() * 0.01, None)}


class DictBlock(nn.Module):
    """A residual block over the dict: masked update, position embedding, aux loss accumulated,
    and a gain made from its weights alone (a leaf whose path never meets the stage's inputs,
    which torch's split backward would leave without a gradient)."""

    def __init__(self, dim: int, positions: int) -> None:
        super().__init__()
        self.lin = nn.Linear(dim, dim)
        self.pos = nn.Embedding(positions, dim)
        self.gain = nn.Parameter(torch.linspace(0.5, 1.5, dim))

    def forward(self, x: dict) -> dict:
        h = x["h"] + torch.tanh(self.lin(x["h"])) * x["mask"].unsqueeze(-1) + self.pos(x["pos"])
        aux, nothing = x["aux"]
        gains = (*x.get("gains", ()), torch.tanh(self.gain))
        return {**x, "h": h, "aux": (aux + 0.01 * h.abs().mean(), nothing), "gains": gains}


class DictHead(nn.Module):
    """The dict -> (outputs, aux loss) for `dict_loss`, the hidden states scaled by the gains."""

    def __init__(self, dim: int, out: int) -> None:
        super().__init__()
        self.lin = nn.Linear(dim, out)

    def forward(self, x: dict) -> tuple:
        h = x["h"].mean(dim=1)
        for gain in x["gains"]:
            h = h * gain
        return self.lin(h), x["aux"][0]


def dict_loss(out, y):
    prediction, aux = out
    return nn.functional.mse_loss(prediction, y) + aux


DICT_MODEL = [
    LayerSpec(DictEmbed, 11, 8),
    LayerSpec(DictBlock, 8, 16),
    LayerSpec(DictBlock, 8, 16),
    LayerSpec(DictHead, 8, 2),
]


def dict_batch(k: int, size: int = 8, length: int = 6):
    g = torch.Generator().manual_seed(700 + k)
    return torch.randint(0, 11, (size, length), generator=g), torch.randn(size, 2, generator=g)


class ChainModel(nn.Module):
    """A user's own model whose forward chains submodules: embed, blocks, norm, head."""

    def __init__(self, vocab: int = 20, dim: int = 12, depth: int = 5) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(dim, dim), nn.Tanh()) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def chain_loss(logits, targets):
    return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def flip_a_byte(path) -> None:
    """Corrupts a checkpoint file in place (a local `Path` or a `raypipe.checkpoint.storage.StoragePath`): one
    byte in the middle inverted, the size unchanged, so only its checksum can tell."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


class WorkClock:
    """A clock that reads work done, not time: the FLOPs of every operator torch's flop counter
    has a formula for, counted while it is entered. Given to `LayerProfiler(clock=...)`, the
    profiler's "seconds" become counts of work, exact on a busy machine. (torch's own
    FlopCounterMode cannot stand in: its module tracker's hooks break the split backward's
    `autograd.grad`.)"""

    def __init__(self) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils.flop_counter import flop_registry

        clock = self

        class _Counting(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                formula = flop_registry.get(func._overloadpacket)
                if formula is not None:
                    clock.flops += formula(*args, **(kwargs or {}), out_val=out)
                return out

        self.flops, self._mode = 0, _Counting()

    def __enter__(self) -> WorkClock:
        self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._mode.__exit__(*exc)

    def __call__(self) -> int:
        return self.flops
