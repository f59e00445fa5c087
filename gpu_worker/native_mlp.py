"""The gated MLP's SiLU and product of bfloat16 activations on the CPU through kernels/cpu_act.c.

torch computes `F.silu(gate) * up` as two ops over a strided view of the merged gate|up projection; the kernel
does it in one pass, over twice as fast on a prefill step's rows (benchmarks/results/cpu-efficiency-log-2026-12.md).
It computes the same (float32, rounded to bfloat16 after the SiLU and
after the product) in one pass; its exponential is not always torch's to the last bit, so an output may differ
from torch's by one bfloat16 step, rarely, and a row's do not depend on the batch. Only where the kernel was
built with AVX-512: its scalar loop alone is slower than torch. Where the linears run on AMX tiles or AVX-512
BF16's dot products, the merged gate|up projection does it in its epilogue (a gated NativeLinear): its output,
twice the activation's, is then neither written out nor read back (a prefill step's memory traffic less).
"""
from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F
from torch import nn

from gpu_worker import packed_linear
from gpu_worker.models.layers import GatedMLP, replace_modules


class NativeGatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)) with the activation in one C call, or in the gate|up projection's epilogue
    where the linears read the pairs' layout (swapped before they are packed: the projection is packed gated
    here)."""

    def __init__(self, mlp: GatedMLP, kernel: ctypes.CDLL, way: str) -> None:
        super().__init__()
        self.down_proj, self.kernel = mlp.down_proj, kernel
        # still torch's (swapped before pack_linears): packed here, gated
        projection = mlp.gate_up_proj
        self.gated = (way in packed_linear.GATED_KINDS and isinstance(projection, nn.Linear)
                      and projection.weight.dtype == torch.bfloat16)
        self.gate_up_proj = (packed_linear.NativeLinear(projection, kernel, way, gated=True) if self.gated
                             else projection)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        projected = self.gate_up_proj(x)
        return self.down_proj(projected if self.gated else self.activate(projected))

    def activate(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of [..., 2n] bfloat16 rows (gate then up) → [..., n]."""
        if gate_up.dtype != torch.bfloat16:  # the kernel reads bfloat16
            raise TypeError(f"NativeGatedMLP activates bfloat16, not {gate_up.dtype}")
        n = gate_up.shape[-1] // 2
        rows = gate_up.reshape(-1, 2 * n)
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        out = torch.empty((rows.shape[0], n), dtype=torch.bfloat16)
        self.kernel.bf16_silu_mul(rows.data_ptr(), rows.stride(0), out.data_ptr(), rows.shape[0], n)
        return out.view(*gate_up.shape[:-1], n)


def swap_mlps(model: nn.Module, kernel: ctypes.CDLL, way: str) -> int:
    """Replace every SiLU-gated MLP of `model` (loaded, bfloat16, on the CPU, before pack_linears packs the others
    for `way`) by its native twin; how many."""
    return replace_modules(model, GatedMLP, lambda mlp: NativeGatedMLP(mlp, kernel, way),
                           where=lambda mlp: mlp.act is F.silu)
