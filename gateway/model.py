"""The served model as the gateway sees it: its id, limits and tokenizer (no torch, no transformers to start)."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gateway.errors import bad_request
from gateway.request_model import ChatTemplate
from gateway.tools import CallFormat, call_format
from shared.model_dir import eos_token_ids, max_model_len, read_config, resolve_model_dir, vocab_size
from shared.settings import Settings


BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte tokens
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE spelling: the printable character that stands for each byte, read back."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


class Tokenizer:
    """The tokenizer operations the gateway needs, on the checkpoint's Rust tokenizer (`tokenizer.json`) and
    its `tokenizer_config.json`, as transformers' own tokenizer does them (the tests hold the two equal).

    transformers itself is not imported to start: that alone takes seconds, and a restarted gateway should serve
    within a second or two. Only chat templates are rendered by transformers' own renderer (its sandbox and
    helpers, exactly), imported in the background once the gateway is up (`warm_up`)."""

    def __init__(self, backend: Any, config: dict[str, Any], chat_template: str | None) -> None:
        from tokenizers import decoders

        self.backend = backend
        self.clean_up_spaces = bool(config.get("clean_up_tokenization_spaces", False))
        self.special_tokens = {name: _token_content(config[name]) for name in SPECIAL_TOKENS if config.get(name)}
        self.tokenizer_class = str(config.get("tokenizer_class") or "PreTrainedTokenizerFast")
        self.chat_template = chat_template
        self.added = backend.get_added_tokens_decoder()
        # A byte-level BPE vocabulary spells each byte as one printable character; reading that spelling back
        # gives a token's exact bytes, which decoding alone turns into U+FFFD when they are not whole characters.
        self.byte_of = byte_level_alphabet() if isinstance(backend.decoder, decoders.ByteLevel) else {}
        self.texts: dict[int, str] = {}  # token_text's cache: at most one entry per vocabulary token
        self.appended: dict[int, str | None] = {}  # appended_text's cache
        self._render = None

    @classmethod
    def load(cls, model_dir: Path) -> "Tokenizer":
        config_path = model_dir / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        template_path = model_dir / "chat_template.jinja"
        template = template_path.read_text() if template_path.is_file() else config.get("chat_template")
        if isinstance(template, list):  # named templates: the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        if (model_dir / "tokenizer.json").is_file():
            from tokenizers import Tokenizer as RustTokenizer

            return cls(RustTokenizer.from_file(str(model_dir / "tokenizer.json")), config, template)
        # A checkpoint with only a slow (e.g. SentencePiece) tokenizer: transformers converts it once here.
        from transformers import AutoTokenizer

        return cls(AutoTokenizer.from_pretrained(model_dir, local_files_only=True).backend_tokenizer, config, template)

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def warm_up(self) -> None:
        """Import transformers' chat-template renderer (seconds); call it off the event loop."""
        if self._render is None and self.chat_template:
            from transformers.utils.chat_template_utils import render_jinja_template

            self._render = render_jinja_template

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        text = self.backend.decode(token_ids, skip_special_tokens=skip_special_tokens)
        if self.clean_up_spaces:  # transformers' clean_up_tokenization
            for before, after in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                                  (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
                text = text.replace(before, after)
        return text

    def appended_text(self, token_id: int) -> str | None:
        """The text of a token that decoding appends as is to that of any tokens before it, else None: a vocabulary
        token of plain ASCII bytes, under a ByteLevel decoder (its bytes end any unfinished character before them,
        which decodes to the same U+FFFD as without them) and no clean-up (which rewrites across tokens)."""
        text = self.appended.get(token_id, False)
        if text is False:
            raw = b"" if token_id in self.added or not self.byte_of or self.clean_up_spaces else self.token_bytes(token_id)
            text = raw.decode() if raw and raw.isascii() else None
            self.appended[token_id] = text
        return text

    def token_strs(self, token_ids: list[int]) -> list[str | None]:
        """Each token's vocabulary entry (transformers' convert_ids_to_tokens)."""
        return [self.backend.id_to_token(t) for t in token_ids]

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (special tokens: their text)."""
        added = self.added.get(token_id)
        if added is not None:
            return added.content.encode()
        piece = self.backend.id_to_token(token_id) or ""
        if self.byte_of and piece and all(c in self.byte_of for c in piece):
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
        tokens = {name: self.special_tokens.get(name) for name in ("bos_token", "eos_token", "pad_token", "unk_token")}
        return {"tokenizer_class": self.tokenizer_class, **tokens, "chat_template": self.chat_template,
                "model_max_length": max_model_len, "vocab_size": self.vocab_size}

    def render_chat(self, messages: list[dict[str, Any]], template: ChatTemplate = ChatTemplate(),
                    tools: list[dict[str, Any]] | None = None) -> ChatPrompt:
        """The chat template's text and token ids (with the tools offered, for a template that renders them); 400
        when the model has no template or it rejects the messages."""
        if not self.chat_template:
            raise bad_request("this model has no chat template; use /v1/completions with a plain prompt",
                              param="messages", code="no_chat_template")
        from jinja2 import TemplateError

        self.warm_up()
        try:
            rendered, _ = self._render([messages], chat_template=self.chat_template, tools=tools or None,
                                       add_generation_prompt=template.add_generation_prompt,
                                       continue_final_message=template.continue_final_message,
                                       **self.special_tokens | dict(template.kwargs))
        except (TemplateError, ValueError, TypeError, KeyError, AttributeError, IndexError) as e:
            raise bad_request(f"the chat template rejected the messages: {e}", param="messages") from None
        # The template already writes any BOS token, so by default no special tokens are added again.
        return ChatPrompt(rendered[0], self.encode(rendered[0], template.add_special_tokens))


@dataclass(frozen=True, slots=True)
class ChatPrompt:
    """Chat messages as the model reads them: the template's text, and its token ids."""
    text: str
    token_ids: list[int]


def _token_content(value: Any) -> str:
    """A special token as tokenizer_config.json holds it: a string, or an AddedToken's fields."""
    return value["content"] if isinstance(value, dict) else str(value)


@dataclass(slots=True)
class ServedModel:
    name: str  # the model id clients send
    path: Path
    max_model_len: int
    vocab_size: int  # token ids must be below this
    tokenizer: Tokenizer
    eos_token_ids: list[int]
    tool_format: CallFormat  # how the model writes tool calls
    _grammar_tokenizer: Any = None

    def grammar_tokenizer(self) -> Any:
        """llguidance's view of the tokenizer, to check constraints with (built on the first one: about a second)."""
        if self._grammar_tokenizer is None:
            from shared import constraints

            self._grammar_tokenizer = constraints.tokenizer(self.tokenizer.backend.to_str(), self.vocab_size,
                                                            self.eos_token_ids)
        return self._grammar_tokenizer

    @classmethod
    def load(cls, settings: Settings) -> "ServedModel":
        model_dir = resolve_model_dir(settings.model, weights=False)
        path = model_dir.path
        config = read_config(path)
        tokenizer = Tokenizer.load(path)
        return cls(name=model_dir.served_name(settings.served_model_name), path=path,
                   max_model_len=max_model_len(config, settings.max_model_len),
                   vocab_size=vocab_size(config) or tokenizer.vocab_size,
                   tokenizer=tokenizer, eos_token_ids=eos_token_ids(path),
                   tool_format=call_format(settings.tool_call_parser, tokenizer.chat_template))
