"""bfloat16 and float32 linears on the CPU, their weights packed once at load: by kernels/cpu_linear.c where it can,
a row's outputs then the same bits whatever the batch.

`linear_kind(kernel)` says which way this process takes for bfloat16:
- "amx": cpu_linear.c with AMX tiles (Sapphire Rapids and later). The same products and sums as oneDNN's AMX
  matmul at one row, but in one order at any batch; oneDNN changes its order with the number of rows, so a
  sequence's bfloat16 tokens changed with the sequences beside it and when a restarted worker recomputed its
  prefix. It is faster than oneDNN at decode's few rows (oneDNN pays a fixed cost a call before it multiplies)
  and slower at a prefill's many: figures in benchmarks/RESULTS.md ("CPU efficiency against vLLM") and its log.
- "avx512bf16": cpu_linear.c with AVX-512 BF16's dot products (vdpbf16ps; Zen 4 and later, without AMX), the
  instruction oneDNN uses there, in one order at any batch: as fast as oneDNN or faster (RESULTS.md).
- "onednn": torch's oneDNN matmul, on CPUs with native bfloat16 and neither of the above, or without a C
  compiler. Packed once (`torch.ops.mkldnn._reorder_linear_weight`, what Inductor's CPU freezing does): unpacked,
  oneDNN reorders the weight on every call, doubling a decode step's memory traffic.
- "fma": cpu_linear.c in float32 fused multiply-adds, widening bfloat16 weights in registers, on CPUs without
  native bfloat16 (AVX2 alone), where torch's bfloat16 matmul is a slow fallback, several times float32's time.
  Faster than MKL on a float32 copy at every size measured, at half the bytes (RESULTS.md).
- "chunks": no compiler and no native bfloat16: the weights widened `CHUNK_ROWS` rows at a time for MKL (the
  worker keeps freed memory in its heap, so the chunks cost no page faults).

and `linear_kind(kernel, torch.float32)` for float32:
- "fma": cpu_linear.c's fused multiply-adds on float32 weights, where they were measured faster than MKL (AVX2, and
  AVX-512 on AMD and Intel: benchmarks/results/cpu-efficiency-log-2026-12.md): MKL's float32 GEMM slows down per
  row at a decode step's few rows.
- "mkl": torch's own linear, left as it is.

Where cpu_linear.c packs a tied lm_head, the token embedding reads its rows from that packed weight
(`PackedEmbedding`), so the vocabulary's weights are held once.
"""
from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F
from torch import nn

from gpu_worker.models.base import CausalLM
from gpu_worker.models.layers import replace_modules
from kernels import native

CHUNK_ROWS = 256  # the fallback's float32 chunk: 768 KiB at 768 inputs, in cache
NATIVE_KINDS = tuple(native.LINEAR_WAYS)  # through kernels/cpu_linear.c: a row's outputs the same bits in any batch
GATED_KINDS = ("amx", "avx512bf16")  # the pairs' ways, whose epilogue can take the gated MLP's activation


class PackedLinear(nn.Module):
    """A bfloat16 linear through oneDNN, its weight reordered once."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach())
        self.bias = None if linear.bias is None else linear.bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, self.bias, "none", [], "")


class NativeLinear(nn.Module):
    """A bfloat16 or float32 linear (its weight's dtype) through kernels/cpu_linear.c, the `way` one of
    `NATIVE_KINDS`: bfloat16 with AMX tiles, with AVX-512 BF16's dot products or in float32 fused multiply-adds;
    float32 in fused multiply-adds.

    `gated` (the pairs' ways, `GATED_KINDS`): `linear` is a merged gate|up projection, and the module gives
    silu(gate) * up, the activation in the kernel's epilogue (kernels/silu.h: the bits of the projection and
    kernels/cpu_act.c apart), so the projection's output, twice the activation's, is neither written out nor read
    back."""

    def __init__(self, linear: nn.Linear, kernel: ctypes.CDLL, way: str = "fma", gated: bool = False) -> None:
        super().__init__()
        if way not in NATIVE_KINDS:
            raise ValueError(f"cpu_linear.c has no way {way!r} (it has {', '.join(NATIVE_KINDS)})")
        if gated and way == "fma":
            raise ValueError("a gated NativeLinear needs AMX tiles or AVX-512 BF16 (the fma way has no epilogue)")
        self.dtype = torch.float32 if linear.weight.dtype == torch.float32 else torch.bfloat16
        if way != "fma" and self.dtype == torch.float32:
            raise ValueError(f"the {way} way multiplies bfloat16, not float32")
        weight = linear.weight.detach().to(self.dtype)
        bias = None if linear.bias is None else linear.bias.detach().to(self.dtype)
        if gated:
            weight, bias = _in_pairs(weight), None if bias is None else _in_pairs(bias)
        k = self.in_features = linear.in_features
        self.out_features = linear.out_features // (2 if gated else 1)
        self.kernel, self.way, self.gated = kernel, native.LINEAR_WAYS[way], int(gated)
        self.pairs = int(way != "fma")  # AMX tiles and vdpbf16ps read the weight in pairs of input columns
        weight = weight.contiguous()
        self.packed = torch.empty(kernel.packed_size(weight.shape[0], k, self.pairs), dtype=self.dtype)
        if self.dtype == torch.float32:
            kernel.f32_pack(weight.data_ptr(), weight.shape[0], k, self.packed.data_ptr())
        else:
            kernel.bf16_pack(weight.data_ptr(), weight.shape[0], k, self.packed.data_ptr(), self.pairs)
        self.bias = None if bias is None else bias.contiguous()
        self._weights = (self.packed.data_ptr(), None if self.bias is None else self.bias.data_ptr())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # a decode step calls this ~17-60 times: the kernel takes microseconds, so the Python around it is lean
        rows = x.reshape(-1, self.in_features)
        if rows.dtype != self.dtype:
            rows = rows.to(self.dtype)
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        m = rows.shape[0]
        out = torch.empty(m, self.out_features, dtype=self.dtype)
        where = (rows.data_ptr(), rows.stride(0), *self._weights, out.data_ptr(), m, self.out_features,
                 self.in_features, torch.get_num_threads())
        if code := (self.kernel.f32_linear(*where) if self.dtype == torch.float32
                    else self.kernel.bf16_linear(*where, self.way, self.gated)):
            raise MemoryError(f"cpu_linear.c could not allocate the copy of {m} × {self.in_features} inputs") \
                if code == -1 else RuntimeError("cpu_linear.c: a way asked for that this process cannot take")
        out = out.view(*x.shape[:-1], self.out_features)
        return out if x.dtype == self.dtype else out.to(x.dtype)


def _in_pairs(rows: torch.Tensor) -> torch.Tensor:
    """A merged gate|up weight [2n, k] (or bias [2n]) as cpu_linear.c's gated linear reads it: 16 rows of gate,
    the same 16 of up, and so on, each half padded with zeros to a multiple of 16 rows."""
    gate, up = rows.chunk(2)
    pad = -gate.shape[0] % 16
    tail = rows.shape[1:]
    halves = [torch.cat([half, half.new_zeros(pad, *tail)]).view(-1, 16, *tail) for half in (gate, up)]
    return torch.stack(halves, dim=1).reshape(-1, *tail)


class PackedEmbedding(nn.Module):
    """A tied model's token embedding, read from its lm_head's packed weight (kernels/cpu_linear.c): the
    vocabulary's weights are held once, where the embedding and a packed copy for the lm_head took them twice."""

    def __init__(self, lm_head: NativeLinear) -> None:
        super().__init__()
        self.packed, self.kernel, self.pairs = lm_head.packed, lm_head.kernel, lm_head.pairs
        self.num_embeddings, self.embedding_dim = lm_head.out_features, lm_head.in_features

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1).to(torch.int64).contiguous()
        out = torch.empty(flat.numel(), self.embedding_dim, dtype=self.packed.dtype)
        where = (self.packed.data_ptr(), self.num_embeddings, self.embedding_dim, flat.data_ptr(), flat.numel(),
                 out.data_ptr())
        if (self.kernel.f32_unpack_rows(*where) if self.packed.dtype == torch.float32
                else self.kernel.bf16_unpack_rows(*where, self.pairs)):
            raise IndexError(f"a token id is out of the vocabulary [0, {self.num_embeddings})")
        return out.view(*ids.shape, self.embedding_dim)


class ChunkedLinear(nn.Module):
    """A bfloat16 linear multiplied in float32 by MKL, its weight widened a chunk at a time (no C compiler, no
    native bfloat16)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight.detach().contiguous()
        self.bias = None if linear.bias is None else linear.bias.detach().contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        wide, n = x.reshape(-1, self.in_features).float(), self.out_features
        out = torch.empty(wide.shape[0], n)
        for n0 in range(0, n, CHUNK_ROWS):
            n1 = min(n, n0 + CHUNK_ROWS)
            bias = None if self.bias is None else self.bias[n0:n1].float()
            out[:, n0:n1] = F.linear(wide, self.weight[n0:n1].float(), bias)
        return out.to(x.dtype).view(*x.shape[:-1], n)


def native_bfloat16() -> bool:
    """Whether oneDNN multiplies bfloat16 natively on this CPU (and so can pack bfloat16 weights)."""
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def available_kinds(kernel: ctypes.CDLL | None, dtype: torch.dtype = torch.bfloat16) -> list[str]:
    """Every way this process can multiply linears of `dtype` (bfloat16 or float32) with `kernel`
    (kernels/native.py's library, or None for torch's ways alone), the one `linear_kind` takes first."""
    if dtype == torch.float32:
        if kernel is None:
            return ["mkl"]
        return ["fma", "mkl"] if kernel.f32_linear_preferred() else ["mkl", "fma"]
    kinds = ["amx"] if kernel is not None and kernel.bf16_amx() else []
    kinds += ["avx512bf16"] if kernel is not None and kernel.bf16_dp() else []
    kinds += ["onednn"] if native_bfloat16() else []
    kinds += ["fma"] if kernel is not None else []
    return kinds + ["chunks"]


def linear_kind(kernel: ctypes.CDLL | None, dtype: torch.dtype = torch.bfloat16) -> str:
    """How this process multiplies linears of `dtype` with `kernel`: for bfloat16 "amx", "avx512bf16", "onednn",
    "fma" or "chunks", for float32 "fma" or "mkl" (the module's docstring)."""
    return available_kinds(kernel, dtype)[0]


def twin(kind: str, linear: nn.Linear, kernel: ctypes.CDLL | None) -> nn.Module:
    """`linear` (bfloat16 or float32) packed for `kind`, one of `available_kinds(kernel, its dtype)`; "mkl" keeps
    it."""
    if kind in NATIVE_KINDS:
        return NativeLinear(linear, kernel, kind)
    if kind == "mkl":
        return linear
    return PackedLinear(linear) if kind == "onednn" else ChunkedLinear(linear)


def pack_linears(model: CausalLM, kind: str, kernel: ctypes.CDLL | None) -> int:
    """Replace every nn.Linear of `model` (loaded, bfloat16 or float32, on the CPU) by its twin for `kind`; how
    many. A tied token embedding then reads the lm_head's packed weight where cpu_linear.c packed it (oneDNN's
    packing is opaque, and the chunks keep the embedding's own weight)."""
    if kind == "mkl":
        return 0
    count = replace_modules(model, nn.Linear, lambda linear: twin(kind, linear, kernel))
    if model.tie_word_embeddings and isinstance(model.lm_head, NativeLinear):
        model.set_submodule(model.embedding_module, PackedEmbedding(model.lm_head))
    return count
