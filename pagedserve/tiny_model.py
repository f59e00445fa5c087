"""The built-in tiny model: a deterministic Llama checkpoint with a byte-level BPE tokenizer.

Small enough for CPU tests (about 5 MB), yet a real transformer: 4 layers, GQA (4 query heads over
2 KV heads), head_dim 64, RoPE. Written from a fixed seed and a fixed corpus, so every run writes
the same bytes; transformers' Auto classes load it from disk with no network.
"""
from __future__ import annotations

import json
from pathlib import Path

SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
VOCAB_SIZE = 512
SEED = 0

_CORPUS = [
    "PagedAttention divides the key value cache of each sequence into blocks of a fixed number of tokens.",
    "The blocks of a sequence need not be contiguous in memory; a block table maps logical to physical blocks.",
    "Continuous batching adds new requests to the running batch at every step instead of waiting for it to drain.",
    "A scheduler admits requests while free blocks remain and preempts the latest request when memory runs out.",
    "Requests that share a prompt prefix share its cached blocks, counted by reference and copied on write.",
    "The quick brown fox jumps over the lazy dog. Hello, world! How are you today? I am fine, thank you.",
    "Once upon a time there was a small model that answered questions about numbers: 0 1 2 3 4 5 6 7 8 9 10.",
    "User: What is the capital of France? Assistant: The capital of France is Paris.",
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))\n",
    "Größe, café, naïve, 東京, 🚀 — non-ASCII text takes several bytes in UTF-8.",
]


def build_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   additional_special_tokens=["<|im_start|>", "<|im_end|>"],
                                   chat_template=CHAT_TEMPLATE)


def write_tiny_model(out_dir: str | Path) -> Path:
    """Write the tiny checkpoint (config, safetensors weights, tokenizer, chat template) to `out_dir`, every
    file readable by all (0644)."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=2048,
        rope_theta=10000.0, rms_norm_eps=1e-5, initializer_range=0.08, tie_word_embeddings=False,
        bos_token_id=ids["<s>"], eos_token_id=ids["</s>"], pad_token_id=ids["<pad>"])
    with torch.random.fork_rng():
        torch.manual_seed(SEED)
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.generation_config = GenerationConfig(
        bos_token_id=ids["<s>"], eos_token_id=[ids["</s>"], ids["<|im_end|>"]], pad_token_id=ids["<pad>"])
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    (out / "pagedserve.json").write_text(json.dumps({"source": "pagedserve tiny-model", "seed": SEED}) + "\n")
    # Readable by all: the weights come out 0600 (written through a private temporary file), and the compose
    # images read the checkpoint from a read-only mount as another user (uid 1000).
    for path in out.iterdir():
        if path.is_file():
            path.chmod(0o644)
    return out
