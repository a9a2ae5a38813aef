"""The reference policy of a preference run, on the actors: the policy as it stood when the run
began, frozen, as TRL takes it. Under LoRA it is the same base weights: with the adapters off when
they started at zero (a new adapter), else with a frozen copy of the starting adapters (an SFT
adapter loaded first). Adapters are small: never a second copy of the base."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from raypipe.nn.lora import is_adapter


class ReferencePolicy:
    """What a stage's reference pass runs with, captured once from `module` (`capture`)."""

    def __init__(self, adapters: dict[str, torch.Tensor] | None, zeroed: tuple[str, ...] = ()) -> None:
        self.adapters = adapters  # None: the adapters were zero (off gives the same outputs)
        self.zeroed = zeroed  # module prefixes ("3.") of layers whose adapters started at zero, under a copy

    @classmethod
    def capture(cls, module: nn.Module) -> ReferencePolicy:
        """The starting policy of `module`'s trained weights: the adapters off when they are all
        LoRA adapters and every B (up) matrix is zero (or nothing trains here), else a copy of every
        trained tensor (adapters, modules to save, biases)."""
        state = {k: p.detach().clone() for k, p in module.named_parameters() if p.requires_grad}
        ups = [v for k, v in state.items() if ".lora_B." in k]
        zero = all(is_adapter(k) for k in state) and not any(torch.any(v) for v in ups)  # (nothing trained here)
        return cls(None if zero else state)

    @contextlib.contextmanager
    def applied(self, module: nn.Module) -> Iterator[None]:
        """`module` as the reference policy for the duration (its own weights back after)."""
        if self.adapters is None:
            with adapters_off(module):
                yield
            return
        own = dict(module.named_parameters())
        unknown = sorted(set(self.adapters) - set(own))
        if unknown:
            raise KeyError(
                f"the reference policy's copy holds {unknown[:3]}, which this stage does not: it was captured "
                f"for other layers (a resume's split must load the copy by layer, as load_reference does)"
            )
        # layers whose adapters started at zero (nothing saved for them): their B at zero, as captured
        zeroed = [(p, torch.zeros_like(p)) for k, p in own.items() if k.startswith(self.zeroed) and ".lora_B." in k]
        swapped = [(own[k], v) for k, v in self.adapters.items()] + zeroed
        with torch.no_grad():
            kept = [p.detach().clone() for p, _ in swapped]
            for p, v in swapped:
                p.copy_(v)
        try:
            yield
        finally:
            with torch.no_grad():
                for (p, _), k in zip(swapped, kept):
                    p.copy_(k)


@contextlib.contextmanager
def adapters_off(module: nn.Module) -> Iterator[None]:
    """peft's adapters of `module` disabled for the duration, as `PeftModel.disable_adapter` does."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [m for m in module.modules() if isinstance(m, BaseTunerLayer)]
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield
    finally:
        for layer in layers:
            layer.enable_adapters(True)


def save_reference(policy: ReferencePolicy, layers: list[int], root: Any) -> dict[str, dict[str, object]]:
    """Writes a frozen copy's tensors under checkpoint `root`, one file per global layer of
    `layers` (this stage's, in module order) that trains: {relative path: its manifest entry}."""
    from raypipe.checkpoint import layout as ckpt

    files = {}
    for j, index in enumerate(layers):
        part = {k[len(f"{j}.") :]: v for k, v in (policy.adapters or {}).items() if k.startswith(f"{j}.")}
        if part:
            relative = ckpt.layer_file("reference", index)
            files[relative] = ckpt.save_tensors(root / relative, part)
    return files


def load_reference(layers: list[int], root: Any, saved: dict[str, object]) -> ReferencePolicy:
    """The frozen copy `save_reference` wrote for the global `layers` (this stage's, in module
    order) under checkpoint `root`, whose manifest lists the files `saved`; keyed as this stage's
    module names them, whatever the split that saved it."""
    from raypipe.checkpoint import layout as ckpt

    adapters, zeroed = {}, []
    for j, index in enumerate(layers):
        relative = ckpt.layer_file("reference", index)
        if relative in saved:
            adapters.update({f"{j}.{k}": v for k, v in ckpt.load_tensors(root / relative).items()})
        else:  # its adapters started at zero (a stage that captured the adapters off saves nothing)
            zeroed.append(f"{j}.")
    if not adapters:  # every layer here started at zero: the adapters off, not the adapters being trained
        return ReferencePolicy(None)
    return ReferencePolicy(adapters, tuple(zeroed))
