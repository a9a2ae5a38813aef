"""The zero-bubble split of a backward (`actors/step/split_backward.py`) without Ray: its gradients
equal one whole backward's, and it does not import torch's compiler."""

import subprocess
import sys

SPLIT = """
import sys, torch
from raypipe.actors.step.split_backward import covers_every_weight, input_gradients, weight_gradients

def run(split):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    x = torch.randn(5, 8, requires_grad=True)
    out = model(x)
    grad = torch.randn_like(out)
    weights = list(model.parameters())
    if split:
        assert covers_every_weight([out], [x], weights)
        deferred = input_gradients([out], [grad], [x], weights)
        assert all(w.grad is None for w in weights)
        weight_gradients(deferred, weights)
    else:
        out.backward(grad)
    return [x.grad] + [w.grad for w in weights]

same = all(torch.allclose(a, b, rtol=1e-6, atol=1e-7) for a, b in zip(run(True), run(False)))
print("identical:", same)
print("imported:", sorted(m for m in ("torch._dynamo", "torch.distributed.pipelining") if m in sys.modules))
"""


def test_a_split_backward_equals_the_whole_one_without_importing_the_compiler():
    """The split loads torch's `_backward` file alone: its package's `__init__` imports the
    compiler, which cost a later stage 1.5 s at its second step."""
    out = subprocess.run([sys.executable, "-c", SPLIT], capture_output=True, text=True, timeout=120, check=True).stdout
    assert "identical: True" in out
    assert "imported: []" in out
