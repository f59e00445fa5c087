"""Every path a CPU worker's step takes, chosen once at load, in one place, and logged in one line.

The C kernels (kernels/native.py: one build per instruction set, the highest this CPU runs unless
`cpu_kernels` names one, or "torch" for none) serve the linears, attention, RMSNorm, the gated MLP's activation,
the rotary embedding and sampling's argmax and grammar masks; each falls back to torch where the kernel does not
serve its dtype or shape, or the CPU lacks what the faster path needs. A worker is batch invariant (a row's logits
the same bits in any batch, so greedy and seeded tokens survive preemption and restarts exactly) when its linears
and attention are the C kernels': torch's matmuls and attention sum in an order that depends on the batch.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass, field

import torch
from torch import nn

from gpu_worker import native_mlp, native_norm, native_rotary, packed_linear
from kernels import cpu_attention, native

NATIVE, TORCH = "native", "torch"  # TORCH is also `cpu_kernels`' value for none of the C kernels
EPILOGUE = "epilogue"  # the activation computed in the gate|up linear's epilogue


@dataclass(frozen=True)
class CpuPaths:
    kernel: ctypes.CDLL | None = field(repr=False, compare=False)  # None: no C kernels
    build: str  # the kernels' instruction set (kernels/native.py ISAS), or "none"
    linears: str  # a way of gpu_worker/packed_linear.py (its docstring), or "torch" (float16)
    attention: str  # "native" (kernels/cpu_attention.c), "torch", or the attention backend's name
    norm: str  # "native" (kernels/cpu_norm.c) or "torch"
    activation: str  # "epilogue", "native" (kernels/cpu_act.c) or "torch"
    rotary: str  # "native" (kernels/cpu_rotary.c) or "torch"
    sampling: str  # argmax and grammar masks: "native" (kernels/cpu_argmax.c, cpu_mask.c) or "torch"

    @property
    def batch_invariant(self) -> bool:
        return self.linears in packed_linear.NATIVE_KINDS and self.attention == NATIVE

    def describe(self) -> str:
        return (f"CPU paths: kernels {self.build}, linears {self.linears}, attention {self.attention}, norm "
                f"{self.norm}, activation {self.activation}, rotary {self.rotary}, sampling {self.sampling}; "
                f"{'' if self.batch_invariant else 'not '}batch invariant")

    def apply(self, model: nn.Module) -> None:
        """Replace `model`'s modules (loaded on the CPU) by the chosen twins. The gated MLPs first: their gate|up
        projection is packed there, gated, where the activation is the linear's epilogue."""
        if self.activation != TORCH:
            native_mlp.swap_mlps(model, self.kernel, self.linears)
        if self.linears != TORCH:
            packed_linear.pack_linears(model, self.linears, self.kernel)
        if self.norm == NATIVE:
            native_norm.swap_norms(model, self.kernel)
        if self.rotary == NATIVE:
            native_rotary.swap_rotaries(model, self.kernel)


def choose(cpu_kernels: str, dtype: torch.dtype, attention_backend: str, head_dim: int, block_size: int) -> CpuPaths:
    """The paths for a model of `dtype` whose attention backend is `attention_backend` ("cpu", "torch" or
    "triton"), with `cpu_kernels` "auto", an instruction set of kernels/native.py's ISAS, or "torch". ValueError
    for an instruction set this CPU cannot run."""
    kernel = None if cpu_kernels == TORCH else native.load(cpu_kernels)
    build = native.isa_named(cpu_kernels).name if kernel is not None else "none"
    bfloat16 = dtype == torch.bfloat16 and kernel is not None
    linears = packed_linear.linear_kind(kernel, dtype) if dtype in (torch.bfloat16, torch.float32) else TORCH
    if attention_backend != "cpu":
        attention = attention_backend
    else:
        attention = NATIVE if cpu_attention.serves(kernel, dtype, head_dim, block_size) else TORCH
    if not bfloat16:
        activation = TORCH
    elif linears in packed_linear.GATED_KINDS:
        activation = EPILOGUE
    else:  # its scalar loop alone is slower than torch
        activation = NATIVE if kernel.bf16_silu_mul_vectorized() else TORCH
    return CpuPaths(kernel, build, linears, attention, NATIVE if bfloat16 else TORCH, activation,
                    NATIVE if bfloat16 and kernel.bf16_rotary_vectorized() else TORCH,
                    NATIVE if kernel is not None else TORCH)
