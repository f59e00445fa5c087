"""The architectures pagedserve serves, by the `architectures` name of their config.json."""
from __future__ import annotations

from typing import Any

from gpu_worker.models.base import CausalLM, UnsupportedModelError
from gpu_worker.models.gpt2 import GPT2LMHeadModel
from gpu_worker.models.llama import LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM
from gpu_worker.models.opt import OPTForCausalLM

ARCHITECTURES: dict[str, type[CausalLM]] = {cls.__name__: cls for cls in (
    LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, GPT2LMHeadModel, OPTForCausalLM)}


def model_class(config: Any) -> type[CausalLM]:
    names = list(getattr(config, "architectures", None) or [])
    for name in names:
        if name in ARCHITECTURES:
            return ARCHITECTURES[name]
    raise UnsupportedModelError(
        f"architecture {', '.join(names) or '(none given in config.json)'} is not supported; "
        f"supported: {', '.join(ARCHITECTURES)}")


__all__ = ["ARCHITECTURES", "CausalLM", "UnsupportedModelError", "model_class"]
