"""torch.compile per layer on a stage (`TrainConfig.compile`): each layer of the stage (a
transformer block, an embedding, a head) compiled on its own actor, as torchtitan compiles per
block, in place (`nn.Module.compile`), so parameter names, state dicts, checkpoints, LoRA
adapters and ZeRO's views stay what they were.

Per layer rather than the stage whole: a layer is the unit every split of the model shares
(pp, chunks, elastic re-plans), so one compiled block serves every stage that holds one, and
the inductor cache on disk serves every actor of the node after the first. Graphs are
traced with `dynamic=None` (torch's default: static first, then dynamic in the dimension that
changed), so microbatches of varying length cost one recompile, not one per length; a step's
report counts the graphs and graph breaks so far (`compile_report`).

With a split backward (I, W) a compiled layer's backward is one compiled node that makes its
input and weight gradients together; I then computes the weight gradients too and W has
nothing left to do (`actors.split_backward`): the result is exact, the zero-bubble gain is not
there (what torch avoids by refusing such stages).
"""

from __future__ import annotations

from torch import nn


def compile_layers(module: nn.Sequential, on: bool) -> None:
    """Compiles each layer of `module` in place (`on`), or returns it to eager. A layer may name
    the parts to compile instead of itself (`compile_targets()`): a transformers decoder layer
    compiles transformers' own layer, while the code around it (its masks, made by running
    transformers' forward up to it) stays eager, where it would break the graph."""
    for layer in module:
        targets = layer.compile_targets() if hasattr(layer, "compile_targets") else [layer]
        for target in targets:
            if on and getattr(target, "_compiled_call_impl", None) is None:
                target.compile(dynamic=None)
            elif not on:
                target._compiled_call_impl = None


def compile_report() -> dict[str, object]:
    """This process's compiled graphs so far (a recompile, for a new shape or dtype, adds one)
    and graph breaks (a layer that could not compile whole)."""
    from torch._dynamo.utils import counters

    return {
        "graphs": int(counters["stats"]["unique_graphs"]),
        "graph_breaks": int(sum(counters["graph_break"].values())),
    }
