"""Paged-attention kernels: Triton for CUDA, a pure-torch reference with the same semantics elsewhere.

`attention_backend(name, device_type)` is the one dispatch; every backend module exposes
`store_kv`, `paged_attention` and `copy_blocks` with the signatures of `kernels.reference`.
"""
from __future__ import annotations

import importlib
from types import ModuleType

BACKENDS = {"torch": "kernels.reference", "triton": "kernels.triton_ops"}


def attention_backend(name: str = "auto", device_type: str = "cpu") -> ModuleType:
    if name == "auto":
        name = "triton" if device_type == "cuda" else "torch"
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose one of auto, {', '.join(BACKENDS)}")
    return importlib.import_module(BACKENDS[name])
