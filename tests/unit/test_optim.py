"""The optimizer a stage builds from `TrainConfig.optimizer` (no Ray needed)."""

import pytest
import torch

from raypipe.actors.optim.build import build_optimizer

SPECS = [
    {"name": "sgd", "lr": 0.1, "momentum": 0.9},
    {"name": "adam", "lr": 1e-2},
    {"name": "adamw", "lr": 1e-2, "weight_decay": 0.1},
]


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))


def _train(optimizer_of, steps: int = 5) -> dict[str, torch.Tensor]:
    model = _model()
    optimizer = optimizer_of(model.parameters())
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x, y = torch.randn(32, 8, generator=g), torch.randn(32, 4, generator=g)
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
    return model.state_dict()


@pytest.mark.parametrize("spec", SPECS, ids=[s["name"] for s in SPECS])
def test_cpu_parameters_get_fused_kernels_with_torchs_results(spec):
    optimizer = build_optimizer(_model().parameters(), spec)
    assert optimizer.defaults["fused"] is True
    cls = type(optimizer)
    kwargs = {k: v for k, v in spec.items() if k != "name"}
    ours = _train(lambda p: build_optimizer(p, spec))
    reference = _train(lambda p: cls(p, **kwargs))  # torch's default (per-tensor loop) on CPU
    for key in reference:
        torch.testing.assert_close(ours[key], reference[key], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("choice", [{"fused": False}, {"foreach": True}, {"foreach": False}])
def test_an_explicit_implementation_choice_is_kept(choice):
    optimizer = build_optimizer(_model().parameters(), {"name": "adamw", "lr": 1e-3, **choice})
    assert not optimizer.defaults["fused"]
    for key, value in choice.items():
        assert optimizer.defaults[key] == value


def test_options_the_fused_kernels_refuse_fall_back_to_torchs_default():
    optimizer = build_optimizer(_model().parameters(), {"name": "adam", "lr": 1e-3, "differentiable": True})
    assert not optimizer.defaults["fused"] and optimizer.defaults["differentiable"]


LAZY_DYNAMO = """
import sys, torch
from raypipe.actors.optim.lazy_dynamo import defer_dynamo_import, step_optimizer
from raypipe.actors.optim.build import build_optimizer
defer_dynamo_import()  # done already when raypipe imports its actors' optimizer module

def train(spec, step):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    optimizer = build_optimizer(model.parameters(), spec)
    g = torch.Generator().manual_seed(1)
    for _ in range(4):
        x, y = torch.randn(32, 8, generator=g), torch.randn(32, 4, generator=g)
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        step(optimizer)
    optimizer.load_state_dict(optimizer.state_dict())
    return [p.detach().clone() for p in model.parameters()]

specs = %r
lazy = [train(spec, step_optimizer) for spec in specs]
print("compiler imported before:", "torch._dynamo" in sys.modules)
import torch._dynamo
eager = [train(spec, lambda o: o.step()) for spec in specs]
after = [train(spec, step_optimizer) for spec in specs]
same = all(torch.equal(a, b) for x, y in zip(lazy + after, eager + eager) for a, b in zip(x, y))
print("identical:", same)
"""


def test_optimizers_step_without_importing_the_compiler_and_with_torchs_results():
    """A stage that compiles nothing does not pay `import torch._dynamo` (~1.6 s per actor here)
    to build and step its optimizer, and steps exactly as torch's own `step()` does, before and
    after something imports the compiler."""
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", LAZY_DYNAMO % (SPECS,)], capture_output=True, text=True, timeout=120, check=True
    ).stdout
    assert "compiler imported before: False" in out
    assert "identical: True" in out
