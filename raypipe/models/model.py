"""A model object: what a `Trainer` needs to know about a model besides its layers.

`Trainer(layers, loss_fn)` takes a bare list of layer specs. A model object carries them
together with its loss and its tied weights, and optionally how to export it and whether
its layers keep a KV cache while generating; `raypipe.models.hf` makes one from a
transformers config or model directory, and `raypipe.models.module.split` from an
`nn.Module`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from raypipe.core.errors import ConfigError
from raypipe.core.layers import LayerSpec


@dataclass
class Model:
    """Layer specs with their loss and tied weights.

    Attributes:
        layers: the layer specs, in order.
        loss_fn: `loss_fn(output, target) -> scalar`; it may also have `count(target)`, the
            items its mean is over (tokens not ignored), so microbatches weigh by them.
        tied: groups of state-dict keys (`"<layer>.<name>"`) that are one weight, such as a
            token embedding and the head that reuses it. Every holder keeps a copy; their
            gradients are summed each step, so all stay bit-identical.
        kv_cache: whether the layers keep a KV cache while generating (`begin_cache(shared)`,
            `end_cache()`), so each new token runs through the pipeline alone.
        exporter: writes the model in another library's format (`Trainer.save_pretrained`).
        shard_plan: the stages' [start, end) layer ranges the model was split into (its
            split points), used when `TrainConfig.shard_plan` is not set.
        vocab_size: the token ids the first layer embeds, [0, vocab_size), checked on the driver
            before a step runs; found from the first layer when None (`token_vocab`).
        max_positions: the positions the model has (learned ones) or was trained for (rotary
            ones); a row longer than that fails in it or runs past what it learned, so the rows an
            objective makes and generates are checked against it (None: not known, not checked).
    """

    layers: Sequence[LayerSpec]
    loss_fn: Callable[[Any, Any], Any]
    tied: list[tuple[str, ...]] = field(default_factory=list)
    kv_cache: bool = False
    exporter: object = None
    shard_plan: list[list[int]] | None = None
    vocab_size: int | None = None
    max_positions: int | None = None

    def identity(self) -> dict[str, object]:
        """What identifies the model's weights before training (the base a LoRA run's adapters
        belong to): here its layer specs; a pretrained model says which files it read."""
        import hashlib

        return {"layers": len(self.layers), "hash": hashlib.sha256(repr(list(self.layers)).encode()).hexdigest()[:16]}

    def __post_init__(self) -> None:
        for group in self.tied:
            if len(group) < 2 or len(set(group)) != len(group):
                raise ConfigError(f"Model.tied group {group!r} is invalid: name two or more different keys.")
            for key in group:
                index = key.partition(".")[0]
                if not index.isdigit() or int(index) >= len(self.layers):
                    raise ConfigError(
                        f"Model.tied key {key!r} names no layer: keys look like '0.weight' "
                        f"(layer index, then the name in that layer's state dict)."
                    )


def resolve(layers: Any, loss_fn: Any, config: Any) -> tuple[Model, Callable, list[LayerSpec], Any]:
    """What `Trainer(layers, loss_fn, config)` trains: the model object (made from a bare list of
    layers), its loss (`config.objective`'s when set), its layer specs, and the config with the
    model's split points as its shard plan when the config names none.

    Raises:
        TypeError: no callable loss. ConfigError: no layers, or split points that do not match pp.
    """
    from raypipe.core.layers import as_spec
    from raypipe.models.hf import is_transformers_model

    if is_transformers_model(layers):  # a transformers causal LM object: its weights read per stage
        from raypipe.models.hf import from_model

        layers = from_model(layers)
    if not isinstance(layers, Model) and not hasattr(layers, "__iter__"):
        raise TypeError(
            f"Trainer takes a list of LayerSpecs, a raypipe Model, or a transformers causal LM; got a "
            f"{type(layers).__name__}: split an nn.Module with raypipe.models.module.split(model, loss_fn)."
        )
    model = layers if isinstance(layers, Model) else Model(list(layers), loss_fn)
    loss_fn = loss_fn if loss_fn is not None else model.loss_fn
    if config.objective is not None:  # an objective's run (DPO, GRPO, ...): its loss in place of the model's
        from raypipe.objectives import objective_for

        loss_fn = objective_for(config.objective).loss()
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable, got {loss_fn!r}")
    specs = [as_spec(layer, i) for i, layer in enumerate(model.layers)]
    if not specs:
        raise ConfigError("the model has no layers: pass at least one LayerSpec.")
    if model.vocab_size is None:
        model.vocab_size = token_vocab(specs[0])
    if model.shard_plan is not None and config.shard_plan is None:
        if len(model.shard_plan) != config.pp:
            raise ConfigError(
                f"the model was split into {len(model.shard_plan)} stages (its split points) but "
                f"TrainConfig.pp={config.pp}: give pp={len(model.shard_plan)}, or other split points."
            )
        config = config.replace(shard_plan=model.shard_plan)
    return model, loss_fn, specs, config


def tied_stages(tied: Sequence[Sequence[str]], plan: Sequence[Sequence[tuple[int, int]]]) -> list[list[int]]:
    """For each tied group, the stages (actors) holding its keys, in stage order without repeats;
    `plan`: per actor, the layer ranges it holds (`raypipe.driver.chunks.actor_plan`)."""

    def stage_of(key: str) -> int:
        layer = int(key.partition(".")[0])
        return next(s for s, ranges in enumerate(plan) for start, end in ranges if start <= layer < end)

    return [sorted({stage_of(k) for k in group}) for group in tied]


def token_vocab(first: LayerSpec) -> int | None:
    """The vocabulary a first layer embeds token ids from: an `nn.Embedding` spec's size, or the
    `vocab_size` of the config an embedding layer (a class named `...Embedding`, as the reference
    GPT's) is built from; None for a layer that takes anything else (transformers' models say
    theirs: `raypipe.models.hf`)."""
    from torch import nn

    if first.factory is nn.Embedding:
        size = first.args[0] if first.args else first.kwargs.get("num_embeddings")
        return size if isinstance(size, int) else None
    if not getattr(first.factory, "__name__", "").endswith("Embedding"):
        return None
    for arg in (*first.args, *first.kwargs.values()):
        size = getattr(arg, "vocab_size", None)
        if isinstance(size, int) and not isinstance(size, bool):
            return size
    return None
