"""A short serving run on a GPU: the worker's greedy tokens against transformers on the same device, then the whole
stack (`pagedserve up --device DEVICE --workers 1`) under the serving benchmark.

1. Parity: the tiny model, in float32 and bfloat16, `--parity-prompts` prompts, 32 greedy tokens each: the
   in-process engine against transformers' `generate`, both on the device. Reports how many answers are identical
   token for token and where the others first differ (float32 should be all of them; bfloat16 rounds differently).
2. Serving: a Llama of `--shape` with random bfloat16 weights, written on the device, with the tokenizer of
   `--tokenizer` (a checkpoint directory; the tiny model's when empty), served by `pagedserve up`, and the serving
   benchmark (ShareGPT lengths, `ignore_eos`, so that lengths hold whatever the weights say) at each of `--rates`.

    python -m benchmarks.gpu_serving --out-dir /tmp/gpu --tokenizer DIR        # on a CUDA machine
    python -m benchmarks.gpu_serving --device cpu --shape tiny --num-prompts 8 --rates inf --parity-prompts 2
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

from pagedserve import bench as serving
from benchmarks.up_process import UpProcess
from pagedserve.ports import free_port
from pagedserve.tiny_model import write_tiny_model

NEW_TOKENS = 32
# Llama bodies; the vocabulary is the tokenizer's.
SHAPES = {
    "tiny": None,  # the tiny model itself
    "smollm2-135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, head_dim=64),
    "llama-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=64),
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json",
                   "generation_config.json")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--out-dir", type=Path, default=Path("gpu_serving"), help="logs and JSON reports go here")
    p.add_argument("--parity-prompts", type=int, default=16)
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama-1b")
    p.add_argument("--tokenizer", type=Path, default=None, help="checkpoint directory whose tokenizer to use")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--num-prompts", type=int, default=200, help="requests per rate")
    p.add_argument("--rates", default="8,32,inf", help="comma-separated request rates")
    p.add_argument("--length-scale", type=float, default=1.0, help="ShareGPT lengths times this")
    p.add_argument("--up-args", default="", help="more `pagedserve up` arguments")
    return p.parse_args(argv)


def parity(device: str, dtype: str, num_prompts: int, model_dir: Path) -> dict:
    from transformers import AutoModelForCausalLM

    from pagedserve.engine import Engine
    from shared.sampling import SamplingParams
    from shared.settings import Settings

    rng = torch.Generator().manual_seed(0)
    prompts = [torch.randint(5, 512, (int(n),), generator=rng).tolist()
               for n in torch.randint(16, 64, (num_prompts,), generator=rng)]
    engine = Engine(Settings(model=str(model_dir), device=device, dtype=dtype, num_blocks=256, block_size=16))
    ours = [c.samples[0].token_ids for c in
            engine.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True))]
    del engine
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).to(device).eval()
    theirs = []
    with torch.no_grad():
        for p in prompts:
            out = hf.generate(torch.tensor([p], device=device), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                              do_sample=False)
            theirs.append(out[0, len(p):].tolist())
    first_differences = [next((i for i, (a, b) in enumerate(zip(o, t)) if a != b), None) for o, t in zip(ours, theirs)]
    return {"dtype": dtype, "prompts": num_prompts, "identical": first_differences.count(None),
            "first_differences": [d for d in first_differences if d is not None]}


def write_shaped_model(out: Path, shape: str, tokenizer: Path | None, device: str, tiny: Path) -> Path:
    """A Llama of `shape` with random bfloat16 weights (initialised on `device`: a billion parameters take seconds
    there) and the tokenizer of `tokenizer` (the tiny model's, `tiny`, when None)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    if SHAPES[shape] is None:
        return tiny
    source = tokenizer or tiny
    config = json.loads((source / "config.json").read_text())
    body = LlamaConfig(**SHAPES[shape], vocab_size=config["vocab_size"], max_position_embeddings=8192,
                       rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
                       bos_token_id=config.get("bos_token_id"), eos_token_id=config.get("eos_token_id"),
                       pad_token_id=config.get("pad_token_id"))
    target = out / shape
    with torch.device(device):
        model = LlamaForCausalLM(body).to(torch.bfloat16)
    model.save_pretrained(target, safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copy(source / name, target / name)
    print(f"wrote {shape}: {sum(p.numel() for p in model.parameters()) / 1e9:.2f} B parameters, "
          f"vocabulary {config['vocab_size']}", flush=True)
    return target


def serve(args: argparse.Namespace, model_dir: Path) -> int:
    log = args.out_dir / "up.log"
    started = time.monotonic()
    up = UpProcess.start(["--model", str(model_dir), "--device", args.device, "--workers", "1",
                          "--max-model-len", str(args.max_model_len), "--port", str(free_port()),
                          *args.up_args.split()], log)
    print(f"pagedserve up ready in {time.monotonic() - started:.1f} s at {up.url}", flush=True)
    try:
        return serving.main(["--base-url", up.url, "--model-dir", str(model_dir), "--max-model-len",
                             str(args.max_model_len), "--dataset", "sharegpt", "--length-scale",
                             str(args.length_scale), "--num-prompts", str(args.num_prompts), "--sweep", args.rates,
                             "--label", f"pagedserve-{args.device}-{args.shape}", "--disable-tqdm",
                             "--json-out", str(args.out_dir / "serving.json")])
    finally:
        up.stop()
        kv_lines = [line for line in up.log().splitlines() if "KV cache" in line]
        print("\n".join(kv_lines[:2]), flush=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    if args.device == "cuda":
        print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        models = Path(tmp)
        tiny = write_tiny_model(models / "tiny")
        rows = []
        if args.parity_prompts:
            for dtype in ("float32", "bfloat16"):
                try:
                    row = parity(args.device, dtype, args.parity_prompts, tiny)
                except Exception:  # the serving run still tells what it can
                    traceback.print_exc()
                    continue
                print(f"parity {dtype}: {row['identical']}/{row['prompts']} identical over {NEW_TOKENS} tokens; "
                      f"the others first differ at {row['first_differences']}", flush=True)
                rows.append(row)
            (args.out_dir / "parity.json").write_text(json.dumps(rows, indent=1) + "\n")
        model_dir = write_shaped_model(models, args.shape, args.tokenizer, args.device, tiny)
        return serve(args, model_dir)


if __name__ == "__main__":
    sys.exit(main())
