"""Triton backend: `store_kv`, `paged_attention` and `copy_blocks` with the semantics of `kernels.reference`.

The host side only checks shapes and picks launch parameters from them; it never reads a device
tensor back, so a step costs no synchronisation. Kernels: kernels/triton_attention.py (unified
attention, split-KV reduction) and kernels/triton_cache.py (KV store, block copy).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
from triton.runtime.interpreter import InterpretedFunction

from kernels.triton_attention import reduce_splits_kernel, unified_attention_kernel
from kernels.triton_cache import copy_blocks_kernel, store_kv_kernel

MAX_SPLITS = 16
# a segment with fewer keys than this costs more in the reduction pass than it hides
MIN_SPLIT_TOKENS = 256
COPY_CHUNK = 4096


@dataclass(frozen=True, slots=True)
class AttentionLaunch:
    """Tile shape and grid depth of one unified-attention launch."""
    block_m: int     # rows per program: block_q tokens x the query heads of one KV head
    block_q: int
    tile_n: int      # key positions per inner-loop step
    head_dim_p: int  # head_dim padded to a power of two (masked lanes)
    num_splits: int  # KV segments per q-block; 1 = single pass, no reduction
    num_warps: int
    num_stages: int


def num_kv_splits(num_programs: int, max_context: int, num_sms: int) -> int:
    """Split-KV depth: 1 while the single-pass grid (`num_programs` = q-blocks x KV heads) fills the
    `num_sms` streaming multiprocessors; otherwise enough segments to fill them, a power of two, at
    most MAX_SPLITS, and no segment shorter than MIN_SPLIT_TOKENS of `max_context` keys."""
    if num_programs >= num_sms:
        return 1
    by_sms = triton.next_power_of_2(triton.cdiv(num_sms, max(num_programs, 1)))
    by_context = 1 << (max(max_context // MIN_SPLIT_TOKENS, 1).bit_length() - 1)
    return min(MAX_SPLITS, by_sms, by_context)


def launch_config(num_tokens: int, num_seqs: int, num_kv_heads: int, queries_per_kv: int, head_dim: int,
                  max_context: int, num_sms: int, num_splits: int | None = None) -> AttentionLaunch:
    """Pick tiles from shapes alone. A batch with no more tokens than sequences is all decode: 16-row
    tiles (the GQA group of one token); otherwise 64-row tiles for prefill chunks."""
    decode = num_tokens <= num_seqs
    block_m = max(16 if decode else 64, triton.next_power_of_2(queries_per_kv))
    block_q = block_m // queries_per_kv
    head_dim_p = max(16, triton.next_power_of_2(head_dim))
    # tiles may span pages (keys gathered through the block table), so small pages keep wide tiles
    tile_n = 64 if head_dim_p <= 128 else 32
    if num_splits is None:
        q_blocks = max(num_seqs, triton.cdiv(num_tokens, block_q))
        num_splits = num_kv_splits(q_blocks * num_kv_heads, max_context, num_sms)
    elif num_splits < 1 or num_splits & (num_splits - 1):
        raise ValueError(f"num_splits must be a power of two >= 1, got {num_splits}")
    big = head_dim_p >= 256 or block_m >= 128
    return AttentionLaunch(block_m=block_m, block_q=block_q, tile_n=tile_n, head_dim_p=head_dim_p,
                           num_splits=num_splits, num_warps=8 if big else 4, num_stages=2 if big else 3)


# Each kernel's compile-time constants, from shapes alone: the launches below and tests/triton_compile.py (which
# compiles them for a GPU target with no GPU) take them from here.
def store_kv_constants(num_heads: int, head_dim: int, block_size: int) -> dict:
    return dict(NUM_HEADS=num_heads, HEADS_P=triton.next_power_of_2(num_heads), HEAD_DIM=head_dim,
                HEAD_DIM_P=triton.next_power_of_2(head_dim), BLOCK_SIZE=block_size)


def attention_constants(cfg: AttentionLaunch, qpk: int, head_dim: int, block_size: int, dtype: torch.dtype) -> dict:
    return dict(QPK=qpk, HEAD_DIM=head_dim, HEAD_DIM_P=cfg.head_dim_p, BLOCK_SIZE=block_size, BLOCK_M=cfg.block_m,
                BLOCK_Q=cfg.block_q, TILE_N=cfg.tile_n, NUM_SPLITS=cfg.num_splits,
                # float32 models (the transformers-parity runs) must not lose precision to TF32 dots
                DOT_PRECISION="ieee" if dtype == torch.float32 else "tf32")


def reduce_constants(cfg: AttentionLaunch, head_dim: int) -> dict:
    return dict(HEAD_DIM=head_dim, HEAD_DIM_P=cfg.head_dim_p, NUM_SPLITS=cfg.num_splits)


def copy_blocks_constants(block_numel: int) -> dict:
    return dict(BLOCK_NUMEL=block_numel, CHUNK=min(COPY_CHUNK, triton.next_power_of_2(block_numel)))


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 1  # the CPU interpreter runs programs one by one: splitting only adds work


def _check_device(device: torch.device) -> None:
    # `@triton.jit` builds interpreted kernels when TRITON_INTERPRET=1 was set before triton's import:
    # those run on CPU tensors (the tests); compiled ones need the GPU
    if device.type != "cuda" and not isinstance(store_kv_kernel, InterpretedFunction):
        raise ValueError(f"the Triton backend needs CUDA tensors, got {device}; use the torch backend on "
                         "the CPU, or set TRITON_INTERPRET=1 before importing triton to interpret the kernels")


def _check_cache(key_cache: torch.Tensor, value_cache: torch.Tensor) -> None:
    if key_cache.dim() != 4 or key_cache.shape != value_cache.shape:
        raise ValueError("key_cache and value_cache must both be [num_blocks, block_size, num_kv_heads, "
                         f"head_dim], got {tuple(key_cache.shape)} and {tuple(value_cache.shape)}")
    if key_cache.dtype != value_cache.dtype or key_cache.device != value_cache.device:
        raise ValueError("key_cache and value_cache must share dtype and device")
    _check_device(key_cache.device)
    if key_cache.stride(-1) != 1 or value_cache.stride(-1) != 1:
        raise ValueError("KV caches must be contiguous along head_dim")
    block_size = key_cache.shape[1]
    if block_size < 1 or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two, got {block_size}")


def _inner_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def store_kv(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write `key`/`value` `[num_tokens, num_kv_heads, head_dim]` into their slots; slots < 0 are padding."""
    _check_cache(key_cache, value_cache)
    _, block_size, num_heads, head_dim = key_cache.shape
    if key.shape != value.shape or key.dim() != 3 or tuple(key.shape[1:]) != (num_heads, head_dim):
        raise ValueError(f"key/value must be [num_tokens, {num_heads}, {head_dim}], "
                         f"got {tuple(key.shape)} and {tuple(value.shape)}")
    if slot_mapping.shape != (key.shape[0],):
        raise ValueError(f"slot_mapping must be [{key.shape[0]}], got {tuple(slot_mapping.shape)}")
    if key.shape[0] == 0:
        return
    key, value, slot_mapping = _inner_contiguous(key), _inner_contiguous(value), slot_mapping.contiguous()
    store_kv_kernel[(key.shape[0],)](
        key, value, key_cache, value_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        **store_kv_constants(num_heads, head_dim, block_size))


def paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    block_tables: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                    scale: float) -> torch.Tensor:
    """Causal attention of variable-length query chunks over their sequences' paged KV (see
    `kernels.reference.paged_attention`); the split-KV path is chosen by `num_kv_splits`."""
    return unified_attention(query, key_cache, value_cache, block_tables, query_start_loc, seq_lens, scale)


def unified_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                      block_tables: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                      scale: float, num_splits: int | None = None) -> torch.Tensor:
    """`paged_attention` with the split-KV depth forced by `num_splits` (a power of two; 1 = single
    pass) instead of chosen by the heuristic."""
    _check_cache(key_cache, value_cache)
    _, block_size, num_kv_heads, head_dim = key_cache.shape
    if query.dim() != 3 or query.shape[2] != head_dim:
        raise ValueError(f"query must be [num_tokens, num_q_heads, {head_dim}], got {tuple(query.shape)}")
    num_tokens, num_q_heads, _ = query.shape
    num_seqs = seq_lens.shape[0] if seq_lens.dim() == 1 else -1
    if num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads ({num_q_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    if query.dtype != key_cache.dtype or query.device != key_cache.device:
        raise ValueError(f"query ({query.dtype}, {query.device}) and the KV cache ({key_cache.dtype}, "
                         f"{key_cache.device}) must share dtype and device")
    if (num_seqs < 0 or query_start_loc.shape != (num_seqs + 1,) or block_tables.dim() != 2
            or block_tables.shape[0] < num_seqs):
        raise ValueError("need seq_lens [num_seqs], query_start_loc [num_seqs + 1] and block_tables "
                         f"[>= num_seqs, max_blocks]; got {tuple(seq_lens.shape)}, "
                         f"{tuple(query_start_loc.shape)}, {tuple(block_tables.shape)}")
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if num_tokens == 0 or num_seqs == 0:
        return out
    query = _inner_contiguous(query)
    block_tables = _inner_contiguous(block_tables)
    query_start_loc, seq_lens = query_start_loc.contiguous(), seq_lens.contiguous()
    qpk = num_q_heads // num_kv_heads
    # the block table's width bounds every context without reading seq_lens back
    cfg = launch_config(num_tokens, num_seqs, num_kv_heads, qpk, head_dim, block_tables.shape[1] * block_size,
                        _num_sms(query.device), num_splits)
    if cfg.num_splits == 1:
        split_acc = split_max = split_sum = out  # never touched by the single pass
    else:
        split_acc = torch.empty(num_tokens, num_q_heads, cfg.num_splits, cfg.head_dim_p,
                                dtype=torch.float32, device=query.device)
        split_max = torch.empty(num_tokens, num_q_heads, cfg.num_splits, dtype=torch.float32,
                                device=query.device)
        split_sum = torch.empty_like(split_max)
    grid = (num_tokens // cfg.block_q + num_seqs, num_kv_heads, cfg.num_splits)
    unified_attention_kernel[grid](
        out, split_acc, split_max, split_sum,
        query, key_cache, value_cache, block_tables, query_start_loc, seq_lens,
        scale, num_seqs, num_q_heads,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2), block_tables.stride(0),
        **attention_constants(cfg, qpk, head_dim, block_size, query.dtype),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if cfg.num_splits > 1:
        reduce_splits_kernel[(num_tokens, num_q_heads)](
            out, split_acc, split_max, split_sum, query_start_loc,
            num_seqs, num_q_heads, out.stride(0), out.stride(1), **reduce_constants(cfg, head_dim))
    return out


def copy_blocks(key_caches: list[torch.Tensor], value_caches: list[torch.Tensor],
                block_mapping: torch.Tensor) -> None:
    """Copy-on-write: for every layer, block `dst` becomes a copy of block `src` (rows of `[n, 2]`).

    All layers in one launch. The copies run in parallel, so no destination may also be a source or
    appear twice (copy-on-write targets are fresh blocks); a mapping on the host is checked for it.
    """
    if block_mapping.numel() == 0:
        return
    caches = [*key_caches, *value_caches]
    if not key_caches or len(key_caches) != len(value_caches):
        raise ValueError("need one key and one value cache per layer")
    first = caches[0]
    for cache in caches:
        if (cache.shape != first.shape or cache.stride() != first.stride() or cache.dtype != first.dtype
                or cache.device != first.device or not cache[0].is_contiguous()):
            raise ValueError("all KV caches must share shape, strides, dtype and device, with contiguous blocks")
    _check_device(first.device)
    if block_mapping.dim() != 2 or block_mapping.shape[1] != 2:
        raise ValueError(f"block_mapping must be [n, 2] (src, dst), got {tuple(block_mapping.shape)}")
    if block_mapping.device.type == "cpu":
        src, dst = block_mapping[:, 0].tolist(), block_mapping[:, 1].tolist()
        if not all(0 <= b < first.shape[0] for b in (*src, *dst)):
            raise ValueError(f"block ids must be in [0, {first.shape[0]}), got {block_mapping.tolist()}")
        if len(set(dst)) != len(dst) or set(dst) & set(src):
            raise ValueError(f"copy destinations must be distinct and not sources, got {block_mapping.tolist()}")
    mapping = block_mapping.to(device=first.device, dtype=torch.int64).contiguous()
    addresses = torch.tensor([c.data_ptr() for c in caches], dtype=torch.int64, device=first.device)
    constants = copy_blocks_constants(first[0].numel())
    copy_blocks_kernel[(mapping.shape[0], len(caches), triton.cdiv(constants["BLOCK_NUMEL"], constants["CHUNK"]))](
        addresses, first, mapping, first.stride(0), **constants)
