"""Structured-output constraints compiled by llguidance (a well-kept grammar library, vLLM's fallback backend; no
torch): the gateway checks that a request's constraint compiles before the request is queued, and the worker builds
each constrained sequence's matcher from the same grammar, under the same resource limits.

llguidance rather than xgrammar: it needs no torch, which the gateway does not have, so both sides of the bus compile
with one library; it compiles lazily (a schema in about a millisecond) and bounds every compile and every mask by the
fuel limits below; its masks' cost on the real model: benchmarks/RESULTS.md ("Structured outputs") and its history.
"""
from __future__ import annotations

import json
from typing import Any

from shared.sampling import Constraint

# llguidance's resource limits, the same on both sides of the bus: compiling a grammar past them fails (a 400 at the
# gateway), so no schema can hold a worker; see LLParserLimits for what each bounds.
LIMITS = dict(max_items_in_row=2000, initial_lexer_fuel=1_000_000, step_lexer_fuel=200_000, step_max_items=50_000,
              max_lexer_states=250_000, max_grammar_size=500_000, verbose_errors=False)


# Whitespace between JSON tokens, bounded: a small model let loose on unbounded whitespace can spend every token it has
# on it (a random one always does); 16 characters still indent a few levels deep.
WHITESPACE = r"[\x20\x0A\x0D\x09]{0,16}"


class ConstraintError(ValueError):
    """A constraint that does not compile; the message says why."""


def grammar(constraint: Constraint) -> str:
    """The llguidance grammar of `constraint`; ConstraintError when its spec is not what its kind needs."""
    from llguidance import LLMatcher, grammar_from

    try:
        if constraint.kind == "json_schema":
            overrides = {"whitespace_flexible": False} if constraint.compact else {"whitespace_pattern": WHITESPACE}
            return LLMatcher.grammar_from_json_schema(constraint.spec, overrides=overrides)
        if constraint.kind == "regex":
            return LLMatcher.grammar_from_regex(constraint.spec)
        if constraint.kind == "choice":
            choices = json.loads(constraint.spec)
            if not (isinstance(choices, list) and choices and all(isinstance(c, str) for c in choices)):
                raise ConstraintError("choices must be a non-empty array of strings")
            return grammar_from("choice", constraint.spec)
        return grammar_from("grammar", constraint.spec)  # Lark, or GBNF (llama.cpp's) converted to Lark
    except (ValueError, TypeError, RuntimeError) as e:
        raise ConstraintError(str(e) or type(e).__name__) from None


def tokenizer(tokenizer_json: str, vocab_size: int, eos_token_ids: list[int]) -> Any:
    """llguidance's view of the model's tokenizer (its `tokenizer.json`), over the model's whole vocabulary, with the
    model's EOS ids as the tokens that end a grammar's output (about a second for 50k tokens: build it once)."""
    from llguidance import LLTokenizer

    return LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=list(eos_token_ids))


def limits() -> Any:
    from llguidance import LLParserLimits

    return LLParserLimits(**LIMITS)


def check(constraint: Constraint, llg_tokenizer: Any) -> None:
    """Raise ConstraintError unless `constraint` compiles for this tokenizer within LIMITS."""
    from llguidance import LLMatcher

    error = LLMatcher.validate_grammar(grammar(constraint), llg_tokenizer, limits=limits())
    if error:
        raise ConstraintError(error)
