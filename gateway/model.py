"""The served model as the gateway sees it: its id, limits and tokenizer (transformers, no torch import here)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gateway.errors import bad_request
from shared.model_dir import max_model_len, read_config, resolve_model_dir, served_model_name
from shared.settings import Settings


class Tokenizer:
    """The few tokenizer operations the gateway needs, over a Hugging Face tokenizer."""

    def __init__(self, hf: Any) -> None:
        self.hf = hf

    @classmethod
    def load(cls, model_dir: Path) -> "Tokenizer":
        # Imported here: transformers probes for torch on import, and gateway modules must import without it.
        from transformers import AutoTokenizer

        return cls(AutoTokenizer.from_pretrained(model_dir, local_files_only=True))

    def encode(self, text: str) -> list[int]:
        return list(self.hf(text, add_special_tokens=True)["input_ids"])

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """One token as logprobs show it (special tokens included)."""
        return self.hf.decode([token_id], skip_special_tokens=False)

    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool) -> list[int]:
        """The chat template's token ids; 400 when the model has no template or it rejects the messages."""
        if not getattr(self.hf, "chat_template", None):
            raise bad_request("this model has no chat template; use /v1/completions with a plain prompt",
                              param="messages", code="no_chat_template")
        from jinja2 import TemplateError

        try:
            text = self.hf.apply_chat_template(messages, tokenize=False,
                                               add_generation_prompt=add_generation_prompt)
        except (TemplateError, ValueError, TypeError, KeyError) as e:
            raise bad_request(f"the chat template rejected the messages: {e}", param="messages") from None
        # The template already wrote any BOS token, so no special tokens are added again.
        return list(self.hf(text, add_special_tokens=False)["input_ids"])


@dataclass(slots=True)
class ServedModel:
    name: str  # the model id clients send
    path: Path
    max_model_len: int
    vocab_size: int  # token ids must be below this
    tokenizer: Tokenizer

    @classmethod
    def load(cls, settings: Settings) -> "ServedModel":
        path = resolve_model_dir(settings.model)
        config = read_config(path)
        tokenizer = Tokenizer.load(path)
        vocab = config.get("text_config", config).get("vocab_size")
        return cls(name=served_model_name(path, settings.served_model_name), path=path,
                   max_model_len=max_model_len(config, settings.max_model_len),
                   vocab_size=int(vocab) if isinstance(vocab, int) else len(tokenizer.hf),
                   tokenizer=tokenizer)
