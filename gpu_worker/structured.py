"""Constrained sequences on the worker: each one's place in its grammar, and the token masks that keep it there.

A sequence's matcher is rebuilt from its output tokens whenever it starts here (new, recomputed after preemption,
moved after a worker died, resumed by a new scheduler): `follow` replays what it has not consumed yet, so the masks,
and with them a greedy or seeded sequence's tokens, are the same as if nothing had happened. Compiling, replaying
and masking run on a thread of their own while the model computes the step. Compiled grammars are
kept by constraint and copied for each sequence (a copy is far cheaper than a compile: RESULTS.md).
"""
from __future__ import annotations

import ctypes
import logging
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from kernels import native
from shared import constraints
from shared.sampling import Constraint

log = logging.getLogger(__name__)
MAX_GRAMMARS = 256  # compiled grammars kept, the least recently used dropped first
_BITS = torch.arange(32, dtype=torch.int32)


class GrammarError(ValueError):
    """A constrained sequence that cannot go on: its grammar does not compile, or rejects one of its tokens."""


class SequenceGrammar:
    """One sequence's matcher, how many of its output tokens it has consumed, and the tokens it allows next.

    Its work for a step (compiling its grammar the first time, consuming the tokens since the last step, the mask)
    runs on the worker's grammar thread while the model computes (`Grammars.prepare`); the sampler waits for it
    (`wait`). A failure leaves every token allowed and says why in `error`: the worker fails that sequence alone."""

    def __init__(self, constraint: Constraint, vocab_size: int) -> None:
        self.constraint = constraint
        self.matcher: Any = None  # compiled on the grammar thread, the first time it is needed
        self.consumed = 0
        self.words = torch.zeros((vocab_size + 31) // 32, dtype=torch.int32)  # bit t of word t // 32: token t
        self.job: Future | None = None
        self.error: str | None = None

    def follow(self, output_token_ids: list[int]) -> None:
        """Consume the output tokens the matcher has not seen (sampled here, replayed after a restart)."""
        for token in output_token_ids[self.consumed:]:
            if not self.matcher.consume_token(token):
                raise GrammarError(f"the output's token {token} breaks its constraint: {self.matcher.get_error()}")
            self.consumed += 1

    def prepare(self, grammars: "Grammars", output_token_ids: list[int]) -> None:
        """Catch up with the output, then work out which tokens may come next (into `words`)."""
        try:
            if self.matcher is None:
                self.matcher = grammars.matcher(self.constraint)
            self.follow(output_token_ids)
            self.matcher.unsafe_compute_mask_ptr(self.words.data_ptr(), self.words.numel() * 4)
            if self.matcher.is_error():
                raise GrammarError(f"the constraint failed: {self.matcher.get_error()}")
        except Exception as e:  # noqa: BLE001 - whatever a grammar raises fails its sequence alone, never the step
            self.error = str(e) if isinstance(e, GrammarError) else f"the grammar failed: {type(e).__name__}: {e}"
            self.words.fill_(-1)

    def wait(self) -> None:
        if self.job is not None:
            self.job.result()
            self.job = None


class Grammars:
    """The worker's compiled grammars, for its model's tokenizer (llguidance's view of it is built when the worker
    loads, about a second for a large vocabulary, so that no step waits for it)."""

    def __init__(self, model_dir: Path, vocab_size: int, eos_token_ids: list[int]) -> None:
        self.vocab_size = vocab_size
        self.compiled: OrderedDict[Constraint, Any] = OrderedDict()  # used on the grammar thread alone
        # llguidance lets go of the GIL while it compiles and computes masks
        self.thread = ThreadPoolExecutor(1, thread_name_prefix="grammars")
        self.unusable: str | None = None  # why this model's tokenizer cannot be constrained, if it cannot
        try:
            self.tokenizer = constraints.tokenizer(_tokenizer_json(model_dir), vocab_size, eos_token_ids)
        except (ValueError, RuntimeError, OSError) as e:
            self.tokenizer, self.unusable = None, f"llguidance cannot read this model's tokenizer: {e}"
            log.warning("structured outputs are off on this worker: %s", self.unusable)

    def matcher(self, constraint: Constraint) -> Any:
        """A fresh matcher of `constraint`: a copy of its compiled grammar, compiled now if it is not cached."""
        from llguidance import LLMatcher

        if self.tokenizer is None:
            raise GrammarError(self.unusable)
        template = self.compiled.get(constraint)
        if template is None:
            try:
                template = LLMatcher(self.tokenizer, constraints.grammar(constraint), limits=constraints.limits(),
                                     log_level=0)
            except constraints.ConstraintError as e:
                raise GrammarError(f"the constraint does not compile: {e}") from None
            if template.is_error():
                raise GrammarError(f"the constraint does not compile: {template.get_error()}")
            self.compiled[constraint] = template
            if len(self.compiled) > MAX_GRAMMARS:
                self.compiled.popitem(last=False)
        self.compiled.move_to_end(constraint)
        return template.deep_copy()

    def prepare(self, sampling: list[tuple[SequenceGrammar, list[int]]]) -> None:
        """Start each grammar's work for this step (its output so far) on the grammar thread: it runs while the
        model computes, and no step waits for a compile unless the compile outlasts the forward pass."""
        for grammar, output in sampling:
            grammar.job = self.thread.submit(grammar.prepare, self, output)


def _tokenizer_json(model_dir: Path) -> str:
    """The model's tokenizer as `tokenizer.json` text (a checkpoint with only a slow tokenizer: converted)."""
    path = model_dir / "tokenizer.json"
    if path.is_file():
        return path.read_text()
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir, local_files_only=True).backend_tokenizer.to_str()


def mask_disallowed(logits: torch.Tensor, rows: list[int], grammars: list[SequenceGrammar],
                    kernel: ctypes.CDLL | None) -> None:
    """Set the logits of the tokens each row's grammar does not allow next (SequenceGrammar.prepare) to -inf: in
    place by kernels/cpu_mask.c on the CPU with `kernel` (kernels/native.py's library), else by unpacking the bits
    with torch."""
    vocab = logits.shape[1]
    for g in grammars:
        g.wait()
    words = torch.stack([g.words for g in grammars])
    if (kernel is not None and logits.device.type == "cpu" and logits.dtype in native.DTYPE_CODES
            and logits.stride(-1) == 1):
        index = torch.tensor(rows, dtype=torch.int64)
        kernel.rows_mask_bits(native.DTYPE_CODES[logits.dtype], logits.data_ptr(), logits.stride(0), vocab, len(rows),
                              index.data_ptr(), words.data_ptr(), words.shape[1])
        return
    allowed = ((words.unsqueeze(-1) >> _BITS) & 1).view(len(rows), -1)[:, :vocab].bool()
    index = torch.tensor(rows)
    logits[index] = logits[index].masked_fill(~allowed.to(logits.device), float("-inf"))
