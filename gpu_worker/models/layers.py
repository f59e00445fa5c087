"""Layers every architecture shares: norms, activations, merged linears, rotary embedding, paged attention.

Activations are flat `[num_tokens, hidden]`: a step is one flattened batch of prefill chunks and
decode tokens, and attention finds each sequence's keys and values through the paged cache.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from gpu_worker.models.base import UnsupportedModelError
from kernels import Attention


@dataclass(slots=True)
class ForwardContext:
    """What attention needs for one step besides the activations."""
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]  # per layer [num_blocks, block_size, kv_heads, head_dim]
    attention: Attention  # this step's store + paged attention (kernels.step_attention), shared by every layer


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu, "swish": F.silu, "relu": F.relu, "gelu": F.gelu,
    "gelu_new": _gelu_tanh, "gelu_pytorch_tanh": _gelu_tanh, "gelu_fast": _gelu_tanh,
}


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    if name not in ACTIVATIONS:
        raise UnsupportedModelError(f"activation {name!r} is not supported; supported: {', '.join(ACTIVATIONS)}")
    return ACTIVATIONS[name]


def replace_modules(model: nn.Module, kind: type[nn.Module], make: Callable[[nn.Module], nn.Module],
                    where: Callable[[nn.Module], bool] = lambda module: True) -> int:
    """Replace every submodule of type `kind` (for which `where` holds) by `make(it)`; how many."""
    targets = [(name, module) for name, module in model.named_modules() if isinstance(module, kind) and where(module)]
    for name, module in targets:
        model.set_submodule(name, make(module))
    return len(targets)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # one fused op (float32 statistics whatever the activation dtype); in float32 it is bit for bit
        # the reference implementations' x * rsqrt(mean(x²) + eps) * weight
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


class MergedLinear(nn.Linear):
    """One matmul for several checkpoint linears stacked along the output (q|k|v, gate|up).

    `out_sizes[i]` rows starting at `sum(out_sizes[:i])` hold shard i; the loader fills them.
    """

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool) -> None:
        super().__init__(in_features, sum(out_sizes), bias=bias)
        self.out_sizes = list(out_sizes)

    def shard_rows(self, shard: int) -> slice:
        start = sum(self.out_sizes[:shard])
        return slice(start, start + self.out_sizes[shard])


SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def rope_inv_freq(head_dim: int, params: dict[str, Any]) -> torch.Tensor:
    """Inverse frequencies of rotary embedding, with the scaling its `rope_parameters` ask for."""
    rope_type = params.get("rope_type", "default")
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"rope type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    if float(params.get("partial_rotary_factor", 1.0)) != 1.0:
        raise UnsupportedModelError("partial rotary embeddings (partial_rotary_factor != 1) are not supported")
    base = float(params.get("rope_theta", 10000.0))
    # built on the CPU explicitly: models are constructed under the meta device
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / (base ** exponents)
    if rope_type == "linear":
        inv_freq = inv_freq / float(params["factor"])
    elif rope_type == "llama3":
        inv_freq = _llama3_scaling(inv_freq, params)
    return inv_freq


def _llama3_scaling(inv_freq: torch.Tensor, params: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1: keep high frequencies, divide low ones by `factor`, interpolate smoothly in between."""
    factor = float(params["factor"])
    low, high = float(params["low_freq_factor"]), float(params["high_freq_factor"])
    old_len = float(params["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """cos/sin of each token's position, computed once per step and shared by every layer.

    `sin` comes with its first half negated, so that rotating is `x * cos + x.roll(half) * sin`: three ops
    instead of the split, negation and concatenation of `rotate_half`, with bit-identical results."""

    def __init__(self, head_dim: int, params: dict[str, Any]) -> None:
        super().__init__()
        self.register_buffer("inv_freq", rope_inv_freq(head_dim, params), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        cos, sin = freqs.cos(), freqs.sin()
        return torch.cat((cos, cos), dim=-1)[:, None, :].to(dtype), torch.cat((-sin, sin), dim=-1)[:, None, :].to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate `x` `[num_tokens, heads, head_dim]` (the half-split layout of Hugging Face checkpoints) by the
    `RotaryEmbedding` of its tokens."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), sin)


class Rotary(nn.Module):
    """apply_rotary as a module of the attention, so that the CPU's bfloat16 path can swap in its native twin
    (gpu_worker/native_rotary.py)."""

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return apply_rotary(x, cos, sin)


class PagedAttention(nn.Module):
    """Write this step's keys/values into the paged cache, then attend over each sequence's pages."""

    def __init__(self, layer_idx: int, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """q `[T, heads, head_dim]`, k/v `[T, kv_heads, head_dim]` → `[T, heads * head_dim]`."""
        key_cache, value_cache = ctx.kv_caches[self.layer_idx]
        out = ctx.attention(q, k, v, key_cache, value_cache, self.scale)
        return out.reshape(q.shape[0], self.num_heads * self.head_dim)


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)) with gate and up in one matmul."""

    def __init__(self, hidden: int, intermediate: int, act: str, bias: bool) -> None:
        super().__init__()
        self.gate_up_proj = MergedLinear(hidden, [intermediate, intermediate], bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)
        self.act = activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up)


class MLP(nn.Module):
    """fc2(act(fc1(x))): GPT-2 and OPT (their loaders map checkpoint names onto fc1/fc2)."""

    def __init__(self, hidden: int, intermediate: int, act: str, bias: bool) -> None:
        super().__init__()
        self.fc1 = nn.Linear(hidden, intermediate, bias=bias)
        self.fc2 = nn.Linear(intermediate, hidden, bias=bias)
        self.act = activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))
