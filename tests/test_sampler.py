"""The sampler on hand-made logits: exact masks, penalties against their formula, seeded draws that
ignore the batch, and chi-square tests that draws follow the (truncated) softmax."""
from __future__ import annotations

import math

import pytest
import torch
from kernel_builds import kernel  # noqa: F401 (fixture)
from worker_oracle import single_thread  # noqa: F401 (fixture)

from gpu_worker.sampler import Sampler, apply_min_p, apply_penalties, apply_top_k_top_p, argmax, mask_stop_tokens
from gpu_worker.sequence import SequenceState
from shared.sampling import SamplingParams

CPU = torch.device("cpu")
# chi-square critical values at p = 0.001 (df = number of categories - 1)
CHI2_CRITICAL = {3: 16.266, 7: 24.322}


def seq(params: SamplingParams, prompt=(5, 6), output=(), sample_index: int = 0, seq_id: int = 0) -> SequenceState:
    return SequenceState(seq_id, f"r{seq_id}", sample_index, params, [*prompt, *output], len(prompt))


def kept(logits: torch.Tensor) -> list[list[int]]:
    return [torch.isfinite(row).nonzero().flatten().tolist() for row in logits]


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_argmax_picks_what_torchs_max_picks_first_maxima_and_nans_included(dtype, kernel):
    """kernels/cpu_argmax.c (each build) against torch's own `max(dim=-1)`: vocabularies that are and are not
    whole vectors, ties (bfloat16 has many), -inf rows, NaNs, and rows strided apart."""
    torch.manual_seed(0)
    for vocab in (1, 15, 16, 17, 1000, 32003):
        logits = torch.randn(9, vocab).to(dtype)
        logits[1] = float("-inf")
        logits[2, vocab // 2:] = logits[2].max()  # a tie across the row's halves
        logits[3, -1] = float("nan")
        logits[4, vocab // 3] = float("nan")
        logits[4, -1] = float("inf")
        logits[5] = float("inf")
        assert torch.equal(argmax(logits, kernel), logits.max(dim=-1).indices), vocab
        wide = torch.randn(9, 2 * vocab).to(dtype)
        assert torch.equal(argmax(wide[:, :vocab], kernel), wide[:, :vocab].max(dim=-1).indices), vocab


def test_greedy_tokens_are_the_same_from_bfloat16_logits_as_from_them_widened():
    """The model runner hands the sampler its logits in the model's dtype; a greedy step without logprobs reads
    them as they are, any other widens them first: the tokens are the same."""
    torch.manual_seed(1)
    logits = torch.randn(6, 5000).to(torch.bfloat16)
    seqs = [seq(SamplingParams(temperature=0.0), seq_id=i) for i in range(6)]
    with_logprobs = [seq(SamplingParams(temperature=0.0, logprobs=0), seq_id=i) for i in range(6)]
    greedy = [t.token_id for t in Sampler(CPU, seed=0)(logits, seqs, [])]
    assert greedy == [t.token_id for t in Sampler(CPU, seed=0)(logits.float(), with_logprobs, [])]
    assert greedy == logits.float().max(dim=-1).indices.tolist()


def test_top_k_keeps_the_k_largest_and_ties():
    logits = torch.tensor([[1.0, 5.0, 3.0, 5.0, 2.0, 0.0]] * 3)
    out = apply_top_k_top_p(logits, torch.tensor([1, 3, 6]), None)
    assert kept(out) == [[1, 3], [1, 2, 3], [0, 1, 2, 3, 4, 5]]  # a tie with the k-th value stays
    assert torch.equal(out[torch.isfinite(out)], logits[torch.isfinite(out)])


def test_top_p_keeps_the_smallest_head_reaching_p():
    probs = torch.tensor([0.0625, 0.5, 0.125, 0.25, 0.0625])
    logits = probs.log().repeat(4, 1)
    out = apply_top_k_top_p(logits, None, torch.tensor([0.4, 0.7, 0.8, 1.0]))
    assert kept(out) == [[1], [1, 3], [1, 2, 3], [0, 1, 2, 3, 4]]


def test_top_p_applies_to_the_top_k_renormalised_distribution():
    logits = torch.tensor([0.0625, 0.5, 0.125, 0.25, 0.0625]).log()[None]
    # top-2 leaves {0.5, 0.25} → {2/3, 1/3}; p = 0.6 needs only the first
    assert kept(apply_top_k_top_p(logits, torch.tensor([2]), torch.tensor([0.6]))) == [[1]]
    assert kept(apply_top_k_top_p(logits, torch.tensor([2]), torch.tensor([0.7]))) == [[1, 3]]


def test_min_p_is_relative_to_the_most_likely_token():
    logits = torch.tensor([0.0625, 0.5, 0.125, 0.25, 0.0625]).log().repeat(3, 1)
    out = apply_min_p(logits, torch.tensor([0.2, 0.5, 0.0]))
    assert kept(out) == [[1, 2, 3], [1, 3], [0, 1, 2, 3, 4]]


def test_penalties_match_their_formula():
    gen = torch.Generator().manual_seed(0)
    vocab = 12
    logits = torch.randn(3, vocab, generator=gen) * 3
    seqs = [seq(SamplingParams(repetition_penalty=1.7, frequency_penalty=0.5, presence_penalty=0.3),
                prompt=(1, 2, 2), output=(2, 3, 3, 3)),
            seq(SamplingParams(), prompt=(4,), output=(4, 5)),  # no penalty: untouched
            seq(SamplingParams(repetition_penalty=0.6, presence_penalty=-1.0), prompt=(7,), output=(8, 8, 0))]
    out = logits.clone()
    apply_penalties(out, seqs)
    for row, s in enumerate(seqs):
        p = s.params
        for t in range(vocab):
            value = logits[row, t].item()
            count = s.output_token_ids.count(t)
            if t in s.token_ids:
                value = value / p.repetition_penalty if value > 0 else value * p.repetition_penalty
            value -= p.frequency_penalty * count + p.presence_penalty * (count > 0)
            assert out[row, t].item() == pytest.approx(value, abs=1e-5), (row, t)


def test_stop_tokens_are_masked_until_min_tokens():
    logits = torch.zeros(3, 6)
    seqs = [seq(SamplingParams(min_tokens=2, stop_token_ids=[4]), output=(3,)),
            seq(SamplingParams(min_tokens=2, stop_token_ids=[4], ignore_eos=True), output=()),
            seq(SamplingParams(min_tokens=2, stop_token_ids=[4]), output=(3, 3))]
    mask_stop_tokens(logits, seqs, eos_token_ids=[5])
    assert kept(logits) == [[0, 1, 2, 3], [0, 1, 2, 3, 5], [0, 1, 2, 3, 4, 5]]


def test_greedy_takes_the_argmax_after_penalties():
    logits = torch.tensor([[0.0, 2.0, 1.5, 0.0]])
    plain = Sampler(CPU, seed=0)(logits, [seq(SamplingParams(temperature=0.0))], [])
    penalised = Sampler(CPU, seed=0)(logits, [seq(SamplingParams(temperature=0.0, repetition_penalty=2.0),
                                                  prompt=(1,))], [])
    assert plain[0].token_id == 1 and penalised[0].token_id == 2


def test_seeded_draws_ignore_the_batch():
    gen = torch.Generator().manual_seed(1)
    vocab = 50
    row = torch.randn(vocab, generator=gen)
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=42)
    tokens = []
    for output_index in range(12):
        target = seq(params, output=[7] * output_index, sample_index=1, seq_id=3)
        alone = Sampler(CPU, seed=0)(row[None], [target], [])[0].token_id
        others = [seq(SamplingParams(temperature=1.0)), seq(SamplingParams(temperature=0.5, seed=7), seq_id=9)]
        batch = torch.stack([torch.randn(vocab, generator=gen), row, torch.randn(vocab, generator=gen)])
        mixed = Sampler(CPU, seed=output_index)(batch, [others[0], target, others[1]], [])[1].token_id
        # another request with the same (seed, sample index, output index) draws the same token
        twin = seq(params, prompt=(9, 9, 9), output=[1] * output_index, sample_index=1, seq_id=77)
        assert alone == mixed == Sampler(CPU)(row[None], [twin], [])[0].token_id
        tokens.append(alone)
    assert len(set(tokens)) > 1  # the output index changes the draw
    other_sample = [Sampler(CPU)(row[None], [seq(params, output=[7] * i, sample_index=2)], [])[0].token_id
                    for i in range(12)]
    assert other_sample != tokens


def test_temperature_sampling_follows_softmax():
    logits = torch.tensor([0.3, -1.0, 2.0, 0.0, 1.2, -0.4, 0.8, 1.5])
    temperature = 0.7
    draws = 20000
    params = SamplingParams(temperature=temperature)
    out = Sampler(CPU, seed=123)(logits.repeat(draws, 1), [seq(params)] * draws, [])
    counts = torch.bincount(torch.tensor([o.token_id for o in out]), minlength=8).float()
    assert chi_square(counts, (logits / temperature).softmax(-1)) < CHI2_CRITICAL[7]


def test_truncated_sampling_follows_the_renormalised_softmax():
    logits = torch.tensor([0.3, -1.0, 2.0, 0.0, 1.2, -0.4, 0.8, 1.5])
    draws = 20000
    params = SamplingParams(temperature=1.0, top_k=4)
    out = Sampler(CPU, seed=7)(logits.repeat(draws, 1), [seq(params)] * draws, [])
    counts = torch.bincount(torch.tensor([o.token_id for o in out]), minlength=8).float()
    top = [2, 7, 4, 6]
    assert counts.sum() == counts[top].sum()  # nothing outside the top 4
    assert chi_square(counts[top], logits[top].softmax(-1)) < CHI2_CRITICAL[3]


def test_seeded_draws_follow_softmax():
    logits = torch.tensor([0.3, -1.0, 2.0, 0.0, 1.2, -0.4, 0.8, 1.5])
    draws = 4000
    params = SamplingParams(temperature=1.0, seed=2024)
    seqs = [seq(params, sample_index=i) for i in range(draws)]
    out = Sampler(CPU)(logits.repeat(draws, 1), seqs, [])
    counts = torch.bincount(torch.tensor([o.token_id for o in out]), minlength=8).float()
    assert chi_square(counts, logits.softmax(-1)) < CHI2_CRITICAL[7]


def test_logprobs_come_from_the_raw_distribution():
    logits = torch.tensor([[0.5, 2.0, -1.0, 1.0, 0.0]])
    params = SamplingParams(temperature=0.3, top_k=2, repetition_penalty=1.5, logprobs=3, seed=5)
    (out,) = Sampler(CPU)(logits, [seq(params, prompt=(1,))], [])
    raw = logits[0].log_softmax(-1)
    assert out.logprob == pytest.approx(raw[out.token_id].item())
    assert [t for t, _ in out.top_logprobs] == [1, 3, 0]
    assert [v for _, v in out.top_logprobs] == pytest.approx(raw[[1, 3, 0]].tolist())
    assert all(math.isfinite(v) for _, v in out.top_logprobs)


@pytest.mark.parametrize("temperature", [1e-38, 1e-300, 5e-324, 9e-6])
def test_tiny_temperatures_sample_the_argmax_not_padding(temperature):
    """Issue 12, item 8: logits / 1e-38 overflowed float32 (5e-324 is 0 there) and argmax of NaN gave token 0."""
    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(3, 40, generator=gen) * 4
    logits[:, 0] = -1.0  # token 0 (<pad> in the tiny model) is never the argmax here
    seqs = [seq(SamplingParams(temperature=temperature, top_p=0.9, seed=s), seq_id=s) for s in range(3)]
    out = Sampler(CPU, seed=0)(logits, seqs, [])
    assert [o.token_id for o in out] == logits.argmax(dim=-1).tolist()


def test_the_smallest_sampling_temperature_still_samples():
    """At SAMPLING_EPS and above a row samples: two near-equal logits both come up."""
    from shared.sampling import SAMPLING_EPS

    logits = torch.tensor([[0.0, 1.0, 1.0 + SAMPLING_EPS / 4, -3.0]]).repeat(64, 1)
    seqs = [seq(SamplingParams(temperature=SAMPLING_EPS), seq_id=i) for i in range(64)]
    tokens = {o.token_id for o in Sampler(CPU, seed=1)(logits, seqs, [])}
    assert tokens == {1, 2}
