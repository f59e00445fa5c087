"""GPT-2: learned positions, pre-LayerNorm blocks, Conv1D checkpoint weights (stored transposed)."""
from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from gpu_worker.models.base import CausalLM, MappedWeight, UnsupportedModelError
from gpu_worker.models.layers import MLP, ForwardContext, PagedAttention

_CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


class GPT2Attention(nn.Module):
    def __init__(self, config: Any, layer_idx: int) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.head_dim = config.hidden_size // self.num_heads
        scale = self.head_dim ** -0.5 if config.scale_attn_weights else 1.0
        if config.scale_attn_by_inverse_layer_idx:
            scale /= float(layer_idx + 1)
        self.c_attn = nn.Linear(config.hidden_size, 3 * config.hidden_size)
        self.c_proj = nn.Linear(config.hidden_size, config.hidden_size)
        self.attn = PagedAttention(layer_idx, self.num_heads, self.num_heads, self.head_dim, scale)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        q, k, v = (t.view(-1, self.num_heads, self.head_dim) for t in self.c_attn(x).chunk(3, dim=-1))
        return self.c_proj(self.attn(q, k, v, ctx))


class GPT2Block(nn.Module):
    def __init__(self, config: Any, layer_idx: int) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.layer_norm_epsilon
        self.ln_1 = nn.LayerNorm(hidden, eps=eps)
        self.attn = GPT2Attention(config, layer_idx)
        self.ln_2 = nn.LayerNorm(hidden, eps=eps)
        self.mlp = MLP(hidden, config.n_inner or 4 * hidden, config.activation_function, bias=True)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), ctx)
        return x + self.mlp(self.ln_2(x))


class GPT2Model(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.wte = nn.Embedding(config.vocab_size, config.hidden_size)
        self.wpe = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.h = nn.ModuleList(GPT2Block(config, i) for i in range(config.num_hidden_layers))
        self.ln_f = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_epsilon)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        x = self.wte(input_ids) + self.wpe(positions)
        for block in self.h:
            x = block(x, ctx)
        return self.ln_f(x)


class GPT2LMHeadModel(CausalLM):
    embedding_module: ClassVar[str] = "transformer.wte"
    # causal-mask buffers of older checkpoints
    ignored_suffixes: ClassVar[tuple[str, ...]] = (".attn.bias", ".attn.masked_bias")

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self.transformer = GPT2Model(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    @classmethod
    def check_config(cls, config: Any, max_model_len: int) -> None:
        super().check_config(config, max_model_len)
        if getattr(config, "add_cross_attention", False):
            raise UnsupportedModelError("GPT2LMHeadModel with cross-attention (add_cross_attention) is not supported")

    def checkpoint_name(self, name: str) -> str:
        # the original OpenAI-converted checkpoints name the body without the `transformer.` prefix
        return name if name.startswith(("transformer.", "lm_head.")) else "transformer." + name

    def map_weight(self, name: str, tensor: torch.Tensor) -> MappedWeight | None:
        mapped = super().map_weight(name, tensor)
        if mapped is None:
            return None
        target, shard, tensor = mapped
        if target.endswith(_CONV1D):
            tensor = tensor.t()  # Conv1D stores [in, out]; nn.Linear wants [out, in]
        target = target.replace(".mlp.c_fc.", ".mlp.fc1.").replace(".mlp.c_proj.", ".mlp.fc2.")
        return MappedWeight(target, shard, tensor)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        return self.transformer(input_ids, positions, ctx)
