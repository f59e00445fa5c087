"""The served model as the gateway sees it: its id, limits and tokenizer (transformers, no torch import here)."""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gateway.errors import bad_request
from shared.model_dir import max_model_len, read_config, resolve_model_dir, served_model_name
from shared.settings import Settings


BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte tokens


class Tokenizer:
    """The few tokenizer operations the gateway needs, over a Hugging Face tokenizer."""

    def __init__(self, hf: Any) -> None:
        from tokenizers import decoders
        from transformers.convert_slow_tokenizer import bytes_to_unicode

        self.hf = hf
        # transformers' decode adds ~20 us of checks per call on top of the Rust decode, and the gateway decodes
        # twice per token: without a clean-up pass to apply after it, the Rust decode is all there is to it.
        backend = getattr(hf, "backend_tokenizer", None)
        self.rust_decode = backend.decode if backend is not None and not hf.clean_up_tokenization_spaces else None
        # A byte-level BPE vocabulary spells each byte as one printable character; reading that spelling back
        # gives a token's exact bytes, which decoding alone turns into U+FFFD when they are not whole characters.
        byte_level = isinstance(getattr(backend, "decoder", None), decoders.ByteLevel)
        self.byte_of = {c: b for b, c in bytes_to_unicode().items()} if byte_level else {}
        self.texts: dict[int, str] = {}  # token_text's cache: at most one entry per vocabulary token

    @classmethod
    def load(cls, model_dir: Path) -> "Tokenizer":
        # Imported here: transformers probes for torch on import, and gateway modules must import without it.
        from transformers import AutoTokenizer

        return cls(AutoTokenizer.from_pretrained(model_dir, local_files_only=True))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.hf(text, add_special_tokens=add_special_tokens)["input_ids"])

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        if self.rust_decode is not None:
            return self.rust_decode(token_ids, skip_special_tokens=skip_special_tokens)
        return self.hf.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (special tokens: their text)."""
        added = self.hf.added_tokens_decoder.get(token_id)
        if added is not None:
            return added.content.encode()
        piece = self.hf.convert_ids_to_tokens(token_id)
        if self.byte_of and all(c in self.byte_of for c in piece):
            return bytes(self.byte_of[c] for c in piece)
        if (byte := BYTE_FALLBACK.fullmatch(piece)) is not None:
            return bytes([int(byte[1], 16)])
        return self.decode([token_id], skip_special_tokens=False).encode()

    def token_text(self, token_id: int) -> str:
        """One token as logprobs show it: its text, or, when its bytes are no whole UTF-8 characters on their
        own, vLLM's `bytes:` followed by them with the undecodable ones escaped (`bytes:\\xe6\\x9d`), so that
        distinct tokens never read alike as U+FFFD."""
        text = self.texts.get(token_id)
        if text is None:
            raw = self.token_bytes(token_id)
            try:
                text = raw.decode()
            except UnicodeDecodeError:
                text = "bytes:" + raw.decode("utf-8", "backslashreplace")
            self.texts[token_id] = text
        return text

    def info(self, max_model_len: int) -> dict[str, Any]:
        """What /tokenizer_info tells (vLLM's fields a client such as lm-eval reads: the special tokens and the
        chat template), all JSON."""
        hf = self.hf
        return {"tokenizer_class": type(hf).__name__, "bos_token": hf.bos_token, "eos_token": hf.eos_token,
                "pad_token": hf.pad_token, "unk_token": hf.unk_token,
                "chat_template": getattr(hf, "chat_template", None), "model_max_length": max_model_len,
                "vocab_size": len(hf)}

    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool,
                    add_special_tokens: bool = False) -> list[int]:
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
        # The template already writes any BOS token, so by default no special tokens are added again.
        return self.encode(text, add_special_tokens)


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
