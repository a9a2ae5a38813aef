"""Check raypipe against plain PyTorch on a model of your own.

Trains the same model, from the same weights, on the same data, once as
`nn.Sequential` in this process and once split across Ray actors, and compares
the losses and the weights after a few SGD-with-momentum steps. Uses only the
public API. Run: `python examples/parity_check.py`.
"""

import argparse

import torch
from torch import nn

from raypipe import LayerSpec, TrainConfig, Trainer, build_layers


class ResidualConv(nn.Module):
    """A 1-D convolution block with a residual connection, defined here in the script."""

    def __init__(self, channels: int, kernel: int) -> None:
        super().__init__()
        self.conv = nn.Conv1d(channels, channels, kernel, padding=kernel // 2)
        self.norm = nn.GroupNorm(2, channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.relu(self.norm(self.conv(x)))


class Pool(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mean(dim=-1)


LAYERS = [
    LayerSpec(nn.Conv1d, 2, 8, 3, padding=1),
    LayerSpec(ResidualConv, 8, 5),
    LayerSpec(ResidualConv, 8, 3),
    lambda: nn.Dropout(0.0),
    LayerSpec(Pool),
    LayerSpec(nn.LayerNorm, 8),
    LayerSpec(nn.Linear, 8, 4),
]


def batches(steps: int, size: int):
    g = torch.Generator().manual_seed(123)
    return [(torch.randn(size, 2, 24, generator=g), torch.randint(0, 4, (size,), generator=g)) for _ in range(steps)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pp", type=int, default=3)
    parser.add_argument("--microbatches", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    data = batches(args.steps, 4 * args.microbatches)
    loss_fn = nn.functional.cross_entropy
    worst = 0.0
    for schedule in ("gpipe", "1f1b"):
        reference = nn.Sequential(*build_layers(LAYERS, seed=11))
        opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
        config = TrainConfig(
            pp=args.pp,
            microbatches=args.microbatches,
            schedule=schedule,
            optimizer={"name": "sgd", "lr": 0.1, "momentum": 0.9},
            seed=11,
        )
        with Trainer(LAYERS, loss_fn, config) as trainer:
            for x, y in data:
                got = trainer.step(x, y)["loss"]
                opt.zero_grad()
                loss = loss_fn(reference(x), y)
                loss.backward()
                opt.step()
                print(f"{schedule:5s} loss raypipe {got:.7f}  torch {loss.item():.7f}")
                worst = max(worst, abs(got - loss.item()))
            state = trainer.state_dict()
            expected = reference.state_dict()
            assert list(state) == list(expected), "state_dict keys differ"
            diff = max((state[k] - expected[k]).abs().max().item() for k in expected)
            print(f"{schedule:5s} plan {trainer.plan}: max |weight difference| after {args.steps} steps = {diff:.2e}")
            torch.testing.assert_close(state, expected, rtol=1e-5, atol=4e-5)
    print(f"parity holds (largest loss difference {worst:.2e})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
