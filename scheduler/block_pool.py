"""Physical KV blocks of one cache: reference counts, the LRU free queue and the prefix-hash index.

A block whose reference count drops to zero keeps its hash and joins the tail of the free queue, so a
later request can still hit it; it is evicted (its hash forgotten) only when it is handed out again.
The free queue is a doubly linked list threaded through the blocks themselves, so a hit on a free
cached block takes it out of the middle in O(1).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True, eq=False)
class Block:
    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None  # set while the block is in the prefix index
    prev_free: Block | None = None
    next_free: Block | None = None

    @property
    def is_free(self) -> bool:
        return self.prev_free is not None


class FreeBlockQueue:
    """Free blocks, least recently used first; O(1) append, pop and removal from the middle."""

    def __init__(self, blocks: list[Block]) -> None:
        self.head = Block(-1)  # sentinels: every queued block has both neighbours set
        self.tail = Block(-1)
        self.head.next_free = self.tail
        self.tail.prev_free = self.head
        self.num_free = 0
        for block in blocks:
            self.append(block)

    def append(self, block: Block) -> None:
        last = self.tail.prev_free
        last.next_free = block
        block.prev_free = last
        block.next_free = self.tail
        self.tail.prev_free = block
        self.num_free += 1

    def appendleft(self, block: Block) -> None:
        first = self.head.next_free
        first.prev_free = block
        block.next_free = first
        block.prev_free = self.head
        self.head.next_free = block
        self.num_free += 1

    def popleft(self) -> Block:
        block = self.head.next_free
        if block is self.tail:
            raise ValueError("no free block left")
        self.remove(block)
        return block

    def remove(self, block: Block) -> None:
        block.prev_free.next_free = block.next_free
        block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self.num_free -= 1

    def __iter__(self):
        block = self.head.next_free
        while block is not self.tail:
            yield block
            block = block.next_free


class BlockPool:
    """`num_blocks` blocks; with `reserve_null`, block 0 is the null block that is never handed out."""

    def __init__(self, num_blocks: int, enable_caching: bool = True, reserve_null: bool = True) -> None:
        first = 1 if reserve_null else 0
        if num_blocks <= first:
            raise ValueError(f"a block pool needs more than {first} blocks; got {num_blocks}")
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks[first:])
        self.num_usable = num_blocks - first
        self.enable_caching = enable_caching
        self.cached: dict[bytes, Block] = {}
        self.prefix_queries = 0  # prompt tokens looked up
        self.prefix_hits = 0  # of those, tokens found cached
        self.evictions = 0
        self.num_shared = 0  # blocks with more than one reference

    @property
    def num_free(self) -> int:
        return self.free_queue.num_free

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free / self.num_usable

    def lookup(self, block_hash: bytes) -> Block | None:
        return self.cached.get(block_hash) if self.enable_caching else None

    def touch(self, blocks: list[Block]) -> None:
        """Take a reference on each block (prefix hits and forks); a free cached block leaves the queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            elif block.ref_cnt == 1:
                self.num_shared += 1
            block.ref_cnt += 1

    def allocate(self, num: int) -> list[Block]:
        if num > self.num_free:
            raise ValueError(f"asked for {num} blocks, only {self.num_free} free")
        blocks = []
        for _ in range(num):
            block = self.free_queue.popleft()
            if block.block_hash is not None:
                del self.cached[block.block_hash]
                block.block_hash = None
                self.evictions += 1
            block.ref_cnt = 1
            blocks.append(block)
        return blocks

    def free(self, blocks: list[Block]) -> None:
        """Drop one reference on each block, in the order given (callers pass a table reversed, so a
        prefix's tail is evicted before its head). A block without a hash cannot be hit again: it goes
        to the head of the queue, to be reused first."""
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 1:
                self.num_shared -= 1
            elif block.ref_cnt == 0:
                if block.block_hash is None:
                    self.free_queue.appendleft(block)
                else:
                    self.free_queue.append(block)

    def cache(self, block: Block, block_hash: bytes) -> None:
        """Index a full, computed block by its hash; the first block with a given hash stays the one hit."""
        if self.enable_caching and block.block_hash is None and block_hash not in self.cached:
            block.block_hash = block_hash
            self.cached[block_hash] = block
