"""GPU check and timing of the Triton paged-attention kernels (needs CUDA; a few minutes on an H100/H200).

1. Correctness on CUDA against `kernels.reference` in bfloat16 and float16: store_kv and copy_blocks
   bit-exact; unified attention (single pass, forced split-KV, heuristic) over mixed decode + chunked-
   prefill batches with shuffled pages, for several block sizes, head dims and GQA ratios.
2. Device-to-device copy bandwidth (torch `copy_` of a large buffer: bytes read + written / time).
3. Decode over batch x context: the paged kernel (heuristic split and forced single pass) against
   PyTorch's scaled_dot_product_attention on the same keys/values stored contiguously. Reports KV bytes
   read / time, its share of the copy bandwidth, and the paged kernel's overhead over SDPA.
4. Prefill chunks (with and without cached context): paged kernel against SDPA with a lower-right
   causal mask, in TFLOP/s.

Timings are medians of Triton's do_bench_cudagraph (launch overhead excluded, as in a CUDA-graph
serving loop); a call that cannot be captured falls back to do_bench.

    python -m benchmarks.kernels_gpu --out kernels_gpu.json
"""
from __future__ import annotations

import argparse
import json
import math
import random
import sys
from dataclasses import asdict, dataclass

import torch

from kernels import reference, triton_ops
from benchmarks.paged_batches import random_paged_batch

GIB = 1 << 30
TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 4e-3}
CORRECTNESS_SHAPES = [  # block_size, head_dim, queries_per_kv, num_kv_heads
    (16, 128, 4, 8), (32, 80, 1, 4), (8, 256, 8, 2), (128, 64, 3, 4), (64, 96, 2, 4),
]


@dataclass(slots=True)
class CheckRow:
    dtype: str
    kernel: str
    shape: str
    max_abs_err: float
    ok: bool


@dataclass(slots=True)
class DecodeRow:
    batch: int
    context: int
    splits: int
    paged_us: float
    single_pass_us: float
    sdpa_us: float
    kv_gbs: float
    copy_share: float
    overhead: float  # paged / sdpa - 1
    max_abs_diff: float


@dataclass(slots=True)
class PrefillRow:
    batch: int
    chunk: int
    context: int
    paged_us: float
    sdpa_us: float
    paged_tflops: float
    sdpa_tflops: float
    overhead: float
    max_abs_diff: float


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", help="write the results as JSON to this path")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"], help="timing dtype")
    p.add_argument("--num-q-heads", type=int, default=32)
    p.add_argument("--num-kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--batches", default="1,4,16,64,256", help="decode batch sizes")
    p.add_argument("--contexts", default="512,2048,8192,32768", help="decode context lengths")
    p.add_argument("--prefill", default="1x512+0,1x2048+0,1x512+4096,4x512+2048,1x2048+16384,16x256+1024",
                   help="prefill cases BATCHxCHUNK+CONTEXT")
    p.add_argument("--kv-budget-gib", type=float, default=8.0,
                   help="skip decode points whose K+V exceed this (the contiguous copy doubles it)")
    args = p.parse_args(argv)
    args.batches = [int(x) for x in args.batches.split(",")]
    args.contexts = [int(x) for x in args.contexts.split(",")]
    args.prefill = [tuple(int(v) for v in case.replace("+", "x").split("x")) for case in args.prefill.split(",")]
    if args.num_q_heads % args.num_kv_heads:
        p.error("--num-q-heads must be a multiple of --num-kv-heads")
    return args


def bench_us(fn) -> float:
    import triton.testing

    try:
        return triton.testing.do_bench_cudagraph(fn, return_mode="median") * 1e3
    except RuntimeError:
        torch.cuda.synchronize()
        return triton.testing.do_bench(fn, return_mode="median") * 1e3


def copy_bandwidth_gbs() -> float:
    src = torch.empty(GIB, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    us = bench_us(lambda: dst.copy_(src))
    return 2 * GIB / (us * 1e-6) / 1e9


def mixed_chunks(rng: random.Random, block_size: int, decode_only: bool) -> list[tuple[int, int]]:
    """(cached context, new chunk) pairs: a dozen decodes, or decodes beside fresh and chunked prefills."""
    if decode_only:
        return [(rng.randrange(1, 3000), 1) for _ in range(12)]
    return [(rng.randrange(1, 3000), 1), (0, 333), (1000, 77), (2 * block_size + 3, 129), (5, 1), (4095, 16)]


def check_correctness() -> list[CheckRow]:
    rows = []
    rng = random.Random(0)
    for dtype in (torch.bfloat16, torch.float16):
        name = str(dtype).removeprefix("torch.")
        for block_size, head_dim, qpk, kv_heads in CORRECTNESS_SHAPES:
            shape = f"bs{block_size} d{head_dim} gqa{qpk} kvh{kv_heads}"
            for decode_only in (False, True):
                b = random_paged_batch(rng, mixed_chunks(rng, block_size, decode_only), block_size, head_dim, qpk,
                                       kv_heads, dtype, device="cuda")
                ref_kc, ref_vc = b.key_cache.clone(), b.value_cache.clone()
                triton_ops.store_kv(b.key, b.value, b.key_cache, b.value_cache, b.slot_mapping)
                reference.store_kv(b.key, b.value, ref_kc, ref_vc, b.slot_mapping)
                same = torch.equal(b.key_cache.nan_to_num(7.0), ref_kc.nan_to_num(7.0)) and \
                    torch.equal(b.value_cache.nan_to_num(7.0), ref_vc.nan_to_num(7.0))
                rows.append(CheckRow(name, "store_kv", shape, 0.0 if same else math.inf, same))
                args = b.attention_args(head_dim ** -0.5)
                expected = reference.paged_attention(*args).float()
                for label, splits in (("single", 1), ("split4", 4), ("auto", None)):
                    got = triton_ops.unified_attention(*args, num_splits=splits)
                    err = (got.float() - expected).abs().max().item()
                    kind = f"attention {'decode' if decode_only else 'mixed'} {label}"
                    rows.append(CheckRow(name, kind, shape, err, err <= TOLERANCE[dtype]))
        caches = [torch.randn(64, 16, 8, 128, device="cuda").to(dtype) for _ in range(8)]
        expected_caches = [c.clone() for c in caches]
        mapping = torch.tensor([[3, 40], [17, 2], [63, 9]])
        triton_ops.copy_blocks(caches[:4], caches[4:], mapping)
        reference.copy_blocks(expected_caches[:4], expected_caches[4:], mapping)
        same = all(torch.equal(a, b) for a, b in zip(caches, expected_caches))
        rows.append(CheckRow(name, "copy_blocks", "4 layers x 3 pairs", 0.0 if same else math.inf, same))
    return rows


def paged_copy_of(k: torch.Tensor, v: torch.Tensor, block_size: int) -> tuple:
    """Scatter contiguous `[B, kv_heads, L, d]` keys/values into shuffled pages; L % block_size == 0."""
    batch, kv_heads, length, dim = k.shape
    pages = length // block_size
    ids = torch.randperm(batch * pages, device="cuda") + 1
    tables = ids.view(batch, pages).to(torch.int32)
    caches = []
    for t in (k, v):
        cache = torch.empty(batch * pages + 1, block_size, kv_heads, dim, dtype=t.dtype, device="cuda")
        cache[ids] = t.transpose(1, 2).reshape(batch * pages, block_size, kv_heads, dim)
        caches.append(cache)
    return caches[0], caches[1], tables


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mask=None) -> torch.Tensor:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    # fused kernels only: a silent fallback to the math backend would flatter the paged kernel
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)


def bench_decode(args, dtype: torch.dtype, copy_gbs: float) -> list[DecodeRow]:
    rows = []
    elem = torch.empty(0, dtype=dtype).element_size()
    for batch in args.batches:
        for context in args.contexts:
            kv_bytes = 2 * batch * context * args.num_kv_heads * args.head_dim * elem
            if kv_bytes > args.kv_budget_gib * GIB:
                print(f"  decode batch {batch} context {context}: skipped ({kv_bytes / GIB:.1f} GiB of KV > budget)")
                continue
            rows.append(decode_point(args, dtype, batch, context, kv_bytes, copy_gbs))
            torch.cuda.empty_cache()  # the point's tensors went with its frame
    return rows


def decode_point(args, dtype: torch.dtype, batch: int, context: int, kv_bytes: int, copy_gbs: float) -> DecodeRow:
    hq, hkv, d, bs = args.num_q_heads, args.num_kv_heads, args.head_dim, args.block_size
    scale = d ** -0.5
    k = torch.randn(batch, hkv, context, d, device="cuda").to(dtype)
    v = torch.randn(batch, hkv, context, d, device="cuda").to(dtype)
    kc, vc, tables = paged_copy_of(k, v, bs)
    q = torch.randn(batch, hq, d, device="cuda").to(dtype)
    qsl = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    cfg = triton_ops.launch_config(batch, batch, hkv, hq // hkv, d, tables.shape[1] * bs,
                                   torch.cuda.get_device_properties(0).multi_processor_count)

    def paged(splits=None):
        return triton_ops.unified_attention(q, kc, vc, tables, qsl, seq_lens, scale, num_splits=splits)

    def contiguous():
        return sdpa(q.unsqueeze(2), k, v, scale)

    diff = (paged().float() - contiguous().squeeze(2).float()).abs().max().item()
    paged_us, single_us, sdpa_us = bench_us(paged), bench_us(lambda: paged(1)), bench_us(contiguous)
    kv_gbs = kv_bytes / (paged_us * 1e-6) / 1e9
    return DecodeRow(batch, context, cfg.num_splits, paged_us, single_us, sdpa_us, kv_gbs, kv_gbs / copy_gbs,
                     paged_us / sdpa_us - 1, diff)


def bench_prefill(args, dtype: torch.dtype) -> list[PrefillRow]:
    rows = []
    for batch, chunk, context in args.prefill:
        rows.append(prefill_point(args, dtype, batch, chunk, context))
        torch.cuda.empty_cache()  # the point's tensors went with its frame
    return rows


def prefill_point(args, dtype: torch.dtype, batch: int, chunk: int, context: int) -> PrefillRow:
    from torch.nn.attention.bias import causal_lower_right

    hq, hkv, d, bs = args.num_q_heads, args.num_kv_heads, args.head_dim, args.block_size
    scale = d ** -0.5
    total = -(-(context + chunk) // bs) * bs
    k = torch.randn(batch, hkv, total, d, device="cuda").to(dtype)
    v = torch.randn(batch, hkv, total, d, device="cuda").to(dtype)
    kc, vc, tables = paged_copy_of(k, v, bs)
    k, v = k[:, :, : context + chunk], v[:, :, : context + chunk]
    q = torch.randn(batch * chunk, hq, d, device="cuda").to(dtype)
    q4 = q.view(batch, chunk, hq, d).transpose(1, 2)
    qsl = torch.arange(batch + 1, dtype=torch.int32, device="cuda") * chunk
    seq_lens = torch.full((batch,), context + chunk, dtype=torch.int32, device="cuda")
    mask = causal_lower_right(chunk, context + chunk)

    def paged():
        return triton_ops.paged_attention(q, kc, vc, tables, qsl, seq_lens, scale)

    def contiguous():
        return sdpa(q4, k, v, scale, mask)

    expected = contiguous().transpose(1, 2).reshape(batch * chunk, hq, d)
    diff = (paged().float() - expected.float()).abs().max().item()
    paged_us, sdpa_us = bench_us(paged), bench_us(contiguous)
    flops = 4 * batch * hq * d * (chunk * context + chunk * (chunk + 1) / 2)
    return PrefillRow(batch, chunk, context, paged_us, sdpa_us, flops / (paged_us * 1e-6) / 1e12,
                      flops / (sdpa_us * 1e-6) / 1e12, paged_us / sdpa_us - 1, diff)


def print_table(title: str, rows: list, formats: dict[str, str]) -> None:
    print(f"\n{title}")
    if not rows:
        print("  (none)")
        return
    cols = list(asdict(rows[0]))
    cells = [[format(getattr(r, c), formats.get(c, "")) for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    print("  " + "  ".join(c.rjust(w) for c, w in zip(cols, widths)))
    for row in cells:
        print("  " + "  ".join(x.rjust(w) for x, w in zip(row, widths)))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks/kernels_gpu.py needs a CUDA device and found none (torch.cuda.is_available() is "
              "False); the CPU interpreter checks of these kernels are tests/test_kernels.py.", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    device = torch.cuda.get_device_name(0)
    print(f"device: {device}; timing dtype {args.dtype}; heads {args.num_q_heads}/{args.num_kv_heads} "
          f"x {args.head_dim}; block size {args.block_size}")
    checks = check_correctness()
    print_table("correctness against kernels.reference (CUDA)", checks, {"max_abs_err": ".2e"})
    copy_gbs = copy_bandwidth_gbs()
    print(f"\ndevice-to-device copy bandwidth: {copy_gbs:.0f} GB/s (read + write)")
    decode = bench_decode(args, dtype, copy_gbs)
    print_table("decode: paged (heuristic split / single pass) vs SDPA on contiguous KV", decode,
                {"paged_us": ".1f", "single_pass_us": ".1f", "sdpa_us": ".1f", "kv_gbs": ".0f",
                 "copy_share": ".0%", "overhead": "+.1%", "max_abs_diff": ".1e"})
    prefill = bench_prefill(args, dtype)
    print_table("prefill chunks: paged vs SDPA (lower-right causal) on contiguous KV", prefill,
                {"paged_us": ".1f", "sdpa_us": ".1f", "paged_tflops": ".1f", "sdpa_tflops": ".1f",
                 "overhead": "+.1%", "max_abs_diff": ".1e"})
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": device, "dtype": args.dtype, "copy_bandwidth_gbs": copy_gbs,
                       "correctness": [asdict(r) for r in checks], "decode": [asdict(r) for r in decode],
                       "prefill": [asdict(r) for r in prefill]}, f, indent=2)
        print(f"\nwrote {args.out}")
    failed = [r for r in checks if not r.ok]
    if failed:
        print(f"\n{len(failed)} correctness check(s) FAILED", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
