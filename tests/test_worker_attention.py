"""The CPU attention paths (kernels.cpu_attention and the reference) against dense causal attention written
out by hand.

The worker's tokens already match transformers through them; this pins the batched decode path
(grouping, padding, GQA) on its own, with every slot it must not read set to NaN."""
from __future__ import annotations

import pytest
import torch
from worker_oracle import single_thread  # noqa: F401 (fixture)

from kernels import cpu_attention, reference
from kernels import native as cpu_native


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q `[q_len, heads, d]` are the last q_len of the seq_len positions of k/v `[seq_len, kv_heads, d]`."""
    q_len, heads, _ = q.shape
    seq_len, kv_heads, _ = k.shape
    k = k.repeat_interleave(heads // kv_heads, dim=1)
    v = v.repeat_interleave(heads // kv_heads, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k.double()) * scale
    q_pos = torch.arange(seq_len - q_len, seq_len)[:, None]
    scores = scores.masked_fill(torch.arange(seq_len)[None, :] > q_pos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), v.double()).float()


@pytest.mark.parametrize("backend,native", [(cpu_attention, True), (cpu_attention, False), (reference, False)])
@pytest.mark.parametrize("group_elements", [1 << 24, 1 << 12])  # one decode batch, or many small ones
def test_mixed_batch_matches_dense_attention(backend, native, group_elements, monkeypatch):
    """The CPU backend with its C decode kernel (`native`) and with its torch gathers (no C kernels)."""
    monkeypatch.setattr(backend, "_DECODE_GROUP_ELEMENTS", group_elements)
    kernel = {"kernel": cpu_native.load() if native else None} if backend is cpu_attention else {}
    gen = torch.Generator().manual_seed(0)
    block_size, kv_heads, heads, dim, scale = 8, 2, 6, 16, 0.3
    # (context already cached, new tokens): decodes of many lengths, prefill chunks, a whole prompt, an idle slot
    chunks = [(0, 1), (40, 1), (7, 1), (0, 19), (30, 5), (15, 1), (63, 1), (8, 8), (0, 0), (3, 1)]
    seq_lens = [c + n for c, n in chunks]
    pages = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(pages) + 3
    order = torch.randperm(num_blocks - 1, generator=gen).add(1).tolist()  # shuffled pages, 0 is null
    tables = torch.zeros(len(chunks), max(pages) + 2, dtype=torch.int32)
    key_cache = torch.full((num_blocks, block_size, kv_heads, dim), float("nan"))
    value_cache = torch.full_like(key_cache, float("nan"))
    keys, values = [], []
    for s, (n, p) in enumerate(zip(seq_lens, pages)):
        tables[s, :p] = torch.tensor(order[:p], dtype=torch.int32)
        order = order[p:]
        k, v = torch.randn(n, kv_heads, dim, generator=gen), torch.randn(n, kv_heads, dim, generator=gen)
        slots = torch.tensor([int(tables[s, i // block_size]) * block_size + i % block_size for i in range(n)])
        reference.store_kv(k, v, key_cache, value_cache, slots)
        keys.append(k)
        values.append(v)
    new = [n for _, n in chunks]
    query_start_loc = torch.tensor([0] + torch.tensor(new).cumsum(0).tolist(), dtype=torch.int32)
    query = torch.randn(sum(new), heads, dim, generator=gen)
    out = backend.paged_attention(query, key_cache, value_cache, tables, query_start_loc,
                                  torch.tensor(seq_lens, dtype=torch.int32), scale, **kernel)
    for s, (start, n) in enumerate(zip(query_start_loc.tolist(), new)):
        if n:
            expected = dense_attention(query[start:start + n], keys[s], values[s], scale)
            torch.testing.assert_close(out[start:start + n], expected, atol=1e-5, rtol=1e-5)
