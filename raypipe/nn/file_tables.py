"""Frozen tables a CPU stage computes with straight from the model's file, never holding them whole.

A CPU stage under LoRA keeps its frozen weights as views of the model's safetensors files
(`raypipe.models.hf.tensor_files`): the page cache's pages, one copy on the machine. Computing
through such a view maps the pages it reads into the process (the kernel maps a file's folios
whole, up to 2 MB each), so a large table soon becomes resident in the stage in full. Two tables
are large and read sparsely or once per pass: a vocabulary's embedding and its head, which a tied
model holds on its first and its last stage (Qwen2-0.5B: 545 MB on each of the two, of 1,976).

- `FileEmbedding` reads each looked-up row with one positioned read (a copy out of the page
  cache; the table is never mapped into the process) and gives the same rows bit for bit.
- `FileLinear` (a head tied to an embedding on another stage) multiplies by its weight a block of
  output rows at a time, each block a view of the mapping that is handed back to the page cache
  (`madvise(MADV_DONTNEED)`: clean pages, dropped from the process, still cached) once used; its
  backward does the same, so at most one block (32 MB) of the head is in the process at a time.
  A single block is `F.linear` itself; several give `F.linear`'s logits (each is a dot product
  over the same hidden width: bit for bit on Qwen2's head) and the input's gradient summed over
  the blocks in turn (fp32 rounding). Dropping and mapping the pages again costs about 2 % of the
  head's time, the blocks' products up to 10 % more (`benchmarks/llm_scale.py --stage-peaks`).

Either falls back to the plain module's computation once its weight is trained, replaced, moved
(ZeRO-3 gives it a storage of its own) or written (its tensor version moves), when its file is no
longer the one mapped, and inside `torch.compile` (`compile=True`), whose graphs hold plain ops.
"""

from __future__ import annotations

import collections
import ctypes
import mmap
import os
import sys

import torch
from torch import nn

BLOCK_BYTES = 32 << 20  # a head's weight multiplied this many bytes of rows at a time


class FileEmbedding(nn.Embedding):
    """`nn.Embedding` whose frozen `weight` is a view of `path` from byte `offset`: `forward` reads
    the rows of the ids it is given from the file instead of indexing the view, while the weight
    is the one it was made with and nothing has written to it (a loaded state, a trained row)."""

    path: str
    offset: int
    file: tuple[int, int]  # the mapped file's device and inode: a file put in its place is not read
    untouched: tuple[int, int, int]  # the weight's id, tensor version and address when the file was its table

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():  # `compile`: the plain lookup, which the compiler knows
            return super().forward(input)
        weight = self.weight
        if weight.requires_grad or self.max_norm is not None or fingerprint(weight) != self.untouched:
            return super().forward(input)  # the table may no longer be the file's: index the weight
        rows = read_rows(self.path, self.file, self.offset, input, weight.shape, weight.dtype)
        return super().forward(input) if rows is None else rows


def read_rows(
    path: str, file: tuple[int, int], offset: int, ids: torch.Tensor, shape: torch.Size, dtype: torch.dtype
) -> torch.Tensor | None:
    """Rows `ids` of the `shape` table of `dtype` stored in `path` from byte `offset`, as
    `F.embedding` returns them (`ids`' shape plus the row's); None when `path` is no longer the
    `file` (device, inode) the table was mapped from.

    Raises:
        IndexError: an id outside the table, as `nn.Embedding` does.
    """
    rows, width = shape
    flat = ids.reshape(-1)
    if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= rows):
        raise IndexError(f"index out of range in self: ids from {int(flat.min())} to {int(flat.max())}, {rows} rows")
    unique, where = torch.unique(flat, return_inverse=True)
    out = torch.empty(len(unique), width, dtype=dtype)
    row_bytes = width * out.element_size()
    buffer = out.view(torch.uint8).numpy()
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        stat = os.fstat(fd)
        if (stat.st_dev, stat.st_ino) != file:
            return None
        for j, row in enumerate(unique.tolist()):
            if os.preadv(fd, [buffer[j]], offset + row * row_bytes) != row_bytes:
                return None
    finally:
        os.close(fd)
    return out[where].reshape(*ids.shape, width)


class FileLinear(nn.Linear):
    """`nn.Linear` whose frozen `weight` is a view of a mapped file: multiplied a block of
    `block_rows` output rows at a time, each block's pages handed back once used (Linux)."""

    block_rows: int
    untouched: tuple[int, int, int]  # the weight's id, tensor version and address when the file was its table

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():  # `compile`: the plain product, which the compiler knows
            return super().forward(input)
        weight = self.weight
        if weight.requires_grad or fingerprint(weight) != self.untouched:
            return super().forward(input)  # its pages may be the process's own now: never drop them
        return BlockedLinear.apply(input, weight, self.bias, self.block_rows)


class BlockedLinear(torch.autograd.Function):
    """`F.linear` with a frozen weight, a block of output rows at a time, each block's pages
    released after use; gradients for the input and the bias only."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, rows: int) -> torch.Tensor:
        ctx.weight, ctx.rows, ctx.has_bias = weight, rows, bias is not None  # frozen: held, not saved
        if rows >= weight.shape[0]:
            out = torch.nn.functional.linear(x, weight, bias)
            release(weight)
            return out
        flat = x.reshape(-1, x.shape[-1])
        out = x.new_empty(flat.shape[0], weight.shape[0])
        for start in range(0, weight.shape[0], rows):
            block = weight[start : start + rows]
            torch.mm(flat, block.t(), out=out[:, start : start + rows])  # written in place: no copy
            release(block)
        if bias is not None:
            out += bias
        return out.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, None, torch.Tensor | None, None]:
        weight, rows = ctx.weight, ctx.rows
        grad_x = None
        if ctx.needs_input_grad[0] and rows >= weight.shape[0]:
            grad_x = grad.matmul(weight)  # as `F.linear`'s backward
            release(weight)
        elif ctx.needs_input_grad[0]:
            flat = grad.reshape(-1, weight.shape[0])
            total = grad.new_zeros(flat.shape[0], weight.shape[1])
            for start in range(0, weight.shape[0], rows):
                block = weight[start : start + rows]
                total.addmm_(flat[:, start : start + rows], block)  # a strided slice: no copy
                release(block)
            grad_x = total.reshape(*grad.shape[:-1], weight.shape[1])
        grad_bias = grad.reshape(-1, grad.shape[-1]).sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_x, None, grad_bias, None


def fingerprint(weight: torch.Tensor) -> tuple[int, int, int]:
    """What changes when a weight is replaced, written in place or given another storage."""
    return id(weight), weight._version, weight.data_ptr()


_libc = ctypes.CDLL(None, use_errno=True) if sys.platform == "linux" else None
PAGE = mmap.PAGESIZE


def release(block: torch.Tensor) -> None:
    """Drops the whole pages of a file view's `block` from the process (they stay in the page
    cache; touching them again maps them again). Only for views nothing has written to: a private
    page written would lose the write."""
    if _libc is None:
        return
    start = block.data_ptr()
    first, end = -(-start // PAGE) * PAGE, (start + block.numel() * block.element_size()) // PAGE * PAGE
    if end > first:
        _libc.madvise(ctypes.c_void_p(first), ctypes.c_size_t(end - first), mmap.MADV_DONTNEED)


def read_tables_from_files(
    module: nn.Module, mapped: dict[int, str], tied: list[nn.Parameter] | tuple[()] = ()
) -> list[str]:
    """Makes each frozen `nn.Embedding` of `module` whose table is a file view (`mapped`: parameter
    id -> its file) a `FileEmbedding`, and each frozen `nn.Linear` whose weight is a file view tied
    to a weight on another stage (`tied`: this stage's copies) a `FileLinear` (Linux), where no
    other module of `module` shares the weight (a head beside its embedding reads the table whole
    anyway). Returns their names."""
    users = collections.Counter(id(p) for m in module.modules() for p in m.parameters(recurse=False))
    tied_ids = {id(p) for p in tied}
    made = []
    for name, m in module.named_modules():
        weight = getattr(m, "weight", None)
        if type(m) not in (nn.Embedding, nn.Linear) or weight is None or id(weight) not in mapped:
            continue
        if weight.requires_grad or users[id(weight)] != 1 or not weight.is_contiguous():
            continue
        if type(m) is nn.Linear:
            if id(weight) in tied_ids and _libc is not None:
                m.__class__ = FileLinear
                m.block_rows = max(1, BLOCK_BYTES // (weight.shape[1] * weight.element_size()))
                m.untouched = fingerprint(weight)
                made.append(name)
            continue
        if m.max_norm is not None or not hasattr(os, "preadv"):  # renormed in place; no positioned reads
            continue
        m.__class__ = FileEmbedding
        m.path, m.offset = mapped[id(weight)], weight.data_ptr() - weight.untyped_storage().data_ptr()
        stat = os.stat(m.path)
        m.file = (stat.st_dev, stat.st_ino)
        m.untouched = fingerprint(weight)
        made.append(name)
    return made
