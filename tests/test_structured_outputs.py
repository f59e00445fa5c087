"""Structured outputs on the worker: whatever the model (here the tiny random one, the most unruly there is), a
constrained output matches its constraint, checked by its own oracle (jsonschema, the regular expression, the
choices, a Lark parser); its grammar is rebuilt from its tokens when it starts again (so a recomputed or resumed
request continues exactly); a grammar that fails fails its request alone; the gateway refuses what does not compile.
The real model's constrained outputs and a worker killed under them: tests/test_real_model.py."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest
from kernel_builds import kernel  # noqa: F401 (fixture)
from plan_builder import PlanBuilder, run_until, step
from test_gateway_http import HI, KEYS, LiveGateway, answer, check_error

from shared.sampling import Constraint, SamplingParams
from shared.settings import Settings

COMPACT_SCHEMAS = [  # what the tiny model can finish in a few dozen tokens: bounded strings, numbers and lists
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                      "ok": {"type": "boolean"}, "kind": {"enum": ["cat", "dog"]}},
     "required": ["name", "age", "ok", "kind"], "additionalProperties": False},
    {"type": "array", "items": {"type": "integer", "minimum": -9, "maximum": 9}, "minItems": 2, "maxItems": 4},
    {"type": "object", "properties": {"point": {"type": "object", "properties": {
        "x": {"type": "integer", "minimum": 0, "maximum": 99}, "y": {"type": "integer", "minimum": -5, "maximum": 5}},
        "required": ["x", "y"], "additionalProperties": False},
        "tags": {"type": "array", "items": {"type": "string", "pattern": "^[a-z]{1,3}$"}, "maxItems": 2}},
     "required": ["point", "tags"], "additionalProperties": False},
    {"anyOf": [{"type": "null"}, {"type": "string", "enum": ["on", "off"]}]},
]
REGEX = r"[0-9]{3}-[a-z]{2,4}"
CHOICES = ["yes", "no", "perhaps not"]
LARK = 'start: greeting " " name\ngreeting: "hello" | "hi"\nname: /[A-Z][a-z]{1,5}/'
GBNF = 'root ::= "(" [0-9]+ " + " [0-9]+ ")"'
GRAMMARS = {LARK: r"(hello|hi) [A-Z][a-z]{1,5}", GBNF: r"\([0-9]+ \+ [0-9]+\)"}  # each grammar's language, as a regex


def engine(tiny_model_dir, **settings):
    from pagedserve.engine import Engine

    return Engine(Settings(model=str(tiny_model_dir), dtype="float32", **settings))


def matches(constraint: Constraint, text: str) -> bool:
    if constraint.kind == "json_schema":
        try:
            jsonschema.validate(json.loads(text), json.loads(constraint.spec))
        except (ValueError, jsonschema.ValidationError):
            return False
        return True
    if constraint.kind == "regex":
        return re.fullmatch(constraint.spec, text) is not None
    if constraint.kind == "choice":
        return text in json.loads(constraint.spec)
    return re.fullmatch(GRAMMARS[constraint.spec], text) is not None


CONSTRAINTS = [*(Constraint("json_schema", json.dumps(s), compact=True) for s in COMPACT_SCHEMAS),
               Constraint("json_schema", '{"type": "object", "maxProperties": 0}'),
               Constraint("regex", REGEX), Constraint("choice", json.dumps(CHOICES)), Constraint("grammar", LARK),
               Constraint("grammar", GBNF)]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def test_every_kind_of_constraint_holds_greedy_seeded_and_in_parallel_samples(tiny_model_dir, tokenizer):
    eng = engine(tiny_model_dir)
    prompts = [tokenizer(p).input_ids for p in ("Hello", "The blocks of a sequence", "🚀")]
    for constraint in CONSTRAINTS:
        kinds = [SamplingParams(temperature=0.0, max_tokens=80, constraint=constraint),
                 SamplingParams(temperature=1.0, seed=7, max_tokens=80, constraint=constraint),
                 SamplingParams(n=3, temperature=1.2, seed=11, max_tokens=80, constraint=constraint)]
        for completion in eng.generate(prompts, kinds):
            assert completion.error is None, completion.error
            for sample in completion.samples:
                text = tokenizer.decode(sample.token_ids, skip_special_tokens=True)
                assert sample.finish_reason == "stop" and matches(constraint, text), (constraint, text)


def test_unconstrained_sequences_in_a_batch_with_constrained_ones_are_untouched(tiny_model_dir, tokenizer):
    prompts = [tokenizer(p).input_ids for p in ("Hello", "Once upon a time")]
    plain = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    alone = engine(tiny_model_dir).generate(prompts, plain)
    mixed = engine(tiny_model_dir).generate(prompts + prompts, [plain, plain] + [
        SamplingParams(temperature=0.0, max_tokens=40, constraint=c) for c in CONSTRAINTS[:2]])
    assert [c.samples[0].token_ids for c in mixed[:2]] == [c.samples[0].token_ids for c in alone]


def test_a_constrained_request_preempted_and_recomputed_goes_on_exactly(tiny_model_dir, tokenizer):
    """Recompute re-sends a request with the tokens it had: its grammar replays them, and it continues as if it
    had never stopped (the same path as a request moved off a dead worker)."""
    prompts = [tokenizer(p).input_ids * 3 for p in ("Hello there", "The blocks of a sequence", "Größe 東京")]
    params = [SamplingParams(temperature=t, seed=5, max_tokens=80, constraint=c)
              for t, c in zip((0.0, 1.0, 0.7), CONSTRAINTS[:3])]
    roomy = engine(tiny_model_dir).generate(prompts, params)
    tight = engine(tiny_model_dir, num_blocks=14, block_size=8)
    squeezed = tight.generate(prompts, params)
    assert tight.cluster.stats(0.0).preemptions > 0
    assert [c.samples[0].token_ids for c in squeezed] == [c.samples[0].token_ids for c in roomy]


def test_a_grammar_that_rejects_a_resumed_output_fails_that_request_alone(tiny_model_dir, tokenizer):
    from gpu_worker.worker import Worker

    worker = Worker.load(Settings(model=str(tiny_model_dir), block_size=8, num_blocks=64, swap_space_bytes=0),
                         progress=False)
    builder = PlanBuilder(worker.registration.worker_id, 64, 8)
    digits = SamplingParams(temperature=0.0, max_tokens=20, constraint=Constraint("regex", "[0-9]+"))
    good = builder.add(tokenizer("Count").input_ids, digits, outputs=tokenizer("12", add_special_tokens=False).input_ids)
    bad = builder.add(tokenizer("Count").input_ids, digits, outputs=tokenizer("ab", add_special_tokens=False).input_ids)
    plain = builder.add(tokenizer("Hello").input_ids)
    for seq in (good, bad, plain):
        builder.schedule(seq)
    failures = step(worker, builder).result.refused
    assert [f.rid for f in failures] == [bad.rid] and "breaks its constraint" in failures[0].error
    builder.drop(bad)
    run_until(worker, builder, [good, plain], 6)
    text = tokenizer.decode(good.outputs, skip_special_tokens=True)
    assert re.fullmatch("[0-9]+", text) and text.startswith("12"), text


BAD = [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format", "does not compile"),
    ({"structured_outputs": {"regex": "([a-z"}}, "structured_outputs", "does not compile"),
    ({"structured_outputs": {"grammar": "start: ("}}, "structured_outputs", "does not compile"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one of"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs", "non-empty array"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "schema"),
    ({"response_format": {"type": "xml"}}, "response_format", "xml"),
    ({"guided_json": {"type": "object"}, "guided_regex": "a"}, "guided_regex", "send one constraint"),
    ({"guided_json": "{not json"}, "guided_json", "not JSON"),
    ({"guided_regex": "[0-9]+", "ignore_eos": True}, "ignore_eos", "constrained"),
    ({"guided_regex": "[0-9]+", "min_tokens": 2}, "min_tokens", "constrained"),
    ({"guided_regex": "[0-9]+", "use_beam_search": True, "best_of": 2}, "best_of", "constrained"),
    ({"structured_outputs": {"regex": "(x[a-z]{1,9}y)" * 100_000}}, "structured_outputs",
     "too big"),  # past llguidance's limits: refused at once, never on a worker
]


@pytest.mark.parametrize("fields, param, fragment", BAD, ids=[b[2] + ":" + b[1] for b in BAD])
def test_a_constraint_the_worker_could_not_run_is_a_400_naming_it_before_anything_is_queued(
        redis_url, tiny_model_dir, fields, param, fragment):
    from gateway.model import ServedModel

    model = ServedModel.load(Settings(model=str(tiny_model_dir)))
    with LiveGateway(Settings(model=str(tiny_model_dir), redis_url=redis_url), model, answer(model, ["x"])) as gw:
        for route, body in (("/v1/completions", {"prompt": "hi"}), ("/v1/chat/completions", {"messages": HI})):
            check_error(gw.post(route, json=body | fields), 400, param, fragment)
    import redis

    assert redis.Redis.from_url(redis_url).xlen(KEYS.requests) == 0


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("vocab", [512, 1000])  # a whole number of 32-bit words, and not
def test_the_mask_leaves_exactly_the_allowed_tokens_of_exactly_the_constrained_rows(dtype, vocab, kernel):
    """kernels/cpu_mask.c (each build) and torch's unpacking (no kernels) against each bit read one by one."""
    import torch

    from gpu_worker.structured import SequenceGrammar, mask_disallowed

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(5, vocab, generator=gen).to(getattr(torch, dtype))
    rows = [0, 2, 3]
    grammars = []
    for kind in ("random", "none", "all"):
        g = SequenceGrammar(None, vocab)
        g.words = {"random": torch.randint(-2**31, 2**31 - 1, (g.words.numel(),), dtype=torch.int32, generator=gen),
                   "none": torch.zeros_like(g.words), "all": torch.full_like(g.words, -1)}[kind]
        grammars.append(g)
    expected = logits.clone()
    for row, g in zip(rows, grammars):
        for t in range(vocab):
            if not (int(g.words[t // 32]) >> (t % 32)) & 1:
                expected[row, t] = float("-inf")
    for contiguous, library in ((True, kernel), (False, kernel), (True, None)):  # a strided view: torch's path
        got = logits.clone() if contiguous else logits.t().contiguous().t()
        mask_disallowed(got, rows, grammars, library)
        assert torch.equal(got, expected)
