"""ZeRO stage 3 inside a pipeline stage: its data-parallel replicas shard its parameters, and
each layer's weights are gathered just before its forward and its backward and freed after.

Between uses a parameter keeps its shape but no memory: its storage is resized to nothing
(as torch's first FSDP did), so the tensors autograd saved in the forward, which share that
storage, see the weights again when the backward gathers them into it. Each replica holds,
per parameter, one slice of the flattened (zero-padded) tensor: the one its optimizer steps,
in float32 when the weight is stored narrower (the slice is then the fp32 master).

When a layer is gathered:
- forward: a pre-hook gathers it, a post-hook frees it;
- backward: an identity function on its outputs gathers it when their gradient arrives, one
  on its inputs frees it when theirs leaves (a first layer whose inputs need no gradient is
  freed when the action ends); a layer of embeddings only is not gathered, since an embedding's
  gradient does not read its weight (a vocabulary's table is often the stage's largest layer,
  and its backward comes last, when the step's gradients are all whole);
- a split-backward W gathers its chunk's layers whole (its autograd graph may read them);
- outside a step, the trainer pins every layer gathered on every replica (`hold`) for what
  reads whole weights: evaluation, generation, state dicts, exports and checkpoints.

Gradients accumulate whole over the step's microbatches (as torchtitan's pipelined FSDP does,
so a layer is not reduced once per microbatch); the step's end averages them over the
replicas and keeps this replica's slice.

Failures: every gather is preceded by a one-number gather of "has a replica failed". A replica
that fails announces it at once through one such gather; the others learn it at their next
gather and stop too, so no replica waits for a collective the failed one will never make.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from raypipe.core.errors import StageError
from raypipe.transport.stream import PeerFailed
from raypipe.transport.tree import map_tensors

NARROW = (torch.bfloat16, torch.float16)
DIRECT = 1024  # elements from which an evenly splitting parameter is gathered straight into its storage


class PeerReplicaFailed(PeerFailed):
    """Another data-parallel replica of this stage failed in this step (it reports its own error)."""


class ShardedStage:
    """ZeRO-3 over a stage's layers (`layers`, the modules its executor runs) among the `size`
    replicas of `group` (this one `rank`).

    Attributes:
        slices: each parameter's slice held here (1-D, `ceil(numel / size)` elements); those of
            trainable parameters are leaf tensors the optimizer steps (`master`).
        counts: parameter -> how many gathered uses hold it now (0: freed).
    """

    def __init__(self, layers: Sequence[nn.Module], rank: int, size: int, group: dist.ProcessGroup | None) -> None:
        self.layers, self.rank, self.size, self.group = list(layers), rank, size, group
        self.layer_params = [list(dict.fromkeys(layer.parameters())) for layer in self.layers]
        self.params = list(dict.fromkeys(p for ps in self.layer_params for p in ps))
        for name, p in ((n, p) for layer in self.layers for n, p in layer.named_parameters()):
            storage = p.data.untyped_storage()
            if not p.is_contiguous() or p.storage_offset() or storage.nbytes() != p.numel() * p.element_size():
                raise StageError(
                    f"zero=3 shards each parameter in its own storage, but {name} shares one or is not "
                    f"contiguous: give the layer separate parameters, or use zero=1."
                )
        self.device = self.params[0].device if self.params else torch.device("cpu")  # nccl gathers device tensors
        self.slices: dict[nn.Parameter, torch.Tensor] = {}
        for p in self.params:
            piece = self.slice_of(p, p.data).clone()
            if p.requires_grad:
                piece = nn.Parameter(piece.float() if p.dtype in NARROW else piece)
            self.slices[p] = piece
            # a storage of its own that can be resized (a tensor read from a file may not be),
            # freed at once (on an accelerator it would otherwise hold a second copy of the stage)
            p.data = torch.empty(p.shape, dtype=p.dtype, device=p.device)
            _free(p)
        self.counts = dict.fromkeys(self.params, 0)
        self.pinned = 0
        self.stepping = False  # gathers happen inside a step (or pinned): a lone replica would wait forever
        self.final_sent = False  # this step's failure gather is done (its last gather of the step)
        self.handles = [h for j, layer in enumerate(self.layers) for h in self._hook(j, layer)]

    # ----- slices ------------------------------------------------------------------

    def chunk(self, p: torch.Tensor) -> int:
        return math.ceil(p.numel() / self.size)

    def slice_of(self, p: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
        """This replica's slice of `full` (a tensor shaped like `p`): flattened, zero-padded."""
        k = self.chunk(p)
        flat = full.reshape(-1)
        piece = flat[self.rank * k : (self.rank + 1) * k]
        if piece.numel() < k:
            piece = torch.cat([piece, flat.new_zeros(k - piece.numel())])
        return piece

    def master(self, p: nn.Parameter) -> torch.Tensor:
        """The tensor the optimizer steps for `p`: its slice held here."""
        return self.slices[p]

    def local_state(self, p: nn.Parameter, value: object) -> object:
        """An optimizer-state entry loaded whole (shaped like `p`) cut to this replica's slice."""
        if torch.is_tensor(value) and value.dim() > 0 and value.numel() == p.numel():
            return self.slice_of(p, value).clone()
        return value

    def whole_state(self, p: nn.Parameter, pieces: Sequence[Any]) -> Any:
        """An optimizer-state entry put back together from every replica's slice (rank order)."""
        first = pieces[0]
        if torch.is_tensor(first) and first.dim() == 1 and first.numel() == self.chunk(p):
            return torch.cat(list(pieces))[: p.numel()].reshape(p.shape)
        return first

    def resident_bytes(self) -> int:
        """Bytes of parameters held at a step's peak: every slice, and the largest layer whole."""
        largest = max((sum(p.numel() * p.element_size() for p in ps) for ps in self.layer_params), default=0)
        return largest + sum(s.numel() * s.element_size() for s in self.slices.values())

    def gradient_bytes(self) -> int:
        """Bytes of a step's gradients: whole over the microbatches, then this replica's slices."""
        whole = sum(p.numel() * p.element_size() for p in self.params if p.requires_grad)
        return whole + sum(s.grad.numel() * s.grad.element_size() for s in self.slices.values() if s.grad is not None)

    # ----- gathering ------------------------------------------------------------------

    def acquire(self, params: Iterable[nn.Parameter]) -> None:
        """Holds `params` whole, gathering those not held (a collective of the replicas)."""
        params = list(params)
        if self.pinned:
            return
        missing = [p for p in params if self.counts[p] == 0]
        if missing:
            if not self.stepping:
                raise StageError(
                    "zero=3: this stage's weights are sharded across its data-parallel replicas; "
                    "outside a training step read them through the Trainer (evaluate, state_dict, ...), "
                    "which gathers them on every replica."
                )
            self._check_peers()
            self._gather(missing)
        for p in params:
            self.counts[p] += 1

    def release(self, params: Iterable[nn.Parameter]) -> None:
        """Ends one use of `params`; a parameter no use holds gives its memory back."""
        if self.pinned:
            return
        for p in params:
            if self.counts[p] > 0:
                self.counts[p] -= 1
                if self.counts[p] == 0:
                    _free(p)

    def settle(self) -> None:
        """Frees whatever an action left gathered (a first layer's backward, a W's chunk)."""
        if self.pinned:
            return
        for p, count in self.counts.items():
            if count:
                self.counts[p] = 0
                _free(p)

    def _gather(self, params: list[nn.Parameter]) -> None:
        """All-gathers `params` into their own storages: straight into it for a parameter that
        splits evenly (no second copy of a large one, such as an embedding), the others (biases,
        norms, odd sizes) through one buffer per dtype."""
        by_dtype: dict[torch.dtype, list[nn.Parameter]] = {}
        for p in params:
            if p.numel() % self.size == 0 and p.numel() >= DIRECT:
                _refill(p)
                self._all_gather(p.data.view(-1), self.slices[p].detach().to(p.dtype))
            else:
                by_dtype.setdefault(p.dtype, []).append(p)
        for dtype, group in by_dtype.items():
            mine = torch.cat([self.slices[p].detach().to(dtype) for p in group])
            out = mine.new_empty(self.size * mine.numel())
            self._all_gather(out, mine)
            rows = out.view(self.size, mine.numel())
            offset = 0
            for p in group:
                k = self.chunk(p)
                _refill(p)
                p.data.view(-1).copy_(rows[:, offset : offset + k].reshape(-1)[: p.numel()])
                offset += k

    def _all_gather(self, out: torch.Tensor, mine: torch.Tensor) -> None:
        """Every replica's `mine`, in rank order, into `out`. On the host, one broadcast per replica
        straight into its part of `out`: gloo's all-gather copies its whole output through a buffer
        of its own (a second 519 MB for Qwen2's embedding), its broadcast does not."""
        if out.device.type == "cpu":
            k = mine.numel()
            for r in range(self.size):
                part = out[r * k : (r + 1) * k]
                if r == self.rank:
                    part.copy_(mine)
                dist.broadcast(part, group_src=r, group=self.group)
            return
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather(out, mine, group=self.group)

    # ----- the failure protocol -------------------------------------------------------

    def _check_peers(self) -> None:
        """The gather of "has a replica failed" before each data gather."""
        if self.final_sent:
            raise PeerReplicaFailed("a data-parallel replica of this stage failed in this step")
        if self._any_failed(False):
            self.final_sent = True
            raise PeerReplicaFailed("a data-parallel replica of this stage failed in this step")

    def _any_failed(self, failed: bool) -> bool:
        flags = torch.zeros(self.size, device=self.device)
        self._all_gather(flags, torch.tensor([float(failed)], device=self.device))
        return bool(flags.sum() > 0)

    def announce(self, failed: bool) -> None:
        """This step's last failure gather, made once: at a failure (`failed`), or at the step's
        end; the replicas meet in it whichever way each arrives."""
        if not self.final_sent:
            self.final_sent = True
            self._any_failed(failed)

    def begin_step(self) -> None:
        self.settle()
        self.final_sent = False
        self.stepping = True

    def end_step(self, failed: bool) -> None:
        self.announce(failed)
        self.settle()
        self.stepping = False

    # ----- outside steps --------------------------------------------------------------

    def hold(self, on: bool, gradients: bool = False) -> None:
        """Pins every parameter whole (`on`, a collective: every replica calls it), with the last
        step's gradients put together when `gradients`; or unpins and frees them."""
        if on:
            self.pinned += 1
            if self.pinned == 1:
                self.stepping, self.final_sent = True, False
                self._gather([p for p in self.params if self.counts[p] == 0])
                self.stepping = False
                if gradients:
                    self._gather_gradients()
            return
        self.pinned -= 1
        if self.pinned == 0:
            for p in self.params:
                self.counts[p] = 0
                p.grad = None
                _free(p)

    def _gather_gradients(self) -> None:
        for p in self.params:
            grad = self.slices[p].grad
            if grad is None:
                continue
            out = grad.new_empty(self.size * grad.numel())
            self._all_gather(out, grad.detach())
            p.grad = out[: p.numel()].reshape(p.shape).to(p.dtype)

    def reshard(self) -> None:
        """Takes this replica's slices from the whole weights just loaded into the parameters."""
        with torch.no_grad():
            for p in self.params:
                self.slices[p].copy_(self.slice_of(p, p.data))

    def keep_gradient_slices(self, params: Iterable[nn.Parameter]) -> None:
        """After the replicas' gradients were averaged whole: each slice's gradient is this
        replica's part of its parameter's (float32 for a float32 slice), the whole one is dropped."""
        for p in params:
            piece = self.slices[p]
            grad = torch.zeros_like(piece) if p.grad is None else self.slice_of(p, p.grad).to(piece.dtype)
            piece.grad = grad.clone()
            p.grad = None

    # ----- hooks --------------------------------------------------------------------

    def _hook(self, j: int, layer: nn.Module) -> list[object]:
        params = self.layer_params[j]
        if not params:
            return []
        lookup_only = all(isinstance(m, nn.Embedding) for m in layer.modules() if list(m.parameters(recurse=False)))

        def before(module: nn.Module, args: tuple) -> tuple:
            self.acquire(params)
            if torch.is_grad_enabled() and not self.pinned:
                return map_tensors(lambda t: _OnBackward.apply(self.release, params, t) if t.requires_grad else t, args)
            return args

        def after(module: nn.Module, args: tuple, output: Any) -> Any:
            if torch.is_grad_enabled() and not self.pinned and not lookup_only:
                output = map_tensors(
                    lambda t: _OnBackward.apply(self.acquire, params, t) if t.requires_grad else t, output
                )
            self.release(params)
            return output

        return [layer.register_forward_pre_hook(before), layer.register_forward_hook(after)]


class _OnBackward(torch.autograd.Function):
    """Identity on a tensor; its backward calls `then(params)` first: on a layer's output that
    gathers the layer before its own backward, on its input it frees the layer after."""

    @staticmethod
    def forward(ctx: Any, then: Callable[[list[nn.Parameter]], None], params: list, t: torch.Tensor) -> torch.Tensor:
        ctx.then, ctx.params = then, params
        return t.view_as(t)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        ctx.then(ctx.params)
        return None, None, grad


def _free(p: torch.Tensor) -> None:
    p.data.untyped_storage().resize_(0)


def _refill(p: torch.Tensor) -> None:
    """Gives a freed parameter its memory back (its contents are the gather's to write)."""
    p.data.untyped_storage().resize_(p.numel() * p.element_size())


def hold(sharded: ShardedStage | None, on: bool, gradients: bool = False) -> None:
    """`ShardedStage.hold` where the stage is sharded (ZeRO-3); nothing otherwise."""
    if sharded is not None:
        sharded.hold(on, gradients)


@contextlib.contextmanager
def whole(sharded: ShardedStage | None, loading: bool = False) -> Iterator[None]:
    """Every weight whole inside the block (a collective of the stage's replicas; nothing without
    ZeRO-3); with `loading`, each replica then takes its slices of what was loaded into them."""
    if sharded is None:
        yield
        return
    sharded.hold(True)
    try:
        yield
        if loading:
            sharded.reshard()
    finally:
        sharded.hold(False)
