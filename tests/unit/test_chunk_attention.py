"""A sequence chunk's attention block by block (`raypipe.nn.chunk_attention`) against torch's
SDPA over the joined keys: outputs and the gradients of query, keys and values, chunk by chunk,
with grouped-query heads, under a plain causal mask, left padding, and a sliding window that
hides an earlier chunk entirely (its block is skipped)."""

import pytest
import torch
import torch.nn.functional as F

from raypipe.nn import chunk_attention

SIZES = (5, 4, 3)  # unequal chunks of a 12-token sequence


def masks(kind: str, batch: int, length: int) -> torch.Tensor | None:
    """The whole sequence's (batch, 1, query, key) boolean mask, True where a query sees a key."""
    if kind == "causal":
        return None
    q = torch.arange(length).unsqueeze(1)
    k = torch.arange(length).unsqueeze(0)
    seen = (k <= q).expand(batch, 1, length, length).clone()
    if kind == "padding":  # the second row's first 3 tokens are padding: no query sees them
        seen[1, :, :, :3] = False
        seen[1, :, :3, :] |= torch.eye(length, dtype=torch.bool)[:3]  # as transformers: a padded row sees itself
    if kind == "window":
        seen &= k > q - 3
    return seen


@pytest.mark.parametrize("kind", ["causal", "padding", "window"])
def test_blocks_merged_by_log_sum_exp_equal_attention_over_the_joined_keys(kind):
    torch.manual_seed(0)
    batch, heads, kv_heads, dim, length = 2, 4, 2, 8, sum(SIZES)
    q = torch.randn(batch, heads, length, dim, dtype=torch.float64, requires_grad=True)
    k = torch.randn(batch, kv_heads, length, dim, dtype=torch.float64, requires_grad=True)
    v = torch.randn(batch, kv_heads, length, dim, dtype=torch.float64, requires_grad=True)
    mask = masks(kind, batch, length)
    whole = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=True, scale=0.3)
    grad = torch.randn_like(whole)
    expected = torch.autograd.grad(whole, (q, k, v), grad)

    chunks_q, chunks_k, chunks_v = (t.split(SIZES, dim=2) for t in (q, k, v))
    outs, start = [], 0
    for c, size in enumerate(SIZES):
        end = start + size
        chunk_mask = None if mask is None else mask[:, :, start:end, :end]
        outs.append(
            chunk_attention.attend(chunks_q[c], list(chunks_k[: c + 1]), list(chunks_v[: c + 1]), chunk_mask, scale=0.3)
        )
        start = end
    torch.testing.assert_close(torch.cat(outs, dim=2), whole, rtol=1e-10, atol=1e-10)
    got = torch.autograd.grad(torch.cat(outs, dim=2), (q, k, v), grad)
    for name, a, b in zip("qkv", got, expected):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10, msg=f"d{name}")


def test_a_block_the_window_hides_is_skipped_and_only_the_supported_kernel_is_claimed():
    seen = masks("window", 1, 12)[:, :, 9:12, :12]  # the last chunk: the first chunk (0..4) is out of its window
    plan = chunk_attention.block_plan(torch.zeros(1, 1, 3, 8), [torch.zeros(1, 1, n, 8) for n in SIZES], seen)
    assert plan[0] == (False, False) and plan[1][1] is not None and plan[2] == (True, None), plan
    assert chunk_attention.supported(torch.zeros(1, dtype=torch.float32))
    assert not chunk_attention.supported(torch.zeros(1), dropout=0.1)
    assert not chunk_attention.supported(torch.zeros(1, dtype=torch.float16))


def test_bfloat16_chunks_merge_in_float32_and_give_bfloat16_within_its_precision():
    """The unmasked merge (one block for the first chunk, two after) in bfloat16: outputs and
    gradients in bfloat16, as close to float64 attention over the joined keys as bfloat16 allows."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, sum(SIZES), 8, dtype=torch.float64) for _ in range(3))
    whole = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    low = [t.bfloat16().requires_grad_() for t in (q, k, v)]
    chunks_q, chunks_k, chunks_v = (t.split(SIZES, dim=2) for t in low)
    outs = [chunk_attention.attend(chunks_q[c], list(chunks_k[: c + 1]), list(chunks_v[: c + 1])) for c in range(3)]
    out = torch.cat(outs, dim=2)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), whole, rtol=0, atol=2e-2)
    grads = torch.autograd.grad(out, low, torch.ones_like(out))
    expected = torch.autograd.grad(
        F.scaled_dot_product_attention(*(t.requires_grad_() for t in (q, k, v)), is_causal=True).sum(), (q, k, v)
    )
    for name, a, b in zip("qkv", grads, expected):
        assert a.dtype == torch.bfloat16, name
        torch.testing.assert_close(a.double(), b, rtol=0, atol=5e-2, msg=f"d{name}")
