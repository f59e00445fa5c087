"""Triton unified paged attention: one kernel for prefill chunks, chunked prefill and decode.

A program owns one q-block (up to BLOCK_Q consecutive tokens of one sequence's chunk) for one KV head.
The query heads sharing that KV head are packed with the tokens into BLOCK_M rows (row r = token
r // QPK, head r % QPK), so GQA/MQA reads each key/value tile once for the whole group. Keys are
walked in tiles of TILE_N positions gathered through the block table, with an online softmax in
float32 (base 2: `scale * log2(e)` is folded into the scores).

Split-KV (flash-decoding): with NUM_SPLITS > 1 the third grid axis cuts each q-block's key range into
NUM_SPLITS segments whose unnormalised partial outputs, running maxima and sums go to float32
scratch; `reduce_splits_kernel` merges them. With NUM_SPLITS == 1 the kernel writes the output itself.

The grid's first axis is an upper bound on the q-block count (num_tokens // BLOCK_Q + num_seqs) so the
host never reads the chunk lengths back; programs past their sequence's chunk return at once.
"""
from __future__ import annotations

import triton
import triton.language as tl

LOG2_E = tl.constexpr(1.4426950408889634)  # a plain global does not compile outside the interpreter


@triton.jit
def _find_sequence(query_start_loc_ptr, q_block, num_seqs, BLOCK_Q: tl.constexpr):
    """The sequence owning global q-block `q_block`: sequence s owns the q-blocks from
    query_start_loc[s] // BLOCK_Q + s on (a bound that always covers cdiv(chunk, BLOCK_Q) blocks)."""
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first <= q_block:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _tile_pages(block_table_row, tile_start, positions, key_ok,
                BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr):
    """Physical block ids holding one tile of key positions (a scalar when the tile fits one page)."""
    if TILE_N <= BLOCK_SIZE:
        # tiles are aligned, so the tile lies inside one page: one block-table read, contiguous slots
        return tl.load(block_table_row + tile_start // BLOCK_SIZE).to(tl.int64)
    else:
        # the tile spans pages; positions past the keys would read past the table's row
        return tl.load(block_table_row + positions // BLOCK_SIZE, mask=key_ok, other=0).to(tl.int64)


@triton.jit
def unified_attention_kernel(
    out_ptr, split_acc_ptr, split_max_ptr, split_sum_ptr,
    query_ptr, key_cache_ptr, value_cache_ptr, block_tables_ptr, query_start_loc_ptr, seq_lens_ptr,
    scale, num_seqs, num_q_heads,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
    QPK: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, TILE_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    q_block_id = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    seq = _find_sequence(query_start_loc_ptr, q_block_id, num_seqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    q_block = q_block_id - (q_start // BLOCK_Q + seq)
    if q_block * BLOCK_Q >= q_len:
        return
    context_len = tl.load(seq_lens_ptr + seq) - q_len

    rows = tl.arange(0, BLOCK_M)
    q_idx = q_block * BLOCK_Q + rows // QPK
    head = kv_head * QPK + rows % QPK
    row_ok = (rows // QPK < BLOCK_Q) & (q_idx < q_len)
    token = (q_start + q_idx).to(tl.int64)
    dims = tl.arange(0, HEAD_DIM_P)
    dim_ok = dims < HEAD_DIM
    q = tl.load(query_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
                mask=row_ok[:, None] & dim_ok[None, :], other=0.0)

    # query q_idx sits at position context_len + q_idx and sees the keys at positions <= it
    q_pos = context_len + q_idx
    kv_end = context_len + tl.minimum((q_block + 1) * BLOCK_Q, q_len)
    num_tiles = tl.cdiv(kv_end, TILE_N)
    tiles_per_split = tl.cdiv(num_tiles, NUM_SPLITS)
    tile_lo = split * tiles_per_split
    tile_hi = tl.minimum(tile_lo + tiles_per_split, num_tiles)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_P], tl.float32)
    qk_scale = scale * LOG2_E
    block_table_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for tile in range(tile_lo, tile_hi):
        tile_start = tile * TILE_N
        positions = tile_start + tl.arange(0, TILE_N)
        key_ok = positions < kv_end
        pages = _tile_pages(block_table_row, tile_start, positions, key_ok, BLOCK_SIZE, TILE_N)
        in_page = positions % BLOCK_SIZE
        k_off = pages * stride_kb + in_page * stride_ks
        v_off = pages * stride_vb + in_page * stride_vs
        # masked loads: slots past the sequence may hold anything (NaN included)
        k = tl.load(key_cache_ptr + kv_head * stride_kh + k_off[None, :] + dims[:, None],
                    mask=dim_ok[:, None] & key_ok[None, :], other=0.0)
        scores = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale
        visible = (positions[None, :] <= q_pos[:, None]) & key_ok[None, :]
        scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        # a row that has seen no key yet keeps a finite reference point (its p and alpha are 0)
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(scores - m_ref[:, None])
        alpha = tl.math.exp2(m_i - m_ref)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(value_cache_ptr + kv_head * stride_vh + v_off[:, None] + dims[None, :],
                    mask=key_ok[:, None] & dim_ok[None, :], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    if NUM_SPLITS == 1:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])
    else:
        slot = (token * num_q_heads + head) * NUM_SPLITS + split
        tl.store(split_acc_ptr + slot[:, None] * HEAD_DIM_P + dims[None, :], acc, mask=row_ok[:, None])
        tl.store(split_max_ptr + slot, m_i, mask=row_ok)
        tl.store(split_sum_ptr + slot, l_i, mask=row_ok)


@triton.jit
def reduce_splits_kernel(
    out_ptr, split_acc_ptr, split_max_ptr, split_sum_ptr, query_start_loc_ptr,
    num_seqs, num_q_heads, stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr, NUM_SPLITS: tl.constexpr,
):
    """Merge the NUM_SPLITS partial softmax states of one (token, query head)."""
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    # rows past the last chunk are padding that no attention program wrote
    if token >= tl.load(query_start_loc_ptr + num_seqs):
        return
    splits = tl.arange(0, NUM_SPLITS)
    dims = tl.arange(0, HEAD_DIM_P)
    slot = (token * num_q_heads + head) * NUM_SPLITS + splits
    m = tl.load(split_max_ptr + slot)
    l = tl.load(split_sum_ptr + slot)
    m_all = tl.max(m, 0)
    # an empty segment (m = -inf) weighs 0; segment 0 always holds key 0, so m_all is finite
    weight = tl.where(m == float("-inf"), 0.0, tl.math.exp2(m - m_all))
    acc = tl.load(split_acc_ptr + slot[:, None] * HEAD_DIM_P + dims[None, :])
    out = tl.sum(acc * weight[:, None], 0) / tl.sum(weight * l, 0)
    tl.store(out_ptr + token * stride_ot + head * stride_oh + dims, out.to(out_ptr.dtype.element_ty),
             mask=dims < HEAD_DIM)
