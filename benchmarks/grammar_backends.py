"""llguidance against xgrammar (vLLM's and SGLang's default backend) on pagedserve's structured-output workload, for
the real model's tokenizer: JSON-schema coverage (which schemas each compiles), compile time, and the time to
compute one token's mask, walked along the real model's own greedy answers (so every mask is one a served request
needs). The choice of llguidance in shared/constraints.py rests on these figures and on it needing no torch.

It imports neither pagedserve's services nor its product code, only the two libraries, so it runs in any venv
that has both (vLLM's CPU build ships both):

    python -m benchmarks.structured_outputs --answers /tmp/answers.json
    /work/vllm-venv/bin/python benchmarks/grammar_backends.py /tmp/answers.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any, Callable

# Schemas past the workload's: features a client's schema may use, for coverage only.
EXTRA_SCHEMAS: dict[str, dict[str, Any]] = {
    "$ref and $defs": {"$defs": {"p": {"type": "object", "properties": {"x": {"type": "integer"}},
                                       "required": ["x"]}}, "type": "array", "items": {"$ref": "#/$defs/p"}},
    "recursive $ref": {"$defs": {"n": {"type": "object", "properties": {"kids": {"type": "array",
                                                                                  "items": {"$ref": "#/$defs/n"}}}}},
                       "$ref": "#/$defs/n"},
    "oneOf": {"oneOf": [{"type": "integer"}, {"type": "string", "maxLength": 3}]},
    "allOf": {"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                        {"type": "object", "properties": {"b": {"type": "string"}}}]},
    "format date-time": {"type": "string", "format": "date-time"},
    "format email": {"type": "string", "format": "email"},
    "minLength/maxLength": {"type": "string", "minLength": 3, "maxLength": 5},
    "exclusiveMinimum": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1},
    "multipleOf": {"type": "integer", "multipleOf": 5},
    "uniqueItems": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True},
    "patternProperties": {"type": "object", "patternProperties": {"^x_": {"type": "integer"}}},
    "prefixItems": {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string"}], "items": False},
    "const object": {"const": {"a": 1}},
    "if/then/else": {"if": {"type": "integer"}, "then": {"minimum": 0}, "else": {"type": "string"}},
    "not": {"not": {"type": "string"}},
}


def _timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


class Llguidance:
    name = "llguidance"

    def __init__(self, model_dir: str, vocab: int, eos: list[int]) -> None:
        import llguidance
        import torch

        self.llg = llguidance
        with open(f"{model_dir}/tokenizer.json") as f:
            self.tokenizer = llguidance.LLTokenizer(f.read(), n_vocab=vocab, eos_token=eos)
        self.words = torch.zeros((vocab + 31) // 32, dtype=torch.int32)

    def compile(self, schema: dict) -> Any:
        grammar = self.llg.LLMatcher.grammar_from_json_schema(json.dumps(schema))
        error = self.llg.LLMatcher.validate_grammar(grammar, self.tokenizer)
        if error:
            raise ValueError(error)
        return grammar

    def matcher(self, compiled: Any) -> Any:
        return self.llg.LLMatcher(self.tokenizer, compiled, log_level=0)

    def mask(self, matcher: Any) -> None:
        matcher.unsafe_compute_mask_ptr(self.words.data_ptr(), self.words.numel() * 4)

    @staticmethod
    def accept(matcher: Any, token: int) -> bool:
        return matcher.consume_token(token)


class Xgrammar:
    name = "xgrammar"

    def __init__(self, model_dir: str, vocab: int, eos: list[int]) -> None:
        import xgrammar
        from transformers import AutoTokenizer

        self.xgr = xgrammar
        info = xgrammar.TokenizerInfo.from_huggingface(AutoTokenizer.from_pretrained(model_dir), vocab_size=vocab,
                                                       stop_token_ids=eos)
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self.bitmask = xgrammar.allocate_token_bitmask(1, vocab)

    def compile(self, schema: dict) -> Any:
        return self.compiler.compile_json_schema(json.dumps(schema))

    def matcher(self, compiled: Any) -> Any:
        return self.xgr.GrammarMatcher(compiled)

    def mask(self, matcher: Any) -> None:
        matcher.fill_next_token_bitmask(self.bitmask)

    @staticmethod
    def accept(matcher: Any, token: int) -> bool:
        return matcher.accept_token(token)


def version(dist: str) -> str:
    from importlib.metadata import version as of

    return of(dist)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("answers", help="the file `python -m benchmarks.structured_outputs --answers FILE` writes")
    args = p.parse_args(argv)
    with open(args.answers) as f:
        saved = json.load(f)
    model_dir = saved["model_dir"]
    with open(f"{model_dir}/config.json") as f:
        config = json.load(f)
    vocab, eos = config["vocab_size"], [config["eos_token_id"]] if isinstance(config["eos_token_id"], int) \
        else config["eos_token_id"]
    answers = [a for a in saved["answers"] if a["finish_reason"] == "stop"]
    print(f"{len(answers)} answers of {len(saved['answers'])} finished; vocabulary {vocab}\n")
    print("| backend | compile ms, median (max) | mask µs per token, median (p99) | answers walked | "
          "workload schemas compiled | extra schemas compiled |\n|---|---|---|---|---|---|")
    for kind in (Llguidance, Xgrammar):
        try:
            backend = kind(model_dir, vocab, eos)
        except ImportError as e:
            print(f"| {kind.name} | not installed here: {e} |")
            continue
        compiles, masks, walked, failed = [], [], 0, 0
        for answer in answers:
            try:
                seconds, compiled = _timed(lambda: backend.compile(answer["schema"]))
            except Exception:  # noqa: BLE001 - as below
                failed += 1
                continue
            compiles.append(seconds)
            matcher = backend.matcher(compiled)
            ok = True
            for token in answer["token_ids"]:
                seconds, _ = _timed(lambda: backend.mask(matcher))
                masks.append(seconds)
                if not backend.accept(matcher, token):
                    ok = False
                    break
            walked += ok
        covered = []
        for name, schema in EXTRA_SCHEMAS.items():
            try:
                backend.compile(schema)
                covered.append(name)
            except Exception:  # noqa: BLE001 - each library raises its own kinds for an unsupported schema
                pass
        masks.sort()
        print(f"| {backend.name} {version(backend.name)} | {statistics.median(compiles) * 1e3:.2f} ({max(compiles) * 1e3:.2f}) | "
              f"{statistics.median(masks) * 1e6:.0f} ({masks[int(len(masks) * 0.99)] * 1e6:.0f}) | "
              f"{walked}/{len(answers)} | {len(answers) - failed}/{len(answers)} | {len(covered)}/{len(EXTRA_SCHEMAS)}: "
              f"not {', '.join(sorted(set(EXTRA_SCHEMAS) - set(covered))) or '-'} |", flush=True)


if __name__ == "__main__":
    main()
