"""The `pagedserve` command. Each subcommand imports what it needs when it runs (torch only where used)."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from shared.sampling import ParamError, SamplingParams
from shared.settings import Settings, SettingsError


def _tiny_model(args: argparse.Namespace) -> int:
    from pagedserve.tiny_model import write_tiny_model

    out = write_tiny_model(args.dir)
    print(f"wrote the tiny model to {out}")
    return 0


def _generate(args: argparse.Namespace) -> int:
    from transformers import AutoTokenizer

    from pagedserve.engine import Engine
    from shared.model_dir import resolve_model_dir

    settings = Settings.from_args(args)
    params = SamplingParams(n=args.n, max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed, ignore_eos=args.ignore_eos).validate()
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_dir(settings.model).path, local_files_only=True)
    engine = Engine(settings, num_workers=1)
    prompts = [tokenizer(p).input_ids for p in args.prompt]
    for text, completion in zip(args.prompt, engine.generate(prompts, params)):
        if completion.error:
            print(f"error: {completion.error}", file=sys.stderr)
            continue
        for sample in completion.samples:
            print(f"{text}{tokenizer.decode(sample.token_ids)}\n[finish: {sample.finish_reason}]")
    return 0


# The settings the in-process engine reads (the scheduler and worker cores); the rest configure services.
ENGINE_SETTINGS = ("model", "simulate", "dtype", "device", "attention_backend", "cpu_kernels",
                   "require_batch_invariance", "compute_threads", "cpu_cores",
                   "max_model_len", "block_size", "kv_cache_bytes", "gpu_memory_utilization", "num_blocks",
                   "swap_space_bytes", "enable_prefix_caching", "max_num_seqs", "max_num_batched_tokens",
                   "preemption_mode", "watermark", "async_scheduling")

# Services parse their own flags (every setting); `pagedserve NAME ...` hands them the rest of the line.
SERVICES = {"gateway": ("gateway.__main__", "run the OpenAI-compatible gateway"),
            "scheduler": ("scheduler.service", "run the scheduler service"),
            "worker": ("gpu_worker.service", "run a GPU worker service")}


def _up(args: argparse.Namespace) -> int:
    from pagedserve import launcher

    return launcher.main(args)


def _bench(argv: list[str]) -> int:
    from pagedserve.bench import main as bench_main

    return bench_main(argv)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedserve", description="LLM serving with PagedAttention")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("tiny-model", help="write the built-in tiny Llama checkpoint to DIR")
    p.add_argument("dir", type=Path)
    p.set_defaults(func=_tiny_model)

    p = sub.add_parser("generate", help="complete prompts offline with the in-process engine")
    p.add_argument("--prompt", action="append", required=True, help="prompt text (repeat for a batch)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("-n", type=int, default=1, dest="n")
    p.add_argument("--ignore-eos", action="store_true")
    Settings.add_arguments(p, only=ENGINE_SETTINGS)
    p.set_defaults(func=_generate)

    p = sub.add_parser("up", help="start a local stack: redis-server, scheduler, workers, gateway")
    from pagedserve.launcher import add_arguments

    add_arguments(p)
    p.set_defaults(func=_up)

    sub.add_parser("bench", add_help=False,
                   help="serving benchmark against an OpenAI-compatible endpoint (see `pagedserve bench --help`)")
    for name, (_, text) in SERVICES.items():
        sub.add_parser(name, help=f"{text} (see `pagedserve {name} --help`)", add_help=False)
    return parser


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "bench":
        sys.exit(_bench(argv[1:]))
    if argv and argv[0] in SERVICES:
        import importlib

        sys.exit(importlib.import_module(SERVICES[argv[0]][0]).main(argv[1:]) or 0)
    args = build_parser().parse_args(argv)
    try:
        sys.exit(args.func(args))
    except (SettingsError, ParamError) as e:
        print(f"pagedserve: error: {e}", file=sys.stderr)
        sys.exit(2)
