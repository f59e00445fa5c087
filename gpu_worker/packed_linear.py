"""bfloat16 linears on the CPU: weights packed once for oneDNN where the CPU multiplies bfloat16 natively, and
computed in float32 where it does not.

torch's bfloat16 `F.linear` on the CPU hands the weight to oneDNN, which reorders it into its blocked
layout on each call: for a decode step that reads a weight once, that doubles the memory traffic. Packed
once at load (`torch.ops.mkldnn._reorder_linear_weight`, what Inductor's CPU freezing does), the same
matmul ran 1.1× (prefill) to 2.8× (one token, 768 → 4096) faster here, with bit-identical results. float32
stays on MKL's sgemm: packed, its sums come out in another order.

oneDNN packs bfloat16 only on CPUs with native bfloat16 (AVX-512 BF16, AMX, AVX-NE-CONVERT). On others
(AVX2 alone) torch's bfloat16 matmul is a slow fallback: 64 tokens through 768 → 3072 took 32 ms against
6.7 ms for float32 there. So there a linear keeps its bfloat16 weights, packed into panels once, and
kernels/cpu_linear.c multiplies them in float32, widening them in registers and rounding its output to bfloat16
once, as a bfloat16 matmul with float32 accumulation does. It reads half the bytes of a float32 copy and was
faster than MKL on one at every size measured (1-64 tokens: 0.13-0.9× MKL's time, RESULTS.md), and each output's
sum has one order whatever the batch. Without a C compiler the weights are widened `CHUNK_ROWS` rows at a time
for MKL (the worker keeps freed memory in its heap, so the chunks cost no page faults).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kernels import native

CHUNK_ROWS = 256  # the fallback's float32 chunk: 768 KiB at 768 inputs, in cache


class PackedLinear(nn.Module):
    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach())
        self.bias = None if linear.bias is None else linear.bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, self.bias, "none", [], "")


class WidenedLinear(nn.Module):
    """A bfloat16 linear multiplied in float32 (for CPUs without native bfloat16)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        self.kernel = native.load() if weight.dtype == torch.bfloat16 else None
        self.weight = weight.contiguous() if self.kernel is None else panels(weight, self.kernel.bf16_panel_width())
        self.bias = None if linear.bias is None else linear.bias.detach().contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        m, n, k = rows.shape[0], self.out_features, self.in_features
        if self.kernel is not None:
            rows = rows.to(torch.bfloat16)
            rows = rows if rows.stride(-1) == 1 else rows.contiguous()
            out = torch.empty(m, n, dtype=torch.bfloat16)
            code = self.kernel.bf16_linear(rows.data_ptr(), rows.stride(0), self.weight.data_ptr(),
                                           None if self.bias is None else self.bias.data_ptr(), out.data_ptr(), m, n,
                                           k, torch.get_num_threads())
            if code:
                raise MemoryError(f"cpu_linear.c could not allocate {m} × {k} floats")
            out = out.to(x.dtype)
        else:
            wide, out32 = rows.float(), torch.empty(m, n)
            for n0 in range(0, n, CHUNK_ROWS):
                n1 = min(n, n0 + CHUNK_ROWS)
                bias = None if self.bias is None else self.bias[n0:n1].float()
                out32[:, n0:n1] = F.linear(wide, self.weight[n0:n1].float(), bias)
            out = out32.to(x.dtype)
        return out.view(*x.shape[:-1], n)


def panels(weight: torch.Tensor, width: int) -> torch.Tensor:
    """`weight` [n, k] as kernels/cpu_linear.c reads it: [ceil(n / width), k, width], the last panel padded with
    zeros."""
    padded = F.pad(weight, (0, 0, 0, -weight.shape[0] % width))
    return padded.view(-1, width, weight.shape[1]).transpose(1, 2).contiguous()


def native_bfloat16() -> bool:
    """Whether oneDNN multiplies bfloat16 natively on this CPU (and so can pack bfloat16 weights)."""
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def pack_linears(model: nn.Module) -> int:
    """Replace every nn.Linear of `model` (loaded, bfloat16, on the CPU) by its packed twin, or by its widened one
    where oneDNN cannot pack bfloat16; how many."""
    twin = PackedLinear if native_bfloat16() else WidenedLinear
    targets = [(name, module) for name, module in model.named_modules() if isinstance(module, nn.Linear)]
    for name, module in targets:
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, attr, twin(module))
    return len(targets)
