"""The in-process engine (real scheduler core + real worker core) against transformers' generate."""
from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from shared.sampling import SamplingParams
from shared.settings import Settings

NEW = 32
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # ignore_eos, as the requests under test
    return model


def hf_greedy(model, prompt: list[int], new: int = NEW) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False)
    return out[0, len(prompt):].tolist()


def make_prompts(count: int, seed: int, low: int = 3, high: int = 90) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, 512) for _ in range(rng.randrange(low, high))] for _ in range(count)]


def engine(tiny_model_dir, **settings):
    from pagedserve.engine import Engine

    return Engine(Settings(model=str(tiny_model_dir), **settings))


@pytest.mark.parametrize("settings", [
    {},
    {"max_num_batched_tokens": 24, "block_size": 8},  # chunked prefill mixed with decodes
    {"num_blocks": 20},  # too few blocks: preemption by recompute
    {"num_blocks": 20, "preemption_mode": "swap"},
], ids=["plain", "chunked", "recompute", "swap"])
def test_greedy_matches_transformers(tiny_model_dir, hf_model, settings):
    prompts = make_prompts(6, seed=len(settings))
    eng = engine(tiny_model_dir, **settings)
    completions = eng.generate(prompts, GREEDY)
    for prompt, completion in zip(prompts, completions):
        assert completion.error is None
        assert completion.samples[0].token_ids == hf_greedy(hf_model, prompt)
        assert completion.samples[0].finish_reason == "length"
    if "num_blocks" in settings:
        assert eng.cluster.stats(0.0).preemptions > 0


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_a_sequence_gets_the_same_bits_alone_batched_chunked_or_recomputed(tiny_model_dir, dtype):
    """Where the linears are kernels/cpu_linear.c's (bfloat16: AMX tiles, AVX-512 BF16 dot products, or float32
    fused multiply-adds on CPUs without native bfloat16; float32: fused multiply-adds where they beat MKL), every
    op sums a token's values in one order whatever else is in the step, and the attention does too, decode or
    prefill chunk (kernels/cpu_attention.c). So a sequence's logprobs are the same bits alone, in a batch with
    chunked prefills, or preempted and prefilled again, as after a worker's restart."""
    params = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True, logprobs=0)
    prompts = make_prompts(6, seed=21)
    solo = engine(tiny_model_dir, dtype=dtype)
    (registration,) = [w.registration for w in solo.workers.values()]
    if not registration.batch_invariant:
        pytest.skip(f"{dtype}: not batch invariant here (the worker's log names its CPU paths)")
    alone = [solo.generate([prompt], params)[0].samples[0] for prompt in prompts]
    # the same block size throughout, as a restarted worker keeps it: the attention's online softmax rescales
    # block by block, so another block size may round a token's output otherwise
    chunked = engine(tiny_model_dir, dtype=dtype, max_num_batched_tokens=24)
    recompute = engine(tiny_model_dir, dtype=dtype, num_blocks=20)
    for eng in (chunked, recompute):
        samples = [completion.samples[0] for completion in eng.generate(prompts, params)]
        assert [s.token_ids for s in samples] == [s.token_ids for s in alone]
        assert [s.logprobs for s in samples] == [s.logprobs for s in alone]
    assert recompute.cluster.stats(0.0).preemptions > 0


def hf_greedy_edited(model, prompt: list[int], bias: dict[int, float], allowed: list[int] | None = None) -> list[int]:
    """transformers' greedy generate with `bias` added to its logits (and tokens outside `allowed` ruled out)."""
    from transformers import LogitsProcessor, LogitsProcessorList

    class Edit(LogitsProcessor):
        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
            if allowed is not None:
                kept = torch.full_like(scores, float("-inf"))
                kept[:, allowed] = scores[:, allowed]
                scores = kept
            for token, value in bias.items():
                scores[:, token] += value
            return scores

    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False,
                         logits_processor=LogitsProcessorList([Edit()]))
    return out[0, len(prompt):].tolist()


def test_logit_bias_and_allowed_tokens_steer_greedy_as_they_do_transformers_logits(tiny_model_dir, hf_model):
    prompts = make_prompts(3, seed=31)
    eng = engine(tiny_model_dir)
    favourite = hf_greedy(hf_model, prompts[0])[0]
    cases = [{17: 100.0}, {favourite: -100.0}, {17: 2.5, 40: -1.5, 300: 4.0}]
    for bias in cases:
        params = dataclasses.replace(GREEDY, logit_bias=sorted(bias.items()))
        for prompt, completion in zip(prompts, eng.generate(prompts, params)):
            assert completion.samples[0].token_ids == hf_greedy_edited(hf_model, prompt, bias), bias
    forced = eng.generate(prompts, dataclasses.replace(GREEDY, logit_bias=[(17, 100.0)]))
    assert all(c.samples[0].token_ids == [17] * NEW for c in forced), "+100 makes greedy choose it"
    banned = eng.generate(prompts[:1], dataclasses.replace(GREEDY, logit_bias=[(favourite, -100.0)]))
    assert favourite not in banned[0].samples[0].token_ids, "-100 bans it"
    allowed = [5, 40, 41, 300]
    only = eng.generate(prompts, dataclasses.replace(GREEDY, allowed_token_ids=allowed, logit_bias=[(41, 1.0)]))
    for prompt, completion in zip(prompts, only):
        assert set(completion.samples[0].token_ids) <= set(allowed)
        assert completion.samples[0].token_ids == hf_greedy_edited(hf_model, prompt, {41: 1.0}, allowed)


def test_prefix_hits_are_read_not_recomputed(tiny_model_dir, hf_model):
    eng = engine(tiny_model_dir)
    shared = make_prompts(1, seed=11, low=70, high=71)[0]
    first, second = shared + [9, 10], shared + [11, 12, 13]
    eng.generate([first], GREEDY)
    before = eng.cluster.stats(0.0).workers[0].prefix_hits
    (completion,) = eng.generate([second], GREEDY)
    assert eng.cluster.stats(0.0).workers[0].prefix_hits - before >= 64
    assert completion.samples[0].token_ids == hf_greedy(hf_model, second)


def test_parallel_samples_share_the_prompt_and_are_reproducible(tiny_model_dir):
    params = SamplingParams(n=4, temperature=1.0, seed=1234, max_tokens=16, ignore_eos=True)
    prompt = make_prompts(1, seed=12, low=40, high=41)[0]
    alone = engine(tiny_model_dir).generate([prompt], params)[0]
    crowd = engine(tiny_model_dir, max_num_batched_tokens=32).generate(
        make_prompts(3, seed=13) + [prompt], [GREEDY] * 3 + [params])[-1]
    samples = [s.token_ids for s in alone.samples]
    assert samples == [s.token_ids for s in crowd.samples], "seeded samples ignore batch composition"
    assert len({tuple(s) for s in samples}) > 1, "different samples draw differently"


def test_abort_frees_blocks(tiny_model_dir):
    eng = engine(tiny_model_dir)
    rid = eng.add_request(make_prompts(1, seed=14)[0], SamplingParams(temperature=0.0, max_tokens=200))
    for _ in range(3):
        eng.step()
    total = eng.cluster.stats(0.0).workers[0]
    assert total.free_blocks < total.num_blocks
    eng.abort(rid)
    eng.step()
    after = eng.cluster.stats(0.0).workers[0]
    assert after.free_blocks == after.num_blocks and not eng.has_unfinished()


def test_never_fitting_request_is_rejected(tiny_model_dir):
    eng = engine(tiny_model_dir, num_blocks=4)
    (completion,) = eng.generate([list(range(5, 105))], GREEDY)
    assert completion.error and "block" in completion.error
