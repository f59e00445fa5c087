"""Paged-attention kernels: Triton for CUDA, a CPU backend, and a pure-torch reference with the same semantics.

`attention_backend(name, device_type)` is the one dispatch; every backend module exposes
`store_kv`, `paged_attention` and `copy_blocks` with the signatures of `kernels.reference`.
`step_attention` gives one step's attention, which every layer calls to store its new keys and values and
attend; a backend that prepares what the layers share (indices, masks) once per step defines its own.
"""
from __future__ import annotations

import ctypes
import importlib
from types import ModuleType
from typing import Callable

import torch

BACKENDS = {"torch": "kernels.reference", "triton": "kernels.triton_ops", "cpu": "kernels.cpu_attention"}


def backend_name(name: str = "auto", device_type: str = "cpu") -> str:
    """The backend `name` stands for on `device_type` ("auto": Triton on CUDA, else the CPU's)."""
    if name == "auto":
        name = "triton" if device_type == "cuda" else "cpu"
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose one of auto, {', '.join(BACKENDS)}")
    return name


def attention_backend(name: str = "auto", device_type: str = "cpu") -> ModuleType:
    return importlib.import_module(BACKENDS[backend_name(name, device_type)])


# (query, key, value, key_cache, value_cache, scale) -> attention output: one layer's call in a step
Attention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]


def step_attention(backend: ModuleType, slot_mapping: torch.Tensor, block_tables: torch.Tensor,
                   query_start_loc: torch.Tensor, seq_lens: torch.Tensor, kernel: ctypes.CDLL | None = None
                   ) -> Attention:
    """One step's paged attention: each layer stores its new keys/values at `slot_mapping` and attends. `kernel`:
    kernels/native.py's library, for the CPU backend's C kernel (None: its torch path)."""
    own = getattr(backend, "step_attention", None)
    if own is not None:
        return own(slot_mapping, block_tables, query_start_loc, seq_lens, kernel)

    def attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
               value_cache: torch.Tensor, scale: float) -> torch.Tensor:
        backend.store_kv(key, value, key_cache, value_cache, slot_mapping)
        return backend.paged_attention(query, key_cache, value_cache, block_tables, query_start_loc, seq_lens, scale)
    return attend
