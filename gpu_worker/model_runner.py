"""The device side of a worker: the model, its paged KV cache and the sampler; one forward pass per step."""
from __future__ import annotations

import logging
import math
from pathlib import Path

import torch

from gpu_worker import cpu_paths, cpu_setup
from gpu_worker.cache_engine import CacheEngine, CacheShape, kv_cache_blocks
from gpu_worker.input_batch import prepare_inputs
from gpu_worker.loader import load_config, load_model, resolve_dtype
from gpu_worker.models.layers import ForwardContext, PagedAttention
from gpu_worker.sampler import Sampler, StepToken, top_logprobs
from gpu_worker.sequence import Chunk, SequenceState
from gpu_worker.speculation import draft_rows, verified
from kernels import attention_backend, backend_name, step_attention
from shared.model_dir import max_model_len, read_config
from shared.protocol import PromptLogprob
from shared.sampling import SamplingParams
from shared.settings import Settings

log = logging.getLogger(__name__)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device cuda was asked for, but torch sees no CUDA device")
    return torch.device(name)


class ModelRunner:
    def __init__(self, settings: Settings, model_dir: Path, progress: bool = True) -> None:
        self.settings = settings
        cpu_setup.apply(cpu_setup.Placement(settings.compute_threads, cpu_setup.parse_cores(settings.cpu_cores)))
        self.block_size = settings.block_size
        self.device = resolve_device(settings.device)
        if self.device.type == "cpu":
            cpu_setup.reuse_freed_memory()
        self.max_model_len = max_model_len(read_config(model_dir), settings.max_model_len)
        config = load_config(model_dir)
        self.dtype = resolve_dtype(settings.dtype, self.device, config)
        self.backend = attention_backend(settings.attention_backend, self.device.type)
        free_before, total = torch.cuda.mem_get_info(self.device) if self.device.type == "cuda" else (0, 0)
        self.model = load_model(model_dir, config, self.max_model_len, self.device, self.dtype, progress)
        layers = [m for m in self.model.modules() if isinstance(m, PagedAttention)]
        self.cache_shape = CacheShape(len(layers), layers[0].num_kv_heads, layers[0].head_dim, self.block_size,
                                      self.dtype)
        self.paths = None  # on a GPU: Triton's and cuBLAS's reductions change with the batch
        if self.device.type == "cpu":
            self.paths = cpu_paths.choose(settings.cpu_kernels, self.dtype,
                                          backend_name(settings.attention_backend, "cpu"), layers[0].head_dim,
                                          self.block_size)
            self.paths.apply(self.model)
            log.info(self.paths.describe())
        self.kernel = self.paths.kernel if self.paths else None  # the C kernels' library, for attention and sampling
        if settings.require_batch_invariance and not self.batch_invariant:
            raise RuntimeError(
                "require_batch_invariance is set, and this worker is not batch invariant "
                f"({self.paths.describe() if self.paths else 'a GPU'}): its greedy and seeded tokens could change "
                "with the batch, a preemption or a restart. Serve on the CPU with the C kernels (a C compiler, "
                "cpu_kernels not 'torch', the cpu attention backend) or unset require_batch_invariance")
        num_blocks = self._num_blocks(free_before, total)
        num_swap_blocks = settings.swap_space_bytes // self.cache_shape.block_bytes
        self.cache = CacheEngine(self.cache_shape, num_blocks, num_swap_blocks, self.device, self.backend)
        self.sampler = Sampler(self.device, kernel=self.kernel)
        log.info("KV cache: %d blocks of %d tokens (%.1f MiB), swap: %d blocks", num_blocks, self.block_size,
                 num_blocks * self.cache_shape.block_bytes / 2**20, num_swap_blocks)

    @property
    def batch_invariant(self) -> bool:
        """Whether a row's logits are the same bits in any batch (gpu_worker/cpu_paths.py)."""
        return self.paths is not None and self.paths.batch_invariant

    def _num_blocks(self, free_before: int, total: int) -> int:
        def gpu_budget() -> float:
            peak = self._profile_peak_bytes()
            log.info("GPU memory: %.2f GiB total, %.2f GiB used before loading, peak %.2f GiB while profiling",
                     total / 2**30, (total - free_before) / 2**30, peak / 2**30)
            return total * self.settings.gpu_memory_utilization - (total - free_before) - peak

        num_blocks = kv_cache_blocks(self.settings, self.cache_shape.block_bytes,
                                     gpu_budget if self.device.type == "cuda" else None)
        if (num_blocks - 1) * self.block_size < self.max_model_len:
            log.warning("the KV cache holds %d tokens, fewer than max_model_len %d: longer requests are refused",
                        (num_blocks - 1) * self.block_size, self.max_model_len)
        return num_blocks

    @torch.inference_mode()
    def _profile_peak_bytes(self) -> int:
        """Peak device memory of the largest step the scheduler may send (weights included)."""
        settings = self.settings
        num_tokens = min(settings.max_num_batched_tokens, settings.max_num_seqs * self.max_model_len)
        num_seqs = min(settings.max_num_seqs, num_tokens)
        lengths = [num_tokens // num_seqs + (i < num_tokens % num_seqs) for i in range(num_seqs)]
        blocks = [math.ceil(n / self.block_size) for n in lengths]
        probe = CacheEngine(self.cache_shape, sum(blocks) + 1, 0, self.device, self.backend)
        chunks, next_block = [], 1
        for n, b in zip(lengths, blocks):
            seq = SequenceState(-1, "profile", 0, SamplingParams(), [0] * n, n,
                                list(range(next_block, next_block + b)))
            chunks.append(Chunk(seq, 0, n))
            next_block += b
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        self._forward(chunks, probe)[0].float().softmax(dim=-1)
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        del probe
        torch.cuda.empty_cache()
        return peak

    @torch.inference_mode()
    def _forward(self, chunks: list[Chunk], cache: CacheEngine,
                 extra_rows: list[int] = (), drafts: dict[int, list[int]] | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """The logits of the rows sampled from, and of `extra_rows` (indices in the step's tokens), in the model's
        dtype (a greedy step need not widen them)."""
        inputs = prepare_inputs(chunks, self.block_size, self.device, drafts)
        attend = step_attention(self.backend, inputs.slot_mapping, inputs.block_tables, inputs.query_start_loc,
                                inputs.seq_lens, self.kernel)
        ctx = ForwardContext(cache.kv_caches, attend)
        hidden = self.model(inputs.input_ids, inputs.positions, ctx)
        rows = inputs.logits_indices
        if extra_rows:
            rows = torch.cat([rows, torch.tensor(extra_rows, dtype=rows.dtype, device=rows.device)])
        logits = self.model.compute_logits(hidden[rows])
        return logits[:len(inputs.logits_indices)], logits[len(inputs.logits_indices):]

    @torch.inference_mode()
    def execute(self, chunks: list[Chunk], eos_token_ids: list[int],
                drafts: dict[int, list[int]] | None = None) -> list[StepToken]:
        """One forward pass over `chunks` (sequence, num_computed, num_new); sample each chunk that ends its
        sequence, and append the prompt logprobs of the prompt positions a chunk covers to its sequence's (those
        that ask for them). A sequence with a draft (seq id → proposed tokens, after its last token) gets its
        verified tokens (gpu_worker/speculation.py). Returns (sequence, token) in chunk order, a sequence's tokens
        in order."""
        if not chunks:
            return []
        drafts = drafts or {}
        wanted, rows = _prompt_positions(chunks, drafts)
        logits, prompt_logits = self._forward(chunks, self.cache, rows, drafts)
        if wanted:
            _append_prompt_logprobs(wanted, prompt_logits)
        sampled = [seq for seq, computed, new in chunks if computed + new == len(seq.token_ids)]
        if not sampled:
            return []
        if not drafts:
            return [StepToken(seq, t) for seq, t in zip(sampled, self.sampler(logits, sampled, eos_token_ids))]
        rows_of = [row for seq in sampled for row in draft_rows(seq, drafts.get(seq.seq_id, []))]
        tokens = self.sampler(logits, rows_of, eos_token_ids)
        return verified(sampled, drafts, tokens)


def _prompt_positions(chunks: list[Chunk], drafts: dict[int, list[int]]
                      ) -> tuple[list[tuple[SequenceState, int]], list[int]]:
    """(sequence, position) of each prompt position whose next token's logprob is asked for, and its row among the
    step's tokens: the logits at position p give the logprob of prompt token p + 1."""
    wanted, rows, offset = [], [], 0
    for seq, start, count in chunks:
        if seq.prompt_logprobs is not None and len(seq.prompt_logprobs) == start:
            for p in range(start, min(start + count, seq.num_prompt_tokens - 1)):
                wanted.append((seq, p))
                rows.append(offset + p - start)
        offset += count + len(drafts.get(seq.seq_id, ()))
    return wanted, rows


def _append_prompt_logprobs(wanted: list[tuple[SequenceState, int]], logits: torch.Tensor) -> None:
    """Each position's next prompt token: its logprob under the model's raw distribution, its rank, and the top
    k (the sequence's `prompt_logprobs`)."""
    logprobs = logits.float().log_softmax(dim=-1)
    targets = torch.tensor([seq.token_ids[p + 1] for seq, p in wanted], device=logits.device)
    chosen = logprobs.gather(1, targets[:, None])
    ranks = ((logprobs > chosen).sum(dim=1) + 1).tolist()
    tops = top_logprobs(logprobs, [seq.params.prompt_logprobs for seq, _ in wanted])
    for (seq, _), lp, rank, top in zip(wanted, chosen[:, 0].tolist(), ranks, tops):
        seq.prompt_logprobs.append(PromptLogprob(lp, rank, top))
