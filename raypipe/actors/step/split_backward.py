"""A microbatch's backward in two parts, for zero-bubble schedules: `input_gradients` (I), what
the previous stage waits for, and later `weight_gradients` (W), what only the optimizer needs.

I back-propagates from the stage's outputs to its inputs only, and keeps, for each group of
weights, the gradients that reached the graph nodes where the weights' paths join the
inputs' (torch.distributed.pipelining's `stage_backward_input`); W then back-propagates from
those nodes to the weights alone (`stage_backward_weight`). Nothing is computed twice, and
what stays alive between I and W is the part of the autograd graph the weight gradients
need. torch keeps these two functions in a private module (`_backward`); raypipe pins torch,
and `tests/parity/test_zero_bubble.py` checks them against a whole backward on every schedule.
`torch_backward()` loads that one file without its package, whose `__init__` imports the
schedules and through them the compiler (`torch._dynamo`: 1.5 s at a later stage's second step).

Some cases do not split: a stage whose inputs need no gradient (the first stage: token ids)
runs its whole backward at W, since nothing waits for its I; a stage with no trainable
weights (LoRA stages without adapters) runs it at I, and W has nothing to do; so does a
compiled stage (`actors.compiling`), whose layers' backwards are each one node making input
and weight gradients together. A weight whose path never meets the inputs' (an output
computed from weights alone) would get no gradient from torch's split: `covers_every_weight`
checks a chunk's first split, and such a chunk runs its whole backward at I.

The p2p and compiled engines also split the whole backward (B) of GPipe, 1F1B, interleaved 1F1B and
DualPipeV, to send the input gradient before the weight gradients are made
(`Executor.may_hand_on_early`).
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from collections.abc import Sequence
from dataclasses import dataclass

import torch

_PRIVATE_PACKAGE = "raypipe.actors._torch_pipelining"


@dataclass
class Deferred:
    """What a microbatch's W needs from its I: torch's parameter groups, or the whole backward
    (outputs and their gradients) when I could not split it."""

    groups: list[dict[str, object]] | None = None
    whole: tuple[list[torch.Tensor], list[torch.Tensor] | None] | None = None


def input_gradients(
    outputs: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor] | None,
    inputs: Sequence[torch.Tensor],
    weights: Sequence[torch.nn.Parameter],
    unsplit: bool = False,
) -> Deferred:
    """Sets `.grad` on each of `inputs` (tensors that require grad) from `outputs` and their
    `grads` (None: `outputs` is the scaled loss); returns what `weight_gradients` needs.
    `unsplit`: the whole backward runs here and W has nothing left: a compiled stage (its
    layers' backwards are each one node making input and weight gradients together), or one
    whose split would leave a weight out (`covers_every_weight`)."""
    outputs, grads = list(outputs), None if grads is None else list(grads)
    if not inputs:
        return Deferred(whole=(outputs, grads))
    if unsplit:
        torch.autograd.backward(outputs, grads)
        return Deferred()
    if not weights:
        torch.autograd.backward(outputs, grads, inputs=list(inputs))
        return Deferred()
    _, groups = torch_backward().stage_backward_input(outputs, grads, list(inputs), iter(weights))
    return Deferred(groups=groups)


def covers_every_weight(
    outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor], weights: Sequence[torch.nn.Parameter]
) -> bool:
    """Whether the split gives every weight the backward reaches its gradient: False when a
    weight's path to the outputs never meets the inputs' (an output made from weights alone),
    which torch's split drops. Walks the graph once more: for a stage's first split backward."""
    torch_split = torch_backward()
    _get_grad_fn_or_grad_acc = torch_split._get_grad_fn_or_grad_acc
    construct_reverse_graph, get_param_groups = torch_split.construct_reverse_graph, torch_split.get_param_groups

    if not inputs or not weights:
        return True  # nothing splits (`input_gradients`)
    reverse = construct_reverse_graph([n for n in map(_get_grad_fn_or_grad_acc, outputs) if n is not None])
    weight_nodes = [n for n in map(_get_grad_fn_or_grad_acc, weights) if n is not None]
    reached = {n for n in weight_nodes if n in reverse}  # before get_param_groups adds keys to it
    input_nodes = [n for n in map(_get_grad_fn_or_grad_acc, inputs) if n is not None]
    covered = set().union(*(g["params"] for g in get_param_groups(input_nodes, weight_nodes, reverse)))
    return reached <= covered


def weight_gradients(deferred: Deferred, weights: Sequence[torch.nn.Parameter]) -> None:
    """Accumulates the weights' `.grad` from what `input_gradients` kept."""
    if deferred.whole is not None:
        outputs, grads = deferred.whole
        torch.autograd.backward(outputs, grads)
    elif deferred.groups:
        torch_backward().stage_backward_weight(iter(weights), deferred.groups)


def torch_backward() -> types.ModuleType:
    """torch's `torch.distributed.pipelining._backward`, loaded on first use. When the package is
    not imported already, the file is loaded under a private package whose path is torch's
    pipelining folder, so its one relative import (`._debug`) resolves there and torch's
    `__init__`, with its imports of the schedules and the compiler, never runs."""
    if "torch.distributed.pipelining" in sys.modules:
        return importlib.import_module("torch.distributed.pipelining._backward")
    if _PRIVATE_PACKAGE not in sys.modules:
        spec = importlib.util.find_spec("torch.distributed.pipelining")  # imports the parents only
        package = types.ModuleType(_PRIVATE_PACKAGE)
        package.__path__ = list(spec.submodule_search_locations)
        sys.modules[_PRIVATE_PACKAGE] = package
    return importlib.import_module(_PRIVATE_PACKAGE + "._backward")
