"""Paged attention for the CPU: every query row reads the paged cache in place (a C kernel), in one order.

The reference (kernels/reference.py) gathers slot by slot and rebuilds its indices and masks in every
layer; here a step's plan (each sequence's query rows, blocks and lengths) is built once, at the first layer,
and serves every layer of the step. kernels/cpu_attention.c (built by kernels/native.py) walks each sequence's
blocks in place with an online softmax, a run of a chunk's query rows per block, so it reads each key and
value once per run where gathering copies them twice; and it sums each row's attention in the same order
whether the row is a decode or part of a prefill chunk of any size, so a token's attention does not depend
on chunking, batching or a recompute after preemption or a worker's restart. Without the kernel (or for a
float16 cache, or a head or block size that is not a multiple of 8) decode rows attend in length-sorted
groups instead: per group one index_select of whole blocks for K and one for V, one matmul for the scores of
all heads, a softmax in float32 and one matmul for the output, in the cache dtype as transformers' eager
attention; and multi-query chunks go through torch's fused CPU scaled_dot_product_attention in float32,
causal with the context as offset.

Same semantics and signatures as the reference; `step_attention` is the per-step entry the model uses.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from kernels import native
from kernels.reference import copy_blocks, store_kv

__all__ = ["copy_blocks", "paged_attention", "step_attention", "store_kv"]

# A decode group's gathered keys (float32 elements), as in the reference: bounds the memory of one call.
_DECODE_GROUP_ELEMENTS = 1 << 24
# Query rows of a chunk per task of the C kernel: more reuse each block read from memory, fewer tasks to share
# among threads.
_NATIVE_SPAN = 8


@dataclass(slots=True)
class _NativePlan:
    """Every query row of the step, for the C kernel: its tasks and the tables it reads in place."""
    tasks: torch.Tensor  # [n, 4] int64: first query row, sequence, keys the first row sees, rows
    tables: torch.Tensor  # [num_seqs, max_blocks] int32, contiguous


@dataclass(slots=True)
class _DecodeGroup:
    size: int  # sequences in the group
    rows: torch.Tensor | None  # query rows of the group's sequences; None: rows 0..size-1 in order
    blocks: torch.Tensor  # [size * num_blocks] int64: each sequence's first num_blocks table entries
    num_blocks: int
    padding: torch.Tensor  # [size, 1, 1, num_blocks * block_size] bool: a gathered slot past the sequence's end
    padded_slots: torch.Tensor  # flat indices of those slots in the gathered [size * num_blocks * block_size]


@dataclass(slots=True)
class _Chunk:
    start: int
    q_len: int
    seq_len: int
    blocks: torch.Tensor  # [ceil(seq_len / block_size)] int64
    mask: torch.Tensor | None  # [q_len, seq_len] bool; None when the chunk is the whole sequence (causal)


@dataclass(slots=True)
class StepAttention:
    """One step's attention, callable as `(query, key, value, key_cache, value_cache, scale)` in every layer."""
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    kernel: ctypes.CDLL | None  # kernels/native.py's library; None: torch's gathers
    decodes: list[_DecodeGroup] = field(default_factory=list)
    native: _NativePlan | None = None  # replaces `decodes` and `chunks` where the C kernel runs
    chunks: list[_Chunk] = field(default_factory=list)
    planned: bool = False
    slots: torch.Tensor | None = None  # slot_mapping as int64 when no slot is padding (< 0)
    whole: bool = False  # one decode group holds every query row in order: its output is the step's

    def __call__(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                 value_cache: torch.Tensor, scale: float) -> torch.Tensor:
        if not self.planned:
            _, block_size, kv_heads, dim = key_cache.shape
            self._plan(block_size, kv_heads, dim, query.device, query.dtype, key_cache.dtype)
        if self.slots is None:
            store_kv(key, value, key_cache, value_cache, self.slot_mapping)
        else:  # no padding slot: straight into the caches
            key_cache.view(-1, *key.shape[1:]).index_copy_(0, self.slots, key.to(key_cache.dtype))
            value_cache.view(-1, *value.shape[1:]).index_copy_(0, self.slots, value.to(value_cache.dtype))
        return self.attend(query, key_cache, value_cache, scale)

    def attend(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
               scale: float) -> torch.Tensor:
        if self.whole:
            return _decode(query, key_cache, value_cache, self.decodes[0], scale)
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        if self.native is not None:
            _native_attend(query, key_cache, value_cache, out, self.native, scale, self.kernel)
            return out
        for group in self.decodes:
            rows = group.rows if group.rows is not None else slice(0, group.size)
            out[rows] = _decode(query, key_cache, value_cache, group, scale)
        for chunk in self.chunks:
            out[chunk.start:chunk.start + chunk.q_len] = _chunk(query, key_cache, value_cache, chunk, scale)
        return out

    def _plan(self, block_size: int, kv_heads: int, head_dim: int, device: torch.device, query_dtype: torch.dtype,
              cache_dtype: torch.dtype) -> None:
        slots = self.slot_mapping.long()
        self.slots = slots if bool((slots >= 0).all()) else None
        self.planned = True
        starts = self.query_start_loc.tolist()
        lens = self.seq_lens.tolist()
        tables = self.block_tables
        if device.type == "cpu" and query_dtype == cache_dtype and serves(self.kernel, cache_dtype, head_dim,
                                                                          block_size):
            tasks = [(starts[s] + i, s, seq_len - q_len + i + 1, min(_NATIVE_SPAN, q_len - i))
                     for s, seq_len in enumerate(lens) if (q_len := starts[s + 1] - starts[s]) > 0
                     for i in range(0, q_len, _NATIVE_SPAN)]
            self.native = _NativePlan(torch.tensor(tasks, dtype=torch.int64).view(-1, 4),
                                      tables.to(torch.int32).contiguous())
            return
        decodes = []
        for s, seq_len in enumerate(lens):
            q_len = starts[s + 1] - starts[s]
            if q_len == 1:
                decodes.append(s)
            elif q_len > 1:
                n_blocks = -(-seq_len // block_size)
                mask = None
                if q_len < seq_len:  # query i sits at position seq_len - q_len + i and sees keys up to it
                    q_pos = torch.arange(seq_len - q_len, seq_len, device=device)
                    mask = torch.arange(seq_len, device=device)[None, :] <= q_pos[:, None]
                self.chunks.append(_Chunk(starts[s], q_len, seq_len, tables[s, :n_blocks].long(), mask))
        # sorted by length; a new group when the gathered keys would pass the budget or the padding double
        decodes.sort(key=lambda s: lens[s])
        group: list[int] = []
        for s in decodes:
            width = -(-lens[s] // block_size) * block_size
            if group and ((len(group) + 1) * width * kv_heads * head_dim > _DECODE_GROUP_ELEMENTS
                          or width > 2 * lens[group[0]] + block_size):
                self.decodes.append(self._group(group, lens, starts, block_size, device))
                group = []
            group.append(s)
        if group:
            self.decodes.append(self._group(group, lens, starts, block_size, device))
        self.whole = (not self.chunks and len(self.decodes) == 1 and self.decodes[0].rows is None)

    def _group(self, seqs: list[int], lens: list[int], starts: list[int], block_size: int,
               device: torch.device) -> _DecodeGroup:
        index = torch.tensor(seqs, dtype=torch.int64, device=device)
        seq_lens = self.seq_lens.index_select(0, index).long()
        num_blocks = -(-max(lens[s] for s in seqs) // block_size)
        blocks = self.block_tables.index_select(0, index)[:, :num_blocks].long().flatten()
        padding = torch.arange(num_blocks * block_size, device=device)[None, :] >= seq_lens[:, None]
        padded_slots = padding.flatten().nonzero().flatten()
        in_order = [starts[s] for s in seqs] == list(range(len(seqs)))
        rows = None if in_order else torch.tensor([starts[s] for s in seqs], dtype=torch.int64, device=device)
        return _DecodeGroup(len(seqs), rows, blocks, num_blocks, padding[:, None, None, :], padded_slots)


def _native_attend(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, out: torch.Tensor,
                   plan: _NativePlan, scale: float, kernel: ctypes.CDLL) -> None:
    """Every row of `out`, by kernels/cpu_attention.c over the caches in place."""
    _, block_size, kv_heads, dim = key_cache.shape
    query = query if query.stride(-1) == 1 else query.contiguous()
    code = kernel.paged_attention(
        native.DTYPE_CODES[key_cache.dtype], query.data_ptr(), query.stride(0), query.stride(1), key_cache.data_ptr(),
        value_cache.data_ptr(), out.data_ptr(), out.stride(0), out.stride(1), plan.tables.data_ptr(),
        plan.tables.stride(0), plan.tasks.data_ptr(), plan.tasks.shape[0], query.shape[1], kv_heads, dim,
        block_size, scale, torch.get_num_threads())
    assert code == 0, "cpu_attention.c refused the cache dtype"


def _gather(cache: torch.Tensor, group: _DecodeGroup, zero_padding: bool) -> torch.Tensor:
    """[size, kv_heads, num_blocks * block_size, head_dim], contiguous: the group's keys or values."""
    _, block_size, kv_heads, dim = cache.shape
    n, width = group.size, group.num_blocks * block_size
    pages = cache.index_select(0, group.blocks)
    if zero_padding:
        pages.view(n * width, kv_heads * dim).index_fill_(0, group.padded_slots, 0.0)
    return pages.view(n, width, kv_heads, dim).transpose(1, 2).contiguous()


def _decode(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, group: _DecodeGroup,
            scale: float) -> torch.Tensor:
    kv_heads, dim = key_cache.shape[2], key_cache.shape[3]
    n, heads = group.size, query.shape[1]
    q = query[:n] if group.rows is None else query.index_select(0, group.rows)
    q = q.view(n, kv_heads, heads // kv_heads, dim).to(key_cache.dtype) * scale
    # Slots past a sequence's end hold whatever an earlier owner of the block left (padding entries of the
    # table read the null block): masked out of the scores, and zeroed in the values, since 0 * NaN is NaN.
    scores = torch.matmul(q, _gather(key_cache, group, False).transpose(2, 3)).masked_fill_(group.padding,
                                                                                           float("-inf"))
    probs = scores.softmax(dim=-1, dtype=torch.float32).to(key_cache.dtype)
    return torch.matmul(probs, _gather(value_cache, group, True)).view(n, heads, dim).to(query.dtype)


def _chunk(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, chunk: _Chunk,
           scale: float) -> torch.Tensor:
    _, block_size, kv_heads, dim = key_cache.shape
    n = chunk.blocks.shape[0] * block_size

    def gather(cache: torch.Tensor) -> torch.Tensor:
        return cache.index_select(0, chunk.blocks).view(n, kv_heads, dim)[:chunk.seq_len].transpose(0, 1).float()

    q = query[chunk.start:chunk.start + chunk.q_len].transpose(0, 1).float()
    o = F.scaled_dot_product_attention(q.unsqueeze(0), gather(key_cache).unsqueeze(0), gather(value_cache).unsqueeze(0),
                                       attn_mask=chunk.mask, is_causal=chunk.mask is None, scale=scale,
                                       enable_gqa=q.shape[0] != kv_heads)
    return o[0].transpose(0, 1).to(query.dtype)


def serves(kernel: ctypes.CDLL | None, cache_dtype: torch.dtype, head_dim: int, block_size: int) -> bool:
    """Whether the C kernel of `kernel` (kernels/native.py's library) attends over such a cache: float32 or
    bfloat16, head and block sizes multiples of 8."""
    return kernel is not None and cache_dtype in native.DTYPE_CODES and head_dim % 8 == 0 and block_size % 8 == 0


def step_attention(slot_mapping: torch.Tensor, block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                   seq_lens: torch.Tensor, kernel: ctypes.CDLL | None = None) -> StepAttention:
    return StepAttention(slot_mapping, block_tables, query_start_loc, seq_lens, kernel)


def paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    block_tables: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                    scale: float, kernel: ctypes.CDLL | None = None) -> torch.Tensor:
    """The reference's signature: one layer's attention over caches already stored (plans for this call alone),
    through the C kernel of `kernel` (kernels/native.py's library) where it takes the shapes, else torch's."""
    step = StepAttention(torch.empty(0, dtype=torch.int64), block_tables, query_start_loc, seq_lens, kernel)
    step._plan(*key_cache.shape[1:], query.device, query.dtype, key_cache.dtype)
    return step.attend(query, key_cache, value_cache, scale)
