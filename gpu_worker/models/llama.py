"""The Llama family: Llama (2, 3 with rope scaling), Mistral, Qwen2 (QKV bias), Qwen3 (Q/K norm).

They differ only in attention biases and per-head Q/K RMSNorm, so one decoder serves them all.
"""
from __future__ import annotations

from typing import Any, ClassVar, NamedTuple

import torch
from torch import nn

from gpu_worker.models.base import CausalLM
from gpu_worker.models.layers import (ForwardContext, GatedMLP, MergedLinear, PagedAttention, RMSNorm,
                                      Rotary, RotaryEmbedding)


def _head_dim(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def _rope_parameters(config: Any) -> dict[str, Any]:
    params = dict(getattr(config, "rope_parameters", None) or {})
    params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    return params


class LlamaAttention(nn.Module):
    def __init__(self, config: Any, layer_idx: int, qkv_bias: bool, o_bias: bool, qk_norm: bool) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = _head_dim(config)
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = MergedLinear(config.hidden_size, [q_size, kv_size, kv_size], bias=qkv_bias)
        self.o_proj = nn.Linear(q_size, config.hidden_size, bias=o_bias)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if qk_norm else None
        self.attn = PagedAttention(layer_idx, self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim ** -0.5)
        self.rotary = Rotary()

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        qkv = self.qkv_proj(x).view(x.shape[0], self.num_heads + 2 * self.num_kv_heads, self.head_dim)
        heads = self.num_heads
        if self.q_norm is None:  # q and k side by side: one rotation for both
            qk = self.rotary(qkv[:, :heads + self.num_kv_heads], cos, sin)
            q, k = qk[:, :heads], qk[:, heads:]
        else:
            q = self.rotary(self.q_norm(qkv[:, :heads]), cos, sin)
            k = self.rotary(self.k_norm(qkv[:, heads:heads + self.num_kv_heads]), cos, sin)
        return self.o_proj(self.attn(q, k, qkv[:, heads + self.num_kv_heads:], ctx))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: Any, layer_idx: int, qkv_bias: bool, o_bias: bool, qk_norm: bool) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, layer_idx, qkv_bias, o_bias, qk_norm)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act,
                            bias=bool(getattr(config, "mlp_bias", False)))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, ctx)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, config: Any, qkv_bias: bool, o_bias: bool, qk_norm: bool) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, i, qkv_bias, o_bias, qk_norm)
                                    for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(_head_dim(config), _rope_parameters(config))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary_emb(positions, x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin, ctx)
        return self.norm(x)


class AttentionOptions(NamedTuple):
    qkv_bias: bool  # bias on the q, k and v projections
    o_bias: bool  # bias on the output projection
    qk_norm: bool  # a per-head RMSNorm of queries and keys


class LlamaForCausalLM(CausalLM):
    packed_modules: ClassVar[dict[str, tuple[str, int]]] = {
        "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
    embedding_module: ClassVar[str] = "model.embed_tokens"

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        options = self.attention_options(config)
        self.model = LlamaModel(config, options.qkv_bias, options.o_bias, options.qk_norm)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    @staticmethod
    def attention_options(config: Any) -> AttentionOptions:
        bias = bool(getattr(config, "attention_bias", False))
        return AttentionOptions(bias, bias, False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        return self.model(input_ids, positions, ctx)


class MistralForCausalLM(LlamaForCausalLM):
    """Llama's layers; its sliding window is refused by `check_config` unless it covers max_model_len."""


class Qwen2ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def attention_options(config: Any) -> AttentionOptions:
        return AttentionOptions(qkv_bias=True, o_bias=False, qk_norm=False)


class Qwen3ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def attention_options(config: Any) -> AttentionOptions:
        bias = bool(getattr(config, "attention_bias", False))
        return AttentionOptions(bias, bias, qk_norm=True)
