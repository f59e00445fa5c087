"""What every architecture shares: checkpoint-name mapping, tied embeddings, logits, config checks."""
from __future__ import annotations

from typing import Any, ClassVar, NamedTuple

import torch
from torch import nn


class UnsupportedModelError(ValueError):
    """The checkpoint's architecture or config is one pagedserve cannot serve correctly; the message says why."""


class MappedWeight(NamedTuple):
    """A checkpoint tensor's place in the model."""
    target: str  # the parameter's name
    shard: int | None  # its shard of a merged parameter (q|k|v, gate|up), or None for the whole
    tensor: torch.Tensor


class CausalLM(nn.Module):
    """Base of the decoder-only models: `forward` gives hidden states, `compute_logits` the vocabulary scores.

    Module names mirror the Hugging Face checkpoint names, except where several checkpoint linears
    share one matmul (`packed_modules`: checkpoint name → (our module, shard index)).
    """
    packed_modules: ClassVar[dict[str, tuple[str, int]]] = {}
    embedding_module: ClassVar[str] = ""  # the token embedding an lm_head may be tied to
    ignored_suffixes: ClassVar[tuple[str, ...]] = ("rotary_emb.inv_freq",)  # buffers some checkpoints carry

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))

    @classmethod
    def check_config(cls, config: Any, max_model_len: int) -> None:
        """Refuse configs this code would serve wrongly (it implements full causal attention only)."""
        window = getattr(config, "sliding_window", None)
        layer_types = getattr(config, "layer_types", None)
        uses_window = window is not None and (layer_types is None or "sliding_attention" in layer_types)
        if uses_window and window < max_model_len:
            raise UnsupportedModelError(
                f"{cls.__name__} with sliding-window attention of {window} tokens is served with full attention "
                f"only up to {window} tokens; set max_model_len to {window} or less (max_model_len is {max_model_len})")

    def checkpoint_name(self, name: str) -> str:
        """The checkpoint name in this model's naming (variants of a family prefix names differently)."""
        return name

    def map_weight(self, name: str, tensor: torch.Tensor) -> MappedWeight | None:
        """Where a checkpoint tensor goes, or None to skip it."""
        name = self.checkpoint_name(name)
        if name.endswith(self.ignored_suffixes) or (self.tie_word_embeddings and name == "lm_head.weight"):
            return None
        parts = name.split(".")
        for i, part in enumerate(parts):
            if part in self.packed_modules:
                merged, shard = self.packed_modules[part]
                return MappedWeight(".".join([*parts[:i], merged, *parts[i + 1:]]), shard, tensor)
        return MappedWeight(name, None, tensor)

    def tie_weights(self) -> None:
        if self.tie_word_embeddings:
            self.lm_head.weight = self.get_submodule(self.embedding_module).weight

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)
