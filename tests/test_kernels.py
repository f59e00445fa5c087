"""Triton kernels against the torch reference, run by Triton's CPU interpreter.

tests/conftest.py sets TRITON_INTERPRET=1 before triton is imported, so `@triton.jit` builds
interpreted functions and the kernels run on CPU tensors. Caches start as NaN: a kernel that reads a
slot the reference does not (the null block, a block's tail past the sequence, a padding table entry)
poisons its output and fails the comparison.

The interpreter multiplies bfloat16 `tl.dot` operands as raw bits (triton-lang/triton#11584, "not
supported yet"), so attention runs here in float32 and float16; benchmarks/kernels_gpu.py checks
bfloat16 on a GPU. bfloat16 is still covered where no dot is involved (store, copy).
"""
from __future__ import annotations

import os
import random
import subprocess
import sys

import pytest
import torch
from kernel_builds import best_kernel, kernel  # noqa: F401 (fixtures)

from kernels import attention_backend, cpu_attention, reference, step_attention, triton_ops
from benchmarks.paged_batches import PagedBatch, random_paged_batch

SCALE = 0.125


def make_batch(rng: random.Random, chunks: list[tuple[int, int]], block_size: int, head_dim: int,
               queries_per_kv: int, num_kv_heads: int, dtype: torch.dtype) -> PagedBatch:
    """A random paged batch whose caches the reference has filled."""
    batch = random_paged_batch(rng, chunks, block_size, head_dim, queries_per_kv, num_kv_heads, dtype)
    reference.store_kv(batch.key, batch.value, batch.key_cache, batch.value_cache, batch.slot_mapping)
    return batch


def mixed_chunks(rng: random.Random, block_size: int) -> list[tuple[int, int]]:
    """Decodes, a fresh prefill, chunked prefills over cached contexts; contexts and chunk ends fall
    inside pages, plus one chunk that starts and one that ends exactly on a page boundary."""
    return [
        (rng.randrange(1, 300), 1),
        (0, rng.randrange(33, 65)),
        (rng.randrange(1, 300), rng.randrange(2, 40)),
        (block_size * (299 // block_size), rng.randrange(1, 64)),
        (300, 1),
        (rng.randrange(1, 200), 64 - 1),
        (block_size - 5, 5),
    ]


def tolerance(dtype: torch.dtype) -> dict:
    return {"atol": 2e-5, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 4e-3, "rtol": 4e-3}


# block_size, head_dim, queries_per_kv, num_kv_heads, dtype, num_splits: every block size, head_dim
# and GQA ratio appears, half the cases on the split-KV path (with more segments than some chunks'
# key tiles, so empty segments are merged too)
ATTENTION_CASES = [
    (8, 64, 1, 2, torch.float32, 1),
    (16, 80, 4, 1, torch.float32, 4),
    (32, 96, 8, 1, torch.float32, 1),
    (128, 128, 1, 2, torch.float32, 8),
    (64, 256, 4, 1, torch.float32, 2),
    (16, 64, 3, 2, torch.float16, 4),
    (8, 128, 8, 1, torch.float16, 1),
]


@pytest.mark.parametrize("block_size,head_dim,qpk,kv_heads,dtype,num_splits", ATTENTION_CASES)
def test_mixed_batch_matches_reference(block_size, head_dim, qpk, kv_heads, dtype, num_splits):
    rng = random.Random(f"{block_size}-{head_dim}-{qpk}-{num_splits}")
    batch = make_batch(rng, mixed_chunks(rng, block_size), block_size, head_dim, qpk, kv_heads, dtype)
    out = triton_ops.unified_attention(*batch.attention_args(SCALE), num_splits=num_splits)
    expected = reference.paged_attention(*batch.attention_args(SCALE))
    torch.testing.assert_close(out, expected, **tolerance(dtype))


@pytest.mark.parametrize("block_size,head_dim,qpk,num_splits", [(16, 128, 4, 1), (32, 80, 1, 16), (8, 64, 8, 4)])
def test_decode_batch_matches_reference(block_size, head_dim, qpk, num_splits):
    """All-decode batches take the 16-row decode tiles; contexts 0..300 around page edges."""
    rng = random.Random(f"decode-{block_size}-{num_splits}")
    contexts = [0, block_size - 1, block_size, 2 * block_size + 1, 300] + [rng.randrange(300) for _ in range(3)]
    batch = make_batch(rng, [(c, 1) for c in contexts], block_size, head_dim, qpk, 1, torch.float32)
    out = triton_ops.unified_attention(*batch.attention_args(SCALE), num_splits=num_splits)
    torch.testing.assert_close(out, reference.paged_attention(*batch.attention_args(SCALE)), **tolerance(torch.float32))


def test_paged_attention_heuristic_path_strided_query_int64_metadata():
    """The public entry point (heuristic split choice) with a sequence that has no new tokens, the
    query a strided view into a fused projection, and int64 metadata."""
    rng = random.Random("public-entry")
    batch = make_batch(rng, [(20, 3), (40, 0), (0, 7)], 16, 64, 2, 1, torch.float32)
    fused = torch.randn(batch.query.shape[0], 4, 64)
    fused[:, :2] = batch.query
    batch.query = fused[:, :2]
    batch.block_tables, batch.query_start_loc, batch.seq_lens = (
        batch.block_tables.long(), batch.query_start_loc.long(), batch.seq_lens.long())
    out = triton_ops.paged_attention(*batch.attention_args(SCALE))
    torch.testing.assert_close(out, reference.paged_attention(*batch.attention_args(SCALE)), **tolerance(torch.float32))


@pytest.mark.parametrize("source,cache_dtype", [(torch.float32, torch.float16), (torch.bfloat16, torch.bfloat16)])
def test_store_kv_matches_reference_with_padding_and_strided_input(source, cache_dtype):
    gen = torch.Generator().manual_seed(5)
    num_blocks, block_size, heads, dim = 6, 8, 3, 80
    # key and value are views into one fused [tokens, 2 * heads * dim] projection, as a model makes them
    fused = torch.randn(7, 2 * heads * dim, generator=gen).to(source)
    key = fused[:, : heads * dim].view(7, heads, dim)
    value = fused[:, heads * dim:].view(7, heads, dim)
    slots = torch.tensor([9, -1, 40, 0, 47, -1, 17], dtype=torch.int32)
    caches = [torch.randn(num_blocks, block_size, heads, dim, generator=gen).to(cache_dtype) for _ in range(2)]
    expected = [c.clone() for c in caches]
    triton_ops.store_kv(key, value, caches[0], caches[1], slots)
    reference.store_kv(key, value, expected[0], expected[1], slots)
    assert torch.equal(caches[0], expected[0]) and torch.equal(caches[1], expected[1])


def test_copy_blocks_all_layers_match_reference():
    gen = torch.Generator().manual_seed(6)
    layers = [torch.randn(10, 16, 2, 64, generator=gen).to(torch.bfloat16) for _ in range(6)]
    keys, values = layers[:3], layers[3:]
    expected_keys, expected_values = [c.clone() for c in keys], [c.clone() for c in values]
    mapping = torch.tensor([[3, 7], [5, 2], [9, 1]])
    triton_ops.copy_blocks(keys, values, mapping)
    reference.copy_blocks(expected_keys, expected_values, mapping)
    for got, want in zip(keys + values, expected_keys + expected_values):
        assert torch.equal(got, want)
    triton_ops.copy_blocks(keys, values, torch.empty(0, 2, dtype=torch.int64))
    for got, want in zip(keys + values, expected_keys + expected_values):
        assert torch.equal(got, want)


def test_copy_blocks_rejects_chained_or_out_of_range_copies():
    caches = [torch.zeros(4, 8, 1, 16) for _ in range(2)]
    with pytest.raises(ValueError, match="destinations"):
        triton_ops.copy_blocks(caches[:1], caches[1:], torch.tensor([[1, 2], [2, 3]]))
    with pytest.raises(ValueError, match="block ids"):
        triton_ops.copy_blocks(caches[:1], caches[1:], torch.tensor([[1, 4]]))


def test_attention_rejects_inconsistent_shapes():
    cache = torch.zeros(4, 16, 2, 64)
    meta = (torch.zeros(1, 2, dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32),
            torch.tensor([1], dtype=torch.int32), SCALE)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        triton_ops.paged_attention(torch.zeros(1, 3, 64), cache, cache, *meta)
    with pytest.raises(ValueError, match="query must be"):
        triton_ops.paged_attention(torch.zeros(1, 4, 80), cache, cache, *meta)
    with pytest.raises(ValueError, match="share dtype"):
        triton_ops.paged_attention(torch.zeros(1, 4, 64, dtype=torch.float16), cache, cache, *meta)
    with pytest.raises(ValueError, match="power of two"):
        triton_ops.paged_attention(torch.zeros(1, 4, 64), torch.zeros(4, 12, 2, 64), torch.zeros(4, 12, 2, 64), *meta)
    batch = torch.zeros(1, 4, 64), cache, cache, *meta
    with pytest.raises(ValueError, match="num_splits"):
        triton_ops.unified_attention(*batch, num_splits=3)


def test_split_heuristic():
    sms = 132
    # batch 1 x 8 KV heads at 32k context: split as deep as allowed
    assert triton_ops.num_kv_splits(8, 32768, sms) == triton_ops.MAX_SPLITS
    # short contexts: no segment under MIN_SPLIT_TOKENS keys
    assert triton_ops.num_kv_splits(8, 2 * triton_ops.MIN_SPLIT_TOKENS, sms) == 2
    assert triton_ops.num_kv_splits(8, triton_ops.MIN_SPLIT_TOKENS - 1, sms) == 1
    # a grid that already fills the SMs stays single-pass
    assert triton_ops.num_kv_splits(64 * 8, 32768, sms) == 1
    assert triton_ops.num_kv_splits(66, 32768, sms) == 2


def test_launch_config_tiles():
    decode = triton_ops.launch_config(4, 4, 8, 4, 128, 4096, 132)
    assert (decode.block_m, decode.block_q, decode.tile_n) == (16, 4, 64)
    assert decode.num_splits > 1  # 4 seqs x 8 KV heads leave most of 132 SMs idle
    prefill = triton_ops.launch_config(4096, 4, 8, 4, 128, 4096, 132)
    assert (prefill.block_m, prefill.block_q, prefill.tile_n, prefill.num_splits) == (64, 16, 64, 1)
    mqa = triton_ops.launch_config(2, 2, 1, 32, 80, 1024, 1)
    assert (mqa.block_m, mqa.block_q, mqa.tile_n, mqa.num_splits) == (32, 1, 64, 1)


def test_compiled_kernels_refuse_cpu_tensors_without_the_interpreter():
    """Without TRITON_INTERPRET the kernels are compiled for the GPU: CPU tensors get a clear error."""
    code = ("import torch; from kernels import triton_ops\n"
            "c = torch.zeros(2, 8, 1, 16)\n"
            "try:\n"
            "    triton_ops.store_kv(torch.zeros(1, 1, 16), torch.zeros(1, 1, 16), c, c.clone(),"
            " torch.zeros(1, dtype=torch.int32))\n"
            "except ValueError as e:\n"
            "    print(e)\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert "needs CUDA tensors" in result.stdout, result.stderr


def test_every_kernel_compiles_to_hopper_machine_code_not_only_under_the_interpreter():
    """The interpreter accepts code the compiler refuses (the first GPU run met a plain global in the attention
    kernel): each kernel compiles to an sm_90 cubin here, with Triton's own ptxas and no GPU."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = os.path.join(os.path.dirname(__file__), "triton_compile.py")
    result = subprocess.run([sys.executable, script, "90"], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    assert result.stdout.count("attention ") == 16 and result.stdout.count("store_kv and copy_blocks") == 2


def test_dispatch():
    assert attention_backend("triton", "cpu") is triton_ops
    assert attention_backend("auto", "cpu") is cpu_attention
    assert attention_backend("auto", "cuda") is triton_ops
    assert attention_backend("torch", "cpu") is reference
    assert attention_backend("torch", "cuda") is reference
    with pytest.raises(ValueError, match="unknown attention backend"):
        attention_backend("flash", "cpu")


# The CPU backend against the reference: the same NaN-poisoned caches, so a slot it reads past a sequence's
# end (it gathers whole blocks, and pads short tables with the null block) must be masked out exactly.
@pytest.mark.parametrize("block_size,head_dim,qpk,kv_heads,dtype", [
    (8, 64, 1, 2, torch.float32), (16, 80, 4, 1, torch.float32), (32, 96, 8, 1, torch.float32),
    (128, 128, 1, 2, torch.float32), (16, 64, 3, 2, torch.bfloat16), (8, 128, 2, 2, torch.float16)])
def test_cpu_backend_matches_reference_on_mixed_batches(block_size, head_dim, qpk, kv_heads, dtype, kernel):
    rng = random.Random(f"cpu-{block_size}-{head_dim}-{qpk}")
    batch = make_batch(rng, mixed_chunks(rng, block_size), block_size, head_dim, qpk, kv_heads, dtype)
    out = cpu_attention.paged_attention(*batch.attention_args(SCALE), kernel=kernel)
    torch.testing.assert_close(out, reference.paged_attention(*batch.attention_args(SCALE)), **tolerance(dtype))


@pytest.mark.parametrize("path", ["native", "gathers"])
def test_cpu_backend_decode_groups_by_length_and_rows_out_of_order(path, best_kernel):
    """Decodes of very different lengths (several length groups for the torch gathers), interleaved with
    prefill chunks and a sequence with no new token; one step's plan serves every layer, each storing its own keys
    and values (through a padding slot) into NaN caches before attending. `native`: the C kernel reading the
    caches in place (kernels/cpu_attention.c); `gathers`: the torch path, without the kernels."""
    chunks = [(3, 1), (0, 9), (700, 1), (40, 0), (5, 1), (260, 1), (130, 4), (1, 1), (1200, 1)]
    layers = [random_paged_batch(random.Random("cpu-groups"), chunks, 16, 64, 2, 2, torch.float32)]
    layers += [random_paged_batch(random.Random("cpu-groups"), chunks, 16, 64, 2, 2, torch.float32) for _ in range(2)]
    first = layers[0]
    attend = step_attention(cpu_attention, first.slot_mapping, first.block_tables, first.query_start_loc,
                            first.seq_lens, best_kernel if path == "native" else None)
    for i, batch in enumerate(layers):  # the same pages (same seed); other keys, values and queries
        gen = torch.Generator().manual_seed(i)
        for t in (batch.key, batch.value, batch.query):
            t.copy_(torch.randn(t.shape, generator=gen))
        out = attend(batch.query, batch.key, batch.value, batch.key_cache, batch.value_cache, SCALE)
        torch.testing.assert_close(out, reference.paged_attention(*batch.attention_args(SCALE)),
                                   **tolerance(torch.float32))
    assert attend.slots is None
    if path == "native":
        assert attend.native is not None and not attend.decodes and not attend.chunks
    else:
        assert attend.native is None and len(attend.decodes) > 1 and attend.chunks


@pytest.mark.parametrize("block_size,head_dim,queries_per_kv,num_kv_heads", [(16, 64, 2, 2), (8, 128, 4, 1),
                                                                           (32, 80, 1, 3)])
def test_the_c_kernel_reads_bfloat16_caches_in_place_as_the_reference_reads_them(
        block_size, head_dim, queries_per_kv, num_kv_heads, kernel):
    """bfloat16 caches and queries (the kernel computes in float32 and rounds its output once); NaN wherever a
    sequence has no key, a strided query as the model passes it."""
    chunks = [(0, 1), (17, 1), (300, 1), (block_size - 1, 1), (64, 1)]
    batch = random_paged_batch(random.Random(f"bf16-{head_dim}"), chunks, block_size, head_dim, queries_per_kv,
                               num_kv_heads, torch.bfloat16)
    heads = queries_per_kv * num_kv_heads
    wide = torch.randn(batch.query.shape[0], heads + 1, head_dim, generator=torch.Generator().manual_seed(1))
    query = wide.to(torch.bfloat16)[:, :heads]  # rows `heads + 1` heads apart, as q sliced out of qkv
    attend = step_attention(cpu_attention, batch.slot_mapping, batch.block_tables, batch.query_start_loc,
                            batch.seq_lens, kernel)
    out = attend(query, batch.key, batch.value, batch.key_cache, batch.value_cache, SCALE)
    assert attend.native is not None
    args = batch.attention_args(SCALE)
    expected = reference.paged_attention(query, *args[1:])
    torch.testing.assert_close(out.float(), expected.float(), **tolerance(torch.bfloat16))


@pytest.mark.parametrize("dtype,block_size,head_dim,queries_per_kv,num_kv_heads", [
    (torch.float32, 16, 64, 2, 2), (torch.bfloat16, 16, 64, 2, 2), (torch.bfloat16, 8, 128, 1, 3),
    (torch.float32, 32, 80, 4, 1)])
def test_a_tokens_attention_is_the_same_bits_decoded_prefilled_whole_or_in_chunks(dtype, block_size, head_dim,
                                                                                   queries_per_kv, num_kv_heads,
                                                                                   kernel):
    """One sequence of 45 tokens in a NaN-poisoned cache, its pages shuffled: each position's output alone as a
    decode, in one prefill of all 45, and in chunks of 5, 13 and 27 over the cached context before them, in one
    step with other sequences. The C kernel sums each row in one order, so a worker's restart (which prefills
    what was decoded) changes no bit; the reference checks the values."""
    length, heads = 45, queries_per_kv * num_kv_heads
    gen = torch.Generator().manual_seed(block_size + head_dim)
    pages = -(-length // block_size)
    key_cache = torch.full((pages + 4, block_size, num_kv_heads, head_dim), float("nan"), dtype=dtype)
    value_cache = key_cache.clone()
    table = torch.randperm(pages + 3, generator=gen)[:pages] + 1  # block 0 stays NaN: the null block
    slots = (table[:, None] * block_size + torch.arange(block_size)).flatten()[:length]
    for cache in (key_cache, value_cache):
        cache.view(-1, num_kv_heads, head_dim)[slots] = torch.randn(length, num_kv_heads, head_dim,
                                                                    generator=gen).to(dtype)
    query = torch.randn(length, heads, head_dim, generator=gen).to(dtype)
    other = torch.randn(7, heads, head_dim, generator=gen).to(dtype)  # another sequence's rows, on the same pages

    def attend(spans: list[tuple[int, int]]) -> torch.Tensor:
        """The rows [start, end) of each span as one chunk of its own sequence, after a 7-token prefill of
        another sequence over the same pages; the span rows of the output, in span order."""
        rows = torch.cat([other, *(query[a:b] for a, b in spans)])
        ends = torch.tensor([7, *(b for _, b in spans)], dtype=torch.int32)
        starts = torch.tensor([0, 7, *(b - a for a, b in spans)], dtype=torch.int32).cumsum(0, dtype=torch.int32)
        tables = table.to(torch.int32).expand(len(spans) + 1, pages)
        return cpu_attention.paged_attention(rows, key_cache, value_cache, tables, starts, ends, SCALE, kernel)[7:]

    whole = attend([(0, length)])
    assert not whole.isnan().any()
    assert torch.equal(attend([(p, p + 1) for p in range(length)]), whole)
    assert torch.equal(attend([(0, 5), (5, 18), (18, length)]), whole)
    seq_lens = torch.tensor([length], dtype=torch.int32)
    expected = reference.paged_attention(query, key_cache, value_cache, table[None].to(torch.int32),
                                         torch.tensor([0, length], dtype=torch.int32), seq_lens, SCALE)
    torch.testing.assert_close(whole.float(), expected.float(), **tolerance(dtype))


@pytest.mark.parametrize("backend", [reference, cpu_attention])
def test_step_attention_stores_then_attends(backend, best_kernel):
    rng = random.Random("bound")
    batch = random_paged_batch(rng, [(20, 3), (7, 1)], 16, 64, 2, 1, torch.float32)
    keep = batch.slot_mapping >= 0  # no padding slot: the CPU backend's direct store
    key, value, slots = batch.key[keep], batch.value[keep], batch.slot_mapping[keep]
    expected = make_batch(random.Random("bound"), [(20, 3), (7, 1)], 16, 64, 2, 1, torch.float32)
    attend = step_attention(backend, slots, batch.block_tables, batch.query_start_loc, batch.seq_lens, best_kernel)
    out = attend(batch.query, key, value, batch.key_cache, batch.value_cache, SCALE)
    assert torch.equal(batch.key_cache.nan_to_num(), expected.key_cache.nan_to_num())
    assert torch.equal(batch.value_cache.nan_to_num(), expected.value_cache.nan_to_num())
    torch.testing.assert_close(out, reference.paged_attention(*expected.attention_args(SCALE)),
                               **tolerance(torch.float32))


def test_the_c_kernels_are_built_once_per_machine_and_missing_compilers_fall_back_to_torch(tmp_path, monkeypatch,
                                                                                           caplog):
    """A fresh cache directory gets one shared library, and a build removes other sources' libraries unused for a
    week; a compiler that does not exist gives None (logged), and the worker's CPU paths are then torch's: the
    CPU backend's plan uses the torch gathers."""
    import os
    import time

    from gpu_worker import cpu_paths
    from kernels import native

    stale, recent = tmp_path / "cpu_kernels-0000000000000000.so", tmp_path / "cpu_kernels-1111111111111111.so"
    stale.write_bytes(b"old"), recent.write_bytes(b"other checkout")
    week_ago = time.time() - native.STALE_S - 60
    os.utime(stale, (week_ago, week_ago))
    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(tmp_path))
    native.load.cache_clear()
    try:
        assert native.load() is not None
        assert not stale.exists() and recent.exists()
        built = set(tmp_path.glob("cpu_kernels-*.so")) - {recent}
        assert len(built) == 1
        library = built.pop()
        os.utime(library, (week_ago, week_ago))
        native.load.cache_clear()
        assert native.load() is not None  # loaded again, not rebuilt, and marked used
        assert set(tmp_path.glob("cpu_kernels-*.so")) == {library, recent}
        assert library.stat().st_mtime > week_ago + native.STALE_S
        native.load.cache_clear()
        monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
        assert native.load() is None
        assert "building or loading the CPU kernels failed" in caplog.text
        paths = cpu_paths.choose("auto", torch.float32, "cpu", 64, 16)
        assert (paths.kernel is None and paths.build == "none" and paths.linears == "mkl"
                and paths.attention == paths.sampling == "torch" and not paths.batch_invariant)
        batch = random_paged_batch(random.Random("no-cc"), [(5, 1), (30, 1)], 16, 64, 2, 1, torch.float32)
        attend = step_attention(cpu_attention, batch.slot_mapping, batch.block_tables, batch.query_start_loc,
                                batch.seq_lens, paths.kernel)
        out = attend(batch.query, batch.key, batch.value, batch.key_cache, batch.value_cache, SCALE)
        assert attend.native is None and attend.decodes
        torch.testing.assert_close(out, reference.paged_attention(*batch.attention_args(SCALE)),
                                   **tolerance(torch.float32))
    finally:
        native.load.cache_clear()
