"""Block tables of the sequences on one worker: prefix hits, slot allocation, copy-on-write, swapping.

Each full block is named by a chained hash h_i = sha256(h_{i-1} | token ids of block i | extra keys),
over a canonical byte encoding (little-endian int64 token ids; length-prefixed UTF-8 extra keys, which
carry the model id and leave room for adapter ids); h_-1 is the request's root, the hash of its salt (its
tenant's and its `cache_salt`), so that blocks are shared only between requests of one salt. A block is indexed only once its KV is computed
(the scheduler commits after a step's result), so a hit never points at KV still being written.
"""
from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from scheduler.block_pool import Block, BlockPool

NO_PARENT = bytes(32)


def encode_extra_keys(keys: tuple[str, ...]) -> bytes:
    out = bytearray()
    for key in keys:
        raw = key.encode("utf-8")
        out += struct.pack("<I", len(raw)) + raw
    return bytes(out)


def hash_block_tokens(parent: bytes, token_ids: list[int], extra: bytes) -> bytes:
    h = hashlib.sha256(parent)
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    h.update(extra)
    return h.digest()


def _span(prompt: list[int], output: list[int], start: int, end: int) -> list[int]:
    """Tokens start..end of prompt + output, without building the whole (a commit takes a block of a long output)."""
    n = len(prompt)
    if end <= n:
        return prompt[start:end]
    if start >= n:
        return output[start - n:end - n]
    return prompt[start:] + output[:end - n]


def chain_root(salt: str) -> bytes:
    """The parent of a chain's first block: no salt gives the chain every unsalted request shares."""
    return hashlib.sha256(b"salt\0" + salt.encode("utf-8")).digest() if salt else NO_PARENT


def hash_full_blocks(token_ids: list[int], block_size: int, extra: bytes, known: Sequence[bytes] = (),
                     root: bytes = NO_PARENT) -> list[bytes]:
    """The chained hashes of every full block of `token_ids`, reusing `known` hashes of its leading blocks."""
    hashes = list(known)
    parent = hashes[-1] if hashes else root
    for start in range(len(hashes) * block_size, len(token_ids) - block_size + 1, block_size):
        parent = hash_block_tokens(parent, token_ids[start:start + block_size], extra)
        hashes.append(parent)
    return hashes


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(slots=True)
class SeqBlocks:
    table: list[Block]
    hashes: list[bytes] = field(default_factory=list)  # chained hashes of full blocks (may run ahead)
    num_cached: int = 0  # leading blocks of the table that are in the prefix index


class Opening(NamedTuple):
    """A sequence starting in this step, on its prefix hits."""
    seq_id: int
    hits: list[Block]
    hashes: list[bytes]  # block hashes of its tokens
    num_tokens: int


class Write(NamedTuple):
    """A sequence's next `num_new` tokens, after the `num_computed` its KV already covers."""
    seq_id: int
    num_computed: int
    num_new: int


class WriteSpan(NamedTuple):
    """The blocks a write touches in a table of `table_len` blocks: those it holds already that the new tokens
    write into (`first` to `stop`), and how many to append (`grow`)."""
    first: int
    stop: int
    grow: int


class Needed(NamedTuple):
    """What granting a growth takes: free blocks at most, and each write's span (in the growth's order)."""
    blocks: int
    spans: list[WriteSpan]


@dataclass(slots=True)
class Growth:
    """What one request asks of the cache in one step; `allocate_slots` grants all of it or nothing. (Its parts
    are named tuples and empty ones tuples: this runs for every request every step, and garbage collection
    pauses follow the number of objects made.)"""
    opens: Sequence[Opening] = ()
    swap_in: Sequence[int] = ()  # swapped sequences coming back to the device
    writes: Sequence[Write] = ()


@dataclass(slots=True)
class Slots:
    """What `allocate_slots` did: blocks appended per sequence, copy-on-write copies, swap-in moves."""
    new_block_ids: dict[int, list[int]]
    copies: list[tuple[int, int]]  # (src, dst)
    rewritten: set[int]  # seq ids whose table a copy changed: the worker needs their whole table
    swap_in: Sequence[tuple[int, int]]  # (swap block, device block)


class KVCacheManager:
    def __init__(self, num_blocks: int, num_swap_blocks: int, block_size: int, extra_keys: tuple[str, ...],
                 enable_caching: bool = True) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_caching)
        self.swap_pool = BlockPool(num_swap_blocks, False, reserve_null=False) if num_swap_blocks > 0 else None
        self.extra = encode_extra_keys(extra_keys)
        self.enable_caching = enable_caching
        self.seqs: dict[int, SeqBlocks] = {}  # seq id → device table
        self.swapped: dict[int, SeqBlocks] = {}  # seq id → swap table
        self.num_forks = 0
        self.num_copies = 0

    @property
    def num_free(self) -> int:
        return self.pool.num_free

    def block_ids(self, seq_id: int) -> list[int]:
        return [b.block_id for b in self.seqs[seq_id].table]

    def table_len(self, seq_id: int) -> int:
        """Blocks the sequence holds, on the device or in swap."""
        seq = self.seqs.get(seq_id) or self.swapped[seq_id]
        return len(seq.table)

    # ---- prefix cache ---------------------------------------------------------------------
    def hash_tokens(self, token_ids: list[int], known: Sequence[bytes] = (), root: bytes = NO_PARENT) -> list[bytes]:
        return hash_full_blocks(token_ids, self.block_size, self.extra, known, root) if self.enable_caching else []

    def find_prefix(self, hashes: list[bytes], num_tokens: int) -> list[Block]:
        """The longest run of leading cached blocks, leaving at least the last token to compute (its
        logits are needed), so a fully cached prompt still recomputes its last block."""
        hits = []
        for block_hash in hashes[:(num_tokens - 1) // self.block_size]:
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits

    def commit(self, seq_id: int, prompt: list[int], output: list[int], num_computed: int,
               root: bytes = NO_PARENT) -> None:
        """Index the blocks that computed tokens filled (generated tokens included)."""
        if not self.enable_caching:
            return
        seq = self.seqs[seq_id]
        full = num_computed // self.block_size
        if full <= seq.num_cached:
            return
        bs = self.block_size
        for i in range(seq.num_cached, full):
            if i == len(seq.hashes):
                parent = seq.hashes[-1] if seq.hashes else root
                seq.hashes.append(hash_block_tokens(parent, _span(prompt, output, i * bs, (i + 1) * bs), self.extra))
            self.pool.cache(seq.table[i], seq.hashes[i])
        seq.num_cached = full

    # ---- slots ----------------------------------------------------------------------------
    def num_blocks_for(self, num_tokens: int) -> int:
        """Blocks a table needs to hold `num_tokens` tokens."""
        return cdiv(num_tokens, self.block_size)

    def span(self, table_len: int, write: Write) -> WriteSpan:
        """The one walk of the blocks a write touches: every count of blocks a step needs comes from here. (It runs
        twice per sequence per step: its arithmetic is written out.)"""
        bs = self.block_size
        end = -(-(write.num_computed + write.num_new) // bs)
        if end > table_len:
            return WriteSpan(write.num_computed // bs, table_len, end - table_len)
        return WriteSpan(write.num_computed // bs, end, 0)

    def allocate_slots(self, growth: Growth, keep_free: int = 0) -> Slots | None:
        """Grant `growth` whole: open sequences on their prefix hits, swap sequences in, and make each
        written sequence's table cover num_computed + num_new tokens, copying any shared block the new
        tokens write into first. None, with nothing changed, when it would leave fewer than `keep_free`
        blocks free."""
        needed = self._blocks_needed(growth)
        if needed.blocks + keep_free > self.pool.num_free:
            return None
        for opening in growth.opens:
            self.pool.touch(opening.hits)
            self.pool.prefix_queries += opening.num_tokens
            self.pool.prefix_hits += len(opening.hits) * self.block_size
            self.seqs[opening.seq_id] = SeqBlocks(list(opening.hits), list(opening.hashes), len(opening.hits))
        new_block_ids: dict[int, list[int]] = {}
        copies: list[tuple[int, int]] = []
        rewritten: set[int] = set()
        swapped = self._swap_in(growth.swap_in) if growth.swap_in else ()
        for write, span in zip(growth.writes, needed.spans):
            seq_id = write.seq_id
            table = self.seqs[seq_id].table
            for i in range(span.first, span.stop):
                block = table[i]
                if block.ref_cnt > 1:
                    (fresh,) = self.pool.allocate(1)
                    copies.append((block.block_id, fresh.block_id))
                    rewritten.add(seq_id)
                    self.num_copies += 1
                    self.pool.free([block])
                    table[i] = fresh
            if span.grow:
                added = self.pool.allocate(span.grow)
                table.extend(added)
                new_block_ids[seq_id] = [b.block_id for b in added]
            else:
                new_block_ids[seq_id] = []
        return Slots(new_block_ids, copies, rewritten, swapped)

    def grow_by_one(self, seq_id: int, num_computed: int) -> list[int] | None:
        """`allocate_slots` for the one write of most steps, a token after the `num_computed` a sequence's KV covers:
        the block ids its table grew by (none when the token fits the block it writes). None, with nothing changed,
        when the write takes more: a copy of a shared block, a table that does not reach it, or a free block none is
        left of."""
        table = self.seqs[seq_id].table
        i = num_computed // self.block_size
        if i < len(table):
            return [] if table[i].ref_cnt == 1 else None
        if i > len(table) or not self.pool.num_free:
            return None
        (block,) = self.pool.allocate(1)
        table.append(block)
        return [block.block_id]

    def _blocks_needed(self, growth: Growth) -> Needed:
        """Free blocks that granting `growth` takes at most: free cached hits leaving the queue, swapped
        blocks coming back, growth, and one copy per writer of a shared block while other holders remain; with
        each write's span, which granting it walks again."""
        need = 0
        opened: dict[int, list[Block]] = {}
        if growth.opens:
            opened = {opening.seq_id: opening.hits for opening in growth.opens}
            need = len({b.block_id for hits in opened.values() for b in hits if b.ref_cnt == 0})
        if growth.swap_in:
            need += self.swap_in_blocks(growth.swap_in)
        writers: dict[int, int] = {}  # shared block id → its writers
        shared: dict[int, Block] = {}
        spans = []
        for write in growth.writes:
            seq_id = write.seq_id
            table = opened[seq_id] if seq_id in opened else (self.seqs.get(seq_id) or self.swapped[seq_id]).table
            span = self.span(len(table), write)
            spans.append(span)
            need += span.grow
            for i in range(span.first, span.stop):
                block = table[i]
                if block.ref_cnt > 1:
                    writers[block.block_id] = writers.get(block.block_id, 0) + 1
                    shared[block.block_id] = block
        if writers:
            need += sum(min(n, shared[b].ref_cnt - 1) for b, n in writers.items())
        return Needed(need, spans)

    def free(self, seq_id: int) -> None:
        seq = self.seqs.pop(seq_id, None)
        if seq is not None:
            self.pool.free(seq.table[::-1])
        swapped = self.swapped.pop(seq_id, None)
        if swapped is not None:
            self.swap_pool.free(swapped.table[::-1])

    def truncate(self, seq_id: int, num_tokens: int) -> bool:
        """Free the sequence's blocks past those `num_tokens` tokens take (a draft's rejected tokens had them);
        whether any were."""
        table = self.seqs[seq_id].table
        keep = self.num_blocks_for(num_tokens)
        if len(table) <= keep:
            return False
        self.pool.free(table[keep:][::-1])
        del table[keep:]
        return True

    def fork(self, parent_id: int, child_id: int, num_tokens: int) -> None:
        """The child shares the parent's blocks that hold its first `num_tokens` tokens."""
        parent = self.seqs[parent_id]
        self.num_forks += 1
        shared = parent.table[:self.num_blocks_for(num_tokens)]
        self.pool.touch(shared)
        full = num_tokens // self.block_size
        self.seqs[child_id] = SeqBlocks(list(shared), parent.hashes[:full], min(parent.num_cached, full))

    # ---- swapping -------------------------------------------------------------------------
    @staticmethod
    def _distinct(tables: list[list[Block]]) -> int:
        return len({b.block_id for table in tables for b in table})

    def swap_in_blocks(self, seq_ids: list[int]) -> int:
        """Device blocks that bringing the swapped sequences back takes."""
        return self._distinct([self.swapped[s].table for s in seq_ids])

    def can_swap_out(self, seq_ids: list[int]) -> bool:
        need = self._distinct([self.seqs[s].table for s in seq_ids])
        return self.swap_pool is not None and need <= self.swap_pool.num_free

    def swap_out(self, seq_ids: list[int]) -> list[tuple[int, int]]:
        """Move the sequences' blocks to swap blocks (shared blocks stay shared); (device, swap) pairs."""
        mapping: dict[int, Block] = {}
        pairs = []
        for seq_id in seq_ids:
            seq = self.seqs.pop(seq_id)
            swap_table = []
            for block in seq.table:
                target = mapping.get(block.block_id)
                if target is None:
                    (target,) = self.swap_pool.allocate(1)
                    mapping[block.block_id] = target
                    pairs.append((block.block_id, target.block_id))
                else:
                    self.swap_pool.touch([target])
                swap_table.append(target)
            self.pool.free(seq.table[::-1])
            self.swapped[seq_id] = SeqBlocks(swap_table, seq.hashes, seq.num_cached)
        return pairs

    def _swap_in(self, seq_ids: list[int]) -> list[tuple[int, int]]:
        """Bring swapped sequences back to the device; (swap, device) pairs. A full block whose hash is
        still cached on the device is taken from there instead of copied back."""
        mapping: dict[int, Block] = {}
        pairs = []
        for seq_id in seq_ids:
            seq = self.swapped.pop(seq_id)
            table = []
            for i, block in enumerate(seq.table):
                target = mapping.get(block.block_id)
                if target is None and i < seq.num_cached:
                    target = self.pool.lookup(seq.hashes[i])
                    if target is not None:
                        mapping[block.block_id] = target
                if target is None:
                    (target,) = self.pool.allocate(1)
                    mapping[block.block_id] = target
                    pairs.append((block.block_id, target.block_id))
                else:
                    self.pool.touch([target])
                table.append(target)
            self.swap_pool.free(seq.table[::-1])
            for i in range(seq.num_cached):
                self.pool.cache(table[i], seq.hashes[i])
            self.seqs[seq_id] = SeqBlocks(table, seq.hashes, seq.num_cached)
        return pairs
