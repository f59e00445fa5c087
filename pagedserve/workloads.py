"""Synthetic serving workloads: prompts as token-id lists with output lengths, and request arrival times.

Lengths follow the vLLM paper's datasets (ShareGPT: mean input 161 / output 338 tokens; Alpaca: 19 / 58)
as lognormal distributions with those means, so no dataset download is needed. Prompts are random token
ids: timing depends on lengths, not on content. (This module is not named `datasets` so that it cannot
shadow the Hugging Face library of that name when benchmarks/ lands on sys.path.)
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

DATASETS = ("sharegpt", "alpaca", "random", "prefix")


@dataclass(slots=True, frozen=True)
class LengthDistribution:
    """Lognormal input and output lengths with the given means (in tokens) and log-space spreads."""
    input_mean: float
    output_mean: float
    input_sigma: float
    output_sigma: float


# The paper's Table/Figure 11 means; the spreads mimic its histograms (ShareGPT long-tailed, Alpaca narrow).
SHAREGPT = LengthDistribution(input_mean=161.0, output_mean=338.0, input_sigma=1.0, output_sigma=0.9)
ALPACA = LengthDistribution(input_mean=19.0, output_mean=58.0, input_sigma=0.6, output_sigma=0.7)


@dataclass(slots=True, frozen=True)
class WorkloadSpec:
    dataset: str
    num_prompts: int
    vocab_size: int
    max_model_len: int
    length_scale: float = 1.0  # multiplies ShareGPT/Alpaca lengths (small CPU runs)
    input_len: int = 128  # random: every prompt; prefix: not used
    output_len: int = 128  # random and prefix
    prefix_len: int = 256  # prefix: the shared system prefix
    suffix_len: int = 16  # prefix: the distinct part after it
    special_ids: tuple[int, ...] = ()  # never drawn (bos/eos/pad)

    def validate(self) -> None:
        if self.dataset not in DATASETS:
            raise ValueError(f"unknown dataset {self.dataset!r}; choose one of {', '.join(DATASETS)}")
        if self.num_prompts < 1:
            raise ValueError(f"num_prompts must be at least 1, got {self.num_prompts}")
        if self.vocab_size <= len(set(self.special_ids)):
            raise ValueError(f"vocab_size {self.vocab_size} leaves no ordinary token ids to draw")
        if self.max_model_len < 2:
            raise ValueError(f"max_model_len must be at least 2, got {self.max_model_len}")
        if not self.length_scale > 0:
            raise ValueError(f"length_scale must be positive, got {self.length_scale}")
        for name in ("input_len", "output_len", "prefix_len", "suffix_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        fixed = {"random": self.input_len + self.output_len,
                 "prefix": self.prefix_len + self.suffix_len + self.output_len}.get(self.dataset, 0)
        if fixed > self.max_model_len:
            raise ValueError(f"the {self.dataset} dataset asks for {fixed} tokens per sequence, "
                             f"more than max_model_len {self.max_model_len}")


@dataclass(slots=True)
class SampleRequest:
    prompt_token_ids: list[int]
    max_tokens: int
    temperature: float = 0.0  # greedy unless a workload samples


def lognormal_lengths(rng: np.random.Generator, mean: float, sigma: float, n: int) -> np.ndarray:
    """n lognormal draws whose distribution mean is `mean` (mu = ln(mean) - sigma^2 / 2), rounded, at least 1."""
    mu = math.log(mean) - sigma * sigma / 2
    return np.maximum(1, np.rint(rng.lognormal(mu, sigma, n))).astype(np.int64)


def _fit(input_len: int, output_len: int, max_model_len: int) -> tuple[int, int]:
    """Truncate a sampled pair to fit the model: the prompt keeps at most half, the output the rest."""
    input_len = min(input_len, max(1, max_model_len // 2))
    return input_len, max(1, min(output_len, max_model_len - input_len))


def build_requests(spec: WorkloadSpec, seed: int, salt: int = 0) -> list[SampleRequest]:
    """The workload's requests. Lengths depend on `seed` only; token ids on (seed, salt), so the points of a
    sweep (one salt each) get the same lengths but distinct prompts that cannot hit an earlier point's
    prefix cache. Input and output lengths come from streams of their own, so a smaller workload is the
    head of a larger one (a sweep may send fewer requests at low rates)."""
    spec.validate()
    input_rng, output_rng = np.random.default_rng([seed, 0]), np.random.default_rng([seed, 1])
    token_rng = np.random.default_rng([seed, salt])
    allowed = np.setdiff1d(np.arange(spec.vocab_size, dtype=np.int64), np.asarray(spec.special_ids, np.int64))

    def tokens(k: int) -> list[int]:
        return allowed[token_rng.integers(0, len(allowed), k)].tolist()

    n = spec.num_prompts
    if spec.dataset == "random":
        return [SampleRequest(tokens(spec.input_len), spec.output_len) for _ in range(n)]
    if spec.dataset == "prefix":
        prefix = tokens(spec.prefix_len)
        return [SampleRequest(prefix + tokens(spec.suffix_len), spec.output_len) for _ in range(n)]
    dist = SHAREGPT if spec.dataset == "sharegpt" else ALPACA
    ins = lognormal_lengths(input_rng, dist.input_mean * spec.length_scale, dist.input_sigma, n)
    outs = lognormal_lengths(output_rng, dist.output_mean * spec.length_scale, dist.output_sigma, n)
    requests = []
    for i, o in zip(ins.tolist(), outs.tolist()):
        i, o = _fit(i, o, spec.max_model_len)
        requests.append(SampleRequest(tokens(i), o))
    return requests


def arrival_times(num: int, request_rate: float, burstiness: float, seed: int) -> list[float]:
    """Send times (seconds from the start) of `num` requests.

    Inter-arrival gaps are gamma(shape=burstiness, scale=1/(rate*burstiness)): mean 1/rate for any
    burstiness; burstiness 1 is a Poisson process, below 1 burstier, above 1 more regular. An infinite
    rate sends everything at once.
    """
    if not request_rate > 0:
        raise ValueError(f"request rate must be positive (or inf), got {request_rate}")
    if not burstiness > 0:
        raise ValueError(f"burstiness must be positive, got {burstiness}")
    if math.isinf(request_rate):
        return [0.0] * num
    gaps = np.random.default_rng(seed).gamma(burstiness, 1.0 / (request_rate * burstiness), num)
    gaps[0] = 0.0  # the first request starts the clock
    return np.cumsum(gaps).tolist()


def prefix_groups(num_groups: int, group_size: int, system_len: int, question_len: int, output_len: int,
                  vocab_size: int, seed: int) -> list[SampleRequest]:
    """The shape of llm-d's shared-prefix capacity benchmark: `num_groups` system prompts of `system_len` random
    tokens, each followed by `group_size` distinct questions of `question_len`; every prompt asks for
    `output_len` tokens; all groups' prompts in one shuffled order."""
    rng = np.random.default_rng([seed, 2])
    requests = []
    for _ in range(num_groups):
        system = rng.integers(0, vocab_size, system_len).tolist()
        requests += [SampleRequest(system + rng.integers(0, vocab_size, question_len).tolist(), output_len)
                     for _ in range(group_size)]
    return [requests[i] for i in rng.permutation(len(requests))]
