"""OPT (the PagedAttention paper's models): learned positions offset by 2, pre- or post-LayerNorm
blocks (`do_layer_norm_before`), and project_in/project_out when `word_embed_proj_dim` differs."""
from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from gpu_worker.models.base import CausalLM
from gpu_worker.models.layers import MLP, ForwardContext, MergedLinear, PagedAttention

POSITION_OFFSET = 2  # OPT's position table reserves its first two rows


class OPTAttention(nn.Module):
    def __init__(self, config: Any, layer_idx: int) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = hidden // self.num_heads
        self.qkv_proj = MergedLinear(hidden, [hidden] * 3, bias=config.enable_bias)
        self.out_proj = nn.Linear(hidden, hidden, bias=config.enable_bias)
        self.attn = PagedAttention(layer_idx, self.num_heads, self.num_heads, self.head_dim, self.head_dim ** -0.5)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        q, k, v = (t.view(-1, self.num_heads, self.head_dim) for t in self.qkv_proj(x).chunk(3, dim=-1))
        return self.out_proj(self.attn(q, k, v, ctx))


class OPTDecoderLayer(nn.Module):
    def __init__(self, config: Any, layer_idx: int) -> None:
        super().__init__()
        hidden, affine = config.hidden_size, config.layer_norm_elementwise_affine
        self.pre_norm = config.do_layer_norm_before
        self.self_attn_layer_norm = nn.LayerNorm(hidden, elementwise_affine=affine)
        self.self_attn = OPTAttention(config, layer_idx)
        self.final_layer_norm = nn.LayerNorm(hidden, elementwise_affine=affine)
        self.mlp = MLP(hidden, config.ffn_dim, config.activation_function, bias=config.enable_bias)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        if self.pre_norm:
            x = x + self.self_attn(self.self_attn_layer_norm(x), ctx)
            return x + self.mlp(self.final_layer_norm(x))
        x = self.self_attn_layer_norm(x + self.self_attn(x, ctx))
        return self.final_layer_norm(x + self.mlp(x))


class OPTDecoder(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        hidden, proj = config.hidden_size, config.word_embed_proj_dim
        self.embed_tokens = nn.Embedding(config.vocab_size, proj)
        self.embed_positions = nn.Embedding(config.max_position_embeddings + POSITION_OFFSET, hidden)
        self.project_in = nn.Linear(proj, hidden, bias=False) if proj != hidden else None
        self.project_out = nn.Linear(hidden, proj, bias=False) if proj != hidden else None
        self.layers = nn.ModuleList(OPTDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        keep_final_norm = config.do_layer_norm_before and not getattr(config, "_remove_final_layer_norm", False)
        self.final_layer_norm = (nn.LayerNorm(hidden, elementwise_affine=config.layer_norm_elementwise_affine)
                                 if keep_final_norm else None)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        if self.project_in is not None:
            x = self.project_in(x)
        x = x + self.embed_positions(positions + POSITION_OFFSET)
        for layer in self.layers:
            x = layer(x, ctx)
        if self.final_layer_norm is not None:
            x = self.final_layer_norm(x)
        if self.project_out is not None:
            x = self.project_out(x)
        return x


class OPTModel(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.decoder = OPTDecoder(config)


class OPTForCausalLM(CausalLM):
    packed_modules: ClassVar[dict[str, tuple[str, int]]] = {
        "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2)}
    embedding_module: ClassVar[str] = "model.decoder.embed_tokens"

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self.model = OPTModel(config)
        self.lm_head = nn.Linear(config.word_embed_proj_dim, config.vocab_size, bias=False)

    def checkpoint_name(self, name: str) -> str:
        # facebook/opt-* checkpoints name the body `decoder.` without the `model.` prefix
        if name.startswith("decoder."):
            name = "model." + name
        return name.replace(".fc1.", ".mlp.fc1.").replace(".fc2.", ".mlp.fc2.")

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        return self.model.decoder(input_ids, positions, ctx)
