"""Every supported architecture, loaded through the project's loader, gives transformers' greedy tokens."""
from __future__ import annotations

import json

import pytest
import torch
from plan_builder import PlanBuilder, run_until
from worker_oracle import ARCHS, hf_greedy, prompts, single_thread, write_tiny  # noqa: F401 (fixture)

from gpu_worker import packed_linear
from gpu_worker.loader import ModelLoadError, checkpoint_files, load_config, resolve_dtype
from gpu_worker.models import ARCHITECTURES, UnsupportedModelError
from gpu_worker.models.layers import rope_inv_freq
from gpu_worker.worker import Worker
from shared.settings import Settings

NUM_BLOCKS = 64
BLOCK_SIZE = 16
NEW_TOKENS = 32


def worker_for(model_dir, **settings) -> Worker:
    settings.setdefault("num_blocks", NUM_BLOCKS)
    settings.setdefault("block_size", BLOCK_SIZE)
    return Worker.load(Settings(model=str(model_dir), **settings), progress=False)


def generate(worker: Worker, batch: list[list[int]], new_tokens: int = NEW_TOKENS) -> list[list[int]]:
    reg = worker.registration
    builder = PlanBuilder(reg.worker_id, reg.num_blocks, reg.block_size)
    seqs = [builder.add(p) for p in batch]
    run_until(worker, builder, seqs, new_tokens)
    return [s.outputs for s in seqs]


@pytest.mark.parametrize("backend", ["cpu", "torch"])
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_transformers(arch, backend, tmp_path):
    model_dir = write_tiny(arch, tmp_path / arch)
    batch = prompts([3, 17, 40, 9])
    assert generate(worker_for(model_dir, attention_backend=backend), batch) == hf_greedy(model_dir, batch, NEW_TOKENS)


def test_builtin_tiny_model_matches_transformers(tiny_model_dir):
    batch = prompts([6, 21, 35], vocab=512, seed=3)
    worker = worker_for(tiny_model_dir, block_size=8, num_blocks=2 * NUM_BLOCKS)
    assert worker.runner.dtype == torch.float32  # bf16 checkpoint, float32 on CPU by default
    assert worker.runner.backend.__name__ == "kernels.cpu_attention"  # the default on CPU
    # float32 linears through kernels/cpu_linear.c where it beats MKL (AVX2 without AVX-512, AMD's AVX-512), else
    # torch's own
    native = worker.runner.paths.linears == "fma"
    assert isinstance(worker.runner.model.lm_head, packed_linear.NativeLinear) == native
    assert generate(worker, batch) == hf_greedy(tiny_model_dir, batch, NEW_TOKENS)


def test_sharded_safetensors_load(tmp_path):
    model_dir = write_tiny("llama", tmp_path / "sharded", max_shard_size="60KB")
    assert (model_dir / "model.safetensors.index.json").is_file()
    assert len(checkpoint_files(model_dir)) > 1
    batch = prompts([7, 12])
    assert generate(worker_for(model_dir), batch, 8) == hf_greedy(model_dir, batch, 8)


def test_pytorch_bin_fallback(tmp_path):
    from transformers import AutoModelForCausalLM

    source = write_tiny("qwen2", tmp_path / "source")  # tied embeddings: the .bin carries no lm_head
    model_dir = tmp_path / "bin"
    model_dir.mkdir()
    (model_dir / "config.json").write_text((source / "config.json").read_text())
    state = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).state_dict()
    torch.save({k: v for k, v in state.items() if k != "lm_head.weight"}, model_dir / "pytorch_model.bin")
    assert checkpoint_files(model_dir) == [model_dir / "pytorch_model.bin"]
    batch = prompts([10])
    assert generate(worker_for(model_dir), batch, 8) == hf_greedy(source, batch, 8)


def test_registration(tmp_path):
    model_dir = write_tiny("mistral", tmp_path / "my-model")
    worker = worker_for(model_dir, num_blocks=0, kv_cache_bytes=1 << 20, swap_space_bytes=1 << 19,
                        max_model_len=128)
    reg = worker.registration
    # 2 layers x (K, V) x 16 tokens x 2 kv heads x 16 dims x 4 bytes = 8 KiB per block
    assert (reg.num_blocks, reg.num_swap_blocks) == (128, 64)
    assert (reg.model_id, reg.block_size, reg.max_model_len, reg.eos_token_ids) == ("my-model", 16, 128, [1])
    assert worker_for(model_dir, served_model_name="served").registration.model_id == "served"
    assert worker_for(model_dir).registration.max_model_len == 256  # the model's own position limit


def test_unsupported_architecture_is_refused(tmp_path):
    model_dir = write_tiny("llama", tmp_path / "m")
    config = json.loads((model_dir / "config.json").read_text())
    config["architectures"] = ["LlamaForSequenceClassification"]
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError) as e:
        worker_for(model_dir)
    assert "LlamaForSequenceClassification" in str(e.value)
    assert all(name in str(e.value) for name in ARCHITECTURES)


def test_sliding_window_shorter_than_max_model_len_is_refused(tmp_path):
    model_dir = write_tiny("mistral", tmp_path / "m")
    config = json.loads((model_dir / "config.json").read_text())
    config["sliding_window"] = 64
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="sliding-window"):
        worker_for(model_dir)
    # served within the window, full attention is exact
    assert worker_for(model_dir, max_model_len=64).registration.max_model_len == 64


def test_unsupported_rope_type_is_refused():
    with pytest.raises(UnsupportedModelError, match="yarn"):
        rope_inv_freq(16, {"rope_type": "yarn", "factor": 4.0})


def test_missing_and_misshaped_weights_are_errors(tmp_path):
    from safetensors.torch import load_file, save_file

    model_dir = write_tiny("llama", tmp_path / "m")
    weights = load_file(model_dir / "model.safetensors")
    save_file({k: v for k, v in weights.items() if "layers.1.self_attn.k_proj" not in k},
              model_dir / "model.safetensors")
    with pytest.raises(ModelLoadError, match="layers.1.self_attn.qkv_proj"):
        worker_for(model_dir)
    weights["model.norm.weight"] = torch.ones(7)
    save_file(weights, model_dir / "model.safetensors")
    with pytest.raises(ModelLoadError, match="model.norm.weight"):
        worker_for(model_dir)


def test_dtype_choice(tmp_path):
    config = load_config(write_tiny("gpt2", tmp_path / "m"))
    assert resolve_dtype("auto", torch.device("cpu"), config) == torch.float32
    assert resolve_dtype("bfloat16", torch.device("cpu"), config) == torch.bfloat16
    setattr(config, "dtype", torch.float16)
    assert resolve_dtype("auto", torch.device("cuda"), config) == torch.float16


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2's embedding is tied: read from the packed lm_head
def test_a_bfloat16_worker_starts_on_any_cpu_and_picks_what_transformers_picks_in_bfloat16(arch, tmp_path):
    """Packing bfloat16 weights for oneDNN needs native bfloat16 (AVX-512 BF16, AMX): on an AVX2-only CPU the
    worker widens them in float32 instead of failing to start. Its first tokens are transformers' own
    bfloat16 argmax where that one is clear of the runner-up."""
    from transformers import AutoModelForCausalLM

    model_dir = write_tiny(arch, tmp_path / arch)
    batch = prompts([5, 11, 23, 30], seed=7)
    firsts = [tokens[0] for tokens in generate(worker_for(model_dir, dtype="bfloat16"), batch, 1)]
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    checked = 0
    for prompt, first in zip(batch, firsts):
        with torch.inference_mode():
            top2 = hf(torch.tensor([prompt])).logits[0, -1].float().topk(2)
        if top2.values[0] - top2.values[1] > 0.05:
            assert first == top2.indices[0].item()
            checked += 1
    assert checked >= 2
