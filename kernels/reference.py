"""Pure-torch paged attention: the CPU runtime path and the oracle for the Triton kernels.

Cache layout (DESIGN.md): per layer, key and value tensors `[num_blocks, block_size, num_kv_heads,
head_dim]`; the token at position p of a sequence lives in slot
`block_table[p // block_size] * block_size + p % block_size`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


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
    num_tokens, q_heads, dim = query.shape
    _, block_size, kv_heads, _ = key_cache.shape
    out = torch.empty_like(query)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    for s, seq_len in enumerate(lens):
        start, end = starts[s], starts[s + 1]
        q_len = end - start
        if q_len == 0:
            continue
        n_blocks = -(-seq_len // block_size)
        blocks = block_tables[s, :n_blocks].long()
        k = key_cache[blocks].reshape(n_blocks * block_size, kv_heads, dim)[:seq_len]
        v = value_cache[blocks].reshape(n_blocks * block_size, kv_heads, dim)[:seq_len]
        # query i sits at position seq_len - q_len + i and sees keys at positions <= that
        q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)
        mask = torch.arange(seq_len, device=query.device)[None, :] <= q_pos[:, None]
        o = F.scaled_dot_product_attention(
            query[start:end].transpose(0, 1).unsqueeze(0).float(),
            k.transpose(0, 1).unsqueeze(0).float(),
            v.transpose(0, 1).unsqueeze(0).float(),
            attn_mask=mask, scale=scale, enable_gqa=q_heads != kv_heads)
        out[start:end] = o[0].transpose(0, 1).to(query.dtype)
    return out


def copy_blocks(key_caches: list[torch.Tensor], value_caches: list[torch.Tensor],
                block_mapping: torch.Tensor) -> None:
    """Copy-on-write: for every layer, block `dst` becomes a copy of block `src` (rows of `[n, 2]`)."""
    if block_mapping.numel() == 0:
        return
    src = block_mapping[:, 0].long().to(key_caches[0].device)
    dst = block_mapping[:, 1].long().to(key_caches[0].device)
    for cache in (*key_caches, *value_caches):
        cache.index_copy_(0, dst, cache.index_select(0, src))
