"""transformers' own code between a causal LM's layers, run around raypipe's split of them.

A model splits where transformers says it does: its config's `base_model_pp_plan` names the base
model's modules in order (the embeddings, the decoder layers, the final norm) and the causal LM's
`_pp_plan` its head (`Plan`). What sits between them in transformers' forward (an embedding's
scale or multiplier, the attention masks of each layer type, the rotary embeddings of each
layer type, a logits soft-cap or scale) is not re-written here: every raypipe layer runs it from
transformers' own forward, on a skeleton of the whole model whose parameters are on the meta
device (no memory) and whose computed buffers (rotary frequencies) are real:

- the embedding runs the base model's forward with its own embedding modules swapped in, up to
  the first decoder layer's input (`embed`);
- a decoder layer runs the base model's forward on zeros of its input's shape, the decoder layers
  replaced by stand-ins, until the stand-in of its own index receives its keyword arguments: its
  masks, position embeddings and cache, exactly as the whole model passes them (`layer_inputs`);
- the head runs the causal LM's forward with its norm and head swapped in and the base model
  replaced by one returning the hidden states it was given (`head_logits`).

So a family whose plan transformers declares needs no code here. The skeleton is built once per
actor process and config (`skeleton`, 0.5 s for Llama-3-8B's shape): module-level state, since
every layer of a stage shares it.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from raypipe.core.errors import ConfigError

if TYPE_CHECKING:
    from transformers import PretrainedConfig

# a row for what a model's own plan cannot say: GPT-2 declares none
ROWS: dict[str, dict[str, Any]] = {
    "gpt2": {"embeddings": ("wte", "wpe", "drop"), "layers": "h", "norm": "ln_f"},
}


@dataclass(frozen=True)
class Plan:
    """Where a causal LM splits.

    Attributes:
        base: the causal LM's attribute holding the base model ("model", "transformer", "gpt_neox").
        embeddings: the base model's modules before the decoder layers, in order.
        layers: the base model's attribute holding the decoder layers.
        norm: the base model's final norm; head: the causal LM's head ("lm_head", "embed_out").
        tied: the head's weight key -> the embedding's it shares when the config ties them.
    """

    base: str
    embeddings: tuple[str, ...]
    layers: str
    norm: str
    head: str
    tied: dict[str, str] = field(default_factory=dict)

    def checkpoint_prefix(self, module: str) -> str:
        """The checkpoint prefix of one of the base model's modules ("model.layers.3.")."""
        return f"{self.base}.{module}."


def plan_of(config: PretrainedConfig) -> Plan:
    """Where `config`'s model splits, from transformers' own plans (or `ROWS`).

    Raises:
        ConfigError: the model declares no pipeline plan (naming the way out: LayerSpecs).
    """
    model_type = getattr(config, "model_type", None)
    declared = getattr(config, "base_model_pp_plan", None)
    lm = causal_lm_class(config)
    if declared:
        names = list(declared)
        if "layers" not in names or len(names) < 2 or names.index("layers") != len(names) - 2:
            raise ConfigError(
                f"{model_type}'s base_model_pp_plan {names} is not embeddings, layers, norm: raypipe cannot split it."
            )
        embeddings, norm = tuple(names[:-2]), names[-1]
        layers = "layers"
    elif model_type in ROWS:
        row = ROWS[model_type]
        embeddings, layers, norm = row["embeddings"], row["layers"], row["norm"]
    else:
        raise ConfigError(
            f"raypipe.models.hf cannot split a model of type {model_type!r} ({type(config).__name__}): its "
            f"transformers config declares no base_model_pp_plan (the embeddings, decoder layers and norm a "
            f"pipeline splits). Write it as a list of layers instead, each built on its stage, e.g.\n"
            f"    layers = [LayerSpec(MyEmbedding, cfg)] + [LayerSpec(MyBlock, cfg, i) for i in range(n)] "
            f"+ [LayerSpec(MyHead, cfg)]\n    Trainer(layers, loss_fn, TrainConfig(pp=2))"
        )
    head = next(iter(getattr(lm, "_pp_plan", None) or {"lm_head": None}))
    tied_keys = getattr(lm, "_tied_weights_keys", None)
    tied = dict(tied_keys) if isinstance(tied_keys, dict) else {}
    return Plan(lm.base_model_prefix, embeddings, layers, norm, head, tied)


def causal_lm_class(config: PretrainedConfig) -> type:
    from transformers import AutoModelForCausalLM
    from transformers.models.auto.auto_factory import _get_model_class

    try:
        return _get_model_class(config, AutoModelForCausalLM._model_mapping)
    except (KeyError, ValueError):
        raise ConfigError(
            f"transformers has no causal LM for model type {config.model_type!r} ({type(config).__name__})"
        ) from None


# ----- the skeleton ---------------------------------------------------------------------------

_skeletons: dict[int, tuple[object, object]] = {}  # id(config) -> (config, its skeleton); one per process
_lock = threading.Lock()


def skeleton(config: PretrainedConfig) -> Any:
    """transformers' causal LM for `config`, its parameters on the meta device, its computed buffers
    real; with stand-ins for its decoder layers (`_Stop`), shared by every layer of this process."""
    with _lock:
        found = _skeletons.get(id(config))
        if found is not None:
            return found[1]
        from accelerate import init_empty_weights
        from transformers import AutoModelForCausalLM

        # its computed buffers on the CPU, even when built inside a layer's `torch.device("meta")`
        with warnings.catch_warnings(), torch.device("cpu"), init_empty_weights(include_buffers=False):
            warnings.simplefilter("ignore")
            model = AutoModelForCausalLM.from_config(config)
        plan = plan_of(config)
        base = getattr(model, plan.base)
        model.raypipe_stops = nn.ModuleList(_Stop(i) for i in range(len(getattr(base, plan.layers))))
        _skeletons[id(config)] = (config, model)
        return model


def initialise(module: nn.Module, config: PretrainedConfig) -> None:
    """Initialises `module`'s parameters (materialised, uninitialised) as transformers initialises
    the whole model: its own `_init_weights`, submodule by submodule."""
    model = skeleton(config)
    with torch.no_grad():
        for sub in module.modules():
            model._init_weights(sub)


class _Reached(Exception):
    """Raised by the stand-in of the last decoder layer a prologue wants: it has what it came for."""


class _Stop(nn.Module):
    """Decoder layer `index`'s stand-in in the skeleton's loop: passes the hidden states through,
    keeping the inputs of the layers asked for (`wanted`) in `seen`, and stops the forward after
    the last of them."""

    wanted: frozenset[int] = frozenset()
    seen: dict[int, tuple[torch.Tensor, tuple, dict[str, object]]] = {}

    def __init__(self, index: int) -> None:
        super().__init__()
        self.index = index

    def forward(self, hidden_states: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        if self.index in _Stop.wanted:
            _Stop.seen[self.index] = (hidden_states, args, kwargs)
            if self.index == max(_Stop.wanted):
                raise _Reached()
        return hidden_states


def _run_to(base: nn.Module, wanted: set[int], **inputs: object) -> dict[int, tuple[torch.Tensor, tuple, dict]]:
    """Runs the base model's forward until the decoder layers `wanted` received their inputs."""
    _Stop.wanted, _Stop.seen = frozenset(wanted), {}
    try:
        base(**inputs)
    except _Reached:
        return _Stop.seen
    finally:
        _Stop.wanted = frozenset()
    raise ConfigError(f"{type(base).__name__}'s forward never reached decoder layers {sorted(wanted)}")


class _Zeros(nn.Module):
    """An embedding's stand-in where its weights are not held: zeros of its output's shape (a
    decoder layer's prologue needs only the shapes), in the hidden states' dtype (`dtype`, set
    by the prologue)."""

    dtype = torch.float32

    def __init__(self, width: int) -> None:
        super().__init__()
        self.width = width

    def forward(self, ids: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        return torch.zeros(*ids.shape, self.width, device=ids.device, dtype=_Zeros.dtype)


class _Given(nn.Module):
    """The base model's stand-in in the head's causal-LM forward: returns its norm of the hidden
    states it was given."""

    def __init__(self, norm: nn.Module, hidden: torch.Tensor) -> None:
        super().__init__()
        self.norm, self.hidden = norm, hidden

    def forward(self, *args: object, **kwargs: object) -> object:
        return _Output(last_hidden_state=self.norm(self.hidden))


class _Output(dict):
    """A base model's output as a causal LM's forward reads it: the last hidden state by name or
    as `[0]`, and None for any other field (router logits, cross-attentions, the cache)."""

    def __getattr__(self, name: str) -> Any:
        return self.get(name)

    def __getitem__(self, key: object) -> object:
        return list(self.values())[key] if isinstance(key, int) else self.get(key)


@contextlib.contextmanager
def _swapped(owner: nn.Module, modules: dict[str, nn.Module]) -> Iterator[None]:
    """`owner`'s submodules replaced by `modules` inside the block."""
    before = {name: owner._modules[name] for name in modules}
    try:
        for name, module in modules.items():
            owner._modules[name] = module
        yield
    finally:
        owner._modules.update(before)


def _stand_ins(base: nn.Module, plan: Plan, keep: dict[str, nn.Module]) -> dict[str, nn.Module]:
    """Zeros for the base model's embeddings that hold weights (but those in `keep`), and nothing
    for its norm."""
    out: dict[str, nn.Module] = {plan.norm: nn.Identity()}
    for name in plan.embeddings:
        module = base._modules[name]
        if name in keep:
            out[name] = keep[name]
        elif isinstance(module, nn.Embedding):
            out[name] = _Zeros(module.embedding_dim)
        elif any(True for _ in module.parameters()):  # noqa: E501
            raise ConfigError(
                f"{type(base).__name__}.{name} holds weights but is no embedding: raypipe cannot split it"
            )
    return out


def embed(config: PretrainedConfig, modules: dict[str, nn.Module], inputs: dict[str, object]) -> torch.Tensor:
    """The first decoder layer's input as transformers' base model makes it from `inputs`
    (input_ids, attention_mask, position_ids), with the embedding `modules` this layer holds."""
    return embed_with_arguments(config, modules, inputs)[0]


def embed_with_arguments(
    config: PretrainedConfig, modules: dict[str, nn.Module], inputs: dict[str, object]
) -> tuple[torch.Tensor, tuple, dict[str, object]]:
    """`embed`, with the arguments after the hidden states and the keyword arguments the same pass
    gives decoder layer 0 (`layer_inputs` for it, made from `inputs`: with a cache, if they name one)."""
    return _prologue(config, modules, {0}, inputs)[0]


def _prologue(
    config: PretrainedConfig, modules: dict[str, nn.Module], wanted: set[int], inputs: dict[str, object]
) -> dict[int, tuple[torch.Tensor, tuple, dict]]:
    """One pass of the base model's forward on `inputs`, with the embedding `modules` held (zeros
    for the others) and stand-ins for its layers: each of decoder layers `wanted`'s inputs."""
    model, plan = skeleton(config), plan_of(config)
    base = getattr(model, plan.base)
    with _swapped(base, {**_stand_ins(base, plan, modules), plan.layers: model.raypipe_stops}):
        return _run_to(base, wanted, **inputs)


def layer_inputs(
    config: PretrainedConfig, indices: list[int], hidden: torch.Tensor, inputs: dict[str, object]
) -> dict[int, tuple[tuple, dict[str, object]]]:
    """Per decoder layer of `indices`, the arguments after the hidden states and the keyword
    arguments transformers' base model passes it (its masks, position embeddings, position ids,
    cache) for hidden states like `hidden` and `inputs` (attention_mask, position_ids,
    past_key_values, use_cache): one pass of its forward, so all see the cache as it stood."""
    _Zeros.dtype = hidden.dtype
    seen = _prologue(config, {}, set(indices), {"inputs_embeds": torch.zeros_like(hidden), **inputs})
    return {i: (args, kwargs) for i, (_, args, kwargs) in seen.items()}


def head_logits(
    config: PretrainedConfig, norm: nn.Module, head: nn.Module, hidden: torch.Tensor, **inputs: object
) -> torch.Tensor:
    """The logits transformers' causal LM makes of the last decoder layer's output `hidden` with
    this `norm` and `head` (a soft-cap, a scale: whatever its forward does to them)."""
    model, plan = skeleton(config), plan_of(config)
    extra = {"output_router_logits": False} if hasattr(config, "output_router_logits") else {}
    with _swapped(model, {plan.base: _Given(norm, hidden), plan.head: head}):
        return model(inputs_embeds=hidden, **inputs, **extra).logits


class StageCache:
    """A stage's KV cache while generating: transformers' `DynamicCache` for the whole model, each
    layer held on another stage mirroring one held here of the same attention type, so the masks
    transformers makes for any layer index see this stage's sequence length. Made at the first
    forward, once every decoder layer of the stage has said it is held (`held`).

    The whole model makes every layer's masks once per forward, before any layer extends the
    cache: here the stage's first layer makes them for all its layers (`inputs`), or on the stage
    that embeds the tokens, the embedding in the same pass (`embedded`)."""

    def __init__(self, config: PretrainedConfig, held: list[int]) -> None:
        self.config, self.held, self.cache = config, held, None
        self.made: dict[int, tuple[tuple, dict[str, object]]] = {}
        self.primed = False  # `made` holds this forward's arguments, made by `embedded`

    def embedded(self, modules: dict[str, nn.Module], inputs: dict[str, object]) -> torch.Tensor:
        """`embed` on a stage that also holds decoder layer 0: one pass of the base model's forward
        makes the first layer's input and every held layer's arguments for this forward, as the
        whole model's one prologue a token does (an embedding, then a first layer, made two)."""
        cached = {**inputs, "past_key_values": self._ready(), "use_cache": True}
        seen = _prologue(self.config, modules, set(self.held), cached)
        self.made, self.primed = {i: (args, kwargs) for i, (_, args, kwargs) in seen.items()}, True
        return seen[0][0]

    def inputs(self, index: int, hidden: torch.Tensor, inputs: dict[str, object]) -> tuple[tuple, dict[str, object]]:
        """Decoder layer `index`'s arguments for this forward (`layer_inputs`), with the cache."""
        primed, self.primed = self.primed, False
        if (index == min(self.held) and not primed) or index not in self.made:
            cached = {**inputs, "past_key_values": self._ready(), "use_cache": True}
            self.made = layer_inputs(self.config, sorted(self.held), hidden, cached)
        return self.made.pop(index)

    def _ready(self) -> object:
        if self.cache is None:
            from transformers import DynamicCache

            cache = DynamicCache(config=self.config)
            types = getattr(self.config, "layer_types", None)
            for i in range(len(cache.layers)):
                if i not in self.held:
                    same = [j for j in self.held if types is None or types[j] == types[i]] or self.held
                    cache.layers[i] = cache.layers[same[0]]
            self.cache = cache
        return self.cache
