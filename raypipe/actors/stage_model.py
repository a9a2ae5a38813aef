"""What one stage holds: its layers, built where they run and sharded for its tp rank.

Plain Python and torch (no Ray): a test can build a StageModel in its own process.
Weights leave and enter under global keys, `"<layer index>.<name>"` as
`nn.Sequential(*all_layers)` keys them, so state dicts and checkpoints do not depend
on how the model is split.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn

from raypipe.core.errors import StageError
from raypipe.core.layers import LayerSpec, build_layer, layer_seed, loading_to
from raypipe.nn import TensorParallelGroup, parallelize, shard, shard_specs
from raypipe.nn.file_tables import read_tables_from_files
from raypipe.nn.group import building
from raypipe.nn.moe import ExpertParallelGroup, expert_parameters, keyed_moe_layers, shard_experts


class StageModel:
    """Layers [start, start + len(specs)) on `device`, each built whole under its seed and cut
    to this tp rank's shard (layers with a `tp_plan`; the others are replicated) and, in its
    MoE layers, to this ep rank's experts.

    Attributes:
        module: the layers as an nn.Sequential (local keys `"<j>.<name>"`, j from 0).
        shard_specs: local state-dict key -> how its tensor splits across tp ranks.
        compute_dtype: the floating dtype most of its weights' elements are in (float32 without
            any): a bf16 model's stages compute on bf16 boundaries, a float32 one's on float32.
        params: the parameters, listed once (walking the module tree costs ~0.15 ms a
            time); they stay the same objects for the actor's life: loading copies into them.
        norm_params: those counted in the global gradient norm: a split parameter's shards
            each count, a replicated one counts once, on tp rank 0.
        foreign: local keys of the model's tensors this rank does not hold (other ep ranks' experts).
        expert_params: ids of the parameters of the experts held here (shared only with the
            replicas holding the same experts).
        moes: its MoE layers under "<global layer index>.<module name>", found once.
    """

    def __init__(
        self,
        specs: Sequence[LayerSpec],
        start: int | Sequence[int],
        seed: int,
        device: torch.device,
        tp: TensorParallelGroup,
        tied: Sequence[Sequence[str]] = (),
        lora: dict | None = None,
        quantize: str | None = None,
        ep: ExpertParallelGroup | None = None,
    ) -> None:
        # `start`: the first layer's global index, or every layer's (model chunks hold several ranges)
        self.indices = list(range(start, start + len(specs))) if isinstance(start, int) else list(start)
        self.local = {index: j for j, index in enumerate(self.indices)}
        self.device, self.tp, self.ep = device, tp, ep or ExpertParallelGroup()
        self.foreign: set[str] = set()
        self.foreign_specs: dict[str, Any] = {}  # how the experts held elsewhere split across tp ranks
        # layers read their weights straight onto the accelerator (unless a quantizer wants them on
        # the host first), a tied weight once; a CPU stage's LoRA base, frozen, stays in its files
        host = device.type == "cpu" or quantize is not None
        with loading_to(None if host else device, map_files=lora is not None and quantize is None and host) as loaded:
            self.module = nn.Sequential(
                *[self._build(spec, seed, index, j) for j, (spec, index) in enumerate(zip(specs, self.indices))]
            )
        self.lora = lora is not None
        if lora is not None:  # adapters under a seed per layer, then everything else frozen
            from raypipe.nn import lora as lora_

            lora_.apply(self.module, lora, [layer_seed(seed, index) + 1 for index in self.indices], quantize)
        self.tied = self._tie(tied)
        self.module.to(device)
        self.shard_specs = {**self.foreign_specs, **shard_specs(self.module)}
        self.sharded_params = {id(p) for k, p in self.module.named_parameters() if k in self.shard_specs}
        self.params = list(self.module.parameters())
        self.compute_dtype = weights_dtype(self.params)  # what a boundary sent narrower is restored to
        self.mapped = {  # parameter -> the model file it is a view of
            id(p): held[0] for p in self.params if (held := loaded.mapped.get(p.untyped_storage().data_ptr()))
        }
        self.from_files = any(hasattr(layer, "read_keys") for layer in self.module)  # read from a model directory
        self.tables_read_from_files = read_tables_from_files(self.module, self.mapped, list(self.tied.values()))
        self.expert_params = expert_parameters(self.module) if self.ep.size > 1 else set()
        self.moes = keyed_moe_layers(zip(self.indices, self.module))
        self.norm_params = [p for p in self.params if tp.rank == 0 or id(p) in self.sharded_params]
        # replicated weights that see only this rank's share of their input (a per-head norm after a
        # column-split projection): their gradients are summed over the tp ranks (`tp_summed` of a layer)
        self.tp_summed = [
            p
            for layer in self.module
            for name in getattr(layer, "tp_summed", ())
            if tp.size > 1
            for p in layer.get_submodule(name).parameters()
        ]

    @property
    def layers(self) -> list[int]:
        """The global indices of this stage's layers, in the order it holds them."""
        return self.indices

    def ranges(self) -> list[tuple[int, int]]:
        """The layers as [start, end) ranges of global indices (one per model chunk)."""
        ranges: list[list[int]] = []
        for index in self.indices:
            if ranges and ranges[-1][1] == index:
                ranges[-1][1] += 1
            else:
                ranges.append([index, index + 1])
        return [(a, b) for a, b in ranges]

    def parameter_count(self) -> int:
        return sum(p.numel() for p in self.params)

    def parameter_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.params)

    def mapped_files(self) -> set[str]:
        """The model files whose pages hold parameters of this stage (frozen weights mapped, not
        read: `raypipe.models.hf.tensor_files`); empty when every parameter is the process's own."""
        return set(self.mapped.values())

    def mapped_bytes(self) -> int:
        """Bytes of the parameters that are views of mapped model files."""
        return sum(p.numel() * p.element_size() for p in self.params if id(p) in self.mapped)

    def own_mapped(self) -> None:
        """Copies the parameters mapped from files into storages of their own (each mapped file is
        one storage under all its tensors); `FileEmbedding` and `FileLinear` then index them."""
        for p in self.params:
            if id(p) in self.mapped:
                p.data = p.data.clone()
        self.mapped.clear()

    def gradient_bytes(self) -> int:
        return sum(g.numel() * g.element_size() for g in self.grads())

    def grads(self) -> list[torch.Tensor]:
        return [p.grad for p in self.params if p.grad is not None]

    def trainable(self) -> list[nn.Parameter]:
        return [p for p in self.params if p.requires_grad]

    def zero_grad(self) -> None:
        for p in self.params:  # as module.zero_grad(set_to_none=True), without walking the module tree
            p.grad = None

    # ----- weights under global keys -------------------------------------------------

    def global_key(self, local: str) -> str:
        index, _, rest = local.partition(".")
        return f"{self.indices[int(index)]}.{rest}"

    def local_key(self, key: str) -> str:
        index, _, rest = key.partition(".")
        return f"{self.local[int(index)]}.{rest}"

    def state_dict(self) -> dict[str, torch.Tensor]:
        """This stage's weights under global keys; this tp rank's shards."""
        return {self.global_key(k): v.detach().clone() for k, v in self.module.state_dict().items()}

    def tensor_shards(self) -> dict[str, tuple[int, int]]:
        """Global key -> (dim, chunks) of every tensor split across tp ranks, for merging."""
        return {self.global_key(k): (spec.dim, spec.chunks) for k, spec in self.shard_specs.items()}

    def load_state_dict(self, state: dict[str, torch.Tensor], name: str) -> None:
        """Loads this stage's full (unsplit) weights from global keys, keeping this rank's shards.

        Raises:
            StageError: a key of the stage is missing, or one is not the stage's (`name` says whose).
        """
        local = self.shard_state({self.local_key(k): v for k, v in state.items()})
        local = {k: v for k, v in local.items() if k not in self.foreign}
        result = self.module.load_state_dict(local, strict=False)
        if result.missing_keys or result.unexpected_keys:
            missing = [self.global_key(k) for k in result.missing_keys]
            unexpected = [self.global_key(k) for k in result.unexpected_keys]
            raise StageError(f"{name}: load_state_dict: missing keys {missing}, unexpected keys {unexpected}")

    def adapters(self) -> dict[str, torch.Tensor]:
        """What this stage's LoRA run trains (adapters, and the biases and module copies peft
        trains), under global keys; none without `TrainConfig.lora`."""
        if not self.lora:
            return {}
        return {self.global_key(k): p.detach().clone() for k, p in self.module.named_parameters() if p.requires_grad}

    def peft_adapters(self) -> dict[str, torch.Tensor]:
        """This stage's adapters as peft saves them (`lora.peft_state`)."""
        from raypipe.nn.lora import peft_state

        return {k: v for layer in self.module for k, v in peft_state(layer).items()}

    def load_peft_adapters(self, state: dict[str, torch.Tensor]) -> list[str]:
        """Loads this stage's adapters from peft's saved names (`lora.load_peft_state`); returns the keys taken."""
        from raypipe.nn.lora import load_peft_state

        return sorted(k for layer in self.module for k in load_peft_state(layer, state))

    def load_adapters(self, state: dict[str, torch.Tensor], name: str) -> None:
        """Replaces this stage's adapters from global keys.

        Raises:
            StageError: the keys are not exactly this stage's adapters (`name` says whose).
        """
        if set(state) != set(self.adapters()):
            raise StageError(
                f"{name}: load_adapters: got {sorted(state)[:3]}..., expected {sorted(self.adapters())[:3]}..."
            )
        with torch.no_grad():
            params = dict(self.module.named_parameters())
            for key, value in state.items():
                params[self.local_key(key)].copy_(value)

    def export_layers(self, merge: bool) -> Iterator[tuple[int, dict[str, torch.Tensor]]]:
        """Each layer's base weights under global keys without peft's wrapping, with the adapters
        folded in when `merge` (what a library's own format holds), one layer at a time and
        uncopied where nothing changes them, so an export holds one layer's new tensors at most."""
        from raypipe.nn.lora import dense_state

        for j, layer in enumerate(self.module):
            state = dense_state(layer, merge) if self.lora else layer.state_dict()
            yield self.indices[j], {f"{self.indices[j]}.{k}": v.detach() for k, v in state.items()}

    def gradients(self) -> dict[str, torch.Tensor]:
        """The last step's gradients under global keys (every key of a tied weight); this rank's shards."""
        return {
            self.global_key(k): p.grad.detach().clone()
            for k, p in self.module.named_parameters(remove_duplicate=False)
            if p.grad is not None
        }

    def _tie(self, tied: Sequence[Sequence[str]]) -> dict[int, nn.Parameter]:
        """Makes the keys of each tied group held here one Parameter (the first key's); returns
        group index -> that Parameter, for the groups this stage holds a key of."""
        held = {}
        for g, group in enumerate(tied):
            local = [self.local_key(k) for k in group if int(k.partition(".")[0]) in self.local]
            if not local:
                continue
            first = self.module.get_parameter(local[0])
            for key in local[1:]:
                parent, _, name = key.rpartition(".")
                owner = self.module.get_submodule(parent)
                if owner.get_parameter(name).shape != first.shape:
                    raise StageError(
                        f"tied weights {group[0]} and {key} differ in shape: "
                        f"{tuple(first.shape)} vs {tuple(owner.get_parameter(name).shape)}"
                    )
                setattr(owner, name, first)
            held[g] = first
        return held

    def shard_state(self, local: dict[str, Any]) -> dict[str, Any]:
        """Full tensors under local keys -> this tp rank's shards (replicated ones unchanged)."""
        if self.tp.size == 1:
            return local
        return {
            k: shard(v, self.shard_specs[k], self.tp.rank, self.tp.size) if k in self.shard_specs else v
            for k, v in local.items()
        }

    def _build(self, spec: LayerSpec, seed: int, index: int, j: int) -> nn.Module:
        """Builds the whole layer under its seed, then keeps this tp rank's shard of it (and this ep
        rank's experts)."""
        try:
            with building(self.tp):
                layer = parallelize(build_layer(spec, seed, index), self.tp)
            if self.ep.size > 1:
                specs = shard_specs(layer)
                dropped = shard_experts(layer, self.ep)
                self.foreign |= {f"{j}.{k}" for k in dropped}
                self.foreign_specs.update({f"{j}.{k}": specs[k] for k in dropped if k in specs})
            return layer
        except Exception as error:
            raise StageError(f"layer {index} {spec!r} failed to build: {type(error).__name__}: {error}") from error


def resolve_device(name: str, kind: str, allow_cpu_fallback: bool) -> tuple[torch.device, bool]:
    """The torch device for a stage placed for `kind`, and whether it fell back to the CPU.

    Ray sets the visible devices of cuda/rocm actors, so their device is always cuda:0.

    Raises:
        StageError: no such device here and no fallback allowed; says how to fix it.
    """
    import ray

    if kind in ("cuda", "rocm") and torch.cuda.is_available():
        return torch.device("cuda", 0), False
    if kind == "mps" and torch.backends.mps.is_available():
        return torch.device("mps"), False
    if kind == "cpu":
        return torch.device("cpu"), False
    if allow_cpu_fallback:
        return torch.device("cpu"), True
    node = ray.get_runtime_context().get_node_id()[:12]
    raise StageError(
        f"{name} was placed for {kind} on node {node}, but torch there sees no {kind} device "
        f"(torch {torch.__version__}, cuda {torch.version.cuda}, hip {getattr(torch.version, 'hip', None)}). "
        f"Install a {kind} build of torch on that node, fix the node's advertised resources "
        f"(`raypipe node-resources`), or set TrainConfig.allow_cpu_fallback=True for a test."
    )


def gpu_identity(device: torch.device) -> str | None:
    """Which physical GPU `device` is (its UUID, else its PCI bus id), so the driver can tell
    actors that share one (NCCL refuses two ranks on a GPU); None off CUDA. Every actor sees its
    GPU as cuda:0 (Ray sets the visible devices), so the index says nothing."""
    if device.type != "cuda":
        return None
    props = torch.cuda.get_device_properties(device)
    uuid = getattr(props, "uuid", None)
    if uuid is not None:
        return str(uuid)
    return f"pci {props.pci_domain_id:04x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}"


def weights_dtype(params: Sequence[torch.Tensor]) -> torch.dtype:
    """The floating dtype holding most of `params`' elements; float32 where none is floating (a
    stage of activations, or of quantized weights only). LoRA adapters kept in float32 beside a
    bf16 base count for their few elements."""
    elements: dict[torch.dtype, int] = {}
    for p in params:
        if p.is_floating_point():
            elements[p.dtype] = elements.get(p.dtype, 0) + p.numel()
    return max(elements, key=elements.__getitem__) if elements else torch.float32
