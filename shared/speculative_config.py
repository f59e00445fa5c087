"""`--speculative-config`: draft-free speculative decoding's settings, as vLLM names them, parsed once.

The JSON object takes `method` ("ngram": prompt lookup; "suffix": suffix decoding over the request and recent
outputs), `num_speculative_tokens` (the most tokens proposed per step), for ngram `prompt_lookup_min` and
`prompt_lookup_max` (the n-gram lengths matched), and for suffix `suffix_decoding_max_tree_depth` (the longest
context matched), `suffix_decoding_max_cached_requests` (finished requests whose outputs stay indexed) and
`suffix_decoding_min_token_prob` (a continuation's least lead among those seen, as a share, to be proposed),
`suffix_decoding_max_spec_factor` (a draft is at most this times its first match's length), and
`disable_by_batch_size` (no drafts on a worker running more sequences than this: where a step's drafts would make it
compute-bound; 0 = no limit). Any other key, or a method that needs a draft model, is refused with an error that
names it.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

METHODS = ("ngram", "suffix")
FLOATS = ("suffix_decoding_min_token_prob", "suffix_decoding_max_spec_factor")


class SpeculativeConfigError(ValueError):
    """The speculative config cannot be used; the message names the field."""


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    suffix_decoding_max_tree_depth: int = 16
    suffix_decoding_max_cached_requests: int = 256
    suffix_decoding_min_token_prob: float = 0.1
    suffix_decoding_max_spec_factor: float = 1.0
    disable_by_batch_size: int = 0

    @classmethod
    def parse(cls, text: str) -> SpeculativeConfig | None:
        """The config a JSON object gives, or None for "" (speculation off)."""
        if not text.strip():
            return None
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as e:
            raise SpeculativeConfigError(f"speculative_config is not JSON: {e}") from None
        if not isinstance(raw, dict):
            raise SpeculativeConfigError("speculative_config must be a JSON object")
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(raw) - known)
        if unknown:
            raise SpeculativeConfigError(f"speculative_config: unsupported field(s) {', '.join(unknown)} (supported: "
                                         f"{', '.join(sorted(known))}); draft models and EAGLE heads are not")
        method = raw.get("method")
        if method not in METHODS:
            raise SpeculativeConfigError(f"speculative_config.method must be one of {', '.join(METHODS)}; got "
                                         f"{method!r}")
        if "num_speculative_tokens" not in raw:
            raise SpeculativeConfigError("speculative_config.num_speculative_tokens is required")
        for name, value in raw.items():
            want = float if name in FLOATS else str if name == "method" else int
            if want is float and isinstance(value, int) and not isinstance(value, bool):
                value = raw[name] = float(value)
            if type(value) is not want:
                raise SpeculativeConfigError(f"speculative_config.{name} must be {want.__name__}; got {value!r}")
        config = cls(**raw)
        config._check()
        return config

    def _check(self) -> None:
        if not 1 <= self.num_speculative_tokens <= 16:
            raise SpeculativeConfigError("speculative_config.num_speculative_tokens must be in 1-16; got "
                                         f"{self.num_speculative_tokens}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise SpeculativeConfigError("speculative_config needs 1 <= prompt_lookup_min <= prompt_lookup_max; got "
                                         f"{self.prompt_lookup_min} and {self.prompt_lookup_max}")
        if self.disable_by_batch_size < 0:
            raise SpeculativeConfigError("speculative_config.disable_by_batch_size must be 0 (no limit) or more")
        if self.suffix_decoding_max_tree_depth < 1 or self.suffix_decoding_max_cached_requests < 0:
            raise SpeculativeConfigError("speculative_config.suffix_decoding_max_tree_depth must be at least 1 and "
                                         "suffix_decoding_max_cached_requests 0 or more")
        if not 0.0 <= self.suffix_decoding_min_token_prob <= 1.0:
            raise SpeculativeConfigError("speculative_config.suffix_decoding_min_token_prob must be in [0, 1]")
        if self.suffix_decoding_max_spec_factor <= 0:
            raise SpeculativeConfigError("speculative_config.suffix_decoding_max_spec_factor must be positive")
