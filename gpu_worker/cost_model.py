"""How long one step takes on a simulated device: a roofline over the plan, from the model's shape.

A step's time is a fixed overhead, a per-sequence overhead, and for each phase the larger of its FLOP time
and its memory time (whichever bounds it on that device):
- dense layers: FLOPs 2 x (per-token layer parameters x tokens + lm_head parameters x sampled rows); bytes:
  the layers' and the lm_head's weights, read once per step whatever the batch;
- attention: FLOPs 4 x layers x query heads x head_dim x, per sequence, new x (context + (new + 1) / 2) (QK^T
  and PV under the causal mask); bytes: the K and V of each sequence's context read once, its new ones written;
- block moves: swapped blocks over the host link, copied blocks read and written in device memory.
FLOP times divide by peak FLOPs x an efficiency, memory times by bandwidth x an efficiency. Biases, norms,
activations and the embedding lookup are left out (well under 1 % of either side for the models here).

Profiles (gpu_worker/profiles.json) pair a device with a model and the efficiencies; each part names its
source: a datasheet, a paper, a model's config.json, a measurement, or an assumption.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

PROFILES_PATH = Path(__file__).with_name("profiles.json")
# Bytes of float32 logits per sampled row, twice (the logits and their softmax), in the activation estimate.
LOGIT_BYTES = 2 * 4


class ProfileError(ValueError):
    """An unknown profile name, or a profiles file that does not hold what a profile needs."""


class ChunkSize(NamedTuple):
    """A sequence's part of a step, as the cost model sees it."""
    context: int  # tokens its cache already holds
    new: int  # tokens the step computes


class StepWork(NamedTuple):
    dense_flops: float
    attention_flops: float
    kv_bytes: float  # read and written


@dataclass(slots=True, frozen=True)
class Device:
    name: str
    kind: str  # "cuda": the KV cache is what memory leaves; "cpu": it is the kv_cache_bytes setting
    memory_bytes: int
    peak_flops: float  # dense, in the model's dtype
    memory_bandwidth: float  # bytes/s
    host_bandwidth: float  # bytes/s between device and host memory (swaps)
    source: str


@dataclass(slots=True, frozen=True)
class ModelShape:
    name: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_model_len: int
    dtype_bytes: int
    gated_mlp: bool  # Llama's gate/up/down (3 matrices) or OPT's fc1/fc2 (2)
    tied_embeddings: bool  # the lm_head is the input embedding
    learned_positions: int  # rows of a learned position table (OPT), 0 for RoPE
    source: str

    @property
    def layer_params(self) -> int:
        """Weights one token multiplies through in one layer (attention projections and MLP)."""
        h = self.hidden_size
        attention = h * self.num_heads * self.head_dim * 2 + h * self.num_kv_heads * self.head_dim * 2
        return attention + (3 if self.gated_mlp else 2) * h * self.intermediate_size

    @property
    def lm_head_params(self) -> int:
        return self.hidden_size * self.vocab_size

    @property
    def num_params(self) -> int:
        embeddings = self.lm_head_params * (1 if self.tied_embeddings else 2)
        return self.num_layers * self.layer_params + embeddings + self.learned_positions * self.hidden_size

    @property
    def weight_bytes(self) -> int:
        """Every weight, resident in device memory."""
        return self.num_params * self.dtype_bytes

    @property
    def step_read_bytes(self) -> int:
        """The weights a step reads whole: the layers' and the lm_head (embedding rows are gathered per token)."""
        return (self.num_layers * self.layer_params + self.lm_head_params) * self.dtype_bytes

    def step_work(self, chunks: list[ChunkSize], num_sampled: int) -> StepWork:
        """One step's work: `chunks` per sequence, `num_sampled` of which produce logits."""
        tokens = sum(new for _, new in chunks)
        dense_flops = 2 * (self.num_layers * self.layer_params * tokens + self.lm_head_params * num_sampled)
        attention_flops = 4 * self.num_layers * self.num_heads * self.head_dim * sum(
            new * (context + (new + 1) / 2) for context, new in chunks)
        kv_bytes = self.kv_bytes_per_token * sum(context + 2 * new for context, new in chunks)
        return StepWork(dense_flops, attention_flops, kv_bytes)

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes


@dataclass(slots=True, frozen=True)
class Efficiency:
    matmul: float  # achieved share of peak FLOPs in the dense layers
    attention: float  # ... in attention
    bandwidth: float  # achieved share of memory bandwidth (and of the host link)
    step_overhead_s: float  # per step: scheduling, input preparation, launches
    seq_overhead_s: float  # per sequence in a step
    source: str


@dataclass(slots=True, frozen=True)
class Profile:
    name: str
    device: Device
    model: ModelShape
    efficiency: Efficiency
    description: str

    def activation_bytes(self, max_num_batched_tokens: int, max_num_seqs: int) -> int:
        """Peak working memory of the largest step: hidden states and projections of every token, logits of
        every sampled row."""
        m = self.model
        per_token = (4 * m.hidden_size + 2 * m.intermediate_size) * m.dtype_bytes
        rows = min(max_num_seqs, max_num_batched_tokens)
        return max_num_batched_tokens * per_token + rows * m.vocab_size * LOGIT_BYTES

    def kv_cache_bytes(self, gpu_memory_utilization: float, max_num_batched_tokens: int, max_num_seqs: int) -> int:
        """What memory leaves for the KV cache, as the real worker sizes it on a GPU: the usable share of device
        memory, less the weights and the peak activations."""
        usable = self.device.memory_bytes * gpu_memory_utilization
        return int(usable - self.model.weight_bytes - self.activation_bytes(max_num_batched_tokens, max_num_seqs))

    def step_time(self, chunks: list[ChunkSize], num_sampled: int, swapped_blocks: int = 0,
                  copied_blocks: int = 0, block_size: int = 16) -> float:
        """Seconds for one step: `chunks` per sequence, `num_sampled` of which produce logits; plus the plan's
        block moves."""
        m, d, e = self.model, self.device, self.efficiency
        flops_rate, bytes_rate = d.peak_flops, d.memory_bandwidth * e.bandwidth
        tokens = sum(new for _, new in chunks)
        dense_flops, attention_flops, kv_bytes = m.step_work(chunks, num_sampled)
        dense = max(dense_flops / (flops_rate * e.matmul), m.step_read_bytes / bytes_rate) if tokens else 0.0
        attention = max(attention_flops / (flops_rate * e.attention), kv_bytes / bytes_rate) if tokens else 0.0
        block_bytes = m.kv_bytes_per_token * block_size
        moves = (swapped_blocks * block_bytes / (d.host_bandwidth * e.bandwidth)
                 + 2 * copied_blocks * block_bytes / bytes_rate)
        overhead = e.step_overhead_s + e.seq_overhead_s * len(chunks) if chunks else 0.0
        return overhead + dense + attention + moves


def load_profiles(path: Path = PROFILES_PATH) -> dict[str, Profile]:
    """Every profile of the file, by name."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        devices = {name: Device(name=name, **spec) for name, spec in data["devices"].items()}
        models = {name: ModelShape(name=name, **spec) for name, spec in data["models"].items()}
        return {name: _profile(name, spec, devices, models) for name, spec in data["profiles"].items()}
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ProfileError(f"cannot read the profiles in {path}: {type(e).__name__}: {e}") from None


def _profile(name: str, spec: dict[str, Any], devices: dict[str, Device], models: dict[str, ModelShape]) -> Profile:
    return Profile(name=name, device=devices[spec["device"]], model=models[spec["model"]],
                   efficiency=Efficiency(**spec["efficiency"]), description=spec["description"])


def get_profile(name: str, path: Path = PROFILES_PATH) -> Profile:
    profiles = load_profiles(path)
    if name not in profiles:
        raise ProfileError(f"no simulation profile {name!r}; the profiles are: {', '.join(sorted(profiles))} "
                           f"(in {path})")
    return profiles[name]
