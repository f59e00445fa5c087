"""GGUF files for tests, written from a Hugging Face checkpoint as llama.cpp's converter writes them: llama.cpp's
own writer and tensor names (`gguf.GGUFWriter`, `gguf.get_tensor_name_map`), Q and K rows of llama attention
permuted, GPT-2's Conv1D weights transposed, 1-D tensors in float32, the byte-level BPE tokenizer and chat
template as metadata. Nothing here shares code with the converter under test (shared/gguf_checkpoint.py)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import gguf
import numpy as np
import torch
from safetensors.torch import load_file

ARCH = {"llama": gguf.MODEL_ARCH.LLAMA, "mistral": gguf.MODEL_ARCH.LLAMA, "qwen2": gguf.MODEL_ARCH.QWEN2,
        "qwen3": gguf.MODEL_ARCH.QWEN3, "gpt2": gguf.MODEL_ARCH.GPT2}
CONV1D = (".attn.c_attn.weight", ".attn.c_proj.weight", ".mlp.c_fc.weight", ".mlp.c_proj.weight")
T = gguf.GGMLQuantizationType
# What gguf.quants can make from values; the other types get random blocks (finite ones: see _random_blocks).
QUANTIZABLE = {T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.BF16, T.TQ1_0, T.TQ2_0, T.MXFP4}


def llama_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's reordering of Q and K rows (convert_hf_to_gguf's `permute`)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _random_blocks(qtype: gguf.GGMLQuantizationType, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """Blocks of random bytes in `qtype`'s layout, each redrawn until it dequantizes to finite values below 1e3
    (random bytes make some half-precision scales inf or NaN)."""
    block_elems, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    count = int(np.prod(shape)) // block_elems
    blocks = rng.integers(0, 256, (count, block_bytes), dtype=np.uint8)
    while True:
        with np.errstate(all="ignore"):  # the blocks redrawn below
            values = gguf.quants.dequantize(blocks, qtype).reshape(count, block_elems)
        bad = ~(np.isfinite(values) & (np.abs(values) < 1e3)).all(axis=1)
        if not bad.any():
            return blocks.reshape(*shape[:-1], shape[-1] // block_elems * block_bytes)
        blocks[bad] = rng.integers(0, 256, (int(bad.sum()), block_bytes), dtype=np.uint8)


def _tensor(values: np.ndarray, qtype: gguf.GGMLQuantizationType, rng: np.random.Generator) -> np.ndarray:
    if qtype == T.F32:
        return values
    if qtype == T.F16:
        return values.astype(np.float16)
    if qtype in QUANTIZABLE:
        return gguf.quants.quantize(values, qtype)
    return _random_blocks(qtype, values.shape, rng)


def _tokenizer(writer: gguf.GGUFWriter, model_dir: Path, vocab_size: int) -> None:
    spec = json.loads((model_dir / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"] | {t["content"]: t["id"] for t in spec["added_tokens"]}
    tokens = [""] * vocab_size
    for token, index in vocab.items():
        tokens[index] = token
    special = {t["id"] for t in spec["added_tokens"] if t["special"]}
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL if i in special else gguf.TokenType.NORMAL
                            for i in range(vocab_size)])
    writer.add_token_merges(merges)
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    for key, add in (("bos_token", writer.add_bos_token_id), ("eos_token", writer.add_eos_token_id),
                     ("pad_token", writer.add_pad_token_id)):
        if config.get(key):
            add(vocab[config[key]])
    template = model_dir / "chat_template.jinja"
    if template.is_file():
        writer.add_chat_template(template.read_text())


def write_gguf(model_dir: Path, out: Path, qtype: Callable[[str], gguf.GGMLQuantizationType],
               seed: int = 0) -> Path:
    """`model_dir` (a checkpoint with a byte-level BPE tokenizer.json) as the GGUF file `out`, each matrix in
    `qtype(hf_name)`."""
    config = json.loads((model_dir / "config.json").read_text())
    kind = config["model_type"]
    arch = ARCH[kind]
    weights = load_file(str(model_dir / "model.safetensors"))
    layers = config.get("num_hidden_layers", config.get("n_layer"))
    names = gguf.get_tensor_name_map(arch, layers)
    writer = gguf.GGUFWriter(str(out), gguf.MODEL_ARCH_NAMES[arch])
    writer.add_name(model_dir.name)
    vocab_size = config["vocab_size"]
    if kind == "gpt2":
        heads = kv_heads = config["n_head"]
        writer.add_context_length(config["n_positions"])
        writer.add_embedding_length(config["n_embd"])
        writer.add_block_count(layers)
        writer.add_feed_forward_length(config.get("n_inner") or 4 * config["n_embd"])
        writer.add_head_count(heads)
        writer.add_layer_norm_eps(config["layer_norm_epsilon"])
    else:
        heads = config["num_attention_heads"]
        kv_heads = config.get("num_key_value_heads") or heads
        head_dim = config.get("head_dim") or config["hidden_size"] // heads
        writer.add_context_length(config["max_position_embeddings"])
        writer.add_embedding_length(config["hidden_size"])
        writer.add_block_count(layers)
        writer.add_feed_forward_length(config["intermediate_size"])
        writer.add_head_count(heads)
        writer.add_head_count_kv(kv_heads)
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
        writer.add_rope_dimension_count(head_dim)
        writer.add_rope_freq_base(config.get("rope_theta") or config["rope_parameters"]["rope_theta"])
        writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(vocab_size)
    _tokenizer(writer, model_dir, vocab_size)
    rng = np.random.default_rng(seed)
    for name, tensor in weights.items():
        base, _, suffix = name.rpartition(".")
        gguf_name = names.get_name(base)
        if gguf_name is None:
            continue  # buffers (GPT-2's attention masks) that llama.cpp skips too
        values = tensor.float().numpy()
        if arch == gguf.MODEL_ARCH.LLAMA and base.endswith((".q_proj", ".k_proj")):
            values = llama_permute(values, heads if base.endswith(".q_proj") else kv_heads)
        if name.endswith(CONV1D):
            values = values.T
        values = np.ascontiguousarray(values)
        chosen = qtype(name) if values.ndim == 2 else T.F32
        data = _tensor(values, chosen, rng)
        writer.add_tensor(f"{gguf_name}.{suffix}", data, raw_dtype=chosen if chosen not in (T.F32, T.F16) else None)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def tiny_checkpoint(arch: str, out: Path, tokenizer_dir: Path, **config) -> Path:
    """A tiny random checkpoint of `arch` with the built-in tiny model's tokenizer (and its vocabulary size)."""
    import shutil

    from transformers import AutoModelForCausalLM

    from worker_oracle import tiny_config

    cfg = tiny_config(arch)
    for key, value in (config | {"vocab_size": 512}).items():
        setattr(cfg, key, value)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(tokenizer_dir / name, out / name)
    return out
