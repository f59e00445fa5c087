"""Rotary embedding of bfloat16 query and key heads on the CPU through kernels/cpu_rotary.c.

torch's three ops (a product, a roll and an addcmul, over a strided view of the fused q|k|v projection) each
walk the activations again; the kernel computes the same products, sum and roundings in one pass, the same bits
as torch, in a fraction of the time (benchmarks/results/cpu-efficiency-log-2026-12.md). Only where the kernel was built with AVX-512, and head sizes whose half is a multiple of 16
(64, 128, ...); torch's path otherwise.
"""
from __future__ import annotations

import ctypes

import torch
from torch import nn

from gpu_worker.models.layers import Rotary, apply_rotary, replace_modules


class NativeRotary(nn.Module):
    def __init__(self, kernel: ctypes.CDLL) -> None:
        super().__init__()
        self.kernel = kernel

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [tokens, heads, dim] bfloat16 (tokens may be strided apart), cos and sin [tokens, 1, dim] bfloat16."""
        if not x.dtype == cos.dtype == sin.dtype == torch.bfloat16:  # the kernel reads bfloat16
            raise TypeError(f"NativeRotary rotates bfloat16, not {x.dtype}")
        tokens, heads, dim = x.shape
        if x.stride(2) != 1 or x.stride(1) != dim:
            x = x.contiguous()
        cos, sin = cos.reshape(tokens, dim), sin.reshape(tokens, dim)
        if cos.stride(1) != 1 or sin.stride() != cos.stride():
            cos, sin = cos.contiguous(), sin.contiguous()
        out = torch.empty((tokens, heads, dim), dtype=torch.bfloat16)
        if self.kernel.bf16_rotary(x.data_ptr(), x.stride(0), heads, dim, cos.data_ptr(), sin.data_ptr(),
                                   cos.stride(0), out.data_ptr(), tokens):
            return apply_rotary(x, cos.view(tokens, 1, dim), sin.view(tokens, 1, dim))  # a head size it leaves
        return out


def swap_rotaries(model: nn.Module, kernel: ctypes.CDLL) -> int:
    """Replace every Rotary of `model` (loaded, bfloat16, on the CPU) by its native twin; how many."""
    return replace_modules(model, Rotary, lambda rotary: NativeRotary(kernel))
