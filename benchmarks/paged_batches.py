"""Random paged batches for checking the kernels against the reference (tests on CPU, benchmarks on a GPU)."""
from __future__ import annotations

import random
from dataclasses import dataclass

import torch


@dataclass(slots=True)
class PagedBatch:
    """One attention call's inputs, plus the new keys/values and slots that fill its (NaN) caches."""
    query: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    block_tables: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    slot_mapping: torch.Tensor

    def attention_args(self, scale: float) -> tuple:
        return (self.query, self.key_cache, self.value_cache, self.block_tables, self.query_start_loc,
                self.seq_lens, scale)


def random_paged_batch(rng: random.Random, chunks: list[tuple[int, int]], block_size: int, head_dim: int,
                       queries_per_kv: int, num_kv_heads: int, dtype: torch.dtype,
                       device: str | torch.device = "cpu") -> PagedBatch:
    """Sequences given as (cached context, new chunk), on shuffled pages. The caches start as NaN, so a
    kernel that reads a slot the reference does not (the null block, a page's tail past the sequence, a
    padding table entry) poisons its output; `key`/`value` hold every position's entry, to be stored at
    `slot_mapping` (a -1 padding slot between sequences)."""
    seq_lens = [context + chunk for context, chunk in chunks]
    pages = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(pages) + 4  # + the null block and spares that stay NaN
    ids = list(range(1, num_blocks))
    rng.shuffle(ids)
    # one padding column beyond the longest sequence: entries 0 point at the (NaN) null block
    block_tables = torch.zeros(len(chunks), max(pages) + 1, dtype=torch.int32)
    slots = []
    for s, (n, n_pages) in enumerate(zip(seq_lens, pages)):
        block_tables[s, :n_pages] = torch.tensor(ids[:n_pages], dtype=torch.int32)
        ids = ids[n_pages:]
        slots += [int(block_tables[s, p // block_size]) * block_size + p % block_size for p in range(n)]
        slots.append(-1)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    gen = torch.Generator().manual_seed(rng.randrange(2**31))
    kv_shape = (len(slots), num_kv_heads, head_dim)
    query_start_loc = torch.tensor([0] + [c for _, c in chunks], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    num_queries = int(query_start_loc[-1])
    return PagedBatch(
        query=torch.randn(num_queries, num_kv_heads * queries_per_kv, head_dim, generator=gen).to(device, dtype),
        key_cache=torch.full(shape, float("nan"), dtype=dtype, device=device),
        value_cache=torch.full(shape, float("nan"), dtype=dtype, device=device),
        block_tables=block_tables.to(device),
        query_start_loc=query_start_loc.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        key=torch.randn(kv_shape, generator=gen).to(device, dtype),
        value=torch.randn(kv_shape, generator=gen).to(device, dtype),
        slot_mapping=torch.tensor(slots, dtype=torch.int32, device=device),
    )
