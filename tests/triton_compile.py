"""Compile every Triton kernel to machine code for a CUDA target with no GPU present, with the constants
kernels/triton_ops.py launches them with (its *_constants); the interpreter the kernel tests run under accepts
code that the compiler refuses (a plain Python global inside a kernel, say). Run without TRITON_INTERPRET:

    python tests/triton_compile.py 90          # Hopper (sm_90): two shapes, bfloat16 and float32 (tests/test_kernels.py)
    python tests/triton_compile.py 90 --all    # every shape and dtype of benchmarks/kernels_gpu.py (a few minutes)
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kernels import triton_attention, triton_cache  # noqa: E402
from kernels.triton_ops import (  # noqa: E402
    attention_constants, copy_blocks_constants, launch_config, reduce_constants, store_kv_constants,
)

NUM_SMS = 132  # an H100/H200's: what the split heuristic sees on that chip
# head_dim, queries per KV head, KV heads, block size: the kernel checks' shapes (benchmarks/kernels_gpu.py)
SHAPES = [(128, 4, 8, 16), (80, 1, 4, 32), (256, 8, 2, 8), (64, 3, 4, 128), (96, 2, 4, 64)]
DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}
QUICK_SHAPES = SHAPES[:2]  # a padded head dim and MHA beside GQA
QUICK_DTYPES = ("bfloat16", "float32")  # tf32 and ieee dots


def compile_kernel(fn, target: GPUTarget, types: dict[str, str], constants: dict) -> None:
    """`fn` compiled to a cubin, arguments typed by `types` (the rest i32) and `constants` its constexprs."""
    names = fn.arg_names
    signature = {n: "constexpr" if n in constants else types.get(n, "i32") for n in names}
    triton.compile(ASTSource(fn, signature, constexprs={(names.index(k),): v for k, v in constants.items()}),
                   target=target)


def attention_configs(dtypes, shapes):
    """(dtype, head_dim, queries per KV head, block size, launch) of single-pass and split decode and prefill."""
    for dtype in dtypes:
        for head_dim, qpk, kv_heads, block_size in shapes:
            for tokens, seqs, splits in ((8, 8, 1), (8, 8, 4), (300, 3, 1), (300, 3, 2)):
                yield dtype, head_dim, qpk, block_size, launch_config(tokens, seqs, kv_heads, qpk, head_dim, 4096,
                                                                      NUM_SMS, splits)


def main(arch: int, everything: bool) -> int:
    target = GPUTarget("cuda", arch, 32)
    dtypes, shapes = (tuple(DTYPES), SHAPES) if everything else (QUICK_DTYPES, QUICK_SHAPES)
    for dtype, head_dim, qpk, block_size, cfg in attention_configs(dtypes, shapes):
        t = DTYPES[dtype]
        compile_kernel(triton_attention.unified_attention_kernel, target, {
            **dict.fromkeys(["out_ptr", "query_ptr", "key_cache_ptr", "value_cache_ptr"], f"*{t}"),
            **dict.fromkeys(["split_acc_ptr", "split_max_ptr", "split_sum_ptr"], "*fp32"),
            "scale": "fp32", "block_tables_ptr": "*i32", "query_start_loc_ptr": "*i32", "seq_lens_ptr": "*i32"},
            attention_constants(cfg, qpk, head_dim, block_size, getattr(torch, dtype)))
        if cfg.num_splits > 1:
            compile_kernel(triton_attention.reduce_splits_kernel, target, {
                "out_ptr": f"*{t}", "split_acc_ptr": "*fp32", "split_max_ptr": "*fp32", "split_sum_ptr": "*fp32",
                "query_start_loc_ptr": "*i32"}, reduce_constants(cfg, head_dim))
        print(f"attention {dtype} head_dim {head_dim} qpk {qpk} block {block_size} {cfg}", flush=True)
    for dtype in dtypes:
        t = DTYPES[dtype]
        for head_dim, _, kv_heads, block_size in shapes:
            compile_kernel(triton_cache.store_kv_kernel, target, {
                **dict.fromkeys(["key_ptr", "value_ptr", "key_cache_ptr", "value_cache_ptr"], f"*{t}"),
                "slot_mapping_ptr": "*i64"}, store_kv_constants(kv_heads, head_dim, block_size))
            compile_kernel(triton_cache.copy_blocks_kernel, target, {
                "cache_ptrs_ptr": "*i64", "like_ptr": f"*{t}", "block_mapping_ptr": "*i64", "block_stride": "i64"},
                copy_blocks_constants(block_size * kv_heads * head_dim))
        print(f"store_kv and copy_blocks {dtype}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]), "--all" in sys.argv[2:]))
