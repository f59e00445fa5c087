"""The baselines pagedserve is measured against, as a library: benchmarks and tests take them from here.

- Contiguous reservation (the vLLM paper's Orca, on pagedserve's own machinery): a per-worker scheduler that,
  when it admits a request, reserves KV blocks for the whole length each of its sequences may reach, as a
  contiguous allocator must (`reserving_scheduler`; served by benchmarks/contiguous.py).
- Static batching (what the paper means by it): one left-padded batch through transformers' `generate` at a time,
  first come first served within a batch size and a KV budget (`StaticBatchGenerator`, `take_static_batch`;
  served by benchmarks/hf_static_server.py).
"""
from __future__ import annotations

import asyncio
import functools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from scheduler.kv_cache_manager import Growth, Write
from scheduler.request import RequestState
from scheduler.worker_scheduler import WorkerScheduler, WorkerSchedulerFactory
from shared.model_dir import eos_token_ids, max_model_len, read_config


def max_model_len_tokens(rs: RequestState, max_model_len: int) -> int:
    """Orca (Max): max_model_len."""
    return max_model_len


def pow2_tokens(rs: RequestState, max_model_len: int) -> int:
    """Orca (Pow2): the prompt plus the output length rounded up to a power of two."""
    return len(rs.prompt) + (1 << (rs.req.params.max_tokens - 1).bit_length())


def oracle_tokens(rs: RequestState, max_model_len: int) -> int:
    """Orca (Oracle): the prompt plus exactly the output length."""
    return len(rs.prompt) + rs.req.params.max_tokens


@dataclass(frozen=True, slots=True)
class ContiguousReservation:
    """A reservation policy (scheduler/reservation.py): admission takes `reserved_tokens` per sequence, within the
    worker's capacity, or waits."""
    reserved_tokens: Callable[[RequestState, int], int]  # (request, max_model_len) → tokens a sequence reserves

    def _blocks(self, ws: WorkerScheduler, rs: RequestState) -> int:
        """Blocks each sequence of the request reserves."""
        share = ws.stats().num_blocks // max(1, len(rs.live_samples))
        max_model_len = ws.reg.max_model_len
        tokens = min(self.reserved_tokens(rs, max_model_len), max_model_len, share * ws.reg.block_size)
        return ws.kv.num_blocks_for(tokens)

    def admits(self, ws: WorkerScheduler, rs: RequestState, keep_free: int) -> bool:
        return self._blocks(ws, rs) * len(rs.live_samples) + keep_free <= ws.stats().free_blocks

    def started(self, ws: WorkerScheduler, rs: RequestState) -> None:
        self._top_up(ws, rs)

    def forked(self, ws: WorkerScheduler, rs: RequestState) -> None:
        self._top_up(ws, rs)

    def _top_up(self, ws: WorkerScheduler, rs: RequestState) -> None:
        """Extend each sequence's table to its reservation (blocks no token writes yet); admission made room
        for every sample's, so only forked samples can find too few blocks left, and grow on demand then."""
        bs = ws.reg.block_size
        for seq in rs.seqs:
            held = ws.kv.table_len(seq.seq_id)
            more = self._blocks(ws, rs) - held
            if more > 0 and ws.kv.allocate_slots(Growth(writes=[Write(seq.seq_id, held * bs, more * bs)])):
                seq.resend_table = True  # the worker learns of the blocks with the sequence's next chunk


RESERVATIONS: dict[str, Callable[[RequestState, int], int]] = {
    "max": max_model_len_tokens,
    "pow2": pow2_tokens,
    "oracle": oracle_tokens,
}


def reserving_scheduler(reservation: str = "max") -> WorkerSchedulerFactory:
    """The per-worker scheduler with that contiguous reservation (with or without async scheduling, as the
    settings it is given say)."""
    return functools.partial(WorkerScheduler, reservation=ContiguousReservation(RESERVATIONS[reservation]))


@dataclass(slots=True)
class Completion:
    token_ids: list[int]
    finish_reason: str  # "length" | "stop"


@dataclass(slots=True)
class PendingRequest:
    prompt_ids: list[int]
    max_tokens: int
    ignore_eos: bool
    done: asyncio.Future = field(repr=False)


class StaticBatchGenerator:
    """transformers' model and `generate` over one padded batch; no I/O."""

    def __init__(self, model_dir: Path, device: str, dtype: str) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        config = read_config(model_dir)
        self.torch = torch
        self.max_model_len = max_model_len(config)
        self.vocab_size = int(config.get("text_config", config)["vocab_size"])
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).to(device).eval()
        self.device = device
        self.eos_ids = set(eos_token_ids(model_dir))
        pad = self.tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else min(self.eos_ids, default=0)

    def encode(self, prompt: str) -> list[int]:
        return self.tokenizer.encode(prompt, add_special_tokens=True)

    def generate(self, prompts: list[list[int]], max_tokens: list[int], ignore_eos: bool) -> list[Completion]:
        """Greedy-decode the batch to its longest max_tokens; each request keeps its own share."""
        torch = self.torch
        width = max(len(p) for p in prompts)
        input_ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, prompt in enumerate(prompts):  # left padding: every prompt ends where generation starts
            input_ids[row, width - len(prompt):] = torch.tensor(prompt)
            mask[row, width - len(prompt):] = 1
        steps = max(max_tokens)
        with torch.inference_mode():
            out = self.model.generate(input_ids=input_ids.to(self.device), attention_mask=mask.to(self.device),
                                      max_new_tokens=steps, min_new_tokens=steps if ignore_eos else 0,
                                      do_sample=False, pad_token_id=self.pad_id)
        completions = []
        for row, limit in enumerate(max_tokens):
            tokens = out[row, width:width + limit].tolist()
            stop = None if ignore_eos else next((i for i, t in enumerate(tokens) if t in self.eos_ids), None)
            if stop is None:
                completions.append(Completion(tokens, "length"))
            else:
                completions.append(Completion(tokens[:stop + 1], "stop"))
        return completions

    def text_deltas(self, token_ids: list[int]) -> list[str]:
        """One text piece per token; a token that ends inside a multi-byte character yields "" and its text
        comes with a later token (the usual incremental detokenization); the last token flushes the rest."""
        deltas, prefix, read = [], 0, 0
        last = len(token_ids) - 1
        for i in range(len(token_ids)):
            before = self.tokenizer.decode(token_ids[prefix:read], skip_special_tokens=True)
            after = self.tokenizer.decode(token_ids[prefix:i + 1], skip_special_tokens=True)
            if len(after) > len(before) and (i == last or not after.endswith("\ufffd")):
                deltas.append(after[len(before):])
                prefix, read = read, i + 1
            else:
                deltas.append("")
        return deltas


def take_static_batch(waiting: list[PendingRequest], max_batch_size: int,
                      kv_budget_tokens: int) -> list[PendingRequest]:
    """The head of the queue and the next waiting requests of its ignore_eos kind, first come first served,
    while the padded batch fits: at most max_batch_size rows and, if kv_budget_tokens > 0, rows * (longest
    prompt + longest max_tokens) <= kv_budget_tokens. The head always goes (alone if it must)."""
    head = waiting[0]
    batch: list[PendingRequest] = []
    width = steps = 0
    for r in waiting:
        if r.ignore_eos != head.ignore_eos:
            continue
        w, s = max(width, len(r.prompt_ids)), max(steps, r.max_tokens)
        over_budget = kv_budget_tokens and (len(batch) + 1) * (w + s) > kv_budget_tokens
        if len(batch) == max_batch_size or (batch and over_budget):
            break
        batch.append(r)
        width, steps = w, s
    return batch
