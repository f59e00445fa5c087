"""RMSNorm of bfloat16 activations on the CPU through kernels/cpu_norm.c.

torch's F.rms_norm costs a fixed dispatch of several ops a call whatever the size, which at small batches is a
large share of a decode step (benchmarks/results/cpu-efficiency-log-2026-12.md). The kernel computes what F.rms_norm computes for bfloat16 (float32 arithmetic, one rounding), its
sum of squares in its own order: the outputs may differ from torch's in the last bit, now and then, and a row's
do not depend on the batch.
"""
from __future__ import annotations

import ctypes

import torch
from torch import nn

from gpu_worker.models.layers import RMSNorm, replace_modules


class NativeRMSNorm(nn.Module):
    def __init__(self, norm: RMSNorm, kernel: ctypes.CDLL) -> None:
        super().__init__()
        self.weight = norm.weight.detach().to(torch.bfloat16).contiguous()
        self.size, self.eps, self.kernel = self.weight.numel(), norm.eps, kernel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.bfloat16:  # the kernel reads bfloat16
            raise TypeError(f"NativeRMSNorm normalizes bfloat16 activations, not {x.dtype}")
        rows = x.reshape(-1, self.size)
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        out = torch.empty(rows.shape, dtype=torch.bfloat16)
        self.kernel.bf16_rms_norm(rows.data_ptr(), rows.stride(0), self.weight.data_ptr(), out.data_ptr(),
                                  rows.shape[0], self.size, self.eps)
        return out.view(x.shape)


def swap_norms(model: nn.Module, kernel: ctypes.CDLL) -> int:
    """Replace every RMSNorm of `model` (loaded, bfloat16, on the CPU) by its native twin; how many."""
    return replace_modules(model, RMSNorm, lambda norm: NativeRMSNorm(norm, kernel))
