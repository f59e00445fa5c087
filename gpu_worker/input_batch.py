"""Flatten one step's scheduled chunks (prefill chunks and decode tokens of many sequences) into the
tensors of a single forward pass."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from gpu_worker.sequence import Chunk


@dataclass(slots=True)
class StepInputs:
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    slot_mapping: torch.Tensor  # [num_tokens] int64
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32, padded with the null block 0
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    seq_lens: torch.Tensor  # [num_seqs] int32
    logits_indices: torch.Tensor  # [num_sampled] int64: rows whose hidden states become logits
    sampled: list[int]  # index in the step's chunk list of each sampled row's sequence (a drafting one's repeated)


def prepare_inputs(chunks: list[Chunk], block_size: int, device: torch.device,
                   drafts: dict[int, list[int]] | None = None) -> StepInputs:
    """`chunks` = (sequence, num_computed_tokens, num_new_tokens) in plan order.

    Only a chunk that reaches its sequence's last token is sampled, from that token's row. A sequence with a draft
    (seq id → proposed tokens) has them after its chunk, and each of its rows is sampled (speculative decoding).
    """
    drafts = drafts or {}
    num_seqs = len(chunks)
    computed = np.fromiter((c for _, c, _ in chunks), dtype=np.int64, count=num_seqs)
    new = np.fromiter((n + len(drafts.get(seq.seq_id, ())) for seq, _, n in chunks), dtype=np.int64, count=num_seqs)
    query_start_loc = np.zeros(num_seqs + 1, dtype=np.int64)
    np.cumsum(new, out=query_start_loc[1:])
    seq_of_token = np.repeat(np.arange(num_seqs), new)
    positions = np.arange(int(query_start_loc[-1])) - query_start_loc[seq_of_token] + computed[seq_of_token]

    width = max(len(seq.block_table) for seq, _, _ in chunks)
    block_tables = np.zeros((num_seqs, width), dtype=np.int32)
    input_ids: list[int] = []
    sampled: list[int] = []
    rows: list[int] = []
    for i, (seq, start, count) in enumerate(chunks):
        block_tables[i, :len(seq.block_table)] = seq.block_table
        input_ids.extend(seq.token_ids[start:start + count])
        if start + count == len(seq.token_ids):
            draft = drafts.get(seq.seq_id, ())
            input_ids.extend(draft)
            last = int(query_start_loc[i + 1])
            sampled.extend([i] * (len(draft) + 1))
            rows.extend(range(last - len(draft) - 1, last))
    slots = block_tables[seq_of_token, positions // block_size].astype(np.int64) * block_size + positions % block_size

    def put(array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        return torch.from_numpy(array).to(device=device, dtype=dtype)

    return StepInputs(
        input_ids=torch.tensor(input_ids, dtype=torch.int64, device=device),
        positions=put(positions, torch.int64),
        slot_mapping=put(slots, torch.int64),
        block_tables=put(block_tables, torch.int32),
        query_start_loc=put(query_start_loc, torch.int32),
        seq_lens=put(computed + new, torch.int32),
        logits_indices=torch.tensor(rows, dtype=torch.int64, device=device),
        sampled=sampled,
    )
