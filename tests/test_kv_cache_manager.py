"""Block tables: chained hashes, prefix hits, commit of filled blocks, fork + copy-on-write, swapping."""
from __future__ import annotations

import hashlib

import pytest

from scheduler.kv_cache_manager import (
    NO_PARENT, Growth, KVCacheManager, Opening, Write, encode_extra_keys, hash_full_blocks,
)

BS = 8


def manager(num_blocks=9, num_swap=8, model="m", caching=True) -> KVCacheManager:
    return KVCacheManager(num_blocks, num_swap, BS, (model,), caching)


def run_prompt(kv: KVCacheManager, seq_id: int, tokens: list[int]) -> int:
    """Open a sequence on its hits, allocate and 'compute' the rest of the tokens; returns the hit tokens."""
    hashes = kv.hash_tokens(tokens)
    hits = kv.find_prefix(hashes, len(tokens))
    cached = len(hits) * BS
    opening = Opening(seq_id, hits, hashes, len(tokens))
    assert kv.allocate_slots(Growth([opening], [], [Write(seq_id, cached, len(tokens) - cached)]))
    kv.commit(seq_id, tokens, [], len(tokens))
    return cached


def grants_exactly(kv: KVCacheManager, growth: Growth, blocks: int):
    """allocate_slots refuses `growth` when it would leave fewer free blocks than it takes, and grants it
    taking exactly `blocks`."""
    free = kv.num_free
    assert kv.allocate_slots(growth, keep_free=free - blocks + 1) is None
    assert kv.num_free == free, "a refusal changes nothing"
    slots = kv.allocate_slots(growth, keep_free=free - blocks)
    assert slots is not None and kv.num_free == free - blocks
    return slots


def test_hash_is_sha256_over_the_documented_bytes():
    tokens = list(range(100, 100 + 2 * BS))
    extra = encode_extra_keys(("model-α", "adapter"))
    assert extra == b"".join(len(k.encode()).to_bytes(4, "little") + k.encode() for k in ("model-α", "adapter"))
    h0 = hashlib.sha256(NO_PARENT + b"".join(t.to_bytes(8, "little", signed=True) for t in tokens[:BS]) + extra)
    h1 = hashlib.sha256(h0.digest() + b"".join(t.to_bytes(8, "little", signed=True) for t in tokens[BS:]) + extra)
    assert hash_full_blocks(tokens + [1, 2, 3], BS, extra) == [h0.digest(), h1.digest()]


def test_hashes_chain_and_carry_the_extra_keys():
    a = list(range(3 * BS))
    b = [7] + a[1:]
    ha, hb = hash_full_blocks(a, BS, b"m"), hash_full_blocks(b, BS, b"m")
    assert all(x != y for x, y in zip(ha, hb)), "a change in block 0 changes every later hash"
    assert all(x != y for x, y in zip(ha, hash_full_blocks(a, BS, encode_extra_keys(("other",)))))
    assert hash_full_blocks(a, BS, b"m", ha[:1]) == ha, "known leading hashes are reused"


def test_longest_prefix_hit_always_leaves_the_last_token():
    kv = manager()
    prompt = list(range(3 * BS))
    assert run_prompt(kv, 1, prompt) == 0
    assert run_prompt(kv, 2, prompt) == 2 * BS, "a fully cached prompt recomputes its last block"
    assert run_prompt(kv, 3, prompt + [5]) == 3 * BS
    assert run_prompt(kv, 4, prompt[:BS] + [0] * (2 * BS)) == BS, "the hit stops at the first miss"
    assert kv.pool.prefix_hits == 6 * BS
    assert kv.pool.prefix_queries == 3 * len(prompt) + 1 + 3 * BS


def test_another_model_never_hits():
    kv_a = manager(model="a")
    prompt = list(range(2 * BS + 1))
    run_prompt(kv_a, 1, prompt)
    other = manager(model="b")
    assert other.find_prefix(other.hash_tokens(prompt), len(prompt)) == []
    assert other.hash_tokens(prompt) != kv_a.hash_tokens(prompt)


def test_generated_tokens_are_cached_once_their_block_fills():
    kv = manager()
    prompt = list(range(BS + 3))
    run_prompt(kv, 1, prompt)
    tokens = list(prompt)
    for t in range(50, 50 + BS):  # decode: one token a step
        tokens.append(t)
        kv.allocate_slots(Growth(writes=[Write(1, len(tokens) - 1, 1)]))
        kv.commit(1, prompt, tokens[len(prompt):], len(tokens))
    kv.free(1)
    follow_up = tokens + [99] * 5  # the next turn of a chat resends everything
    assert run_prompt(kv, 2, follow_up) == 2 * BS


def test_free_in_reverse_order_evicts_a_prefix_tail_first():
    kv = manager(num_blocks=4)
    prompt = list(range(3 * BS))
    run_prompt(kv, 1, prompt)
    hashes = kv.hash_tokens(prompt)
    kv.free(1)
    kv.pool.allocate(1)
    assert [kv.pool.lookup(h) is not None for h in hashes] == [True, True, False]


def test_fork_shares_blocks_and_copies_a_shared_block_on_first_write():
    kv = manager()
    prompt = list(range(2 * BS + 3))
    run_prompt(kv, 0, prompt[:-1])  # the prompt up to its last token, as for n > 1
    for child in (1, 2):
        kv.fork(0, child, len(prompt) - 1)
    table = kv.block_ids(0)
    assert kv.block_ids(1) == kv.block_ids(2) == table
    assert [kv.pool.blocks[b].ref_cnt for b in table] == [3, 3, 3]
    # three writers of one block: two copies, the last writes in place
    slots = grants_exactly(kv, Growth(writes=[Write(s, len(prompt) - 1, 1) for s in (0, 1, 2)]), 2)
    assert slots.new_block_ids == {0: [], 1: [], 2: []}
    assert slots.copies == [(table[2], kv.block_ids(0)[2]), (table[2], kv.block_ids(1)[2])]
    assert slots.rewritten == {0, 1} and kv.block_ids(2) == table
    assert [kv.pool.blocks[b].ref_cnt for b in table] == [3, 3, 1]
    grants_exactly(kv, Growth(writes=[Write(s, len(prompt), 1) for s in (0, 1, 2)]), 0)


def test_fork_on_a_block_boundary_needs_no_copy():
    kv = manager()
    run_prompt(kv, 0, list(range(2 * BS)))
    kv.fork(0, 1, 2 * BS)
    slots = grants_exactly(kv, Growth(writes=[Write(0, 2 * BS, 1), Write(1, 2 * BS, 1)]), 2)
    assert slots.copies == []
    assert kv.block_ids(0)[:2] == kv.block_ids(1)[:2] and kv.block_ids(0)[2] != kv.block_ids(1)[2]


def test_a_table_can_grow_ahead_of_its_tokens():
    """What the contiguous-reservation baseline does (benchmarks/baselines.py): blocks no token fills yet."""
    kv = manager()
    slots = grants_exactly(kv, Growth([Opening(1, [], [], 5)], [], [Write(1, 0, 40)]), 5)
    assert len(slots.new_block_ids[1]) == 5
    assert grants_exactly(kv, Growth(writes=[Write(1, 5, 1)]), 0).new_block_ids == {1: []}


def test_opening_on_free_cached_hits_counts_them_and_one_request_is_granted_whole():
    kv = manager(num_blocks=5)
    prompt = list(range(2 * BS + 1))
    run_prompt(kv, 0, prompt)
    kv.free(0)  # its two full blocks stay cached, free
    hashes = kv.hash_tokens(prompt)
    hits = kv.find_prefix(hashes, len(prompt))
    assert len(hits) == 2 and kv.num_free == 4
    opening = Growth([Opening(1, hits, hashes, len(prompt)), Opening(2, [], [], 30)], [],
                     [Write(1, 2 * BS, 1), Write(2, 0, 30)])
    assert kv.allocate_slots(opening) is None, "2 hits leaving the free queue + 1 + 4 blocks > 4 free"
    assert 1 not in kv.seqs and 2 not in kv.seqs and kv.num_free == 4
    grants_exactly(kv, Growth([Opening(1, hits, hashes, len(prompt))], [], [Write(1, 2 * BS, 1)]), 3)
    assert kv.block_ids(1)[:2] == [b.block_id for b in hits]


@pytest.mark.parametrize("evict", [False, True], ids=["cached-blocks-stay", "cached-blocks-evicted"])
def test_swap_round_trip_maps_back_and_keeps_sharing(evict):
    kv = manager(num_blocks=9, num_swap=4)
    prompt = list(range(2 * BS + 3))
    run_prompt(kv, 0, prompt[:-1])
    kv.fork(0, 1, len(prompt) - 1)
    before = kv.block_ids(0)
    assert kv.block_ids(1) == before
    assert kv.can_swap_out([0, 1])
    out = kv.swap_out([0, 1])
    assert [d for d, _ in out] == before, "each distinct device block is copied out once"
    assert kv.num_free == kv.pool.num_usable and kv.swap_pool.num_free == 1
    if evict:
        kv.pool.free(kv.pool.allocate(kv.num_free))
    free = kv.num_free
    assert kv.allocate_slots(Growth(swap_in=[0, 1]), keep_free=free - 2) is None, "room for 3 blocks is asked"
    back = dict(kv.allocate_slots(Growth(swap_in=[0, 1]), keep_free=free - 3).swap_in)
    to_swap = dict(out)
    after = kv.block_ids(0)
    assert kv.block_ids(1) == after and [kv.pool.blocks[b].ref_cnt for b in after] == [2, 2, 2]
    if evict:
        assert after == [back[to_swap[b]] for b in before], "every block comes back through its swap block"
    else:
        assert after[:2] == before[:2], "full blocks still cached on the device are taken from there"
        assert list(back) == [to_swap[before[2]]] and after[2] == back[to_swap[before[2]]]
    assert kv.swap_pool.num_free == kv.swap_pool.num_usable
    assert [b.block_id for b in kv.find_prefix(kv.hash_tokens(prompt), len(prompt))] == after[:2]


def test_swap_out_needs_room():
    kv = manager(num_swap=2)
    run_prompt(kv, 0, list(range(3 * BS)))
    assert not kv.can_swap_out([0]), "three blocks do not fit two swap blocks"
    no_swap = manager(num_swap=0)
    run_prompt(no_swap, 0, [1, 2, 3])
    assert not no_swap.can_swap_out([0])
