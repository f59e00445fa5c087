"""Draft-free speculative decoding: greedy and seeded outputs are token for token those without it (every parity
architecture, float32 and bfloat16 on the CPU kernels), unseeded draws keep the model's distribution (against
transformers' softmax), the scheduler gives back what rejected tokens took, and bad configs are refused."""
from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
from worker_oracle import ARCHS, Transformers, prompts, single_thread, write_tiny  # noqa: F401 (fixture)

from gpu_worker.proposers import NgramIndex
from gpu_worker.sampler import Sampler
from gpu_worker.sequence import SequenceState
from pagedserve.engine import Engine
from shared.sampling import SamplingParams
from shared.settings import Settings, SettingsError

# 1-grams match often in a tiny model's 256-token vocabulary: drafts get checked, some accepted, some not.
NGRAM = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}'
SUFFIX = '{"method": "suffix", "num_speculative_tokens": 4}'
NEW = 48


def repeating_prompts() -> list[list[int]]:
    """Prompts that repeat themselves, as text that quotes its context does."""
    return [p * 2 for p in prompts([7, 12, 20, 30], seed=3)]


def run(model_dir, prompts_: list[list[int]], params, **settings):
    engine = Engine(Settings(model=str(model_dir), **settings))
    completions = engine.generate(prompts_, params)
    assert all(c.error is None for c in completions)
    return [[s.token_ids for s in c.samples] for c in completions], engine.cluster.stats(0.0).workers[0]


def drafted_both_ways(stats) -> bool:
    """Drafts were checked, and some of their tokens accepted and some rejected: both paths ran."""
    return stats.drafts > 0 and 0 < stats.accepted_tokens < stats.draft_tokens


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_outputs_with_speculation_are_those_without_it_token_for_token(arch, dtype, tmp_path, single_thread):
    model_dir = write_tiny(arch, tmp_path / arch)
    greedy = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
    without, _ = run(model_dir, repeating_prompts(), greedy, dtype=dtype, attention_backend="cpu")
    with_, stats = run(model_dir, repeating_prompts(), greedy, dtype=dtype, attention_backend="cpu",
                       speculative_config=NGRAM)
    assert with_ == without
    assert drafted_both_ways(stats)
    assert stats.accepted_at[0] >= stats.accepted_at[-1] and sum(stats.accepted_at) == stats.accepted_tokens
    if dtype == "float32":  # and both are transformers' own
        oracle = Transformers(model_dir)
        assert [out[0] for out in without] == [oracle.greedy(p, NEW) for p in repeating_prompts()]


def test_suffix_decoding_learns_from_finished_outputs_and_leaves_greedy_outputs_unchanged(tmp_path, single_thread):
    model_dir = write_tiny("llama", tmp_path / "llama")
    greedy = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
    batch = prompts([9, 9, 9], seed=5)
    engine = Engine(Settings(model=str(model_dir), dtype="float32", speculative_config=SUFFIX))
    first = [c.samples[0].token_ids for c in engine.generate(batch, greedy)]
    before = engine.cluster.stats(0.0).workers[0].accepted_tokens
    again = [c.samples[0].token_ids for c in engine.generate(batch, greedy)]  # the same requests once more
    stats = engine.cluster.stats(0.0).workers[0]
    without, _ = run(model_dir, batch, greedy, dtype="float32")
    assert first == again == [out[0] for out in without]
    # the second time, the finished outputs the worker indexed predict each output: most drafts are accepted
    assert stats.accepted_tokens - before > NEW


@pytest.mark.parametrize("settings", [
    {},
    {"async_scheduling": False},
    {"num_blocks": 14, "block_size": 8},  # preemption by recompute, drafts rolled back across block edges
    {"num_blocks": 14, "block_size": 8, "preemption_mode": "swap"},
], ids=["async", "sync", "recompute", "swap"])
def test_seeded_samples_with_speculation_are_those_without_it_and_every_block_comes_back(tmp_path, settings,
                                                                                         single_thread):
    """Seeded draws are a pure function of (seed, sample, position): a draft changes which rows are computed
    together, never a token. n = 2 shares the prompt's blocks (copy-on-write) while each sample drafts."""
    model_dir = write_tiny("qwen2", tmp_path / "qwen2")
    params = [SamplingParams(temperature=0.5, seed=7, n=2, max_tokens=NEW, ignore_eos=True, presence_penalty=0.1),
              SamplingParams(temperature=0.3, top_p=0.9, seed=11, max_tokens=NEW, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True, repetition_penalty=1.05),
              SamplingParams(temperature=0.4, top_k=5, seed=3, max_tokens=NEW, ignore_eos=True, logprobs=2)]
    without, _ = run(model_dir, repeating_prompts(), params, dtype="float32", **settings)
    engine = Engine(Settings(model=str(model_dir), dtype="float32", speculative_config=NGRAM, **settings))
    completions = engine.generate(repeating_prompts(), params)
    assert [[s.token_ids for s in c.samples] for c in completions] == without
    stats = engine.cluster.stats(0.0)
    assert drafted_both_ways(stats.workers[0])
    if "num_blocks" in settings:
        assert stats.preemptions > 0
    ws = engine.cluster.workers["worker-0"]
    assert ws.kv.pool.num_free == ws.kv.pool.num_usable and not ws.kv.seqs and not ws.kv.swapped


def test_a_draft_ends_where_its_stop_token_or_max_tokens_does(tmp_path, single_thread):
    model_dir = write_tiny("gpt2", tmp_path / "gpt2")
    greedy = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
    without, _ = run(model_dir, repeating_prompts(), greedy, dtype="float32")
    # a stop token the outputs hold, and a max_tokens short of where a draft would reach
    stop = without[1][0][20]
    params = [SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True, stop_token_ids=[stop]),
              SamplingParams(temperature=0.0, max_tokens=13, ignore_eos=True)]
    for p in params:
        expected, _ = run(model_dir, repeating_prompts(), p, dtype="float32")
        got, _ = run(model_dir, repeating_prompts(), p, dtype="float32", speculative_config=NGRAM)
        assert got == expected
    assert all(len(out[0]) <= 13 for out in got)


def test_a_worker_running_more_sequences_than_disable_by_batch_size_checks_no_draft(tmp_path, single_thread):
    model_dir = write_tiny("gpt2", tmp_path / "gpt2")
    greedy = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
    four = repeating_prompts()  # four sequences run together until they all end
    limited = NGRAM.replace("}", ', "disable_by_batch_size": %d}')
    _, over = run(model_dir, four, greedy, dtype="float32", speculative_config=limited % 3)
    _, within = run(model_dir, four, greedy, dtype="float32", speculative_config=limited % 4)
    assert over.drafts == 0 and within.drafts > 0


def chi_square_bound(df: int, z: float = 3.29) -> float:
    """The chi-square statistic's upper 0.05 % point (Wilson-Hilferty): a correct sampler passes all but 1 in 2,000
    seeds; the test is seeded, so it passes or fails the same way every run."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def chi_square(counts: Counter, probs: torch.Tensor, total: int) -> tuple[float, int]:
    """Pearson's statistic over tokens expected at least 5 times, the rest pooled; with its degrees of freedom."""
    expected = probs * total
    big = [t for t in range(len(probs)) if expected[t] >= 5]
    stat = sum((counts[t] - expected[t].item()) ** 2 / expected[t].item() for t in big)
    rest_expected = total - sum(expected[t].item() for t in big)
    rest = total - sum(counts[t] for t in big)
    if rest_expected >= 5:
        stat += (rest - rest_expected) ** 2 / rest_expected
        return stat, len(big)
    return stat, len(big) - 1


def test_unseeded_draws_with_a_draft_keep_the_models_distribution(tmp_path, single_thread):
    """Each of many sequences checks the draft [d] after the same prompt: its first token must follow the model's
    softmax (and d be accepted as often as the model draws it), and the token after an accepted d the model's
    softmax after d: Leviathan et al.'s guarantee, checked against transformers' own logits."""
    from gpu_worker.model_runner import ModelRunner

    model_dir = write_tiny("llama", tmp_path / "llama")
    temperature, copies, rounds = 1.0, 400, 5
    prompt = prompts([8], seed=9)[0]
    oracle = Transformers(model_dir)
    first = (oracle.logprobs(prompt)[-1] / temperature).softmax(-1)
    draft = first.argmax().item()  # the likeliest token, drawn about one time in nine: accepted now and then
    after = (oracle.logprobs(prompt + [draft])[-1] / temperature).softmax(-1)
    runner = ModelRunner(Settings(model=str(model_dir), dtype="float32", num_blocks=8, attention_backend="cpu"),
                         model_dir, progress=False)
    runner.sampler = Sampler(runner.device, seed=1234)
    params = SamplingParams(temperature=temperature, max_tokens=4)
    firsts, seconds = Counter(), Counter()
    for r in range(rounds):
        seqs = [SequenceState(r * copies + i, f"r{i}", 0, params, list(prompt), len(prompt), [1])
                for i in range(copies)]  # one shared block: every copy writes the same keys and values there
        out = runner.execute([(s, 0, len(prompt)) for s in seqs], [], {s.seq_id: [draft] for s in seqs})
        tokens: dict[int, list[int]] = {}
        for seq, token in out:
            tokens.setdefault(seq.seq_id, []).append(token.token_id)
        assert len(tokens) == copies
        for got in tokens.values():
            firsts[got[0]] += 1
            assert len(got) == (2 if got[0] == draft else 1)
            if len(got) == 2:
                seconds[got[1]] += 1
    total = copies * rounds
    stat, df = chi_square(firsts, first, total)
    assert stat < chi_square_bound(df), (stat, df)
    accepted = sum(seconds.values())
    assert accepted == firsts[draft] and accepted > 100
    stat, df = chi_square(seconds, after, accepted)
    assert stat < chi_square_bound(df), (stat, df)


def test_the_ngram_index_proposes_what_followed_the_latest_match_and_repeats_a_pattern():
    index = NgramIndex(1, 3)
    tokens = [5, 6, 7, 8, 9, 5, 6, 7]
    index.extend(tokens)
    assert index.propose(tokens, 3) == [8, 9, 5]  # [5, 6, 7] matched at its first place
    tokens += [1, 2]
    index.extend(tokens)
    assert index.propose(tokens, 2) == []  # nothing ever followed [7, 1, 2], [1, 2] or [2]
    repeating = [3, 4, 3, 4, 3]
    index = NgramIndex(2, 2)
    index.extend(repeating)
    assert index.propose(repeating, 5) == [4, 3, 4, 3, 4]  # the copy runs on through its own draft


@pytest.mark.parametrize("config, error", [
    ('{"method": "eagle", "num_speculative_tokens": 3}', "method must be one of ngram, suffix"),
    ('{"method": "ngram"}', "num_speculative_tokens is required"),
    ('{"method": "ngram", "num_speculative_tokens": 3, "model": "draft"}', "unsupported field(s) model"),
    ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens must be in 1-16"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5}', "prompt_lookup_min <= "),
    ('{"method": "ngram", "num_speculative_tokens": "2"}', "num_speculative_tokens must be int"),
    ("ngram", "not JSON"),
])
def test_a_speculative_config_pagedserve_cannot_use_is_refused_naming_the_field(config, error):
    with pytest.raises(SettingsError, match="speculative_config") as e:
        Settings(speculative_config=config)
    assert error in str(e.value)
