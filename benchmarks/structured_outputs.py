"""What structured outputs cost on the real model (SmolLM2-135M-Instruct), in the in-process engine (the worker's
own code): the decode step with 0, 16 and 64 of 64 sequences constrained, the part of it spent on the grammars
(llguidance's mask and the -inf fill), and compiling each of the workload's twenty schemas, cold and cached.
TPOT is the step time: every sequence of a step gets one token from it, constrained or not.

    python -m benchmarks.structured_outputs                 # float32, 64 sequences, 48 timed steps
    python -m benchmarks.structured_outputs --dtype bfloat16 --constrained 0,16,64
    python -m benchmarks.structured_outputs --answers /tmp/answers.json  # the workload's greedy answers, saved
                                                                           # for benchmarks/grammar_backends.py
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from contextlib import contextmanager
from typing import Iterator

from benchmarks.step_profile import Clock
from benchmarks.structured_workload import SCHEMAS
from shared.model_dir import CHAT_MODEL_NAME, resolve_model_dir
from shared.sampling import Constraint, SamplingParams
from shared.settings import Settings

# Every constrained sequence keeps decoding for the whole run: it may not end before 40 items of its array.
LONG = {"type": "array", "minItems": 40, "maxItems": 40, "items": {
    "type": "object", "properties": {"thing": {"type": "string", "pattern": "^[a-z]{2,10}$"},
                                     "count": {"type": "integer", "minimum": 1, "maximum": 9}},
    "required": ["thing", "count"], "additionalProperties": False}}


@contextmanager
def grammar_clock() -> Iterator[Clock]:
    """Wall seconds of the worker's grammar work: on its own thread ("thread": SequenceGrammar.prepare, a first
    compile, the tokens since the last step, the mask), and on the step's path ("path": the sampler's
    mask_disallowed, waiting for that work where it outlasts the forward pass, then the fill)."""
    from gpu_worker import sampler, structured

    clock = Clock(now=time.perf_counter)
    prepare, fill = structured.SequenceGrammar.prepare, sampler.mask_disallowed
    structured.SequenceGrammar.prepare = clock.wrap("thread", prepare)
    sampler.mask_disallowed = clock.wrap("path", fill)
    try:
        yield clock
    finally:
        structured.SequenceGrammar.prepare, sampler.mask_disallowed = prepare, fill


def step_times(model_path, dtype: str, sequences: int, constrained: int, steps: int
               ) -> tuple[list[float], dict[str, float]]:
    """Decode step times (seconds) with `constrained` of `sequences` constrained, and grammar_clock's seconds."""
    from transformers import AutoTokenizer

    from pagedserve.engine import Engine

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    engine = Engine(Settings(model=str(model_path), dtype=dtype, max_num_seqs=sequences, kv_cache_bytes=512 << 20))
    warm = steps + 8
    for i in range(sequences):
        question = SCHEMAS[i % len(SCHEMAS)][0] + f" (item {i})"
        ids = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                            return_dict=True)["input_ids"]
        if i < constrained:
            params = SamplingParams(temperature=0.0, max_tokens=warm,
                                    constraint=Constraint("json_schema", json.dumps(LONG)))
        else:
            params = SamplingParams(temperature=0.0, max_tokens=warm, ignore_eos=True)
        engine.add_request(list(ids), params)
    while True:  # prefill, until every sequence decodes
        engine.step()
        if all(len(c.samples[0].token_ids) >= 2 for c in engine.completions.values()):
            break
    times = []
    with grammar_clock() as clock:
        for _ in range(steps):
            start = time.perf_counter()
            outputs = engine.step()
            times.append(time.perf_counter() - start)
            assert len(outputs) == sequences, "every sequence decodes in every timed step"
    return times, clock.seconds


def compile_times(model_path) -> list[tuple[float, float, float]]:
    """Per schema: the gateway's check (cold), the worker's first matcher (compile), its second (cached)."""
    from gpu_worker.structured import Grammars, SequenceGrammar
    from shared import constraints
    from shared.model_dir import eos_token_ids, read_config, vocab_size

    vocab = vocab_size(read_config(model_path))
    eos = list(eos_token_ids(model_path))
    llg = constraints.tokenizer((model_path / "tokenizer.json").read_text(), vocab, eos)
    grammars = Grammars(model_path, vocab, eos)
    out = []
    for _, schema in SCHEMAS:
        constraint = Constraint("json_schema", json.dumps(schema))
        t0 = time.perf_counter()
        constraints.check(constraint, llg)
        t1 = time.perf_counter()
        for _ in range(2):  # the first compiles, the second copies the cached grammar
            SequenceGrammar(constraint, vocab).prepare(grammars, [])
        t2 = time.perf_counter()
        grammar = SequenceGrammar(constraint, vocab)
        grammar.prepare(grammars, [])
        t3 = time.perf_counter()
        assert grammar.error is None, grammar.error
        out.append((t1 - t0, t2 - t1 - (t3 - t2), t3 - t2))
    return out


def save_answers(model_path, path: str) -> None:
    """Each workload question's greedy constrained answer (token ids and text), for benchmarks/grammar_backends.py."""
    from transformers import AutoTokenizer

    from pagedserve.engine import Engine

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    engine = Engine(Settings(model=str(model_path), dtype="float32"))
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                             return_dict=True)["input_ids"] for q, _ in SCHEMAS]
    params = [SamplingParams(temperature=0.0, max_tokens=200, constraint=Constraint("json_schema", json.dumps(schema)))
              for _, schema in SCHEMAS]
    answers = []
    for (question, schema), completion in zip(SCHEMAS, engine.generate(prompts, params)):
        ids = completion.samples[0].token_ids
        answers.append({"question": question, "schema": schema, "token_ids": ids,
                        "text": tokenizer.decode(ids, skip_special_tokens=True),
                        "finish_reason": completion.samples[0].finish_reason})
    with open(path, "w") as f:
        json.dump({"model_dir": str(model_path), "answers": answers}, f, indent=1)
    print(f"{len(answers)} answers written to {path}")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--sequences", type=int, default=64)
    p.add_argument("--constrained", default="0,16,64", help="constrained sequences per run, comma-separated")
    p.add_argument("--steps", type=int, default=48)
    p.add_argument("--answers", help="only save the workload's greedy answers to this JSON file")
    args = p.parse_args(argv)
    model_path = resolve_model_dir(CHAT_MODEL_NAME).path
    if args.answers:
        save_answers(model_path, args.answers)
        return

    print(f"## Compile, {len(SCHEMAS)} schemas (ms: median, max)")
    times = compile_times(model_path)
    print("| stage | median ms | max ms |\n|---|---:|---:|")
    for name, column in (("gateway check (cold)", 0), ("worker: compile", 1), ("worker: cached copy + first mask", 2)):
        values = [t[column] * 1e3 for t in times]
        print(f"| {name} | {statistics.median(values):.2f} | {max(values):.2f} |")

    print(f"\n## Decode step, {args.sequences} sequences, {args.dtype} ({args.steps} steps each)")
    print("| constrained | step p50 ms | step mean ms | grammar work ms per step (its thread) | on the step's path "
          "ms (wait + fill) | path share of the step | step vs none |\n|---:|---:|---:|---:|---:|---:|---:|")
    base = None
    for k in (int(x) for x in args.constrained.split(",")):
        steps, grammar = step_times(model_path, args.dtype, args.sequences, k, args.steps)
        mean = statistics.fmean(steps)
        base = base or mean
        print(f"| {k} | {statistics.median(steps) * 1e3:.1f} | {mean * 1e3:.1f} | "
              f"{grammar['thread'] / len(steps) * 1e3:.2f} | {grammar['path'] / len(steps) * 1e3:.2f} | "
              f"{grammar['path'] / sum(steps):.1%} | {mean / base:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
