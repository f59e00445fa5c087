"""Turn each sampled sequence's logits into its next token, batched over sequences (vLLM's semantics).

Order, per row: tokens its constraint's grammar does not allow next masked (gpu_worker/structured.py) → tokens
outside `allowed_token_ids` masked → `logit_bias` added → stop tokens masked while
`min_tokens` is not reached → repetition penalty (tokens of prompt and output) → frequency and presence
penalties (output tokens) → greedy argmax, or
temperature → min-p → top-k → top-p → a draw from the softmax. A temperature below SAMPLING_EPS
(shared/sampling.py) is greedy.

Logprobs are those of the model's raw distribution (log-softmax of the logits before any penalty,
temperature or truncation), vLLM's default: the chosen token's plus the `logprobs` most likely.

A draw is `argmax(probs / E)` with E ~ Exp(1) noise per token (the exponential race, equal in law
to sampling from `probs`). A seeded row draws its noise on the CPU from a generator seeded by a hash
of (seed, sample index, output index), so its token is a pure function of those three and of its
own logits, whatever else is in the batch, after preemption or on another worker.
"""
from __future__ import annotations

import ctypes
import hashlib
import struct
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from gpu_worker.sequence import SequenceState
from gpu_worker.structured import mask_disallowed
from kernels import native
from shared.sampling import SamplingParams


@dataclass(slots=True)
class SampledToken:
    token_id: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] = field(default_factory=list)


class StepToken(NamedTuple):
    """A token a step gives a sequence (a drafting sequence may get several)."""
    seq: SequenceState
    token: SampledToken


def seed_for(seed: int, sample_index: int, output_index: int) -> int:
    digest = hashlib.sha256(struct.pack("<qqq", seed, sample_index, output_index)).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def argmax(scores: torch.Tensor, kernel: ctypes.CDLL | None) -> torch.Tensor:
    """Each row's first maximum (a NaN's where there is one), as `max(dim=-1)`'s indices. On the CPU with `kernel`
    (kernels/native.py's library), kernels/cpu_argmax.c reads float32 or bfloat16 rows in place, where torch's
    `max` (and widening bfloat16 to float32 for it) took several times as long
    (benchmarks/results/cpu-efficiency-log-2026-12.md)."""
    if (kernel is None or scores.device.type != "cpu" or scores.dtype not in native.DTYPE_CODES or scores.dim() != 2
            or scores.stride(-1) != 1):
        return scores.max(dim=-1).indices
    out = torch.empty(scores.shape[0], dtype=torch.int64)
    kernel.rows_argmax(native.DTYPE_CODES[scores.dtype], scores.data_ptr(), scores.stride(0), scores.shape[0],
                       scores.shape[1], out.data_ptr())
    return out


def apply_logit_bias(logits: torch.Tensor, seqs: list[SequenceState]) -> None:
    """Keep only each row's allowed tokens, then add its biases (vLLM's order: both before any penalty)."""
    vocab = logits.shape[1]
    for row, seq in enumerate(seqs):
        params = seq.params
        if params.allowed_token_ids:
            keep = torch.tensor([t for t in params.allowed_token_ids if t < vocab], dtype=torch.int64)
            allowed = torch.full((vocab,), float("-inf"), dtype=logits.dtype, device=logits.device)
            allowed[keep] = logits[row, keep]
            logits[row] = allowed
        if params.logit_bias:
            pairs = [(t, b) for t, b in params.logit_bias if t < vocab]
            ids = torch.tensor([t for t, _ in pairs], dtype=torch.int64)
            logits[row, ids] += torch.tensor([b for _, b in pairs], dtype=logits.dtype, device=logits.device)


def edits_logits(params: SamplingParams) -> bool:
    return bool(params.logit_bias or params.allowed_token_ids) or has_penalty(params)


def mask_stop_tokens(logits: torch.Tensor, seqs: list[SequenceState], eos_token_ids: list[int]) -> None:
    """Forbid stop tokens (and EOS unless ignore_eos) until a sequence has `min_tokens` outputs."""
    vocab = logits.shape[1]
    for row, seq in enumerate(seqs):
        params = seq.params
        if seq.num_output_tokens < params.min_tokens:
            ids = [t for t in params.stop_tokens(eos_token_ids) if t < vocab]
            if ids:
                logits[row, ids] = float("-inf")


def token_counts(token_lists: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """[rows, vocab] count of each token id in each row's list."""
    width = max((len(t) for t in token_lists), default=0)
    ids = torch.full((len(token_lists), width), vocab, dtype=torch.int64)  # id `vocab` is padding
    for row, tokens in enumerate(token_lists):
        ids[row, :len(tokens)] = torch.tensor(tokens, dtype=torch.int64)
    counts = torch.zeros((len(token_lists), vocab + 1), dtype=torch.float32)
    counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=torch.float32))
    return counts[:, :vocab].to(device)


def has_penalty(params: SamplingParams) -> bool:
    return params.repetition_penalty != 1.0 or params.frequency_penalty != 0.0 or params.presence_penalty != 0.0


def apply_penalties(logits: torch.Tensor, seqs: list[SequenceState]) -> None:
    """Repetition penalty over prompt + output tokens, frequency and presence penalties over output tokens."""
    rows = [i for i, s in enumerate(seqs) if has_penalty(s.params)]
    if not rows:
        return
    vocab, device = logits.shape[1], logits.device
    picked = [seqs[i] for i in rows]
    out_counts = token_counts([s.output_token_ids for s in picked], vocab, device)
    seen = (token_counts([s.prompt_token_ids for s in picked], vocab, device) > 0) | (out_counts > 0)
    repetition = torch.tensor([s.params.repetition_penalty for s in picked], device=device)[:, None]
    frequency = torch.tensor([s.params.frequency_penalty for s in picked], device=device)[:, None]
    presence = torch.tensor([s.params.presence_penalty for s in picked], device=device)[:, None]
    sub = logits[rows]
    sub = torch.where(seen, torch.where(sub > 0, sub / repetition, sub * repetition), sub)
    sub = sub - frequency * out_counts - presence * (out_counts > 0).float()
    logits[rows] = sub


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below min_p times the most likely token's."""
    probs = logits.softmax(dim=-1)
    threshold = min_p[:, None] * probs.max(dim=-1, keepdim=True).values
    return logits.masked_fill(probs < threshold, float("-inf"))


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    """Keep the top_k highest logits (ties with the k-th kept too), then the smallest set of the most likely
    tokens whose probability (renormalised after top-k) reaches top_p; the most likely token always stays."""
    sorted_logits, order = logits.sort(dim=-1, descending=False)
    vocab = logits.shape[1]
    if top_k is not None:
        kth = sorted_logits.gather(1, (vocab - top_k.clamp(1, vocab)).unsqueeze(1))
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    if top_p is not None:
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop = cumulative <= (1 - top_p)[:, None]
        drop[:, -1] = False
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return sorted_logits.scatter(1, order, sorted_logits)


def top_logprobs(logprobs: torch.Tensor, ks: list[int]) -> list[list[tuple[int, float]]]:
    """Per row of `logprobs`, its `ks[row]` most likely (token id, logprob), most likely first: one topk for all."""
    k = min(max(ks, default=0), logprobs.shape[1])
    if not k:
        return [[] for _ in ks]
    values, ids = logprobs.topk(k, dim=-1)
    return [list(zip(ids[row, :n].tolist(), values[row, :n].tolist())) for row, n in enumerate(ks)]


class Sampler:
    def __init__(self, device: torch.device, seed: int | None = None, kernel: ctypes.CDLL | None = None) -> None:
        """`kernel`: kernels/native.py's library, for greedy choices and grammar masks in place on the CPU."""
        self.device, self.kernel = device, kernel
        # unseeded rows draw from this generator; a fixed seed makes a whole worker run reproducible
        self.generator = torch.Generator(device=device)
        if seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(seed)

    def __call__(self, logits: torch.Tensor, seqs: list[SequenceState],
                 eos_token_ids: list[int]) -> list[SampledToken]:
        """logits `[len(seqs), vocab]` of each sequence's last position, in the model's dtype → one token per
        sequence."""
        want_logprobs = [s.params.logprobs is not None for s in seqs]
        edits = any(s.num_output_tokens < s.params.min_tokens or edits_logits(s.params) or s.grammar is not None
                    for s in seqs)
        if not edits and not any(want_logprobs) and all(s.params.greedy for s in seqs):
            # as widened: widening keeps the order
            return [SampledToken(t) for t in argmax(logits, self.kernel).tolist()]
        logits = logits.float()
        raw_logprobs = logits.log_softmax(dim=-1) if any(want_logprobs) else None
        if edits:
            logits = logits.clone()  # edited in place below; a copy of a batch's logits is not free, so only then
            constrained = [row for row, s in enumerate(seqs) if s.grammar is not None]
            if constrained:
                mask_disallowed(logits, constrained, [seqs[row].grammar for row in constrained], self.kernel)
            apply_logit_bias(logits, seqs)
            mask_stop_tokens(logits, seqs, eos_token_ids)
            apply_penalties(logits, seqs)
        tokens = self._choose(logits, seqs)
        token_list = tokens.tolist()
        results = [SampledToken(t) for t in token_list]
        if raw_logprobs is not None:
            chosen = raw_logprobs.gather(1, tokens[:, None]).squeeze(1).tolist()
            tops = top_logprobs(raw_logprobs, [s.params.logprobs or 0 for s in seqs])
            for row, seq in enumerate(seqs):
                if not want_logprobs[row]:
                    continue
                results[row].logprob = chosen[row]
                if seq.params.logprobs:
                    results[row].top_logprobs = tops[row]
        return results

    def _choose(self, logits: torch.Tensor, seqs: list[SequenceState]) -> torch.Tensor:
        greedy = [s.params.greedy for s in seqs]
        if all(greedy):
            return argmax(logits, self.kernel)
        tokens = argmax(logits, self.kernel)
        rows = [i for i, g in enumerate(greedy) if not g]
        picked = [seqs[i] for i in rows]
        device = logits.device
        sub = logits[rows] / torch.tensor([s.params.temperature for s in picked], device=device)[:, None]
        if any(s.params.min_p > 0 for s in picked):
            sub = apply_min_p(sub, torch.tensor([s.params.min_p for s in picked], device=device))
        top_k = top_p = None
        if any(s.params.top_k > 0 for s in picked):
            top_k = torch.tensor([s.params.top_k if s.params.top_k > 0 else sub.shape[1] for s in picked],
                                 device=device)
        if any(s.params.top_p < 1.0 for s in picked):
            top_p = torch.tensor([s.params.top_p for s in picked], device=device)
        if top_k is not None or top_p is not None:
            sub = apply_top_k_top_p(sub, top_k, top_p)
        probs = sub.softmax(dim=-1)
        tokens[rows] = argmax(probs / self._noise(picked, sub.shape[1]), self.kernel)
        return tokens

    def _noise(self, seqs: list[SequenceState], vocab: int) -> torch.Tensor:
        """Exp(1) noise, strictly positive (or +inf, which only rules a token out): -log(U), U in [0, 1)."""
        uniform = torch.empty((len(seqs), vocab), device=self.device)
        unseeded = [i for i, s in enumerate(seqs) if s.params.seed is None]
        if unseeded:
            uniform[unseeded] = torch.rand((len(unseeded), vocab), generator=self.generator, device=self.device)
        for row, seq in enumerate(seqs):
            if seq.params.seed is not None:
                gen = torch.Generator(device="cpu")
                gen.manual_seed(seed_for(seq.params.seed, seq.sample_index, seq.num_output_tokens))
                uniform[row] = torch.rand(vocab, generator=gen).to(self.device)
        return -uniform.log()
