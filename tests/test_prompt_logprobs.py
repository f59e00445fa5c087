"""Prompt logprobs (what lm-eval scores with) equal transformers' log-softmax at every prompt position, float32,
on every architecture: computed in one chunk or several, with the prompt cached or not, for n > 1 too."""
from __future__ import annotations

import pytest
import torch
from worker_oracle import ARCHS, prompts, single_thread, write_tiny  # noqa: F401 (fixture)

from pagedserve.engine import Engine
from shared.sampling import SamplingParams
from shared.settings import Settings

TOLERANCE = 1e-4  # float32, the same weights: only the order of additions differs
TOP = 3


@pytest.fixture(scope="module", params=ARCHS)
def model(request, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    model_dir = write_tiny(request.param, tmp_path_factory.mktemp("models") / request.param)
    return model_dir, AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def oracle(hf, prompt: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf(torch.tensor([prompt])).logits[0, :-1].float().log_softmax(-1)


def check(completion, expected: torch.Tensor, prompt: list[int]) -> None:
    got = completion.prompt_logprobs
    assert len(got) == len(prompt) - 1
    for p, entry in enumerate(got):
        row, target = expected[p], prompt[p + 1]
        assert abs(entry.logprob - row[target].item()) < TOLERANCE
        assert entry.rank == int((row > row[target]).sum()) + 1
        values, ids = row.topk(TOP)
        assert [t for t, _ in entry.top] == ids.tolist()
        assert all(abs(lp - v) < TOLERANCE for (_, lp), v in zip(entry.top, values.tolist()))


def test_prompt_logprobs_equal_transformers_chunked_and_cached(model):
    model_dir, hf = model
    batch = prompts([2, 19, 45], seed=31)
    expected = [oracle(hf, p) for p in batch]
    params = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=TOP)
    # a token budget of 16: the 45-token prompt is computed in several chunks, beside the others
    engine = Engine(Settings(model=str(model_dir), num_blocks=64, block_size=8, max_num_batched_tokens=16))
    for completion, e, p in zip(engine.generate(batch, params), expected, batch):
        check(completion, e, p)
    assert engine.generate([batch[2]], SamplingParams(max_tokens=2))[0].num_cached_tokens == 40, \
        "the prompt's blocks are cached now"
    again, = engine.generate([batch[2]], params)
    check(again, expected[2], batch[2])
    assert again.num_cached_tokens == 0, "a prompt whose logprobs are asked for is computed whole"
    pair, = engine.generate([batch[1]], SamplingParams(n=2, max_tokens=2, temperature=1.0, seed=1, prompt_logprobs=TOP))
    check(pair, expected[1], batch[1])
