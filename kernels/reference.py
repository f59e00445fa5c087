"""Pure-torch paged attention: the CPU runtime path and the oracle for the Triton kernels.

Cache layout (the worker's CacheEngine allocates it, the scheduler's block tables index it): per layer, key
and value tensors `[num_blocks, block_size, num_kv_heads, head_dim]`; the token at position p of a sequence
lives in slot `block_table[p // block_size] * block_size + p % block_size`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

_DECODE_GROUP_ELEMENTS = 1 << 24  # gathered keys of one batch of decode tokens: 64 MiB in float32


def store_kv(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write `key`/`value` `[num_tokens, num_kv_heads, head_dim]` into their slots; slots < 0 are padding."""
    slots = slot_mapping.long()
    keep = slots >= 0
    if not bool(keep.all()):
        key, value, slots = key[keep], value[keep], slots[keep]
    num_blocks, block_size, heads, dim = key_cache.shape
    key_cache.view(num_blocks * block_size, heads, dim).index_copy_(0, slots, key.to(key_cache.dtype))
    value_cache.view(num_blocks * block_size, heads, dim).index_copy_(0, slots, value.to(value_cache.dtype))


def paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    block_tables: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                    scale: float) -> torch.Tensor:
    """Causal attention of variable-length query chunks over their sequences' paged KV.

    query `[num_tokens, num_q_heads, head_dim]` holds sequence s's new tokens at rows
    `query_start_loc[s]:query_start_loc[s+1]`; they are the last tokens of its `seq_lens[s]` tokens,
    whose keys/values (new ones included) are already in the cache. Returns `[num_tokens, num_q_heads, head_dim]`.
    """
    out = torch.empty_like(query)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    decodes = []
    for s, seq_len in enumerate(lens):
        q_len = starts[s + 1] - starts[s]
        if q_len == 1:
            decodes.append(s)
        elif q_len > 1:
            _chunk_attention(query, key_cache, value_cache, block_tables, starts[s], q_len, seq_len, s, scale, out)
    # decode tokens (one query each) attend in batches, sorted by length so padding stays small
    decodes.sort(key=lambda s: lens[s])
    _, _, kv_heads, dim = key_cache.shape
    group: list[int] = []
    for s in decodes:
        if group and (len(group) + 1) * lens[s] * kv_heads * dim > _DECODE_GROUP_ELEMENTS:
            _decode_attention(query, key_cache, value_cache, block_tables, query_start_loc, seq_lens, group, scale,
                              out)
            group = []
        group.append(s)
    if group:
        _decode_attention(query, key_cache, value_cache, block_tables, query_start_loc, seq_lens, group, scale, out)
    return out


def _chunk_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                     block_tables: torch.Tensor, start: int, q_len: int, seq_len: int, s: int, scale: float,
                     out: torch.Tensor) -> None:
    """One sequence's chunk of several queries (a prefill chunk): causal with its context as offset."""
    q_heads, kv_heads = query.shape[1], key_cache.shape[2]
    _, block_size, _, dim = key_cache.shape
    n_blocks = -(-seq_len // block_size)
    blocks = block_tables[s, :n_blocks].long()
    k = key_cache.index_select(0, blocks).reshape(n_blocks * block_size, kv_heads, dim)[:seq_len]
    v = value_cache.index_select(0, blocks).reshape(n_blocks * block_size, kv_heads, dim)[:seq_len]
    # query i sits at position seq_len - q_len + i and sees keys at positions <= that
    q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)
    mask = torch.arange(seq_len, device=query.device)[None, :] <= q_pos[:, None]
    o = F.scaled_dot_product_attention(
        query[start:start + q_len].transpose(0, 1).unsqueeze(0).float(),
        k.transpose(0, 1).unsqueeze(0).float(),
        v.transpose(0, 1).unsqueeze(0).float(),
        attn_mask=mask, scale=scale, enable_gqa=q_heads != kv_heads)
    out[start:start + q_len] = o[0].transpose(0, 1).to(query.dtype)


def _decode_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                      block_tables: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                      group: list[int], scale: float, out: torch.Tensor) -> None:
    """Single-query sequences in one batched call: keys gathered slot by slot, padded to the longest."""
    q_heads, kv_heads = query.shape[1], key_cache.shape[2]
    _, block_size, _, dim = key_cache.shape
    seqs = torch.tensor(group, device=query.device)
    rows = query_start_loc[seqs].long()
    lens = seq_lens[seqs].long()
    pos = torch.arange(int(lens.max()), device=query.device)
    valid = pos[None, :] < lens[:, None]
    # padding positions read position 0's slot: finite data that the mask then ignores
    safe = torch.where(valid, pos[None, :], 0)
    slots = block_tables[seqs].long().gather(1, safe // block_size) * block_size + safe % block_size
    flat = slots.flatten()
    k = key_cache.reshape(-1, kv_heads, dim).index_select(0, flat).view(*slots.shape, kv_heads, dim)
    v = value_cache.reshape(-1, kv_heads, dim).index_select(0, flat).view(*slots.shape, kv_heads, dim)
    o = F.scaled_dot_product_attention(
        query[rows].unsqueeze(2).float(), k.transpose(1, 2).float(), v.transpose(1, 2).float(),
        attn_mask=valid[:, None, None, :], scale=scale, enable_gqa=q_heads != kv_heads)
    out[rows] = o.squeeze(2).to(query.dtype)


def copy_blocks(key_caches: list[torch.Tensor], value_caches: list[torch.Tensor],
                block_mapping: torch.Tensor) -> None:
    """Copy-on-write: for every layer, block `dst` becomes a copy of block `src` (rows of `[n, 2]`)."""
    if block_mapping.numel() == 0:
        return
    src = block_mapping[:, 0].long().to(key_caches[0].device)
    dst = block_mapping[:, 1].long().to(key_caches[0].device)
    for cache in (*key_caches, *value_caches):
        cache.index_copy_(0, dst, cache.index_select(0, src))
