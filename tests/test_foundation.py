"""Packaging facts: light services import without torch, the HF `kernels` probe stays off, the tiny model."""
from __future__ import annotations

import filecmp
import subprocess
import sys
import textwrap

import redis

BLOCK_TORCH = textwrap.dedent("""
    import importlib.abc, pkgutil, sys
    class NoTorch(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name.split(".")[0] in ("torch", "triton"):
                raise ImportError(f"{name} is blocked: this service must start without torch")
    sys.meta_path.insert(0, NoTorch())
    for pkg in ("shared", "scheduler", "gateway"):
        mod = __import__(pkg)
        for info in pkgutil.walk_packages(mod.__path__, pkg + "."):
            if not info.name.endswith("__main__"):
                __import__(info.name)
    assert not any(m.split(".")[0] in ("torch", "triton") for m in sys.modules)
    print("ok")
""")


def test_light_packages_import_without_torch():
    out = subprocess.run([sys.executable, "-c", BLOCK_TORCH], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_transformers_does_not_take_our_kernels_package_for_the_hub_one():
    out = subprocess.run([sys.executable, "-c",
                          "import transformers.utils as u; print(u.is_kernels_available())"],
                         capture_output=True, text=True, timeout=300)
    assert out.stdout.strip() == "False", out.stderr


def test_tiny_model_is_deterministic_and_loads_offline(tmp_path, tiny_model_dir):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    second = subprocess.run([sys.executable, "-m", "pagedserve", "tiny-model", str(tmp_path / "again")],
                            capture_output=True, text=True, timeout=300)
    assert second.returncode == 0, second.stderr
    names = sorted(p.name for p in tiny_model_dir.iterdir())
    assert names == sorted(p.name for p in (tmp_path / "again").iterdir())
    match, mismatch, errors = filecmp.cmpfiles(tiny_model_dir, tmp_path / "again", names, shallow=False)
    assert not mismatch and not errors

    tok = AutoTokenizer.from_pretrained(tiny_model_dir, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, local_files_only=True, dtype=torch.float32)
    cfg = model.config
    assert cfg.num_hidden_layers >= 4 and cfg.num_key_value_heads < cfg.num_attention_heads
    assert sum(p.stat().st_size for p in tiny_model_dir.iterdir()) < 8 << 20
    text = "Hello, 東京 🚀"
    assert tok.decode(tok(text).input_ids) == text
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert chat.endswith("<|im_start|>assistant\n")
    ids = tok("The blocks", return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=8, do_sample=False)
    assert out.shape == (1, ids.shape[1] + 8)


def test_redis_fixture_restarts_and_keeps_data(own_redis):
    client = redis.Redis.from_url(own_redis.url)
    client.set("k", "v")
    own_redis.restart()
    client = redis.Redis.from_url(own_redis.url)
    assert client.get("k") == b"v"


def test_session_redis_answers(redis_url):
    assert redis.Redis.from_url(redis_url).ping()
