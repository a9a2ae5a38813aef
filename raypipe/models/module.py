"""object `nn.Module` whose forward is a chain of submodules, split into raypipe layers.

    model = MyModel()                    # embed -> blocks[0..n) -> norm -> head
    split_model = module.split(model, split_points=["blocks.4", "blocks.8"], loss_fn=F.cross_entropy)
    trainer = Trainer(split_model, config=TrainConfig(pp=3))

Like torchtitan's manual split, the stages are the model's own submodules: its direct
children in call order, a `ModuleList`/`Sequential` child standing for its elements.
Unlike `torch.distributed.pipelining.pipeline()`, which traces and can cut anywhere, this
only accepts a forward that hands each submodule's output straight to the next, and checks
that with `torch.fx`: anything computed between two submodules (an addition, a reshape, a
second argument) is an error that names it and says what to do. Each submodule travels to
the actor of its stage only, with its weights; `to_module_keys` maps the trainer's state
dict back to the model's own keys.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from torch import nn

from raypipe.core.errors import ConfigError
from raypipe.core.layers import LayerSpec
from raypipe.models.model import Model

CONTAINERS = (nn.ModuleList, nn.Sequential)


class ModuleModel(Model):
    """A split `nn.Module`: one layer per chained submodule (`unit_names`, e.g. "blocks.3")."""

    unit_names: list[str]

    def to_module_keys(self, state: dict[str, object]) -> dict[str, object]:
        """A trainer's state dict (`"<layer>.<name>"`) under the module's own keys ("blocks.3.<name>")."""
        return {f"{self.unit_names[int(k.partition('.')[0])]}.{k.partition('.')[2]}": v for k, v in state.items()}


def split(
    model: nn.Module, split_points: Sequence[str] | None = None, loss_fn: Callable[[Any, Any], Any] | None = None
) -> ModuleModel:
    """Splits `model` into layers at its chained submodules.

    Args:
        split_points: the submodules that begin stages 1, 2, ... (e.g. ["blocks.4", "blocks.8"]
            for pp=3); None splits by `TrainConfig.partition` at any submodule.
        loss_fn: `loss_fn(output, target)`.

    Raises:
        ConfigError: the forward is not a chain of submodules (the message names what is
            computed in between), or a split point is not one of them.
    """
    from raypipe.models.hf import is_transformers_model

    if is_transformers_model(model):
        raise ConfigError(
            f"{type(model).__name__} is a transformers model: pass it to Trainer(model, config=...) as it is, or "
            f"use raypipe.models.hf.from_model(model) (or hf.from_pretrained(dir)): raypipe splits it where "
            f"transformers' own pipeline plan says, each stage reading only its layers."
        )
    units = chain(model)
    if split_points is None:
        plan = None
    else:
        starts = []
        for point in split_points:
            if point not in units:
                raise ConfigError(
                    f"split point {point!r} is not one of {type(model).__name__}'s chained "
                    f"submodules: use one of {units}."
                )
            starts.append(units.index(point))
        if starts != sorted(set(starts)) or starts[0] == 0:
            raise ConfigError(
                f"split_points={list(split_points)} must name submodules after the first, in call order "
                f"({units}), each once."
            )
        bounds = [0, *starts, len(units)]
        plan = [[a, b] for a, b in zip(bounds, bounds[1:])]
    modules = dict(model.named_modules())
    specs = [LayerSpec(_given, modules[name]) for name in units]
    result = ModuleModel(specs, loss_fn, shard_plan=plan)
    result.unit_names = units
    return result


def chain(model: nn.Module) -> list[str]:
    """The names of the submodules `model.forward` chains, in call order.

    Raises:
        ConfigError: the forward cannot be traced, or does anything but call them in a chain.
    """
    import torch.fx

    candidates = set()
    for name, child in model.named_children():
        if isinstance(child, CONTAINERS):
            candidates |= {f"{name}.{n}" for n, _ in child.named_children()}
        else:
            candidates.add(name)

    class Tracer(torch.fx.Tracer):
        def is_leaf_module(self, module: nn.Module, qualified_name: str) -> bool:
            return qualified_name in candidates

    advice = (
        "raypipe splits a forward that only chains submodules (each one's output is the next "
        "one's input): move that computation into a submodule, write the model as a list of "
        "LayerSpecs, or use raypipe.models.hf for a transformers model."
    )
    try:
        graph = Tracer().trace(model)
    except Exception as error:  # noqa: BLE001 - any tracing failure gets the same advice
        raise ConfigError(
            f"cannot trace {type(model).__name__}.forward ({type(error).__name__}: {error}); {advice}"
        ) from None
    units, previous = [], None
    for node in graph.nodes:
        if node.op == "placeholder":
            if previous is not None:
                raise ConfigError(f"{type(model).__name__}.forward takes more than one input; {advice}")
            previous = node
        elif node.op == "call_module" and node.args == (previous,) and not node.kwargs:
            units.append(node.target)
            previous = node
        elif node.op == "output":
            if node.args[0] is not previous:
                raise ConfigError(
                    f"{type(model).__name__}.forward returns something other than its last submodule's output; {advice}"
                )
        else:
            where = f"after {units[-1]!r}" if units else "before its first submodule"
            raise ConfigError(f"{type(model).__name__}.forward computes {node.op} {node.target!r} {where}; {advice}")
    if len(set(units)) != len(units):
        raise ConfigError(f"{type(model).__name__}.forward calls a submodule twice ({units}); {advice}")
    return units


def _given(module: nn.Module) -> nn.Module:
    """The LayerSpec factory of a submodule that already exists: it arrives with its weights."""
    return module
