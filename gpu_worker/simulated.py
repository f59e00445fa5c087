"""A simulated device for the worker core: step times from the cost model, tokens from a hash.

`SimulatedRunner` has the `Runner` protocol of gpu_worker/worker.py, so the real worker core (and with it
the real worker service: registration, heartbeats, plans, results, swaps, copies, failure paths) runs on
it unchanged. Per step it asks the profile's cost model how long the plan takes (gpu_worker/cost_model.py).
When pacing, a GPU step is device time: the runner sleeps until that much wall time has passed since the
step began. A CPU step is CPU work: the runner burns that much of its thread's CPU time, so that it
stretches as the real worker's step does when other processes want the cores. Without pacing it returns at
once, and a discrete-event driver advances its own clock by `last_step_s`.

Its tokens are a pure function of the request: a 64-bit rolling hash of the sequence's tokens so far (and,
for a sampled request, its seed, or 0 without one, and its sample index), mod the vocabulary, never an EOS
id. So greedy outputs do not depend on batching, preemption or the worker, and the exactly-once checks of
the real stack hold. The logprobs it reports are those of a uniform distribution over the vocabulary.
"""
from __future__ import annotations

import itertools
import math
import time

from gpu_worker.cache_engine import kv_cache_blocks
from gpu_worker.cost_model import ChunkSize, Profile, get_profile
from gpu_worker.sampler import SampledToken, StepToken
from gpu_worker.sequence import Chunk, SequenceState
from gpu_worker.speculation import verified
from gpu_worker.worker import Worker
from shared import model_dir as model_dirs
from shared.protocol import WorkerRegistration
from shared.sampling import SamplingParams
from shared.settings import Settings

MASK = (1 << 64) - 1


def mix(x: int) -> int:
    """splitmix64's finalizer: a bijection of 64-bit ints that spreads every input bit over the output."""
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK
    return x ^ (x >> 31)


def extend_hash(h: int, token_ids: list[int]) -> int:
    for t in token_ids:
        h = mix((h + t + 0x9E3779B97F4A7C15) & MASK)
    return h


def sample_salt(params: SamplingParams, sample_index: int) -> int:
    """0 for greedy requests (every sample the same, as greedy decoding gives); else the seed and the sample."""
    if params.greedy:
        return 0
    return mix(((params.seed or 0) + 1) & MASK) ^ mix((sample_index + 1) << 32)


class BlockMoves:
    """The runner's `cache`: block moves touch no memory here; they count toward the step's time."""

    def __init__(self) -> None:
        self.swapped = 0
        self.copied = 0

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        self.swapped += len(pairs)

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        self.swapped += len(pairs)

    def copy(self, pairs: list[tuple[int, int]]) -> None:
        self.copied += len(pairs)


class SimulatedRunner:
    def __init__(self, profile: Profile, vocab_size: int, block_size: int, pace: bool = True) -> None:
        self.profile = profile
        self.vocab_size = vocab_size
        self.block_size = block_size
        self.pace = pace
        self.cpu = profile.device.kind == "cpu"
        self.cache = BlockMoves()
        self.last_step_s = 0.0
        # seq id → (rid, tokens hashed, hash): the next step extends the hash by the tokens since, instead of
        # hashing the whole sequence again. Kept for the sequences of the last step only.
        self._hashes: dict[int, tuple[str, int, int]] = {}

    def execute(self, chunks: list[Chunk], eos_token_ids: list[int],
                drafts: dict[int, list[int]]) -> list[StepToken]:
        started = self._clock()
        sampled = [seq for seq, computed, new in chunks if computed + new == len(seq.token_ids)]
        self.last_step_s = self.profile.step_time(
            [ChunkSize(computed, new + len(drafts.get(seq.seq_id, ()))) for seq, computed, new in chunks],
            len(sampled) + sum(map(len, drafts.values())), self.cache.swapped, self.cache.copied, self.block_size)
        self.cache.swapped = self.cache.copied = 0
        eos = set(eos_token_ids)
        hashes: dict[int, tuple[str, int, int]] = {}
        rows = []
        for seq in sampled:
            h = self._sequence_hash(seq)
            hashes[seq.seq_id] = (seq.rid, len(seq.token_ids), h)
            salt = sample_salt(seq.params, seq.sample_index)
            rows.append(self._token(h ^ salt, seq.params, eos))
            for token in drafts.get(seq.seq_id, ()):
                h = extend_hash(h, [token])
                rows.append(self._token(h ^ salt, seq.params, eos))
        self._hashes = hashes
        if self.pace:
            self._wait_until(started + self.last_step_s)
        return verified(sampled, drafts, rows)

    def _clock(self) -> float:
        """What a step's time is counted in: the thread's CPU time on a CPU device, wall time on a GPU."""
        return time.thread_time() if self.cpu else time.perf_counter()

    def _wait_until(self, until: float) -> None:
        if not self.cpu:
            time.sleep(max(0.0, until - time.perf_counter()))
            return
        while time.thread_time() < until:  # CPU work: spin until this thread has spent it
            pass

    def _sequence_hash(self, seq: SequenceState) -> int:
        rid, length, h = self._hashes.get(seq.seq_id, ("", 0, 0))
        if rid != seq.rid or length > len(seq.token_ids):
            length, h = 0, 0
        return extend_hash(h, seq.token_ids[length:])

    def _token(self, h: int, params: SamplingParams, eos: set[int]) -> SampledToken:
        token = mix(h) % self.vocab_size
        while token in eos:
            token = (token + 1) % self.vocab_size
        if params.logprobs is None:
            return SampledToken(token)
        logprob = -math.log(self.vocab_size)
        # The most likely tokens, all equally so: the chosen one and those after it, no EOS (beam search takes
        # its candidates from here).
        ids = (t % self.vocab_size for t in range(token, token + self.vocab_size))
        top = [(t, logprob) for t in itertools.islice((t for t in ids if t not in eos), params.logprobs)]
        return SampledToken(token, logprob, top)


def simulated_worker(profile: Profile, settings: Settings, worker_id: str, model_id: str, max_model_len: int,
                     vocab_size: int, eos_token_ids: list[int], pace: bool = True) -> Worker:
    """A worker core on a simulated device, its KV cache sized as the real worker would size it there: the
    num_blocks setting if given, else what the device's memory leaves (GPU) or kv_cache_bytes (CPU)."""
    block_bytes = profile.model.kv_bytes_per_token * settings.block_size

    def gpu_budget() -> float:
        return profile.kv_cache_bytes(settings.gpu_memory_utilization, settings.max_num_batched_tokens,
                                      settings.max_num_seqs)

    num_blocks = kv_cache_blocks(settings, block_bytes, gpu_budget if profile.device.kind == "cuda" else None)
    runner = SimulatedRunner(profile, vocab_size, settings.block_size, pace)
    return Worker(runner, WorkerRegistration(
        worker_id=worker_id, model_id=model_id, num_blocks=num_blocks,
        num_swap_blocks=settings.swap_space_bytes // block_bytes, block_size=settings.block_size,
        max_model_len=max_model_len, eos_token_ids=list(eos_token_ids), vocab_size=vocab_size,
        batch_invariant=True),  # its tokens are a hash of the sequence's
        speculation=settings.speculation)


def load(settings: Settings, worker_id: str) -> Worker:
    """The worker service's simulated worker (`--simulate PROFILE`). The served model directory (the built-in
    tiny model unless `--model` names one) gives what the gateway sees too: the model id, the vocabulary its
    tokenizer decodes, the EOS ids and max_model_len; no weights are read. The profile gives the step times
    and the KV capacity."""
    profile = get_profile(settings.simulate)
    model_dir = model_dirs.resolve_model_dir(settings.model, weights=False)
    path = model_dir.path
    config = model_dirs.read_config(path)
    vocab = model_dirs.vocab_size(config)
    if vocab is None or vocab < 2:
        raise model_dirs.ModelDirError(f"{path}/config.json gives no vocab_size for the simulated worker's tokens")
    model_id = model_dir.served_name(settings.served_model_name)
    max_len = model_dirs.max_model_len(config, settings.max_model_len)
    return simulated_worker(profile, settings, worker_id, model_id, max_len, vocab, model_dirs.eos_token_ids(path))
