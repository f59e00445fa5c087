"""Facts about a local Hugging Face model directory, read from its JSON files (no torch, no network)."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

TINY_MODEL_NAME = "pagedserve-tiny-llama"
_POSITION_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")


class ModelDirError(ValueError):
    """The model directory is missing or lacks what pagedserve needs; the message says what."""


def default_model_dir() -> Path:
    """Where the built-in tiny model lives (written on first use by `pagedserve up` / `tiny-model`)."""
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "pagedserve" / TINY_MODEL_NAME


def resolve_model_dir(model: str) -> Path:
    path = Path(model).expanduser() if model else default_model_dir()
    if not (path / "config.json").is_file():
        hint = "run `pagedserve tiny-model DIR` to write the built-in model" if not model else \
            "pass a local Hugging Face checkpoint directory (pagedserve never downloads weights)"
        raise ModelDirError(f"no config.json in model directory {path}: {hint}")
    return path


def read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise ModelDirError(f"cannot read {path}: {e}") from None
    if not isinstance(data, dict):
        raise ModelDirError(f"{path} does not hold a JSON object")
    return data


def read_config(model_dir: Path) -> dict[str, Any]:
    return read_json(model_dir / "config.json")


def served_model_name(model_dir: Path, served_name: str = "") -> str:
    return served_name or model_dir.resolve().name


def eos_token_ids(model_dir: Path) -> list[int]:
    """End-of-sequence ids: generation_config.json first (it may list several), then config.json."""
    for name in ("generation_config.json", "config.json"):
        path = model_dir / name
        if path.is_file():
            eos = read_json(path).get("eos_token_id")
            if eos is not None:
                return sorted({int(e) for e in (eos if isinstance(eos, list) else [eos])})
    return []


def vocab_size(config: dict[str, Any]) -> int | None:
    """The model's vocabulary size as its config states it (a multimodal config's in `text_config`), or None."""
    vocab = config.get("text_config", config).get("vocab_size")
    return vocab if isinstance(vocab, int) else None


def max_model_len(config: dict[str, Any], requested: int = 0) -> int:
    """The longest sequence served: the model's position limit, or `requested` if that is smaller."""
    text = config.get("text_config", config)
    limit = next((int(text[k]) for k in _POSITION_KEYS if isinstance(text.get(k), int)), 0)
    if limit <= 0:
        if requested <= 0:
            raise ModelDirError("the model config gives no position limit; set max_model_len")
        return requested
    if requested > limit:
        raise ModelDirError(f"max_model_len {requested} exceeds the model's limit of {limit} positions")
    return requested or limit
