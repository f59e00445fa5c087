"""llama.cpp's GGUF files served as Hugging Face checkpoints.

A GGUF file is read with llama.cpp's own reader (the `gguf` package) and converted once into a checkpoint
directory under the cache, named for the file's sha256: `config.json` and `generation_config.json` mapped from
its metadata, the tokenizer and chat template through transformers' own GGUF tokenizer conversion, and, for a
worker, every tensor dequantized to float32 (`gguf.quants`) under its Hugging Face name, with the Q/K row
permutation llama.cpp applies to llama attention undone. Later starts load that directory as any checkpoint.

No torch here (the gateway converts the config and tokenizer itself): numpy, `gguf`, safetensors' numpy API and
transformers' tokenizer code, each imported when a GGUF is first converted.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

from shared.model_dir import ModelDirError, cache_dir

log = logging.getLogger(__name__)

SHARD_BYTES = 2 << 30  # float32 weights per safetensors file
INDEX = "model.safetensors.index.json"
DONE = "pagedserve.json"  # written last: the config and tokenizer are complete
_BLOCK = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_REQUIRED = object()


class GgufError(ModelDirError):
    """A GGUF file pagedserve cannot serve: the message names the file and the problem."""


@dataclass(frozen=True, slots=True)
class Family:
    """How one GGUF architecture becomes a Hugging Face one: its config, and each tensor's name and layout."""
    architecture: str  # the Hugging Face class
    model_type: str
    config: Callable[["Metadata"], dict[str, Any]]
    globals: dict[str, str]  # GGUF tensor name (without .weight/.bias) → Hugging Face module name
    layers: dict[str, str]  # per block, GGUF part → module name under the layer prefix
    layer_prefix: str
    permuted_qk: bool = False  # llama.cpp interleaves the rotary halves of Q and K rows for llama
    transposed: tuple[str, ...] = ()  # GGUF parts whose weight the Hugging Face layout (Conv1D) stores transposed

    def hf_name(self, gguf_name: str) -> str | None:
        base, _, suffix = gguf_name.rpartition(".")
        if base in self.globals:
            return f"{self.globals[base]}.{suffix}"
        match = _BLOCK.fullmatch(gguf_name)
        if match is None or match[2] not in self.layers:
            return None
        return f"{self.layer_prefix}.{match[1]}.{self.layers[match[2]]}.{match[3]}"


@dataclass(frozen=True, slots=True)
class Metadata:
    """A GGUF file's key/value metadata, and the names of its tensors."""
    values: dict[str, Any]
    tensor_names: frozenset[str]

    @property
    def arch(self) -> str:
        return self.values["general.architecture"]

    def key(self, name: str, default: Any = _REQUIRED) -> Any:
        """`{arch}.{name}`; a missing key without a default is a GgufError naming it."""
        value = self.values.get(f"{self.arch}.{name}", default)
        if value is _REQUIRED:
            raise GgufError(f"the GGUF metadata lacks {self.arch}.{name}")
        return value

    def token_ids(self) -> dict[str, int]:
        """The special token ids the file names, by their config name."""
        names = {"bos_token_id": "bos_token_id", "eos_token_id": "eos_token_id", "pad_token_id": "padding_token_id"}
        return {ours: self.values[f"tokenizer.ggml.{theirs}"] for ours, theirs in names.items()
                if f"tokenizer.ggml.{theirs}" in self.values}

    def vocab_size(self) -> int:
        return self.key("vocab_size", None) or len(self.values["tokenizer.ggml.tokens"])


def _rope(meta: Metadata) -> dict[str, Any]:
    params: dict[str, Any] = {"rope_type": "default", "rope_theta": float(meta.key("rope.freq_base", 10000.0))}
    scaling = meta.key("rope.scaling.type", "none")
    if scaling == "linear":
        params |= {"rope_type": "linear", "factor": float(meta.key("rope.scaling.factor"))}
    elif scaling != "none":
        raise GgufError(f"rope scaling {scaling!r} ({meta.arch}.rope.scaling.type) is not supported; "
                        "supported: none, linear")
    return params


def _llama_config(meta: Metadata) -> dict[str, Any]:
    heads, hidden = meta.key("attention.head_count"), meta.key("embedding_length")
    return {
        "hidden_size": hidden,
        "intermediate_size": meta.key("feed_forward_length"),
        "num_hidden_layers": meta.key("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": meta.key("attention.head_count_kv", heads),
        "head_dim": meta.key("attention.key_length", None) or meta.key("rope.dimension_count", hidden // heads),
        "max_position_embeddings": meta.key("context_length"),
        "rms_norm_eps": meta.key("attention.layer_norm_rms_epsilon"),
        "rope_parameters": _rope(meta),
        "hidden_act": "silu",
        "attention_bias": "blk.0.attn_q.bias" in meta.tensor_names,
        "vocab_size": meta.vocab_size(),
        "tie_word_embeddings": "output.weight" not in meta.tensor_names,
    }


def _gpt2_config(meta: Metadata) -> dict[str, Any]:
    hidden = meta.key("embedding_length")
    return {
        "n_embd": hidden,
        "n_layer": meta.key("block_count"),
        "n_head": meta.key("attention.head_count"),
        "n_positions": meta.key("context_length"),
        "n_inner": meta.key("feed_forward_length", 4 * hidden),
        "layer_norm_epsilon": meta.key("attention.layer_norm_epsilon"),
        "activation_function": "gelu_new",
        "vocab_size": meta.vocab_size(),
        "tie_word_embeddings": "output.weight" not in meta.tensor_names,
    }


_LLAMA_GLOBALS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LLAMA_LAYERS = {
    "attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm", "ffn_norm": "post_attention_layernorm", "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
FAMILIES: dict[str, Family] = {
    # Mistral's GGUF files say `llama`: llama.cpp runs them as Llama, and so does pagedserve.
    "llama": Family("LlamaForCausalLM", "llama", _llama_config, _LLAMA_GLOBALS, _LLAMA_LAYERS, "model.layers",
                    permuted_qk=True),
    "qwen2": Family("Qwen2ForCausalLM", "qwen2", _llama_config, _LLAMA_GLOBALS, _LLAMA_LAYERS, "model.layers"),
    "qwen3": Family("Qwen3ForCausalLM", "qwen3", _llama_config, _LLAMA_GLOBALS, _LLAMA_LAYERS, "model.layers"),
    "gpt2": Family("GPT2LMHeadModel", "gpt2", _gpt2_config,
                   {"token_embd": "transformer.wte", "position_embd": "transformer.wpe",
                    "output_norm": "transformer.ln_f", "output": "lm_head"},
                   {"attn_norm": "ln_1", "attn_qkv": "attn.c_attn", "attn_output": "attn.c_proj", "ffn_norm": "ln_2",
                    "ffn_up": "mlp.c_fc", "ffn_down": "mlp.c_proj"}, "transformer.h",
                   transposed=("attn_qkv", "attn_output", "ffn_up", "ffn_down")),
}


def checkpoint_dir(gguf_path: Path, weights: bool) -> Path:
    """The checkpoint directory converted from `gguf_path`: its config and tokenizer, and with `weights` its
    weights too; converted on first use (one process at a time per file), then read from the cache."""
    if not gguf_path.is_file():
        raise GgufError(f"no GGUF file at {gguf_path}")
    started = time.monotonic()
    digest = _sha256(gguf_path)
    root = cache_dir() / "gguf"
    root.mkdir(parents=True, exist_ok=True)
    out = root / f"{gguf_path.stem}-{digest[:16]}"
    with _locked(root / f"{out.name}.lock"):
        if (out / DONE).is_file() and (not weights or (out / INDEX).is_file()):
            return out
        log.info("converting %s (%.0f MB) into %s, once: reading its metadata", gguf_path,
                 gguf_path.stat().st_size / 1e6, out)
        reader, family, meta = _open(gguf_path)
        out.mkdir(exist_ok=True)
        if not (out / DONE).is_file():
            _write_config(out, family, meta)
            _write_tokenizer(out, meta)
            _write_json(out / DONE, {"source": "gguf", "file": str(gguf_path.resolve()), "sha256": digest,
                                     "name": gguf_path.stem})
        if weights:
            _write_weights(out, reader, family, meta)
        log.info("converted %s in %.1f s", gguf_path.name, time.monotonic() - started)
    return out


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(8 << 20):
            digest.update(chunk)
    return digest.hexdigest()


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """One converter per file across processes (a gateway and workers may start together)."""
    with path.open("a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _open(path: Path) -> tuple[Any, Family, Metadata]:
    """The file's reader, family and metadata, or a GgufError saying what makes it unusable."""
    import gguf

    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:  # the reader raises whatever a cut-short or foreign file makes numpy raise
        raise GgufError(f"{path} is not a readable GGUF file: it is cut short, damaged or of another format "
                        f"({type(e).__name__}: {e})") from None
    values = {name: field.contents() for name, field in reader.fields.items() if not name.startswith("GGUF.")}
    meta = Metadata(values, frozenset(t.name for t in reader.tensors))
    arch = values.get("general.architecture")
    family = FAMILIES.get(arch)
    if family is None:
        raise GgufError(f"{path} holds a model of architecture {arch!r}, which pagedserve does not serve from GGUF; "
                        f"supported: {', '.join(FAMILIES)}")
    for tensor in reader.tensors:
        if family.hf_name(tensor.name) is None:
            raise GgufError(f"{path}: tensor {tensor.name} has no place in a {arch} model (pagedserve cannot serve "
                            "what it would do)")
        if not _dequantizable(tensor.tensor_type):
            raise GgufError(f"{path}: tensor {tensor.name} is stored as {tensor.tensor_type.name}, which cannot be "
                            f"dequantized; supported: {', '.join(t.name for t in supported_types())}")
    return reader, family, meta


def supported_types() -> list[Any]:
    """The GGML tensor types `gguf.quants` dequantizes."""
    import gguf

    return [t for t in gguf.GGMLQuantizationType if _dequantizable(t)]


def _dequantizable(qtype: Any) -> bool:
    import gguf
    from gguf import quants

    return qtype in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16) or qtype in quants._type_traits


def _write_json(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)


def _write_config(out: Path, family: Family, meta: Metadata) -> None:
    ids = meta.token_ids()
    config = {"architectures": [family.architecture], "model_type": family.model_type, **family.config(meta),
              **ids, "torch_dtype": "float32"}
    _write_json(out / "config.json", config)
    # Chat models end a turn with an end-of-turn token that may differ from EOS: both stop generation.
    eos = sorted({meta.values[f"tokenizer.ggml.{k}"] for k in ("eos_token_id", "eot_token_id", "eom_token_id")
                  if f"tokenizer.ggml.{k}" in meta.values})
    generation = {k: v for k, v in ids.items() if k != "eos_token_id"}
    if eos:
        generation["eos_token_id"] = eos[0] if len(eos) == 1 else eos
    _write_json(out / "generation_config.json", generation)


def _write_tokenizer(out: Path, meta: Metadata) -> None:
    """The tokenizer the metadata describes, built by transformers' own GGUF conversion, saved as transformers
    saves any tokenizer (tokenizer.json, tokenizer_config.json, chat_template.jinja)."""
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer

    if "tokenizer.ggml.tokens" not in meta.values:
        raise GgufError("the GGUF file has no tokenizer (no tokenizer.ggml.tokens)")
    grouped = {group: {name: meta.values[f"tokenizer.{key}"] for key, name in renames.items()
                       if f"tokenizer.{key}" in meta.values}
               for group, renames in GGUF_TOKENIZER_MAPPING.items()}
    tokenizer, config = grouped["tokenizer"], grouped["tokenizer_config"]
    if tokenizer.get("tokenizer_type") == "llama":
        config.setdefault("add_bos_token", True)  # llama.cpp adds BOS to a sentencepiece vocabulary by default
    tokens = tokenizer["tokens"]
    for name, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"), ("unk_token", "unknown_token_id"),
                      ("pad_token", "padding_token_id")):
        token_id = meta.values.get(f"tokenizer.ggml.{key}")
        if token_id is not None:
            config[name] = tokens[token_id]
    try:
        backend, extra = convert_gguf_tokenizer(meta.arch, tokenizer)
    except (KeyError, ValueError, NotImplementedError) as e:
        raise GgufError(f"transformers cannot build this GGUF file's tokenizer "
                        f"({tokenizer.get('tokenizer_type')!r}): {e}") from None
    PreTrainedTokenizerFast(tokenizer_object=backend, **config, **extra).save_pretrained(out)


def _write_weights(out: Path, reader: Any, family: Family, meta: Metadata) -> None:
    """Every tensor dequantized to float32 under its Hugging Face name, in shards of SHARD_BYTES, the index
    written last (its presence says the weights are complete)."""
    import numpy as np
    from gguf.quants import dequantize
    from safetensors.numpy import save_file
    from tqdm import tqdm

    config = json.loads((out / "config.json").read_text())
    heads = config.get("num_attention_heads")
    kv_heads = config.get("num_key_value_heads")
    shard: dict[str, Any] = {}
    shard_bytes = 0
    files: list[tuple[str, list[str]]] = []

    def flush() -> None:
        nonlocal shard, shard_bytes
        name = f"model-{len(files) + 1:05d}.safetensors"
        save_file(shard, str(out / (name + ".tmp")), metadata={"format": "pt"})
        (out / (name + ".tmp")).chmod(0o644)  # compose's images read the cache as another user
        os.replace(out / (name + ".tmp"), out / name)
        files.append((name, list(shard)))
        shard, shard_bytes = {}, 0

    for tensor in tqdm(reader.tensors, desc="dequantizing GGUF tensors", unit="tensor"):
        name = family.hf_name(tensor.name)
        part = tensor.name.split(".")[-2]
        values = dequantize(tensor.data, tensor.tensor_type).astype(np.float32, copy=False)
        values = values.reshape([int(d) for d in reversed(tensor.shape)])
        if family.permuted_qk and part in ("attn_q", "attn_k"):
            values = _unpermute(values, heads if part == "attn_q" else kv_heads)
        if part in family.transposed and name.endswith(".weight"):
            values = values.T
        values = np.ascontiguousarray(values)
        if shard and shard_bytes + values.nbytes > SHARD_BYTES:
            flush()
        shard[name] = values
        shard_bytes += values.nbytes
    if shard:
        flush()
    weight_map = {tensor: name for name, tensors in files for tensor in tensors}
    total = sum((out / name).stat().st_size for name, _ in files)
    _write_json(out / INDEX, {"metadata": {"total_size": total}, "weight_map": weight_map})


def _unpermute(w: Any, heads: int) -> Any:
    """Undo llama.cpp's reordering of a Q or K projection's rows: each head's rotary halves, interleaved there,
    back into the two blocks Hugging Face's rotary embedding expects."""
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
