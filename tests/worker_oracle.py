"""The oracle of worker tests: tiny random checkpoints of every supported architecture, written with
transformers' own `save_pretrained`, and transformers' own greedy `generate` on the same weights."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

INIT_RANGE = 0.15  # large weights: greedy argmax without near-ties
VOCAB = 256
MAX_POSITIONS = 256


def tiny_config(arch: str):
    import transformers as tf

    llama_like = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=MAX_POSITIONS,
                      initializer_range=INIT_RANGE, eos_token_id=1, bos_token_id=0, pad_token_id=0)
    opt_like = dict(vocab_size=VOCAB, hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=4,
                    max_position_embeddings=MAX_POSITIONS, init_std=INIT_RANGE, eos_token_id=1, bos_token_id=0,
                    pad_token_id=0)
    configs = {
        # Llama 3.1 rope scaling, with an original context short enough that scaling changes frequencies
        "llama": lambda: tf.LlamaConfig(**llama_like, rope_parameters={
            "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
        "mistral": lambda: tf.MistralConfig(**llama_like, sliding_window=None),
        "qwen2": lambda: tf.Qwen2Config(**llama_like, tie_word_embeddings=True),
        "qwen3": lambda: tf.Qwen3Config(**llama_like, head_dim=32),
        "gpt2": lambda: tf.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=MAX_POSITIONS,
                                      initializer_range=INIT_RANGE, scale_attn_by_inverse_layer_idx=True,
                                      eos_token_id=1, bos_token_id=0),
        # like opt-350m: post-LayerNorm blocks and word embeddings projected in and out
        "opt": lambda: tf.OPTConfig(**opt_like, word_embed_proj_dim=32, do_layer_norm_before=False),
        "opt-prenorm": lambda: tf.OPTConfig(**opt_like, do_layer_norm_before=True),
    }
    return configs[arch]()


ARCHS = ["llama", "mistral", "qwen2", "qwen3", "gpt2", "opt", "opt-prenorm"]


def write_tiny(arch: str, out: Path, **save_kwargs) -> Path:
    from transformers import AutoModelForCausalLM

    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(tiny_config(arch), dtype=torch.float32)
    model.save_pretrained(out, **save_kwargs)
    return out


class Transformers:
    """transformers' own model of a checkpoint, float32."""

    def __init__(self, model_dir: Path) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.model.generation_config.eos_token_id = None  # never stop early: compare whole runs
        self._greedy: dict[tuple[int, ...], list[int]] = {}

    @torch.inference_mode()
    def greedy(self, prompt: list[int], max_new_tokens: int) -> list[int]:
        """generate(do_sample=False) for one prompt (no padding); cached per prompt."""
        cached = self._greedy.get(tuple(prompt), [])
        if len(cached) < max_new_tokens:
            ids = torch.tensor([prompt])
            out = self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                      do_sample=False, pad_token_id=0)
            cached = self._greedy[tuple(prompt)] = out[0, len(prompt):].tolist()
        return cached[:max_new_tokens]

    @torch.inference_mode()
    def logprobs(self, tokens: list[int]) -> torch.Tensor:
        """[len(tokens), vocab]: log-softmax of the next-token logits after each position."""
        return self.model(torch.tensor([tokens])).logits[0].float().log_softmax(dim=-1)


def hf_greedy(model_dir: Path, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    oracle = Transformers(model_dir)
    return [oracle.greedy(p, max_new_tokens) for p in prompts]


def bf16_step(x: torch.Tensor) -> torch.Tensor:
    """The distance from each bfloat16 value to the next one up in magnitude."""
    exponent = torch.floor(torch.log2(x.float().abs().clamp_min(2.0 ** -126)))
    return torch.exp2(exponent - 7)


def bf16_model_logits(arch: str, tmp_path: Path):
    """A tiny bfloat16 model of `arch`, loaded as a worker loads it, and a function giving its logits for one
    12-token prompt with torch's SDPA as the attention (no cache): the model before and after a module swap."""
    from torch.nn import functional as F

    from gpu_worker.loader import load_config, load_model
    from gpu_worker.models.layers import ForwardContext

    model_dir = write_tiny(arch, tmp_path / arch)
    model = load_model(model_dir, load_config(model_dir), 64, torch.device("cpu"), torch.bfloat16, progress=False)
    ids = torch.tensor(prompts([12])[0])

    def attend(q, k, v, key_cache, value_cache, scale):
        out = F.scaled_dot_product_attention(q.transpose(0, 1).float(), k.transpose(0, 1).float(),
                                             v.transpose(0, 1).float(), is_causal=True, scale=scale,
                                             enable_gqa=q.shape[1] != k.shape[1])
        return out.transpose(0, 1).to(q.dtype)

    def logits() -> torch.Tensor:
        with torch.inference_mode():
            return model.compute_logits(model(ids, torch.arange(len(ids)), ForwardContext([(None, None)] * 8, attend)))

    return model, logits


def prompts(lengths: list[int], vocab: int = VOCAB, seed: int = 1) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(2, vocab, (n,), generator=gen).tolist() for n in lengths]


@pytest.fixture(autouse=True, scope="module")
def single_thread():
    """One intra-op thread: these tiny models gain nothing from more, and on a shared CPU an OpenMP
    team waiting for a preempted thread makes each small op tens of times slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
