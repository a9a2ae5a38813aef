"""Peak resident memory as the stage actors report it, on Linux and on macOS, and the loss that
keeps a large vocabulary's transients off the peak."""

import contextlib
import resource
import sys

import torch

from raypipe.actors.step.memory import count_saved_bytes, max_rss_bytes


def test_ru_maxrss_is_kib_on_linux_and_bytes_on_macos():
    assert max_rss_bytes(2048, "linux") == 2 * 2**20
    assert max_rss_bytes(2 * 2**20, "darwin") == 2 * 2**20
    assert max_rss_bytes(2048, "freebsd14") == 2 * 2**20


def test_this_process_peak_is_plausible():
    """Allocate and touch 256 MiB: the peak reported must be at least that and under the machine's memory."""
    block = torch.ones(64 * 2**20)  # 256 MiB of fp32, written
    peak = max_rss_bytes(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, sys.platform)
    del block
    assert 256 * 2**20 <= peak < 64 * 2**30


def test_saved_bytes_count_what_a_microbatch_spans_not_the_whole_batch_storage():
    """A microbatch is a row slice of the stacked batch: its Linear saves the slice (4 x 16 floats),
    not the 16 x 16 batch; the same tensor saved twice counts once."""
    batch = torch.randn(16, 16)
    layer = torch.nn.Linear(16, 16)
    with count_saved_bytes() as saved:
        layer(batch[4:8].requires_grad_(False)).sum()
    assert saved.bytes == 4 * 16 * 4
    x = torch.randn(8, 16, requires_grad=True)
    with count_saved_bytes() as saved:
        (x * x).sum()  # saves x for both operands
    assert saved.bytes == 8 * 16 * 4
    qkv = torch.randn(4, 3 * 16, requires_grad=True) * 1.0
    with count_saved_bytes() as saved:  # q, k, v: strided views that each stretch over the storage
        q, k, v = qkv.split(16, dim=1)
        (q * k).sum() + (v * k).sum()  # saves q, k, v and k again, nothing else
    assert saved.bytes == 4 * 3 * 16 * 4  # the storage once, not three times


def test_a_layers_own_weights_are_not_counted_as_activations():
    """A linear saves its weight to compute its input's gradient: memory the stage holds anyway."""
    from raypipe.actors.step.memory import weight_storages

    layer = torch.nn.Linear(16, 32)
    x = torch.randn(4, 16, requires_grad=True)
    with count_saved_bytes() as everything:
        layer(x).sum()
    with count_saved_bytes(weights=weight_storages(layer)) as activations:
        layer(x).sum()
    assert activations.bytes == 4 * 16 * 4  # the input only
    assert everything.bytes == activations.bytes + 32 * 16 * 4


def test_the_vocabulary_loss_matches_cross_entropy_and_makes_nothing_of_the_logits_size(monkeypatch):
    """The LLM loss in blocks of rows: loss and gradient equal `F.cross_entropy` after transformers'
    upcast (to rounding; a bf16 model's gradient exactly but for a rare element, one of whose
    softmax terms rounds to bf16 the other way from a float32 sum in another order: 12 of 2,048 at
    seed 2, 2 at seed 7, none at seeds 0-1 and 3-6), and no tensor its forward or backward makes is
    as big as the logits (what made a 150k vocabulary's LoRA peak 1.57x its parameters)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    from raypipe.nn import cross_entropy

    class LargestMade(TorchDispatchMode):
        largest = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
            inputs = {t.untyped_storage().data_ptr() for t in tensors}
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                    self.largest = max(self.largest, t.numel())
            return out

    def plain(logits, targets):
        return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), targets.flatten())

    monkeypatch.setattr(cross_entropy, "BLOCK_ELEMENTS", 8 * 1000)  # blocks of 8 of the 64 rows
    torch.manual_seed(2)  # the same data whatever ran before (one with elements a bf16 step apart)
    hidden, head = torch.randn(4, 16, 32), torch.randn(1000, 32)
    targets = torch.randint(0, 1000, (4, 16))
    targets[0, :5] = cross_entropy.IGNORE
    for dtype, exact in ((torch.float32, False), (torch.bfloat16, True)):

        def loss_and_grad(loss_fn, watch=None):
            x = hidden.clone().requires_grad_(True)
            logits = x.to(dtype) @ head.to(dtype).T
            with watch or contextlib.nullcontext():
                loss = loss_fn(logits, targets) * 0.25  # the executor's scale: weight / microbatches
                loss.backward()
            return loss.detach(), x.grad

        reference = loss_and_grad(plain)
        watch = LargestMade()
        blocked = loss_and_grad(cross_entropy.chunked_cross_entropy, watch)
        torch.testing.assert_close(blocked[0], reference[0])  # a sum in another order
        if exact:  # all but a few elements bit for bit, those within one bf16 step of the gradient's scale
            step = 2**-8 * float(reference[1].abs().max())
            torch.testing.assert_close(blocked[1], reference[1], rtol=0, atol=step)
            assert (blocked[1] == reference[1]).float().mean() > 0.99
        else:
            torch.testing.assert_close(blocked[1], reference[1])
        assert 0 < watch.largest <= 8 * 1000, (dtype, watch.largest)


def test_a_tied_head_from_its_file_gives_linears_logits_and_gradient_a_block_at_a_time(tmp_path):
    """`FileLinear` over a mapped file, four blocks of rows: the logits and the input's gradient of
    `F.linear` (within fp32 rounding: the gradient sums the blocks in turn), the weight's pages
    handed back after each pass and its values the file's still; a weight written since it was
    mapped is multiplied whole, its pages kept."""
    import os

    from torch import nn

    from raypipe.actors.step.memory import resident_bytes_of
    from raypipe.nn import file_tables

    torch.manual_seed(0)
    weight = torch.randn(4096, 64)  # 1 MiB
    path = str(tmp_path / "head.bin")
    weight.numpy().tofile(path)
    storage = torch.UntypedStorage.from_file(path, False, os.path.getsize(path))
    head = nn.Linear(64, 4096, bias=False)
    head.weight = nn.Parameter(torch.empty(0).set_(storage, 0, (4096, 64)), requires_grad=False)
    made = file_tables.read_tables_from_files(nn.Sequential(head), {id(head.weight): path}, [head.weight])
    assert made == ["0"] and type(head) is file_tables.FileLinear
    head.block_rows = 1024
    x = torch.randn(3, 5, 64, requires_grad=True)
    logits = head(x)
    logits.pow(2).sum().backward()
    assert resident_bytes_of({path}) < weight.numel() * 4 / 8  # blocks released (fault-around may keep a few)
    reference = x.detach().requires_grad_()
    want = torch.nn.functional.linear(reference, weight)
    want.pow(2).sum().backward()
    torch.testing.assert_close(logits, want, rtol=1e-6, atol=1e-6)
    assert (x.grad - reference.grad).norm() / reference.grad.norm() < 1e-6  # 4,096 terms summed in another order
    assert torch.equal(head.weight, weight)  # refaulted from the file: its values unchanged
    with torch.no_grad():
        head.weight[0] = 0.0  # written: its page is the process's own now, never to be dropped
    head(x)
    assert head.weight[0].abs().sum() == 0 and torch.equal(head.weight[1:], weight[1:])
