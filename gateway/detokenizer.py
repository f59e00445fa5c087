"""Incremental detokenization: text deltas from a growing list of token ids, whole characters only.

A byte-level tokenizer can split one UTF-8 character over several tokens; decoding such a prefix ends
in U+FFFD. The detokenizer decodes a short window [prefix_offset:] against [prefix_offset:read_offset]
and emits the difference only once it no longer ends in U+FFFD (vLLM's method), so the deltas join to
`decode(output ids)`, with one exception, as in vLLM: when the prompt ends partway through a character
and the first output token finishes it, that character belongs to neither, and the U+FFFD that
decoding the output alone begins with is not sent. A few prompt tokens seed the window so tokenizers
that drop a leading space at the start of a decode (SentencePiece) still render the first output
token's space.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

PROMPT_CONTEXT = 5
REPLACEMENT = "\ufffd"


@dataclass(slots=True)
class IncrementalDetokenizer:
    decode: Callable[[list[int]], str]
    token_ids: list[int] = field(default_factory=list)
    prefix_offset: int = 0
    read_offset: int = 0
    # Whole characters decoded but held back behind an unfinished one: the next token's text starts this many
    # characters after what `add` has returned so far.
    held: int = 0
    # A token's text when decoding appends it as is to any tokens' (Tokenizer.appended_text), else None: with
    # nothing held back, such a token's delta is its text, as the two decodes of `_advance` would find.
    appended_text: Callable[[int], str | None] | None = None

    @classmethod
    def after_prompt(cls, decode: Callable[[list[int]], str], prompt_ids: list[int],
                     appended_text: Callable[[int], str | None] | None = None) -> "IncrementalDetokenizer":
        context = list(prompt_ids[-PROMPT_CONTEXT:])
        return cls(decode, context, 0, len(context), appended_text=appended_text)

    def add(self, token_id: int) -> str:
        """Append one token; return the text it completes (empty while a character is still partial)."""
        self.token_ids.append(token_id)
        if self.read_offset == len(self.token_ids) - 1 and self.appended_text is not None:
            text = self.appended_text(token_id)
            if text is not None:
                self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
                return text
        return self._advance(final=False)

    def flush(self) -> str:
        """At the end of the sequence: whatever is still held back, replacement characters included."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        prefix = self.decode(self.token_ids[self.prefix_offset:self.read_offset])
        full = self.decode(self.token_ids[self.prefix_offset:])
        if len(full) > len(prefix) and (final or not full.endswith(REPLACEMENT)):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
            self.held = 0
            return full[len(prefix):]
        self.held = max(len(full.rstrip(REPLACEMENT)) - len(prefix), 0)
        return ""
