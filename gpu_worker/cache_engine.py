"""The physical KV cache: per-layer key/value block tensors on the device and a swap area in host memory.

The scheduler decides which block holds what; this only moves bytes when a plan says so.
"""
from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Callable

import torch

from shared.settings import Settings


class CacheSizeError(ValueError):
    """The memory given to the KV cache holds fewer than the two blocks a worker needs (null block + one)."""


def kv_cache_blocks(settings: Settings, block_bytes: int, gpu_budget: Callable[[], float] | None) -> int:
    """The KV blocks a worker gets: the num_blocks setting if given, else what the bytes `gpu_budget()` leaves hold
    (a GPU), else kv_cache_bytes (the CPU)."""
    if settings.num_blocks > 0:
        num_blocks = settings.num_blocks
    elif gpu_budget is not None:
        num_blocks = int(gpu_budget() // block_bytes)
    else:
        num_blocks = settings.kv_cache_bytes // block_bytes
    if num_blocks < 2:
        raise CacheSizeError(
            f"the KV cache holds {max(num_blocks, 0)} blocks of {block_bytes} bytes; a worker needs at least 2: "
            "raise kv_cache_bytes (CPU) or gpu_memory_utilization (GPU), or set num_blocks")
    return num_blocks


@dataclass(slots=True)
class CacheShape:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    @property
    def block_bytes(self) -> int:
        """Bytes one block takes over all layers, keys and values."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * elem


class CacheEngine:
    def __init__(self, shape: CacheShape, num_blocks: int, num_swap_blocks: int, device: torch.device,
                 backend: ModuleType) -> None:
        self.shape = shape
        self.num_blocks = num_blocks
        self.num_swap_blocks = num_swap_blocks
        self.device = device
        self.backend = backend
        dims = (shape.block_size, shape.num_kv_heads, shape.head_dim)
        self.key_caches = [torch.zeros((num_blocks, *dims), dtype=shape.dtype, device=device)
                           for _ in range(shape.num_layers)]
        self.value_caches = [torch.zeros((num_blocks, *dims), dtype=shape.dtype, device=device)
                             for _ in range(shape.num_layers)]
        # pinned host memory makes device↔host copies fast; it only exists alongside CUDA
        pin = device.type == "cuda"
        self.swap_key_caches = [torch.zeros((num_swap_blocks, *dims), dtype=shape.dtype, pin_memory=pin)
                                for _ in range(shape.num_layers)]
        self.swap_value_caches = [torch.zeros((num_swap_blocks, *dims), dtype=shape.dtype, pin_memory=pin)
                                  for _ in range(shape.num_layers)]

    @property
    def kv_caches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return list(zip(self.key_caches, self.value_caches))

    def copy(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write: device block dst becomes a copy of device block src, in every layer."""
        if pairs:
            mapping = torch.tensor(pairs, dtype=torch.int64, device=self.device)
            self.backend.copy_blocks(self.key_caches, self.value_caches, mapping)

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """(device block, swap block) pairs: save device blocks to host memory."""
        self._move(pairs, (self.key_caches, self.value_caches), (self.swap_key_caches, self.swap_value_caches))

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """(swap block, device block) pairs: bring saved blocks back to the device."""
        self._move(pairs, (self.swap_key_caches, self.swap_value_caches), (self.key_caches, self.value_caches))

    @staticmethod
    def _move(pairs: list[tuple[int, int]], sources: tuple[list[torch.Tensor], ...],
              targets: tuple[list[torch.Tensor], ...]) -> None:
        if not pairs:
            return
        src = torch.tensor([p[0] for p in pairs], dtype=torch.int64)
        dst = torch.tensor([p[1] for p in pairs], dtype=torch.int64)
        for source_layers, target_layers in zip(sources, targets):
            for source, target in zip(source_layers, target_layers):
                rows = source.index_select(0, src.to(source.device))
                target.index_copy_(0, dst.to(target.device), rows.to(target.device))
