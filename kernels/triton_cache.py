"""Triton kernels that move KV pages: write new tokens into their slots, copy blocks on write."""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def store_kv_kernel(
    key_ptr, value_ptr, key_cache_ptr, value_cache_ptr, slot_mapping_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
    NUM_HEADS: tl.constexpr, HEADS_P: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    """One program per token: copy its `[num_kv_heads, head_dim]` key and value into its slot."""
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:  # padding token
        return
    block = slot // BLOCK_SIZE
    in_block = slot % BLOCK_SIZE
    heads = tl.arange(0, HEADS_P)[:, None]
    dims = tl.arange(0, HEAD_DIM_P)[None, :]
    ok = (heads < NUM_HEADS) & (dims < HEAD_DIM)
    k = tl.load(key_ptr + token * stride_kt + heads * stride_kh + dims, mask=ok)
    v = tl.load(value_ptr + token * stride_vt + heads * stride_vh + dims, mask=ok)
    tl.store(key_cache_ptr + block * stride_kcb + in_block * stride_kcs + heads * stride_kch + dims,
             k.to(key_cache_ptr.dtype.element_ty), mask=ok)
    tl.store(value_cache_ptr + block * stride_vcb + in_block * stride_vcs + heads * stride_vch + dims,
             v.to(value_cache_ptr.dtype.element_ty), mask=ok)


@triton.jit
def copy_blocks_kernel(
    cache_ptrs_ptr, like_ptr, block_mapping_ptr, block_stride,
    BLOCK_NUMEL: tl.constexpr, CHUNK: tl.constexpr,
):
    """One program per (pair, cache tensor, chunk of a block); every layer's key and value caches are
    reached through a table of base addresses, so all layers go in one launch. `like_ptr` only lends
    its element type to those addresses."""
    pair = tl.program_id(0)
    cache = tl.program_id(1)
    chunk = tl.program_id(2)
    src = tl.load(block_mapping_ptr + 2 * pair).to(tl.int64)
    dst = tl.load(block_mapping_ptr + 2 * pair + 1).to(tl.int64)
    base = tl.load(cache_ptrs_ptr + cache).to(tl.pointer_type(like_ptr.dtype.element_ty))
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    ok = offs < BLOCK_NUMEL
    tl.store(base + dst * block_stride + offs, tl.load(base + src * block_stride + offs, mask=ok), mask=ok)
