"""The block pool: null block, LRU free queue with removal from the middle, lazy eviction, counters."""
from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from scheduler.block_pool import Block, BlockPool, FreeBlockQueue


def ids(blocks) -> list[int]:
    return [b.block_id for b in blocks]


def test_null_block_is_never_handed_out():
    pool = BlockPool(5)
    assert pool.num_usable == pool.num_free == 4
    assert sorted(ids(pool.allocate(4))) == [1, 2, 3, 4]
    with pytest.raises(ValueError, match="asked for 1 blocks, only 0 free"):
        pool.allocate(1)
    assert pool.blocks[0].ref_cnt == 0 and not pool.blocks[0].is_free


def test_swap_pools_use_every_block():
    pool = BlockPool(3, enable_caching=False, reserve_null=False)
    assert sorted(ids(pool.allocate(3))) == [0, 1, 2]


def test_too_small_pool_is_refused():
    with pytest.raises(ValueError, match="more than 1 blocks"):
        BlockPool(1)


def test_freed_blocks_are_reused_least_recently_used_first():
    pool = BlockPool(5)
    a, b, c, d = pool.allocate(4)
    for block, h in ((a, b"a"), (b, b"b"), (c, b"c")):
        pool.cache(block, h)
    pool.free([c, a, b, d])  # hashed ones go to the tail in this order, the unhashed d to the head
    assert ids(pool.free_queue) == [d.block_id, c.block_id, a.block_id, b.block_id]
    assert ids(pool.allocate(2)) == [d.block_id, c.block_id]
    assert pool.lookup(b"c") is None and pool.evictions == 1
    assert pool.lookup(b"a") is a and pool.lookup(b"b") is b


def test_a_hit_on_a_free_cached_block_takes_it_out_of_the_middle():
    pool = BlockPool(6)
    blocks = pool.allocate(5)
    pool.cache(blocks[2], b"x")
    pool.free(blocks)
    assert pool.num_free == 5
    hit = pool.lookup(b"x")
    pool.touch([hit])
    assert hit.ref_cnt == 1 and not hit.is_free and pool.num_free == 4
    assert hit.block_id not in ids(pool.free_queue)
    assert all(b is not hit for b in pool.allocate(4)), "a held block is never handed out"
    pool.touch([hit])
    pool.free([hit])
    assert hit.ref_cnt == 1 and not hit.is_free, "a shared block stays in use until its last holder frees it"


def test_the_first_block_cached_under_a_hash_stays_the_one_hit():
    pool = BlockPool(4)
    a, b = pool.allocate(2)
    pool.cache(a, b"h")
    pool.cache(b, b"h")
    assert pool.lookup(b"h") is a and b.block_hash is None


def test_caching_off_never_hits():
    pool = BlockPool(4, enable_caching=False)
    (a,) = pool.allocate(1)
    pool.cache(a, b"h")
    assert pool.lookup(b"h") is None and a.block_hash is None


def test_usage():
    pool = BlockPool(5)
    blocks = pool.allocate(2)
    assert pool.usage == 0.5
    pool.free(blocks)
    assert pool.usage == 0.0


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["append", "appendleft", "popleft", "remove"]), st.integers(0, 7)),
                max_size=60))
def test_free_queue_matches_a_list(ops):
    blocks = [Block(i) for i in range(8)]
    queue = FreeBlockQueue(blocks[:4])
    model = blocks[:4]
    for op, i in ops:
        block = blocks[i]
        if op in ("append", "appendleft") and block not in model:
            getattr(queue, op)(block)
            model.insert(len(model) if op == "append" else 0, block)
        elif op == "remove" and block in model:
            queue.remove(block)
            model.remove(block)
        elif op == "popleft":
            if model:
                assert queue.popleft() is model.pop(0)
            else:
                with pytest.raises(ValueError):
                    queue.popleft()
        assert list(queue) == model and queue.num_free == len(model)
        assert all(b.is_free == (b in model) for b in blocks)
