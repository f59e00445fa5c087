"""GGUF checkpoints: llama.cpp's files, written here with llama.cpp's own writer, converted by pagedserve and
checked against transformers' own GGUF loader on the same file (tensors, config, tokenizer, greedy tokens), and
refused with a message that names the problem when pagedserve cannot serve them."""
from __future__ import annotations

import glob
import json
import os
from pathlib import Path

import gguf
import pytest
import torch
from gguf_writer import T, tiny_checkpoint, write_gguf
from safetensors.torch import load_file
from up_harness import run_up

from shared import gguf_checkpoint
from shared.gguf_checkpoint import GgufError, supported_types
from shared.model_dir import resolve_model_dir
from shared.sampling import SamplingParams
from shared.settings import Settings

NEW = 24
TEXTS = ["Hello, world!", "  Größe, café — 東京 🚀\n\n\tdef add(a, b):\n    return a + b",
         "<|im_start|>user\nhi<|im_end|>", "The blocks of a sequence need not be contiguous."]


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch) -> Path:
    """Each test converts into its own cache."""
    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture(scope="module")
def every_type_gguf(tiny_model_dir, tmp_path_factory) -> tuple[Path, dict[str, gguf.GGMLQuantizationType]]:
    """The built-in tiny model as one GGUF file whose 30 matrices take every type pagedserve dequantizes in turn."""
    types = supported_types()
    chosen: dict[str, gguf.GGMLQuantizationType] = {}

    def pick(name: str) -> gguf.GGMLQuantizationType:
        chosen[name] = types[len(chosen) % len(types)]
        return chosen[name]
    path = write_gguf(tiny_model_dir, tmp_path_factory.mktemp("gguf") / "every-type.gguf", pick)
    assert set(types) <= set(chosen.values())
    return path, chosen


def transformers_model(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()


def converted_weights(path: Path) -> dict[str, torch.Tensor]:
    weights: dict[str, torch.Tensor] = {}
    for f in glob.glob(str(resolve_model_dir(str(path)).path / "*.safetensors")):
        weights |= load_file(f)
    return weights


def test_every_listed_quant_type_dequantizes_to_transformers_values_tensor_by_tensor(every_type_gguf, tiny_model_dir):
    path, chosen = every_type_gguf
    for listed in ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K"):
        assert T[listed] in chosen.values()
    ours = converted_weights(path)
    theirs = transformers_model(path).state_dict()
    assert set(ours) == set(theirs)
    for name, tensor in theirs.items():
        torch.testing.assert_close(ours[name], tensor, rtol=0, atol=0, msg=lambda m: f"{name}: {m}")
    # Stored unquantized, a tensor comes back as the checkpoint had it: the Q/K rows are in Hugging Face's order.
    original = load_file(str(tiny_model_dir / "model.safetensors"))
    for name, qtype in chosen.items():
        if qtype in (T.F32, T.BF16):
            assert torch.equal(ours[name], original[name].float()), name
    assert {T.F32, T.BF16} & {chosen[n] for n in chosen if ".q_proj." in n or ".k_proj." in n}


def test_config_tokenizer_and_chat_template_are_those_transformers_reads_from_the_file(every_type_gguf,
                                                                                      tiny_model_dir):
    from transformers import AutoConfig, AutoTokenizer

    path, _ = every_type_gguf
    model_dir = resolve_model_dir(str(path), weights=False)
    assert not list(model_dir.path.glob("*.safetensors")), "the gateway's conversion writes no weights"
    ours = AutoConfig.from_pretrained(model_dir.path)
    theirs = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    for key in ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps", "vocab_size",
                "tie_word_embeddings", "bos_token_id", "eos_token_id"):
        assert getattr(ours, key) == getattr(theirs, key), key
    assert ours.rope_parameters["rope_theta"] == theirs.rope_parameters["rope_theta"]
    converted = AutoTokenizer.from_pretrained(model_dir.path)
    reference = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    original = AutoTokenizer.from_pretrained(tiny_model_dir)
    for text in TEXTS:
        assert converted(text).input_ids == reference(text).input_ids == original(text).input_ids, text
    assert converted.chat_template == reference.chat_template == original.chat_template
    assert converted.special_tokens_map == reference.special_tokens_map
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    assert (converted.apply_chat_template(messages, add_generation_prompt=True)
            == original.apply_chat_template(messages, add_generation_prompt=True))


def test_the_gateway_serves_a_gguf_file_with_its_tokenizer_without_converting_weights(every_type_gguf):
    from gateway.model import ServedModel

    path, _ = every_type_gguf
    served = ServedModel.load(Settings(model=str(path)))
    assert served.name == "every-type" and served.vocab_size == 512 and served.max_model_len == 2048
    assert served.tokenizer.decode(served.tokenizer.encode(TEXTS[1])) == TEXTS[1]
    assert not list(served.path.glob("*.safetensors"))


def test_a_converted_file_is_cached_by_its_hash_and_a_changed_file_converts_again(every_type_gguf, tmp_path):
    path, _ = every_type_gguf
    first = resolve_model_dir(str(path)).path
    stamp = (first / "model.safetensors.index.json").stat().st_mtime_ns
    assert resolve_model_dir(str(path)).path == first
    assert (first / "model.safetensors.index.json").stat().st_mtime_ns == stamp, "the second start reuses it"
    assert json.loads((first / "pagedserve.json").read_text())["name"] == "every-type"
    changed = tmp_path / path.name
    data = bytearray(path.read_bytes())
    data[-1] ^= 1  # one bit of the last tensor
    changed.write_bytes(bytes(data))
    assert resolve_model_dir(str(changed)).path != first
    inside = tmp_path / "holder"
    inside.mkdir()
    os.symlink(path, inside / path.name)
    assert resolve_model_dir(str(inside)).name == "holder", "a directory holding one .gguf serves it"


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gpt2"])
def test_a_q8_0_gguf_of_each_family_generates_what_transformers_generates_from_the_file(arch, tiny_model_dir,
                                                                                      tmp_path):
    from pagedserve.engine import Engine

    # transformers' GGUF mapping reads no head size for qwen3 (its default, 128, stands) and no context for GPT-2
    # (its default, 1024): the tiny models here take those values, which both readers then agree on.
    config = {"qwen3": {"head_dim": 128}, "gpt2": {"n_positions": 1024}}.get(arch, {})
    checkpoint = tiny_checkpoint(arch, tmp_path / arch, tiny_model_dir, **config)
    path = write_gguf(checkpoint, tmp_path / f"{arch}.gguf", lambda name: T.Q8_0)
    reference = transformers_model(path)
    reference.generation_config.eos_token_id = None
    engine = Engine(Settings(model=str(path), dtype="float32", num_blocks=64))
    prompts = [[5, 17, 300, 41, 9], list(range(40, 80)), [511, 3, 250]]
    completions = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True))
    for prompt, completion in zip(prompts, completions):
        ids = torch.tensor([prompt])
        expected = reference.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False,
                                      pad_token_id=0)[0, len(prompt):].tolist()
        assert completion.samples[0].token_ids == expected, arch


def _rewritten(source: Path, out: Path, change: dict) -> Path:
    """`source` written again with the metadata values and tensors in `change` replaced or added."""
    reader = gguf.GGUFReader(source)
    arch = change.get("general.architecture", reader.fields["general.architecture"].contents())
    writer = gguf.GGUFWriter(str(out), arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        value = change.get(name, field.contents())
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name.replace("llama.", f"{arch}.", 1), value, kind, sub_type=sub)
    tensors = [(t.name, t.data, t.tensor_type) for t in reader.tensors] + [
        (name, data, qtype) for name, (data, qtype) in change.get("tensors", {}).items()]
    for name, data, qtype in tensors:
        writer.add_tensor(name, data, raw_dtype=None if qtype in (T.F32, T.F16) else qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


@pytest.fixture(scope="module")
def small_gguf(tiny_model_dir, tmp_path_factory) -> Path:
    return write_gguf(tiny_model_dir, tmp_path_factory.mktemp("small") / "small.gguf", lambda name: T.Q8_0)


def _bad_files(small: Path, out: Path) -> dict[str, tuple[Path, str]]:
    truncated = out / "truncated.gguf"
    truncated.write_bytes(small.read_bytes()[: small.stat().st_size // 2])
    text = out / "not-a-model.gguf"
    text.write_text("this is no GGUF file\n" * 100)
    q8_1 = gguf.GGML_QUANT_SIZES[T.Q8_1]
    return {
        "truncated": (truncated, "is not a readable GGUF file: it is cut short, damaged or of another format"),
        "not gguf": (text, "is not a readable GGUF file: it is cut short, damaged or of another format"),
        "architecture": (_rewritten(small, out / "mamba.gguf", {"general.architecture": "mamba"}),
                         "architecture 'mamba', which pagedserve does not serve from GGUF; supported: llama"),
        "quant type": (_rewritten(small, out / "q8_1.gguf", {"tensors": {
            "blk.0.attn_q.bias": (torch.zeros(1, q8_1[1], dtype=torch.uint8).numpy(), T.Q8_1)}}),
            "tensor blk.0.attn_q.bias is stored as Q8_1, which cannot be dequantized; supported: F32, F16"),
        "unknown tensor": (_rewritten(small, out / "rope.gguf", {"tensors": {
            "rope_freqs.weight": (torch.ones(32).numpy(), T.F32)}}), "tensor rope_freqs.weight has no place"),
    }


@pytest.mark.parametrize("case", ["truncated", "not gguf", "architecture", "quant type", "unknown tensor"])
def test_a_file_pagedserve_cannot_serve_is_refused_with_a_message_naming_the_problem(case, small_gguf, tmp_path):
    path, message = _bad_files(small_gguf, tmp_path)[case]
    with pytest.raises(GgufError) as refused:
        resolve_model_dir(str(path))
    assert message in str(refused.value) and str(path) in str(refused.value)


@pytest.mark.slow
def test_up_refuses_a_bad_gguf_before_starting_anything(small_gguf, tmp_path, cache):
    for path, message in _bad_files(small_gguf, tmp_path).values():
        out = run_up("--model", str(path), env={"PAGEDSERVE_CACHE_DIR": str(cache)})
        assert out.returncode == 2 and out.stdout == "", out.stderr
        assert message in out.stderr and " (pid " not in out.stderr, out.stderr


def test_conversion_is_torch_free(every_type_gguf, tmp_path):
    """The gateway converts a GGUF's config and tokenizer where torch is not installed (its image has none)."""
    import subprocess
    import sys

    path, _ = every_type_gguf
    code = ("import sys; sys.modules['torch'] = None\n"  # torch is not found, and importing it fails
            "from shared.model_dir import resolve_model_dir\n"
            f"print(resolve_model_dir({str(path)!r}).path)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, PAGEDSERVE_CACHE_DIR=str(tmp_path)), cwd=Path(__file__).parent.parent)
    assert out.returncode == 0, out.stderr
    assert (Path(out.stdout.strip()) / "model.safetensors.index.json").is_file()
    assert gguf_checkpoint.INDEX == "model.safetensors.index.json"
