"""Layer specs: how the driver describes layers without building them, and how a stage's layers
read their weights while it builds them (`loading_to`).

The driver holds `LayerSpec`s (a class or factory plus arguments); each stage actor
builds only its own slice. Layer i is always built right after seeding torch with
`layer_seed(seed, i)`, so the whole model starts from the same weights however it
is split, and `build_layers` rebuilds exactly those weights in one process.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

# A loss: `loss_fn(output, target) -> scalar tensor` (a token loss may also say which targets count:
# `data.batches.loss_weights`)
LossFunction = Callable[..., torch.Tensor]

# What one stage hands the next, and what a batch's inputs and targets are cut into: a tensor, or
# tuples, lists and dicts of them, with None leaves
Boundary = torch.Tensor | tuple["Boundary", ...] | list["Boundary"] | dict[str, "Boundary"] | None


class LayerSpec:
    """A layer to build later: `LayerSpec(nn.Linear, 16, 64)` builds `nn.Linear(16, 64)`.

    Args:
        factory: an `nn.Module` class or any callable returning an `nn.Module`.
        *args, **kwargs: passed to `factory` when the layer is built.
    """

    def __init__(self, factory: Callable[..., nn.Module], *args: Any, **kwargs: Any) -> None:
        if not callable(factory):
            raise TypeError(f"LayerSpec needs a class or callable, got {factory!r}")
        self.factory = factory
        self.args = args
        self.kwargs = kwargs

    def build(self) -> nn.Module:
        module = self.factory(*self.args, **self.kwargs)
        if not isinstance(module, nn.Module):
            raise TypeError(f"{self!r} built a {type(module).__name__}, not an nn.Module")
        return module

    def __repr__(self) -> str:
        name = getattr(self.factory, "__qualname__", repr(self.factory))
        parts = [repr(a) for a in self.args] + [f"{k}={v!r}" for k, v in self.kwargs.items()]
        return f"LayerSpec({name}{', ' if parts else ''}{', '.join(parts)})"


def as_spec(layer: Any, index: int) -> LayerSpec:
    """Accepts a LayerSpec or a zero-argument callable returning a module."""
    if isinstance(layer, LayerSpec):
        return layer
    if isinstance(layer, nn.Module):
        raise TypeError(
            f"layer {index} is a built {type(layer).__name__}; raypipe builds layers on the "
            f"actors, so pass LayerSpec({type(layer).__name__}, ...) or a zero-argument callable."
        )
    if callable(layer):
        return LayerSpec(layer)
    raise TypeError(f"layer {index} is {layer!r}: give a LayerSpec or a callable returning nn.Module")


def layer_seed(seed: int, index: int) -> int:
    """The torch seed layer `index` is built under; independent of how the model is split."""
    return (seed * 1_000_003 + index) % (2**63)


def build_layers(specs: Sequence[Any], seed: int = 0, start: int = 0, end: int | None = None) -> list[nn.Module]:
    """Builds layers [start, end) exactly as the stage actors do, with the same weights.

    `nn.Sequential(*build_layers(specs, seed))` is the one-process twin of a trainer
    made from the same specs and seed.
    """
    end = len(specs) if end is None else end
    return [build_layer(as_spec(specs[i], i), seed, i) for i in range(start, end)]


def build_layer(spec: LayerSpec, seed: int, index: int) -> nn.Module:
    """Builds global layer `index` under its own seed, leaving the caller's RNG untouched."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(layer_seed(seed, index))
        return spec.build()


def parameter_counts(specs: Sequence[LayerSpec]) -> list[int]:
    """Parameters per layer, counted on the meta device so no memory is allocated."""
    counts = []
    for index, spec in enumerate(specs):
        try:
            with torch.device("meta"):
                module = spec.build()
        except Exception:  # a layer whose constructor needs real data: build it for real
            module = build_layer(spec, 0, index)
        counts.append(sum(p.numel() for p in module.parameters()))
    return counts


class Loading:
    """How the layers a stage builds read their tensors from a model's files: onto `device` (its
    accelerator; None: the host), and with `share`, a tensor another of its layers already read
    (a tied head beside its embedding) shared, not read again, while that layer still holds it.
    With `map_files`, host tensors that will stay frozen are mapped from their files, not read
    (`raypipe.models.hf.tensor_files`). Layers built outside `loading_to` (one by one, in a test
    or the profiler) share nothing and read everything."""

    def __init__(self, device: torch.device | None = None, share: bool = False, map_files: bool = False) -> None:
        self.device, self.share, self.map_files = device, share, map_files
        # a mapped file's storage by its address -> the file's path and the storage, held while the
        # layers are built so that no other storage takes a freed mapping's address meanwhile
        self.mapped: dict[int, tuple[str, torch.UntypedStorage]] = {}
        self.held: weakref.WeakValueDictionary[str, torch.Tensor] = weakref.WeakValueDictionary()

    def keep(self, tensors: dict[str, torch.Tensor]) -> None:
        """Remembers the tensors a layer now holds under their checkpoint keys, for the layers after it."""
        if self.share:
            self.held.update(tensors)


_loading: list[Loading] = [Loading()]


@contextlib.contextmanager
def loading_to(device: torch.device | None, map_files: bool = False) -> Iterator[Loading]:
    """The layers one stage builds inside read their tensors onto `device`, each at most once
    (host tensors mapped from their files with `map_files`: weights that will stay frozen)."""
    _loading.append(Loading(device, share=True, map_files=map_files))
    try:
        yield _loading[-1]
    finally:
        _loading.pop()


def loading() -> Loading:
    """How layers built now read their tensors."""
    return _loading[-1]


def checkpoint_key(prefixes: list[tuple[str, str]], local: str) -> str:
    """A layer's state-dict key under its checkpoint's name, by the layer's (local prefix,
    checkpoint prefix) pairs (`prefixes`, the first that matches): a transformers layer's key in
    its model's checkpoint, a LoRA target's module path."""
    prefix, hf = next((p, h) for p, h in prefixes if local.startswith(p))
    return hf + local[len(prefix) :]
