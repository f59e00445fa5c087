"""Sampling parameters, their validation, and the one function that decides when a sequence ends."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

MAX_N = 128
MAX_LOGPROBS = 20
MAX_BEAM_WIDTH = 16
MAX_SEED = 2**63 - 1
MAX_LOGIT_BIAS = 100.0


class ParamError(ValueError):
    """A request parameter is out of range; `param` names it (OpenAI's error body carries it)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


# Temperatures below this are greedy, as in vLLM: logits / 1e-38 overflow float32 (and 5e-324 is 0 there),
# and what is left of the distribution at such a temperature is its argmax anyway.
SAMPLING_EPS = 1e-5


CONSTRAINT_KINDS = ("json_schema", "regex", "choice", "grammar")


@dataclass(frozen=True, slots=True)
class Constraint:
    """What a sequence's output must match (structured outputs, tool calls): compiled by llguidance on both sides of
    the bus (shared/constraints.py), so that the gateway refuses what the worker could not run."""
    kind: str  # one of CONSTRAINT_KINDS
    spec: str  # the JSON schema, the regular expression, the choices as a JSON array of strings, a Lark or GBNF grammar
    compact: bool = False  # JSON without whitespace between its tokens (vLLM's disable_any_whitespace)


@dataclass(slots=True)
class SamplingParams:
    n: int = 1
    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 = off
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    # Added to the logits before penalties and sampling (OpenAI's logit_bias): (token id, bias in [-100, 100]).
    logit_bias: list[tuple[int, float]] = field(default_factory=list)
    allowed_token_ids: list[int] = field(default_factory=list)  # empty: every token; else sampling among these
    logprobs: int | None = None  # None = none; k = the chosen token's logprob plus the top k
    prompt_logprobs: int | None = None  # None = none; k = each prompt token's logprob plus the top k
    # Beam search (0 = sampling): this many beams, the n best returned, scored and stopped as transformers'
    # beam search: cumulative logprob / generated length ** length_penalty; early_stopping True, False or "never".
    beam_width: int = 0
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    constraint: Constraint | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    def validate(self) -> "SamplingParams":
        _in_range("n", self.n, 1, MAX_N)
        _in_range("max_tokens", self.max_tokens, 1, None)
        _in_range("min_tokens", self.min_tokens, 0, self.max_tokens)
        _in_range("temperature", self.temperature, 0.0, 2.0)
        if not 0.0 < self.top_p <= 1.0:
            raise ParamError("top_p", f"top_p must be in (0, 1]; got {self.top_p}")
        if self.top_k < -1:
            raise ParamError("top_k", f"top_k must be -1 or 0 (off) or at least 1; got {self.top_k}")
        _in_range("min_p", self.min_p, 0.0, 1.0)
        if self.seed is not None:
            _in_range("seed", self.seed, 0, MAX_SEED)
        _in_range("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _in_range("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise ParamError("repetition_penalty",
                             f"repetition_penalty must be in (0, 2]; got {self.repetition_penalty}")
        for name in ("stop_token_ids", "allowed_token_ids"):
            for t in getattr(self, name):
                if t < 0:
                    raise ParamError(name, f"{name} must be token ids of 0 or more; got {t}")
        for t, bias in self.logit_bias:
            if t < 0 or not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise ParamError("logit_bias", f"logit_bias maps token ids to biases in [-{MAX_LOGIT_BIAS:g}, "
                                               f"{MAX_LOGIT_BIAS:g}]; got {t}: {bias}")
        if self.logprobs is not None:
            _in_range("logprobs", self.logprobs, 0, MAX_LOGPROBS)
        if self.prompt_logprobs is not None:
            _in_range("prompt_logprobs", self.prompt_logprobs, 0, MAX_LOGPROBS)
        if self.constraint is not None:
            if self.constraint.kind not in CONSTRAINT_KINDS:
                raise ParamError("constraint", f"a constraint is one of {', '.join(CONSTRAINT_KINDS)}; got "
                                               f"{self.constraint.kind!r}")
            # The grammar decides where the output may end: EOS must stay allowed there, and nowhere else.
            # allowed_token_ids could leave a grammar no token at all
            for name, forbidden in (("ignore_eos", self.ignore_eos), ("min_tokens", self.min_tokens),
                                    ("beam_width", self.beam_width), ("allowed_token_ids", self.allowed_token_ids)):
                if forbidden:
                    raise ParamError(name, f"{name} does not apply to a constrained (structured) output")
        if self.beam_width:
            _in_range("beam_width", self.beam_width, self.n, MAX_BEAM_WIDTH)
            if self.logit_bias or self.allowed_token_ids:
                name = "logit_bias" if self.logit_bias else "allowed_token_ids"
                raise ParamError(name, f"{name} does not apply to beam search")
            _in_range("length_penalty", self.length_penalty, -10.0, 10.0)
            if self.early_stopping not in (True, False, "never"):
                raise ParamError("early_stopping", f"early_stopping must be true, false or \"never\"; "
                                                   f"got {self.early_stopping!r}")
        return self

    def stop_tokens(self, eos_token_ids: list[int] | tuple[int, ...]) -> frozenset[int]:
        """The tokens that end a sample: its stop_token_ids, and the model's EOS ids unless ignore_eos."""
        return frozenset(self.stop_token_ids).union(() if self.ignore_eos else eos_token_ids)

    def beam_candidates(self, eos_token_ids: list[int] | tuple[int, ...]) -> int:
        """K: how many continuations a beam search step ranks, and each beam reports (at least two per beam, and one
        more than the EOS ids, so that beams ending on EOS leave enough going on, as transformers does)."""
        return max(2, 1 + (0 if self.ignore_eos else len(eos_token_ids))) * self.beam_width


def _in_range(name: str, value: float, low: float, high: float | None) -> None:
    if not math.isfinite(value) or value < low or (high is not None and value > high):
        allowed = f"at least {low}" if high is None else f"in [{low}, {high}]"
        raise ParamError(name, f"{name} must be {allowed}; got {value}")


def finish_reason(params: SamplingParams, output_token_ids: list[int], num_tokens: int,
                  max_model_len: int, eos_token_ids: list[int] | tuple[int, ...]) -> str | None:
    """Why a sequence that just produced `output_token_ids[-1]` ends, or None while it goes on.

    `num_tokens` is the whole sequence (prompt + output). The scheduler and the worker both call
    this, so they agree on every finish without a round trip.
    """
    if not output_token_ids:
        return None
    out_len = len(output_token_ids)
    last = output_token_ids[-1]
    if out_len >= params.min_tokens:
        if last in params.stop_token_ids or (not params.ignore_eos and last in eos_token_ids):
            return "stop"
    if out_len >= params.max_tokens or num_tokens >= max_model_len:
        return "length"
    return None
